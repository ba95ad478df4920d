"""Speculative decoding in the engine: prompt-lookup drafts, the verification that keeps the
target distribution, and a tiny model whose outputs with drafts equal its outputs without."""

from __future__ import annotations

import collections

import pytest
import torch

from kvserve.engine import LLM, GrammarKind, StructuredOutputParams
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.input_batch import CachedRequestState
from kvserve.engine.sampling.sampler import Sampler, SamplingBatch
from kvserve.engine.spec_decode import NgramDrafter, NgramIndex, SpeculativeConfig
from kvserve.engine.spec_decode.verification import num_kept
from kvserve.scheduler import Request, SamplingParams
from tests.engine.test_model_runner import Seq, step, tiny_runner


# ---------------------------------------------------------------- the proposer


def test_the_longest_earlier_suffix_match_proposes_what_followed_it():
    index = NgramIndex(1, 3)
    tokens = [7, 1, 2, 3, 9, 9, 4, 1, 2, 3]
    assert index.propose(tokens, 3) == [9, 9, 4]  # "1 2 3" occurred at 1..3: then 9 9 4
    assert index.propose(tokens + [9], 2) == [9, 4]  # "2 3 9" now
    assert NgramIndex(1, 3).propose([5, 6, 7], 2) == []  # nothing repeats


def test_the_latest_earlier_occurrence_wins_and_a_match_needs_min_n():
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]
    assert NgramIndex(2, 3).propose([4, 8, 1, 4], 2) == []  # only a 1-token repeat: below min_n


def test_a_growing_request_is_indexed_incrementally_with_the_same_answers():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 1, 4, 1, 5]
    incremental = NgramIndex(1, 4)
    for end in range(1, len(tokens) + 1):
        assert incremental.propose(tokens[:end], 3) == NgramIndex(1, 4).propose(tokens[:end], 3)


def test_the_drafter_skips_penalised_requests_and_large_batches_but_not_min_tokens_ones():
    config = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2,
                               disable_by_batch_size=2)
    drafter = NgramDrafter(config)

    def request(request_id: str, **params) -> Request:
        r = Request(request_id, [1, 2, 3, 1, 2], SamplingParams(**params), (0,), 0.0)
        return r

    plain, penalised, holding = request("a"), request("b", presence_penalty=0.5), request("c", min_tokens=3)
    drafter.propose([plain, penalised, holding], num_running=2)
    # min_tokens bans are applied per draft row by the sampler (test_drafts_under_min_tokens_...).
    assert plain.spec_token_ids == [3, 1] and penalised.spec_token_ids == [] and holding.spec_token_ids == [3, 1]
    drafter.propose([plain], num_running=3)  # more running than disable_by_batch_size
    assert plain.spec_token_ids == []
    drafter.propose([plain], num_running=1, validate=lambda request_id, drafts: drafts[:1])
    assert plain.spec_token_ids == [3]
    assert len(drafter) == 2  # a's and c's indexes
    drafter.forget(["a", "c"])
    assert len(drafter) == 0


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_configs_name_what_is_wrong(value, message):
    with pytest.raises(ConfigError, match=message) as error:
        EngineConfig(speculative_config=value)
    assert error.value.option == "--speculative-config"


def test_a_speculative_config_parses_as_vllm_spells_it():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=3)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 6}).speculative_config \
        .prompt_lookup_max == 6


# ---------------------------------------------------------------- verification


def test_the_kept_tokens_are_the_matching_drafts_and_one_more():
    assert num_kept([5, 6, 7, 8], [5, 6, 7]) == 4
    assert num_kept([5, 1, 7, 8], [5, 6, 7]) == 2
    assert num_kept([9, 6, 7, 8], [5, 6, 7]) == 1
    assert num_kept([4], []) == 1


def _chi2(counts: collections.Counter, probs: torch.Tensor) -> float:
    total = sum(counts.values())
    observed = torch.tensor([counts[t] for t in range(len(probs))], dtype=torch.float64)
    expected = probs.double() * total
    return float(((observed - expected) ** 2 / expected).sum())


