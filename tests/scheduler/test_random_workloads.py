"""Hypothesis-driven workloads: arrivals, aborts at any moment (also between schedule and
update), preemptions, chunking, prefix sharing and n > 1, with one or two layer groups (sliding
windows among them), checked against the fake model's reference outputs and the invariants of
every step; every block is free at the end."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.paging import FullAttentionSpec, SlidingWindowSpec
from kvserve.paging.kv_cache_spec import blocks_per_request
from kvserve.scheduler import FinishReason, Request, SamplingParams
from tests.scheduler.fake_model import reference_next_token
from tests.scheduler.harness import BLOCK_SIZE, VOCAB_SIZE, Harness, make_config, make_request

EOS = 3  # inside the vocabulary: some requests stop early
SHARED_PREFIX = [(7 * i + 1) % VOCAB_SIZE for i in range(40)]
TWO_GROUPS = [FullAttentionSpec(2, 16, "float32", 4), FullAttentionSpec(1, 32, "float32", 4)]


def window(size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(2, 16, "float32", 4, sliding_window=size)


# Windows shorter than a block, of a block, and across blocks; a window group first makes the
# prefix lookup ask the groups again when a later one finds less.
GROUP_CHOICES = [None, TWO_GROUPS, [TWO_GROUPS[0], window(12)], [window(8), TWO_GROUPS[0]], [window(5)],
                 [window(12), window(20)]]


@dataclass(frozen=True)
class Spec:
    arrival_step: int
    prompt: tuple[int, ...]
    n: int
    params: SamplingParams
    priority: int
    abort_step: int | None
    abort_between: bool  # abort after schedule(), before update_from_output()


@st.composite
def specs(draw: st.DrawFn, max_model_len: int) -> Spec:
    prompt_len = draw(st.integers(1, max_model_len))
    if draw(st.booleans()):
        shared = draw(st.integers(0, min(prompt_len, len(SHARED_PREFIX))))
        prompt = SHARED_PREFIX[:shared] + draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=prompt_len - shared, max_size=prompt_len - shared))
    else:
        prompt = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=prompt_len, max_size=prompt_len))
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 12)))
    params = SamplingParams(
        n=draw(st.integers(1, 3)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, 2 if max_tokens is None else min(2, max_tokens))),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=2)),
    )
    return Spec(
        arrival_step=draw(st.integers(0, 12)),
        prompt=tuple(prompt),
        n=params.n,
        params=params,
        priority=draw(st.integers(0, 2)),
        abort_step=draw(st.one_of(st.none(), st.integers(0, 20))),
        abort_between=draw(st.booleans()),
    )


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Harness, list[Spec]]:
    max_model_len = draw(st.sampled_from([16, 24, 40]))
    config = make_config(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    # One layer group, or two (a model whose layers keep different caches: one table each).
    group_specs = draw(st.sampled_from(GROUP_CHOICES))
    num_groups = 1 if group_specs is None else len(group_specs)
    fewest = blocks_per_request(group_specs or TWO_GROUPS[:1], max_model_len, BLOCK_SIZE, config.max_num_batched_tokens)
    num_blocks = draw(st.integers(fewest, max(fewest, 16 * num_groups)))
    harness = Harness(num_blocks=num_blocks, enable_prefix_caching=draw(st.booleans()), config=config,
                      group_specs=group_specs)
    return harness, draw(st.lists(specs(max_model_len), min_size=1, max_size=8))


def reference(prompt: tuple[int, ...], params: SamplingParams, seed: int, max_model_len: int,
              window: int | None) -> tuple[list[int], FinishReason]:
    """The fake model's rollout with the stop rules, written out independently of stop_checker."""
    history, output = list(prompt), []
    while True:
        token = reference_next_token(history, VOCAB_SIZE, seed, window)
        history.append(token)
        output.append(token)
        if len(output) >= params.min_tokens and (token in params.stop_token_ids or (token == EOS and not params.ignore_eos)):
            return output, FinishReason.STOP
        if (params.max_tokens is not None and len(output) >= params.max_tokens) or len(history) >= max_model_len:
            return output, FinishReason.LENGTH


def requests_of(spec_index: int, spec: Spec) -> list[Request]:
    parent = f"q{spec_index}"
    return [
        make_request(
            f"{parent}#{i}", list(spec.prompt), parent_id=parent, index=i, seed=1000 * spec_index + i,
            priority=spec.priority, arrival=float(spec.arrival_step), eos=EOS,
            **{name: getattr(spec.params, name) for name in ("max_tokens", "min_tokens", "ignore_eos", "stop_token_ids")},
        )
        for i in range(spec.n)
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workload_matches_reference_and_frees_everything(workload: tuple[Harness, list[Spec]]) -> None:
    h, all_specs = workload
    groups = {f"q{i}": (spec, requests_of(i, spec)) for i, spec in enumerate(all_specs)}
    aborted: set[str] = set()

    def abort_group(parent: str) -> None:
        ids = [r.request_id for r in groups[parent][1]]
        aborted.update(r.request_id for r in h.abort(*ids))

    step = 0
    while step <= 12 or h.scheduler.has_unfinished_requests():
        assert step < 3000, "the workload did not drain"
        for parent, (spec, requests) in groups.items():
            if spec.arrival_step == step:
                h.add(*requests)
        for parent, (spec, _) in groups.items():
            if spec.abort_step == step and not spec.abort_between:
                abort_group(parent)
        output = h.schedule()
        for parent, (spec, _) in groups.items():
            if spec.abort_step == step and spec.abort_between:
                abort_group(parent)
        h.update(output)
        step += 1

    h.assert_idle()
    max_model_len = h.config.max_model_len
    for parent, (spec, requests) in groups.items():
        for request in requests:
            expected, reason = reference(spec.prompt, spec.params, request.seed, max_model_len, h.runner.sampling_window)
            produced = h.outputs[request.request_id]
            if request.request_id in aborted:
                assert request.finish_reason is FinishReason.ABORT
                assert produced == expected[: len(produced)]
            else:
                assert produced == expected, f"{request.request_id}: {produced} != {expected}"
                assert request.finish_reason is reason
            assert request.output_token_ids == produced
