"""The batched sampler on constructed logits: exact filter masks, penalties and bias by their
definitions, min_tokens, greedy, seeded reproducibility across batches, logprobs of the raw
distribution, and sampling frequencies that follow the softmax."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.sampling import sampler as sampler_module
from kvserve.engine.sampling.sampler import Sampler, apply_logits_processors, draw_inverse_cdf, greedy_tokens
from kvserve.engine.sampling.sampling_batch import SamplingBatch
from kvserve.engine.sampling.sampling_filters import filter_logits
from kvserve.engine.sampling.sampling_noise import uniform_from_counter
from kvserve.engine.input_batch import CachedRequestState
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, bf16_row_argmax
from kvserve.scheduler.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")
EOS = 0


def request(params: SamplingParams, *, seed: int = 0, prompt: list[int] | None = None,
            output: list[int] | None = None, samples: bool = True, request_id: str = "r") -> CachedRequestState:
    """The runner's state of a request about to sample its next token."""
    prompt = [1, 2] if prompt is None else prompt
    state = CachedRequestState(request_id, len(prompt), params, seed, block_ids=[[0]])
    state.append_tokens(prompt + list(output or []))
    state.num_computed_tokens, state.num_new_tokens, state.samples = len(state.all_token_ids) - 1, 1, samples
    return state


def batch_of(requests: list[CachedRequestState], vocab: int) -> SamplingBatch:
    return SamplingBatch.from_requests(requests, vocab, (EOS,), CPU)


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()


# --- filters: exact masks -----------------------------------------------------------------------

def test_top_k_keeps_exactly_k_even_with_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [2.0, 2.0, 2.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    out = filter_logits(logits, top_k=torch.tensor([2, 3, 0]))
    assert kept(out)[0] == {1, 3}
    assert len(kept(out)[1]) == 3 and kept(out)[1] <= {0, 1, 2, 3}
    assert kept(out)[2] == {0, 1, 2, 3, 4}  # top_k 0: off
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])  # kept logits are untouched


@pytest.mark.parametrize(("top_p", "expected"), [(0.5, {0}), (0.7, {0, 1}), (0.75, {0, 1}), (0.76, {0, 1, 2}),
                                                 (0.9, {0, 1, 2, 3}), (0.96, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, expected: set[int]) -> None:
    # Probabilities 32/64, 16/64, 8/64, 5/64, 3/64 (cumulative 0.5, 0.75, 0.875, 0.953, 1) in
    # shuffled vocabulary order.
    order = [3, 0, 4, 1, 2]
    probs = [0.5, 0.25, 0.125, 5 / 64, 3 / 64]
    logits = torch.empty(1, 5)
    logits[0, order] = torch.tensor(probs).log()
    out = filter_logits(logits, top_p=torch.tensor([top_p]))
    assert kept(out)[0] == {order[i] for i in expected}


def test_top_p_always_keeps_the_most_likely_token() -> None:
    out = filter_logits(log_probs(0.9, 0.1), top_p=torch.tensor([1e-6]))
    assert kept(out) == [{0}]


def test_top_p_renormalises_after_top_k() -> None:
    # After top-2 the mass is 2/3, 1/3: top_p 0.6 keeps one token, 0.7 both.
    logits = log_probs(0.4, 0.2, 0.2, 0.2)
    logits[0, 2] = math.log(0.19)
    out = filter_logits(logits.repeat(2, 1), top_k=torch.tensor([2, 2]), top_p=torch.tensor([0.6, 0.7]))
    assert kept(out) == [{0}, {0, 1}]


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.125).repeat(3, 1)
    out = filter_logits(logits, min_p=torch.tensor([0.3, 0.25, 0.0]))
    assert kept(out) == [{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3}]  # 0.125 >= 0.25 * 0.5 is kept


def _reference_filters(row: torch.Tensor, k: int, p: float, min_p: float) -> set[int]:
    """Straight from the definitions: min-p line, sort, cut to k, renormalise, cut to the nucleus."""
    probs = torch.softmax(row.double(), dim=0)
    ranked = sorted((i for i in range(len(row)) if probs[i] >= min_p * probs.max()), key=lambda i: -row[i].item())
    if k:
        ranked = ranked[:k]
    weights = torch.softmax(row[ranked].double(), dim=0).tolist()
    kept_set, mass = set(), 0.0
    for token, w in zip(ranked, weights):
        if mass >= p and kept_set:
            break
        kept_set.add(token)
        mass += w
    return kept_set


# 50: one candidate pass; 1000 and 8000: flat rows whose nucleus or min-p set outgrows the
# first (and, for 8000, the second) candidate pass, plus rows that keep the whole row.
@pytest.mark.parametrize("vocab", [50, 1000, 8000])
def test_filters_match_a_per_row_reference_with_mixed_parameters(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    scale = torch.tensor([[0.1], [1], [3], [0.5], [2], [1], [0.2], [4], [0.05], [1], [0.01]])
    logits = torch.randn(len(scale), vocab, generator=generator) * scale
    top_k = torch.tensor([0, 5, 0, 40, 0, 1, 0, 7, 0, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.99, 0.8, 1.0, 1.0, 0.999])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.02, 0.3, 0.5, 0.0, 0.0])
    out = filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    for row in range(len(scale)):
        expected = _reference_filters(logits[row], int(top_k[row]), float(top_p[row]), float(min_p[row]))
        assert kept(out[row:row + 1])[0] == expected, row
        assert torch.equal(out[row, sorted(expected)], logits[row, sorted(expected)])


