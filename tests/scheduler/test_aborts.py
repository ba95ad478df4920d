"""finish_requests: aborts (and engine-found stop strings) at any moment free everything."""

from __future__ import annotations

from kvserve.scheduler import FinishReason, RequestStatus
from tests.scheduler.harness import Harness, make_config, make_request
from tests.scheduler.test_parallel_sampling import PROMPT, group, reference_output


def test_abort_waiting_request_never_runs() -> None:
    h = Harness(num_blocks=32, config=make_config(max_num_seqs=1))
    h.add(make_request("a", 5, max_tokens=3), make_request("b", 5, max_tokens=3))
    h.step()
    [aborted] = h.abort("b")
    assert aborted.status is RequestStatus.FINISHED and aborted.finish_reason is FinishReason.ABORT
    records = h.run()
    assert all(s.request_id == "a" for r in records for s in r.output.scheduled)
    h.assert_idle()


def test_abort_running_request_frees_its_blocks_at_once() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("a", 20, max_tokens=8), make_request("b", 9, max_tokens=8))
    h.step()
    used = h.kv.stats().blocks_used
    h.abort("a")
    assert h.kv.stats().blocks_used == used - 3
    assert h.kv.block_ids("a") == []
    h.run()
    assert len(h.outputs["b"]) == 8 and len(h.outputs["a"]) == 1
    h.assert_idle()


def test_abort_between_schedule_and_update_is_skipped_safely() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("a", 6, max_tokens=3), make_request("b", 6, max_tokens=3))
    output = h.schedule()
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    h.abort("a")
    updates = h.update(output)
    assert [u.request.request_id for u in updates] == ["b"]
    assert h.finished["a"].num_computed_tokens == 0  # the skipped update did not touch it
    h.run()
    assert len(h.outputs["b"]) == 3 and h.outputs["a"] == []
    h.assert_idle()


def test_abort_preempted_request() -> None:
    h = Harness(num_blocks=3, config=make_config(max_model_len=24))
    h.add(make_request("a", 8, arrival=0, max_tokens=5), make_request("b", 8, arrival=1, max_tokens=5))
    h.step()
    assert h.step().output.preempted_request_ids == ["b"]
    [aborted] = h.abort("b")
    assert aborted.num_preemptions == 1 and aborted.finish_reason is FinishReason.ABORT
    h.run()
    h.assert_idle()


def test_unknown_and_already_finished_ids_are_ignored() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("a", 4, max_tokens=1))
    h.run()
    assert h.scheduler.finish_requests(["a", "nope"], FinishReason.ABORT) == []
    assert h.finished["a"].finish_reason is FinishReason.LENGTH
    h.assert_idle()


def test_stop_string_found_by_the_engine_finishes_with_its_reason() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("a", 4, max_tokens=10))
    h.step()
    [finished] = h.scheduler.finish_requests(["a"], FinishReason.STOP, "</s>")
    assert (finished.finish_reason, finished.stop_reason) == (FinishReason.STOP, "</s>")
    h.assert_idle()


def test_abort_held_sibling_leaves_the_rest_of_the_group_sharing() -> None:
    h = Harness(num_blocks=32)
    h.add(*group("p", PROMPT, 3, max_tokens=2))
    h.abort("p#1")
    assert h.scheduler.num_waiting == 2
    h.step()
    assert h.kv.block_ids("p#2") == h.kv.block_ids("p#0")
    h.run()
    assert h.outputs["p#1"] == [] and h.outputs["p#2"] == reference_output(PROMPT, 2, seed=2)
    h.assert_idle()


def test_abort_leader_releases_held_siblings_to_normal_admission() -> None:
    h = Harness(num_blocks=32, config=make_config(max_num_batched_tokens=8))
    h.add(*group("p", PROMPT, 3, max_tokens=2))
    assert h.step().batch == [("p#0", 8)]  # the leader's prompt is half done
    h.abort("p#0")
    assert h.scheduler.num_waiting == 2 and h.scheduler.num_running == 0
    h.run()
    assert [h.outputs["p#1"], h.outputs["p#2"]] == [reference_output(PROMPT, 2, seed=i) for i in (1, 2)]
    h.assert_idle()


def test_abort_everything_mid_flight() -> None:
    h = Harness(num_blocks=6, config=make_config(max_num_batched_tokens=16, max_model_len=48))
    h.add(*(make_request(f"r{i}", 7 + i, arrival=i, max_tokens=20) for i in range(6)))
    h.add(*group("p", PROMPT, 2, arrival=9, max_tokens=5))
    for _ in range(4):
        h.step()
    aborted = h.abort(*[f"r{i}" for i in range(6)], "p#0", "p#1")
    assert {r.finish_reason for r in aborted} == {FinishReason.ABORT}
    h.assert_idle()