def test_verifying_a_draft_keeps_the_target_distribution():
    # Target p0 after the last token and p1 after draft token 1 (the draft is taken as certain):
    # the first kept token must be distributed as p0 whatever the draft, and the second (kept
    # only when the draft was right) as p1, as decoding the two positions one by one would.
    p0 = torch.tensor([0.1, 0.5, 0.15, 0.25])
    p1 = torch.tensor([0.4, 0.05, 0.35, 0.2])
    logits = torch.stack([p0.log(), p1.log()])
    params = SamplingParams(temperature=1.0, max_tokens=None)
    trials, states = 4000, []
    for seed in range(trials):  # two rows per trial, every trial in one sampler call
        state = CachedRequestState(f"r{seed}", 1, params, seed, block_ids=[[0]])
        state.append_tokens([0])
        state.samples = True
        states += [state, state]
    batch = SamplingBatch.from_requests(states, 4, (), torch.device("cpu"), draft_offsets=[0, 1] * trials)
    sampled = Sampler()(logits.repeat(trials, 1), batch).token_ids
    first, second = collections.Counter(), collections.Counter()
    for trial in range(trials):
        pair = sampled[2 * trial:2 * trial + 2]
        kept = pair[:num_kept(pair, [1])]
        first[kept[0]] += 1
        if len(kept) == 2:
            second[kept[1]] += 1
    assert sum(second.values()) == first[1]  # the draft is kept exactly when t0 equals it
    # 3 degrees of freedom each: p ~ 0.001
    assert _chi2(first, p0) < 16.3, first
    assert _chi2(second, p1) < 16.3, second


# ---------------------------------------------------------------- a tiny model


def _decode(runner, prompt: list[int], num_tokens: int, drafts_for, params=None) -> list[int]:
    """Drives the runner as the scheduler would, with drafts from `drafts_for(tokens)`."""
    seq = Seq("r", list(prompt), list(range(16)), params=params or SamplingParams(temperature=0.0))
    output = runner.execute(step(seq.schedule(len(prompt))))
    tokens = list(prompt) + output.sampled_token_ids[0]
    seq.computed = len(prompt)
    while len(tokens) - len(prompt) < num_tokens:
        seq.tokens = list(tokens)
        drafts = drafts_for(tokens)[: num_tokens - (len(tokens) - len(prompt)) - 1]
        new, entry = seq.schedule(1)
        entry = entry._replace(num_new_tokens=1 + len(drafts), spec_token_ids=drafts)
        output = runner.execute(step((new, entry)))
        kept = output.sampled_token_ids[0]
        assert 1 <= len(kept) <= len(drafts) + 1
        seq.computed += len(kept)
        tokens += kept
    return tokens[len(prompt):]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded-sampled"])
def test_a_tiny_model_decodes_the_same_tokens_with_drafts_as_without(params):
    prompt = [11, 12, 13, 14, 15, 16, 17, 11, 12, 13]
    without = _decode(tiny_runner(compiled=False), prompt, 24, lambda tokens: [], params)
    index = NgramIndex(1, 3)
    with_lookup = _decode(tiny_runner(compiled=False), prompt, 24, lambda tokens: index.propose(tokens, 4), params)
    # Drafts that are right (the tokens decoding without them produced) and wrong ones too.
    right = _decode(tiny_runner(compiled=False), prompt, 24,
                    lambda tokens: without[len(tokens) - len(prompt):len(tokens) - len(prompt) + 3], params)
    wrong = _decode(tiny_runner(compiled=False), prompt, 24, lambda tokens: [(t + 1) % 97 for t in tokens[-3:]], params)
    assert with_lookup == right == wrong == without


# ---------------------------------------------------------------- the engine