# --- penalties, bias, min_tokens ----------------------------------------------------------------

def test_presence_and_frequency_penalties_follow_their_definition() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    batch = batch_of([request(params, prompt=[4, 4], output=[3, 3, 5, 3])], vocab=6)
    logits = torch.tensor([[1.0, -1.0, 2.0, 3.0, 0.5, -2.0]])
    out = Sampler().processed_logits(logits, batch)
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 0.25 * 3  # three occurrences in the output
    expected[0, 5] -= 0.5 + 0.25 * 1
    # token 4 is only in the prompt: presence/frequency look at the output only
    assert torch.allclose(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    batch = batch_of([request(params, prompt=[0, 1], output=[2])], vocab=5)
    logits = torch.tensor([[3.0, -3.0, 1.0, 4.0, -1.0]])
    out = Sampler().processed_logits(logits, batch)
    assert out.tolist() == [[1.5, -6.0, 0.5, 4.0, -1.0]]


def test_penalties_are_per_row_and_absent_when_unused() -> None:
    assert batch_of([request(SamplingParams())], vocab=4).penalties is None
    batch = batch_of([request(SamplingParams(), output=[1]), request(SamplingParams(presence_penalty=1.0), output=[1])], 4)
    out = Sampler().processed_logits(torch.zeros(2, 4), batch)
    assert out.tolist() == [[0, 0, 0, 0], [0, -1, 0, 0]]


def test_logit_bias_is_added_to_the_raw_logits() -> None:
    batch = batch_of([request(SamplingParams(logit_bias={1: 2.5, 3: -100}))], vocab=4)
    out = apply_logits_processors(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), batch)
    assert out.tolist() == [[1.0, 3.5, 1.0, -99.0]]
    sampled = Sampler()(torch.tensor([[1.0, 1.0, 2.0, 1.0]]), batch_of([request(
        SamplingParams(temperature=0, logit_bias={1: 2.5}))], vocab=4))
    assert sampled.token_ids == [1]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    logits = torch.zeros(1, 5)
    before = apply_logits_processors(logits, batch_of([request(params, output=[1])], vocab=5))
    assert kept(before) == [{1, 2, 4}]
    after = apply_logits_processors(logits, batch_of([request(params, output=[1, 1])], vocab=5))
    assert kept(after) == [{0, 1, 2, 3, 4}]
    # ignore_eos: EOS does not end the request, so only the stop tokens are held back.
    ignoring = SamplingParams(min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert kept(apply_logits_processors(logits, batch_of([request(ignoring)], vocab=5))) == [{0, 1, 2, 4}]


def test_min_tokens_bans_each_draft_row_by_its_own_output_count() -> None:
    # A request with one output verifying 3 drafts samples 4 rows, standing 0-3 tokens past its
    # outputs: with min_tokens 3 the first two rows (outputs 1 and 2) hold the stop tokens back,
    # the last two (3 and 4) do not. Speculative decoding drafts under min_tokens on this.
    params = SamplingParams(min_tokens=3, stop_token_ids=(3,))
    state = request(params, output=[1])
    rows = SamplingBatch.from_requests([state] * 4, 5, (EOS,), CPU, draft_offsets=[0, 1, 2, 3])
    assert kept(apply_logits_processors(torch.zeros(4, 5), rows)) == [{1, 2, 4}, {1, 2, 4}, set(range(5)), set(range(5))]


def test_greedy_is_the_argmax_of_the_processed_logits() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    out = Sampler()(logits, batch_of([request(greedy, seed=i) for i in range(6)], vocab=100))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    # with a penalty the argmax moves off the penalised token
    top = int(logits[0].argmax())
    penalised = SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1.5)
    moved = Sampler()(logits[:1], batch_of([request(penalised, output=[top])], vocab=100))
    expected = Sampler().processed_logits(logits[:1], batch_of([request(penalised, output=[top])], vocab=100))
    assert moved.token_ids == [int(expected.argmax())]
    assert top_k_one_is_greedy(logits)


