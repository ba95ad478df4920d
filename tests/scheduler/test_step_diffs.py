"""The step diffs: what a SchedulerOutput sends stays small however long a request runs, and the
runner hears of every request once as new and once as finished."""

from __future__ import annotations

import pickle

from kvserve.scheduler import FinishReason
from tests.scheduler.harness import Harness, make_config, make_request


def test_a_decode_step_sends_the_same_bytes_at_step_10_and_at_step_500():
    h = Harness(num_blocks=128, config=make_config(max_model_len=1024))
    h.add(make_request("a", 40, max_tokens=600, ignore_eos=True))
    sizes = {}
    for step in range(1, 501):
        output = h.schedule()
        if step in (10, 500):
            sizes[step] = len(pickle.dumps(output))
            (scheduled,) = output.scheduled
            assert len(scheduled.new_token_ids) == 1 and not scheduled.tables_replaced
            assert output.new_requests == []
        h.update(output)
    # Step 500 may differ by a few bytes of integers that grew (positions, token ids).
    assert abs(sizes[500] - sizes[10]) <= 8, sizes


def test_a_new_block_is_sent_once_and_then_never_again():
    h = Harness(num_blocks=32)  # blocks of 8 tokens
    h.add(make_request("a", 6, max_tokens=12, ignore_eos=True))
    sent_blocks = []
    first = h.step()
    assert first.output.new_requests[0].request_id == "a" and first.output.scheduled[0].tables_replaced
    sent_blocks += list(first.output.scheduled[0].new_block_ids[0])
    for _ in range(11):
        (scheduled,) = h.step().output.scheduled
        assert not scheduled.tables_replaced
        for blocks in scheduled.new_block_ids:
            sent_blocks += list(blocks)
    # 17 positions computed (6 prompt tokens, 11 outputs fed back): blocks of 8, 8 and 1.
    assert sent_blocks == h.runner.requests["a"].tables[0] and len(sent_blocks) == 3


def test_finished_and_aborted_requests_are_reported_to_the_runner_once():
    h = Harness(num_blocks=32)
    h.add(make_request("done", 4, max_tokens=1), make_request("gone", 4, max_tokens=5), make_request("queued", 4))
    h.step()  # "done" finishes in this update
    h.abort("gone")
    second = h.schedule()
    assert sorted(second.finished_req_ids) == ["done", "gone"]
    h.update(second)
    assert "done" not in h.runner.requests and "gone" not in h.runner.requests
    h.run()
    assert all(r not in ("done", "gone") for record in h.steps[2:] for r in record.output.finished_req_ids)


def test_a_request_aborted_before_it_ever_ran_is_not_reported():
    h = Harness(num_blocks=32, config=make_config(max_num_seqs=1))
    h.add(make_request("running", 4, max_tokens=3), make_request("waiting", 4))
    h.step()
    h.scheduler.finish_requests(["waiting"], FinishReason.ABORT)
    assert h.schedule().finished_req_ids == []


def test_a_preempted_request_gets_its_new_tables_whole_and_no_token_twice():
    h = Harness(num_blocks=4, config=make_config(max_model_len=24))  # 4 blocks of 8 tokens
    h.add(make_request("old", 14, max_tokens=8, ignore_eos=True))
    h.step()
    h.add(make_request("new", 14, max_tokens=8, ignore_eos=True))
    h.run()
    h.assert_idle()
    resumed = [s for record in h.steps for s in record.output.scheduled
               if s.tables_replaced and s.request_id in {r for rec in h.steps for r in rec.output.preempted_request_ids}]
    assert resumed, "the workload was meant to preempt"
    # The runner rebuilt each request's tokens from the diffs: nothing lost, nothing twice.
    assert all(len(h.outputs[r]) == 8 for r in ("old", "new"))


def test_the_step_after_the_last_request_ends_still_tells_the_runner():
    h = Harness(num_blocks=32)
    h.add(make_request("a", 4, max_tokens=2))
    h.run()
    assert "a" in h.runner.requests  # finished in the last update: the runner is told next step
    output = h.schedule()
    assert output.scheduled == [] and output.finished_req_ids == ["a"] and not output.is_empty
    h.update(output)
    assert h.runner.requests == {}
    assert h.schedule().is_empty
