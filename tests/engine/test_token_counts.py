"""The penalties' token counts kept across steps equal counts rebuilt from scratch, whatever
happens between steps: tokens appended, a request paused for a step, an id reused; a finished
request's counts are dropped."""

from __future__ import annotations

import torch

from kvserve.engine.sampling.sampler import Sampler
from kvserve.engine.sampling.sampling_batch import SamplingBatch
from kvserve.engine.input_batch import CachedRequestState
from kvserve.scheduler.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
PENALISED = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)


def request(request_id: str, output: list[int], params: SamplingParams = PENALISED,
            prompt: list[int] | None = None) -> CachedRequestState:
    prompt = [1, 6] if prompt is None else prompt
    state = CachedRequestState(request_id, len(prompt), params, 0, block_ids=[[0]])
    state.append_tokens(prompt + output)
    state.samples = True
    return state


def processed(sampler: Sampler, rows: list[CachedRequestState], logits: torch.Tensor) -> torch.Tensor:
    return sampler.processed_logits(logits, SamplingBatch.from_requests(rows, VOCAB, (0,), CPU))


LOGITS = torch.linspace(-2.0, 3.0, VOCAB).repeat(3, 1)


def test_counts_follow_tokens_appended_between_steps() -> None:
    kept = Sampler()
    a, b = request("a", [2]), request("b", [], SamplingParams(temperature=0))
    c = request("c", [3, 3])
    for token in (2, 5, 5, 7):
        rows = [a, b, c]
        assert torch.equal(processed(kept, rows, LOGITS), processed(Sampler(), rows, LOGITS))
        a.append_tokens([token])
        c.append_tokens([token + 1 if token < 7 else 0])


def test_a_request_missing_for_a_step_or_a_reused_id_is_counted_afresh() -> None:
    kept = Sampler()
    a = request("a", [2, 2])
    processed(kept, [a], LOGITS[:1])
    a.append_tokens([4])
    processed(kept, [request("other", [1])], LOGITS[:1])  # "a" paused (e.g. preempted) this step
    a.append_tokens([4])
    assert torch.equal(processed(kept, [a], LOGITS[:1]), processed(Sampler(), [a], LOGITS[:1]))
    reused = request("a", [7, 7, 7, 7, 7], prompt=[3])  # a new request under the same id, more tokens
    assert torch.equal(processed(kept, [reused], LOGITS[:1]), processed(Sampler(), [reused], LOGITS[:1]))


def test_only_penalised_rows_change() -> None:
    rows = [request("a", [7, 7]), request("g", [7, 7], SamplingParams(temperature=0)), request("b", [1])]
    out = processed(Sampler(), rows, LOGITS)
    assert torch.equal(out[1], LOGITS[1])
    assert out[0, 7] < LOGITS[0, 7] and out[2, 1] != LOGITS[2, 1]


def test_finished_requests_are_forgotten() -> None:
    kept = Sampler()
    processed(kept, [request("a", [2]), request("b", [3])], LOGITS[:2])
    assert len(kept.token_counts) == 2
    kept.token_counts.remove(["a", "never-seen"])
    assert len(kept.token_counts) == 1
