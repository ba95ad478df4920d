"""LLMEngine's step loop without a model: a real Scheduler and KV cache manager, the real
OutputTracker and detokenizer, and a scripted runner that writes given texts byte by byte. Covers
the glue the slow end-to-end tests cover only with SmolLM2: deltas, stop strings split over
steps, n > 1, aborts and finish reasons."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvserve.engine.admission import AdmissionError
from kvserve.engine.config import EngineConfig
from kvserve.engine.input_batch import InputBatch
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.outputs import OutputAccumulator, RequestOutput
from kvserve.paging import KVCacheManager
from kvserve.scheduler import FinishReason, ModelRunnerOutput, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.scheduler.output import TokenLogprobs

EOS = 0
VOCAB = 257  # id = UTF-8 byte + 1; 0 is EOS
BLOCK_SIZE = 8


class ByteTokenizer:
    eos_token_id = EOS
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # EOS is the one special token: skipped, or shown as "<eos>" (as "<|im_end|>" would be).
        pieces = [b"<eos>" if i == EOS else bytes([i - 1]) for i in ids if i != EOS or not skip_special_tokens]
        return b"".join(pieces).decode("utf-8", errors="replace")


class ScriptedRunner:
    """Completion "<id>#<index>" writes texts[<id>#<index>] (or texts[<id>]) one byte per step,
    then EOS. Logprobs, when asked for, are -0.5 per token with the token itself on top."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts
        self.steps = 0
        self.batch = InputBatch(num_groups=1)  # what a runner knows of each request: the step diffs

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        ids, tokens, logprobs = [], [], []
        for state in self.batch.apply(output):
            if not state.samples:
                continue
            parent = state.request_id.rsplit("#", 1)[0]
            script = ByteTokenizer().encode(self.texts.get(state.request_id, self.texts.get(parent, "")))
            position = len(state.output_token_ids)
            token = script[position] if position < len(script) else EOS
            ids.append(state.request_id)
            tokens.append([token])
            wants = state.sampling_params.logprobs
            logprobs.append(None if wants is None else [TokenLogprobs(token, -0.5, 1, [(token, -0.5)][:wants])])
        return ModelRunnerOutput(ids, tokens, logprobs)


def make_engine(texts: dict[str, str], num_blocks: int = 64) -> LLMEngine:
    model_config = ModelConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
        max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
        eos_token_ids=(EOS,))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                          KVCacheManager(num_blocks, BLOCK_SIZE))
    return LLMEngine(EngineConfig(), model_config, ByteTokenizer(), scheduler, ScriptedRunner(texts))  # type: ignore[arg-type]


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    deltas: dict[str, list[RequestOutput]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return deltas
        for output in engine.step():
            deltas.setdefault(output.request_id, []).append(output)
    raise AssertionError("the engine did not finish")


def final(deltas: list[RequestOutput]) -> RequestOutput:
    accumulator = OutputAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.result()


def texts_by_index(deltas: list[RequestOutput]) -> dict[int, list[str]]:
    seen: dict[int, list[str]] = {}
    for delta in deltas:
        for completion in delta.outputs:
            seen.setdefault(completion.index, []).append(completion.text)
    return seen


def test_each_step_reports_only_the_new_token_and_text() -> None:
    engine = make_engine({"r": "hello"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=5))
    deltas = run(engine)["r"]
    assert [d.outputs[0].token_ids for d in deltas] == [[ord(c) + 1] for c in "hello"]
    assert [d.outputs[0].text for d in deltas] == list("hello")
    assert [d.finished for d in deltas] == [False] * 4 + [True]
    whole = final(deltas).outputs[0]
    assert (whole.text, whole.finish_reason, len(whole.token_ids)) == ("hello", "length", 5)
    assert engine.scheduler.kv_cache_manager.stats().blocks_used == 0


def test_eos_finishes_with_stop_and_no_text() -> None:
    engine = make_engine({"r": "ok"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=10))
    deltas = run(engine)["r"]
    last = deltas[-1].outputs[0]
    assert (last.text, last.token_ids, last.finish_reason, last.stop_reason) == ("", [EOS], "stop", None)
    assert final(deltas).outputs[0].text == "ok"


def test_stop_token_id_is_the_stop_reason() -> None:
    engine = make_engine({"r": "abcdef"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=10, stop_token_ids=[ord("c") + 1]))
    whole = final(run(engine)["r"]).outputs[0]
    assert (whole.token_ids[-1], whole.finish_reason, whole.stop_reason) == (ord("c") + 1, "stop", ord("c") + 1)
    assert len(whole.token_ids) == 3


@pytest.mark.parametrize("include", [False, True])
def test_the_ending_token_s_text_is_left_out_unless_asked_for(include: bool) -> None:
    # vLLM's behaviour: EOS or a stop token id ends the reply without its text (which shows when
    # special tokens are not skipped); its id stays in token_ids. include_stop_str_in_output keeps it.
    engine = make_engine({"eos": "ok", "tok": "abcdef", "len": "xyz"})
    params = {"skip_special_tokens": False, "include_stop_str_in_output": include}
    engine.add_request("eos", "hi", SamplingParams(max_tokens=10, **params))
    engine.add_request("tok", "hi", SamplingParams(max_tokens=10, stop_token_ids=[ord("c") + 1], **params))
    engine.add_request("len", "hi", SamplingParams(max_tokens=2, **params))
    outputs = {request_id: final(deltas).outputs[0] for request_id, deltas in run(engine).items()}
    assert outputs["eos"].token_ids == [ord("o") + 1, ord("k") + 1, EOS]
    assert outputs["eos"].text == ("ok<eos>" if include else "ok")
    assert outputs["tok"].text == ("abc" if include else "ab")
    assert (outputs["len"].text, outputs["len"].finish_reason) == ("xy", "length")


def test_stop_string_split_over_steps_is_held_back_then_cut() -> None:
    engine = make_engine({"r": "one two three"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=20, stop=["two"]))
    deltas = run(engine)["r"]
    streamed = texts_by_index(deltas)[0]
    assert "".join(streamed) == "one "
    assert not any("t" in piece or "w" in piece for piece in streamed)  # never a piece of the stop string
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", "two")
    assert engine.scheduler.kv_cache_manager.stats().blocks_used == 0


def test_held_back_text_that_is_not_a_stop_string_is_released() -> None:
    engine = make_engine({"r": "tw!"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=3, stop=["two"], include_stop_str_in_output=True))
    deltas = run(engine)["r"]
    assert [d.outputs[0].text for d in deltas] == ["", "", "tw!"]  # "t", "tw" may start "two"


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    engine = make_engine({"r": "one two three"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=20, stop=["two"], include_stop_str_in_output=True))
    assert final(run(engine)["r"]).outputs[0].text == "one two"


def test_a_split_utf8_character_arrives_whole() -> None:
    engine = make_engine({"r": "né!"})  # é is two bytes, so two tokens
    engine.add_request("r", "hi", SamplingParams(max_tokens=4))
    pieces = texts_by_index(run(engine)["r"])[0]
    assert "".join(pieces) == "né!" and "\ufffd" not in "".join(pieces)


def test_n_completions_report_under_their_index_and_finish_independently() -> None:
    engine = make_engine({"r#0": "aaaa", "r#1": "b"})
    engine.add_request("r", "prompt", SamplingParams(n=2, max_tokens=4))
    deltas = run(engine)["r"]
    whole = final(deltas)
    assert [(c.index, c.text, c.finish_reason) for c in whole.outputs] == [(0, "aaaa", "length"), (1, "b", "stop")]
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    # Once completion 1 has finished it is not reported again.
    finished_at = next(i for i, d in enumerate(deltas) if any(c.index == 1 and c.finished for c in d.outputs))
    assert all(c.index == 0 for d in deltas[finished_at + 1:] for c in d.outputs)


def test_logprobs_come_one_per_new_token_with_a_running_total() -> None:
    engine = make_engine({"r": "abc"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=3, logprobs=1))
    deltas = run(engine)["r"]
    assert [len(d.outputs[0].logprobs or []) for d in deltas] == [1, 1, 1]
    assert [d.outputs[0].cumulative_logprob for d in deltas] == [-0.5, -1.0, -1.5]
    assert len(final(deltas).outputs[0].logprobs or []) == 3


def test_no_logprobs_unless_asked() -> None:
    engine = make_engine({"r": "abc"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=3))
    assert all(d.outputs[0].logprobs is None and d.outputs[0].cumulative_logprob is None for d in run(engine)["r"])


def test_abort_reports_held_back_text_and_frees_everything() -> None:
    engine = make_engine({"r": "abxyzw", "other": "zzzzzz"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=20, stop=["xyq"]))
    engine.add_request("other", "hello", SamplingParams(max_tokens=6))
    seen: list[RequestOutput] = []
    for _ in range(4):  # "abxy" generated; "xy" may start "xyq", so it is held back
        seen += [o for o in engine.step() if o.request_id == "r"]
    assert "".join(texts_by_index(seen)[0]) == "ab"
    [aborted] = engine.abort_request("r")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].text == "xy" and aborted.outputs[0].token_ids == []
    assert engine.abort_request("r") == []  # already gone
    rest = run(engine)
    assert "r" not in rest and "".join(texts_by_index(rest["other"])[0]) == "zz"
    assert engine.num_unfinished_requests == 0
    assert engine.scheduler.kv_cache_manager.stats().blocks_used == 0