def top_k_one_is_greedy(logits: torch.Tensor) -> bool:
    out = Sampler()(logits, batch_of([request(SamplingParams(top_k=1, temperature=5.0), seed=i) for i in range(6)], 100))
    return out.token_ids == logits.argmax(dim=-1).tolist()


# --- seeds: reproducible whatever the batch -----------------------------------------------------

def test_seeded_request_is_reproducible_across_batch_composition_and_order() -> None:
    vocab = 500
    generator = torch.Generator().manual_seed(7)
    target_row = torch.randn(vocab, generator=generator)
    target = request(SamplingParams(temperature=1.0, top_p=0.95), seed=1234, output=[5, 6, 7], request_id="target")
    expected = Sampler()(target_row.unsqueeze(0), batch_of([target], vocab)).token_ids[0]
    for size in (2, 5, 17):
        others = [request(SamplingParams(temperature=0.7, top_k=3 * i, min_p=0.01 * (i % 3), presence_penalty=0.1 * i),
                          seed=i, output=list(range(i))) for i in range(size - 1)]
        other_logits = torch.randn(size - 1, vocab, generator=generator)
        for position in (0, size // 2, size - 1):
            rows = others[:position] + [target] + others[position:]
            logits = torch.cat([other_logits[:position], target_row.unsqueeze(0), other_logits[position:]])
            assert Sampler()(logits, batch_of(rows, vocab)).token_ids[position] == expected


def test_seed_and_step_drive_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the draw is decided by u alone
    params = SamplingParams(temperature=1.0)
    draw = lambda seed, output: Sampler()(logits, batch_of([request(params, seed=seed, output=output)], 1000)).token_ids[0]
    assert draw(3, [1, 2]) == draw(3, [9, 9])  # same seed, same step (e.g. recomputed after preemption)
    assert len({draw(3, [0] * step) for step in range(10)}) > 5  # each step draws anew
    assert len({draw(seed, []) for seed in range(10)}) > 5
    assert draw(2**64 + 3, [1, 2]) == draw(3, [1, 2])  # seeds are taken modulo 2**64


def test_counter_uniforms_are_open_interval_and_uniform() -> None:
    seeds = torch.arange(200_000, dtype=torch.int64)
    u = uniform_from_counter(seeds, torch.zeros_like(seeds), torch.zeros_like(seeds))
    assert bool(((u > 0) & (u < 1)).all())
    histogram = torch.histc(u.float(), bins=20, min=0, max=1)
    expected = len(seeds) / 20
    assert float((histogram - expected).abs().max()) < 5 * math.sqrt(expected)
    steps = uniform_from_counter(seeds[:1].repeat(1000), seeds[:1].repeat(1000), torch.arange(1000))
    assert abs(float(steps.mean()) - 0.5) < 0.05


# --- sampling distribution ----------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_follow_the_softmax(temperature: float) -> None:
    n = 8000
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().repeat(n, 1)
    rows = [request(SamplingParams(temperature=temperature), seed=seed) for seed in range(n)]
    tokens = torch.tensor(Sampler()(logits, batch_of(rows, 4)).token_ids)
    frequencies = torch.bincount(tokens, minlength=4).double() / n
    expected = torch.softmax(logits[0].double() / temperature, dim=0)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((frequencies - expected).abs() < 4 * sigma).all()), (frequencies, expected)


def test_filtered_tokens_are_never_drawn() -> None:
    n = 3000
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6, -1.0]]).repeat(n, 1)
    rows = [request(SamplingParams(temperature=1.0, top_k=3), seed=seed) for seed in range(n)]
    tokens = set(Sampler()(logits, batch_of(rows, 6)).token_ids)
    assert tokens == {0, 1, 2}


def test_inverse_cdf_picks_the_interval_containing_u() -> None:
    # Weights 1, 0 (masked), 3 over two chunks' worth of vocabulary: cdf 0.25 | 0.25 | 1.0.
    vocab = 300
    logits = torch.full((3, vocab), NEG_INF)
    logits[:, 0] = 0.0
    logits[:, 299] = math.log(3.0)
    tokens = draw_inverse_cdf(logits, torch.tensor([0.1, 0.2499, 0.25001], dtype=torch.float64))
    assert tokens.tolist() == [0, 0, 299]