class _DraftCounts:
    """A stats listener summing the engine's speculative-decoding counters."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def on_step(self, stats) -> None:
        self.drafts += stats.spec_num_drafts
        self.draft_tokens += stats.spec_num_draft_tokens
        self.accepted += stats.spec_num_accepted_tokens
        assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens

    def on_request_finished(self, stats) -> None:
        pass


def _tiny_llm(path, speculative_config=None, jump_forward=True) -> tuple[LLM, _DraftCounts]:
    from tests.engine.tiny_model_dir import write_tiny_model

    model = path / "m"
    if not model.exists():
        write_tiny_model(model)
    llm = LLM(str(model), dtype="float32", num_kv_blocks=96, enforce_eager=True, max_num_batched_tokens=64,
              speculative_config=speculative_config, jump_forward=jump_forward)
    counts = _DraftCounts()
    llm.engine.stats_listeners.append(counts)
    return llm, counts


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATING = ["w5 w6 w7 w8 w5 w6 w7 w8 w5 w6", "w9 w10 w9 w10 w9", "w20 w21 w22 w23 w24 w25 w20 w21"]


def test_the_engine_with_drafts_gives_what_it_gives_without(tmp_path):
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["w7 w8"], logprobs=2)]
    plain, _ = _tiny_llm(tmp_path)
    spec, counts = _tiny_llm(tmp_path, SPEC)
    expected = plain.generate(REPEATING, params, use_tqdm=False)
    got = spec.generate(REPEATING, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in have.outputs] == [c.text for c in want.outputs]
        assert [c.finish_reason for c in have.outputs] == [c.finish_reason for c in want.outputs]
    for have, want in zip(got[2].outputs[0].logprobs, expected[2].outputs[0].logprobs, strict=True):
        assert (have.token_id, have.rank, [t for t, _ in have.top]) == (want.token_id, want.rank, [t for t, _ in want.top])
        assert have.logprob == pytest.approx(want.logprob, abs=1e-4)  # one forward verifies several rows
    assert counts.drafts > 0 and 0 < counts.accepted <= counts.draft_tokens
    assert not spec.engine.drafter._indexes  # finished requests forgotten


def test_drafts_under_min_tokens_give_what_decoding_without_them_gives(tmp_path):
    # 98 is a stop token that the prompt makes the drafter propose (after w109) while min_tokens
    # still bans it; those rows must reject it, and the request stops (98 or EOS) only after 10 outputs.
    # The last request is what benchmark clients send (kvserve-bench, vLLM's): ignore_eos with
    # min_tokens = max_tokens.
    stopping = REPEATING[0] + " w109 w98 w109 w98"
    prompts = [stopping, stopping, REPEATING[0] + " w109 w93 w109 w93"]  # the last: greedy 98 98 98 ...
    params = [SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, stop_token_ids=[98]),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, min_tokens=10, stop_token_ids=[98]),
              SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, ignore_eos=True)]
    plain, _ = _tiny_llm(tmp_path)
    spec, counts = _tiny_llm(tmp_path, SPEC)
    drafter, banned_drafts = spec.engine.drafter, []
    propose = drafter.propose

    def recording(requests, num_running, validate=None):
        requests = list(requests)
        propose(requests, num_running, validate)
        for r in requests:
            held_back = r.sampling_params.min_tokens - r.num_output_tokens  # draft positions still under the ban
            banned_drafts.extend(t for t in r.spec_token_ids[:held_back] if t in r.sampling_params.stop_token_ids)

    drafter.propose = recording
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert 98 not in got[0].outputs[0].token_ids[:10]
    assert got[0].outputs[0].finish_reason == "stop" and 10 < len(got[0].outputs[0].token_ids) < 24
    assert banned_drafts  # the drafts did propose the stop token where it was banned
    assert len(got[2].outputs[0].token_ids) == 20
    assert counts.drafts > 0 and counts.accepted > 0


def test_drafts_of_a_constrained_request_keep_to_its_grammar(tmp_path):
    # After the output's first w5 the prompt proposes what followed its w5 (w6 w9 w10); the grammar
    # allows only the w5 w6 pattern, so that draft is cut to w6, while drafts from the output's own
    # repetition fit. (Jump-forward off: this grammar forces everything after the first w5.)
    regex = StructuredOutputParams(GrammarKind.REGEX, "(w5w6){4}w7")  # the words' tokens carry no spaces
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_output=regex)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["w5 w6 w9 w10 w11", "w5 w6 w5 w6 w5"]
    plain, _ = _tiny_llm(tmp_path, jump_forward=False)
    spec, counts = _tiny_llm(tmp_path, SPEC, jump_forward=False)
    manager, cuts = spec.engine.structured_output, []
    validate = manager.valid_drafts

    def recording(request_id, drafts):
        kept = validate(request_id, drafts)
        cuts.append((request_id in manager, len(drafts), len(kept)))
        return kept

    manager.valid_drafts = recording
    expected = plain.generate(prompts, [params, free], use_tqdm=False)
    got = spec.generate(prompts, [params, free], use_tqdm=False)
    assert any(constrained and kept < drafted for constrained, drafted, kept in cuts)  # the grammar cut some
    assert all(kept == drafted for constrained, drafted, kept in cuts if not constrained)
    assert got[0].outputs[0].token_ids[:9] == [5, 6] * 4 + [7]
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert got[1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert counts.accepted > 0
    assert not spec.engine.structured_output._matchers


@pytest.mark.slow
def test_the_default_model_with_drafts_is_greedy_identical_and_accepts_drafts():
    llm = LLM(dtype="float32", speculative_config=SPEC | {"num_speculative_tokens": 4})
    counts = _DraftCounts()
    llm.engine.stats_listeners.append(counts)
    passage = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
               "were striking thirteen.")
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly: {passage}"}])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm.engine.drafter = None  # the same engine without drafts
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert counts.accepted >= 10, (counts.drafts, counts.draft_tokens, counts.accepted)