def test_abort_of_one_sibling_group_marks_only_unfinished_completions() -> None:
    engine = make_engine({"r#0": "aaaaaaaa", "r#1": ""})
    engine.add_request("r", "prompt", SamplingParams(n=2, max_tokens=8))
    early = []
    for _ in range(3):
        early += engine.step()
    assert any(c.index == 1 and c.finish_reason == "stop" for d in early for c in d.outputs)
    [aborted] = engine.abort_request("r")
    assert [(c.index, c.finish_reason) for c in aborted.outputs] == [(0, "abort")]


def test_a_reused_request_id_is_refused_while_running() -> None:
    engine = make_engine({"r": "abc"})
    engine.add_request("r", "hi", SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", "hi", SamplingParams(max_tokens=3))


def test_add_request_runs_the_admission_check_and_keeps_nothing_it_refuses() -> None:
    engine = make_engine({"r": "x"})
    assert engine.max_model_len == engine.scheduler.config.max_model_len == 256
    with pytest.raises(AdmissionError) as refused:
        engine.add_request("r", [1, VOCAB], SamplingParams(max_tokens=1))
    assert refused.value.field == "prompt"
    with pytest.raises(AdmissionError, match="maximum context length is 256"):
        engine.add_request("r", "x" * 250, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests() and engine.num_unfinished_requests == 0


def test_cache_salt_keeps_prefix_cache_entries_apart() -> None:
    engine = make_engine({"a": "x", "b": "x", "c": "x"})
    prompt = "sixteen byte pre" + "fix"  # two full 8-token blocks and a partial one
    finished = {}
    for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        finished.update({r: final(d) for r, d in run(engine).items()})
    assert [finished[r].num_cached_tokens for r in "abc"] == [0, 0, 16]


def test_priority_orders_admission_under_priority_scheduling() -> None:
    model_config = make_engine({}).model_config
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256,
                                          policy="priority"), KVCacheManager(64, BLOCK_SIZE))
    engine = LLMEngine(EngineConfig(scheduling_policy="priority"), model_config, ByteTokenizer(), scheduler,
                       ScriptedRunner({}))  # type: ignore[arg-type]
    for request_id, priority in (("low", 5), ("high", -1), ("mid", 0)):
        engine.add_request(request_id, "p", SamplingParams(max_tokens=1), priority=priority)
    order = [output.request_id for _ in range(10) for output in engine.step() if output.finished]
    assert order == ["high", "mid", "low"]


def test_finish_reasons_are_the_schedulers_enum_end_to_end() -> None:
    engine = make_engine({"len": "abcdef", "eos": "a", "str": "say two", "gone": "zzzz"})
    engine.add_request("len", "p", SamplingParams(max_tokens=2))
    engine.add_request("eos", "p", SamplingParams(max_tokens=5))
    engine.add_request("str", "p", SamplingParams(max_tokens=20, stop=("two",)))
    engine.add_request("gone", "p", SamplingParams(max_tokens=20))
    engine.step()
    [aborted] = engine.abort_request("gone")
    reasons = {r: final(d).outputs[0].finish_reason for r, d in run(engine).items()}
    reasons["gone"] = aborted.outputs[0].finish_reason
    assert reasons == {"len": FinishReason.LENGTH, "eos": FinishReason.STOP, "str": FinishReason.STOP,
                       "gone": FinishReason.ABORT}
    assert all(type(reason) is FinishReason for reason in reasons.values())
    assert f"{FinishReason.LENGTH}" == str(FinishReason.LENGTH) == "length"