# --- logprobs -----------------------------------------------------------------------------------

def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    rows = [
        request(SamplingParams(temperature=0, logprobs=2, presence_penalty=2.0, logit_bias={1: 10.0}), output=[3]),
        request(SamplingParams(temperature=0.5, logprobs=0)),
    ]
    out = Sampler()(logits, batch_of(rows, 5))
    raw = torch.log_softmax(logits, dim=-1)
    first, second = out.logprobs
    assert out.token_ids[0] == 1  # the bias decided the token ...
    assert first.token_id == 1 and first.logprob == pytest.approx(float(raw[0, 1]))  # ... not the logprob
    assert first.rank == 3
    assert [t for t, _ in first.top] == [3, 0]
    assert [lp for _, lp in first.top] == pytest.approx([float(raw[0, 3]), float(raw[0, 0])])
    assert second.top == [] and second.rank >= 1
    assert second.logprob == pytest.approx(float(raw[1, out.token_ids[1]]))


def test_rows_without_logprobs_get_none() -> None:
    out = Sampler()(torch.zeros(2, 4), batch_of([request(SamplingParams(logprobs=1)), request(SamplingParams())], 4))
    assert out.logprobs[0] is not None and out.logprobs[1] is None


# --- batch construction -------------------------------------------------------------------------

def test_rows_that_do_not_sample_are_skipped_and_shapes_are_checked() -> None:
    rows = [request(SamplingParams(), samples=False), request(SamplingParams(temperature=0))]
    batch = batch_of(rows, 4)
    assert batch.num_rows == 1
    assert Sampler()(torch.tensor([[0.0, 0.0, 9.0, 0.0]]), batch).token_ids == [2]
    with pytest.raises(ValueError, match="num_sampling_rows=1"):
        Sampler()(torch.zeros(2, 4), batch)


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    assert Sampler()(logits, batch_of([request(SamplingParams(temperature=0))], 3)).token_ids == [1]


# Chunks of 512 (1024), 256 (1280), 128 (1152), and the plain argmax fallback (1000); bf16 logits
# through kvserve's C++ argmax where it is built, and through the chunked path without it.
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("vocab", [1024, 1280, 1152, 1000])
def test_greedy_tokens_is_argmax_with_its_tie_and_nan_rules(vocab: int, kernel: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The first maximum wins a tie (inside a chunk and across chunks), a NaN counts as the
    maximum (even after a larger finite value), an all -inf row gives 0."""
    if kernel and not bf16_gemm_available():
        pytest.skip("kvserve's bf16 kernels are not built here (no AVX-512 or no C++ compiler)")
    monkeypatch.setattr(sampler_module, "bf16_gemm_available", lambda: kernel)
    argmax_kernel_calls = []
    monkeypatch.setattr(sampler_module, "bf16_row_argmax",
                        lambda logits: argmax_kernel_calls.append(1) or bf16_row_argmax(logits))
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [5, 7, 900]] = 50.0
    logits[1, [300, 9]] = float("nan")
    logits[2] = NEG_INF
    logits[3, [200, 20]] = float("inf")
    logits[4] = 0.0
    logits[5, 3] = 60.0
    logits[5, 700] = float("nan")
    logits[6, [130, 129]] = 70.0
    expected = [5, 9, 0, 20, 0, 700, 129, logits[7].argmax().item()]
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist() == expected
    half = logits.bfloat16()
    assert greedy_tokens(half).tolist() == half.argmax(dim=-1).tolist()
    assert greedy_tokens(logits[:, :vocab // 2]).tolist() == logits[:, :vocab // 2].argmax(dim=-1).tolist()
    assert len(argmax_kernel_calls) == (1 if kernel else 0)  # the bf16 logits only


def test_plain_greedy_rows_take_the_argmax_of_half_precision_logits_without_upcasting() -> None:
    """bf16 logits (as a half-precision lm_head gives them) sample exactly what their float32
    upcast samples, greedy or not."""
    logits = (torch.randn(3, 1024, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    greedy = SamplingParams(temperature=0.0)
    plain = batch_of([request(greedy, request_id=f"g{i}") for i in range(3)], 1024)
    assert plain.is_plain_greedy
    assert Sampler()(logits, plain).token_ids == logits.float().argmax(dim=-1).tolist()
    mixed = batch_of([request(greedy), request(SamplingParams(temperature=0.0, logprobs=2)),
                      request(SamplingParams(temperature=1.0), seed=3)], 1024)
    assert not mixed.is_plain_greedy
    assert Sampler()(logits, mixed).token_ids == Sampler()(logits.float(), mixed).token_ids
