"""ModelRunner on a tiny random Llama: the flattened batch puts decodes first and maps sampled rows
back; the compiled forward writes the same cache and samples the same tokens as eager, with no
new graph for new row counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.worker.kv_cache_sizing import kv_cache_config_for
from kvserve.engine.model_runner import ModelRunner, StepInputs
from kvserve.engine.quantization.quantize_model import quantize_model
from kvserve.kernels import TorchAttentionBackend
from kvserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.scheduler.sampling_params import SamplingParams

BLOCK = 4
CONFIG = ModelConfig(
    architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
    max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
    eos_token_ids=(2,),
)
GREEDY = SamplingParams(temperature=0.0)


def tiny_runner(compiled: bool, config: ModelConfig = CONFIG, quantization: str | None = None) -> ModelRunner:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    if quantization is not None:
        quantize_model(model, quantization)
    return ModelRunner(model.eval(), config, kv_cache_config_for(model, 32, BLOCK, torch.float32), torch.float32,
                       TorchAttentionBackend(), torch.device("cpu"), eos_token_ids=(), compiled=compiled)


@dataclass
class Seq:
    """A request as these tests drive it by hand: the scheduler's side of the step diffs."""

    request_id: str
    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    outputs: list[int] = field(default_factory=list)
    params: SamplingParams = GREEDY
    num_sent: int = 0  # tokens the runner has been sent

    def schedule(self, n: int) -> tuple[NewRequestData | None, ScheduledRequest]:
        samples = self.computed + n == len(self.tokens)
        first = self.num_sent == 0
        new = NewRequestData(self.request_id, len(self.tokens) - len(self.outputs), self.params, 0) if first else None
        entry = ScheduledRequest(self.request_id, self.computed, n, samples, self.tokens[self.num_sent:],
                                 (tuple(self.blocks),) if first else (), first)
        self.num_sent = len(self.tokens)
        return new, entry


def step(*scheduled: tuple[NewRequestData | None, ScheduledRequest]) -> SchedulerOutput:
    return SchedulerOutput([entry for _, entry in scheduled], [new for new, _ in scheduled if new is not None])


def prepare(runner: ModelRunner, output: SchedulerOutput) -> StepInputs:
    return runner.prepare_inputs(runner.input_batch.apply(output))


def test_decodes_go_first_and_sampled_rows_map_back_to_their_requests():
    runner = tiny_runner(compiled=False)
    chunk = Seq("a", list(range(10, 17)), [5, 1])  # 5 of 7 prompt tokens: samples nothing
    decode = Seq("b", [3, 4, 5, 6], [7], computed=3)
    last_chunk = Seq("c", [8, 9, 10, 11, 12], [2, 9], computed=2)
    decode2 = Seq("d", [20, 21], [4], computed=1)
    output = step(chunk.schedule(5), decode.schedule(1), last_chunk.schedule(3), decode2.schedule(1))
    inputs = prepare(runner, output)
    meta = inputs.attn_metadata[0]
    assert all(layer_meta is meta for layer_meta in inputs.attn_metadata)  # one group: one metadata
    assert inputs.input_ids.tolist() == [6, 21, 10, 11, 12, 13, 14, 10, 11, 12]
    assert meta.num_decodes == 2 and meta.query_start_loc.tolist() == [0, 1, 2, 7, 10]
    assert meta.slot_mapping.tolist() == [7 * BLOCK + 3, 4 * BLOCK + 1, 20, 21, 22, 23, 4, 8 + 2, 8 + 3, 9 * BLOCK]
    # Sampling requests in the scheduler's order: b, c, d -> their last rows 0, 9, 1.
    assert inputs.logits_indices.tolist() == [0, 9, 1]


def test_prompt_logprobs_follow_their_rows_when_decodes_move_first():
    scoring = SamplingParams(temperature=0.0, prompt_logprobs=2)
    alone = tiny_runner(compiled=False).execute(step(Seq("p", [9, 8, 7, 6, 5], [3, 4], params=scoring).schedule(4)))
    runner = tiny_runner(compiled=False)
    decode = Seq("d", [11, 12, 13], [0])
    runner.execute(step(decode.schedule(3)))
    decode.computed = 3
    decode.tokens.append(14)
    # The chunk comes first in the scheduler's order; the runner moves the decode ahead of it.
    mixed = runner.execute(step(Seq("p", [9, 8, 7, 6, 5], [3, 4], params=scoring).schedule(4), decode.schedule(1)))
    assert mixed.prompt_logprobs.keys() == {"p"}
    _assert_same_logprobs(mixed.prompt_logprobs["p"].entries, alone.prompt_logprobs["p"].entries)


def _assert_same_logprobs(got: list, expected: list) -> None:
    """The same tokens, ranks and top tokens; logprobs to float32 rounding: a matmul's kernel may
    depend on the step's row count (MKL's sgemm does on AVX2 CPUs), so a row's sums need not be
    bit for bit those of the same row in another batch."""
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in got] == \
        [(e.token_id, e.rank, [t for t, _ in e.top]) for e in expected]
    for g, e in zip(got, expected):
        assert g.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in e.top], abs=1e-4)


def run_steps(runner: ModelRunner, plan: list[list[tuple[int, int]]], seqs: list[Seq]) -> list[list[int]]:
    """plan: per step, (sequence index, tokens to compute) in the scheduler's order."""
    for plan_step in plan:
        result = runner.execute(step(*(seqs[i].schedule(n) for i, n in plan_step)))
        sampled = {request_id: tokens[0] for request_id, tokens in zip(result.request_ids, result.sampled_token_ids)}
        for i, n in plan_step:
            seqs[i].computed += n
            if seqs[i].request_id in sampled:
                seqs[i].tokens.append(sampled[seqs[i].request_id])
                seqs[i].outputs.append(sampled[seqs[i].request_id])
    return [s.outputs for s in seqs]


def fresh_seqs() -> list[Seq]:
    return [Seq("long", [(7 * i) % 90 + 3 for i in range(13)], [11, 3, 30, 8, 19, 6]),
            Seq("short", [5, 9, 14], [0, 21, 17]),
            Seq("one", [42], [25, 12])]


# Row counts 1..9, chunks across block boundaries, decodes and chunks in either order.
PLAN = [[(0, 6), (1, 3)], [(1, 1), (0, 7)], [(2, 1)], [(0, 1), (1, 1), (2, 1)], [(2, 1)], [(1, 1), (0, 1)],
        [(0, 1), (2, 1), (1, 1)], [(2, 1), (0, 1)]]


@pytest.mark.slow
def test_compiled_forward_equals_eager_without_a_graph_per_row_count():
    eager, compiled = tiny_runner(compiled=False), tiny_runner(compiled=True)
    compiled.warm_up()
    eager.warm_up()  # the same garbage in block 0, so that the caches compare equal
    torch._dynamo.utils.counters.clear()
    assert run_steps(compiled, PLAN, fresh_seqs()) == run_steps(eager, PLAN, fresh_seqs())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0, "a step compiled a new graph after warm-up"
    for (k_eager, v_eager), (k_compiled, v_compiled) in zip(eager.kv_caches, compiled.kv_caches):
        torch.testing.assert_close(k_compiled, k_eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_compiled, v_eager, rtol=1e-5, atol=1e-5)


def test_logits_stay_in_the_model_dtype() -> None:
    # No float32 copy of [rows, vocab] per step: the sampler upcasts only batches that need it.
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).to(torch.bfloat16).eval()
    hidden = torch.randn(5, CONFIG.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.bfloat16
        assert torch.equal(logits, model.lm_head(hidden))
