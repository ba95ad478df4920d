"""ModelRunner: owns the KV cache tensors and turns a SchedulerOutput into one forward pass.

    SchedulerOutput ──► InputBatch (its diffs applied to the runner's copy of each request)
                    ──► input_ids, positions, AttentionMetadata per layer group ──► model.forward ──► hidden
    hidden[last row of each sampling request] ──► logits ──► Sampler ──► ModelRunnerOutput

Metadata is built once per step (attention_metadata.build_flat_batch), with decodes first, and
goes through the backend's `prepare` once per group before the first layer.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.attention_metadata import build_flat_batch
from kvserve.engine.compilation import bind_compiled_graphs, compile_layers, mark_cache_shapes_static, symbolic_sizes
from kvserve.engine.input_batch import CachedRequestState, InputBatch
from kvserve.engine.kv_cache_tensors import KVCacheTensors
from kvserve.engine.model.fused_decode import FusedDecodeLayers
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.packed_linear import FEW_ROWS_MAX
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
from kvserve.engine.quantization.int8_linear import PACKED_MAX_ROWS
from kvserve.engine.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from kvserve.engine.spec_decode.verification import num_kept
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask
from kvserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from kvserve.paging import KVCacheConfig, SlidingWindowSpec
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]  # one per layer (its group's), prepared by the backend
    logits_indices: torch.Tensor  # row of each sampling request's last token in the flat batch
    requests: list[CachedRequestState]  # in the flattened order (decodes first)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        kv_cache_config: KVCacheConfig,
        kv_dtype: torch.dtype,
        attention: AttentionBackend,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        *,
        compiled: bool = False,
    ) -> None:
        """compiled: run the decoder layers through torch.compile (engine/compilation.py); call
        `warm_up` once before serving so that compiling happens at start-up. `kv_cache_config`
        must have been planned from this model's `kv_cache_specs` (its groups name its layers)."""
        self.model = model
        self.compiled = compiled
        self.graphs_bound = False  # layers called straight through their compiled graphs (warm_up)
        if compiled:
            compile_layers(model)
        self.model_dtype = model.dtype
        self.model_config = model_config
        if kv_cache_config.num_layers != len(model.layers):
            raise ValueError(f"the KV cache config covers {kv_cache_config.num_layers} layers, the model has "
                             f"{len(model.layers)}: plan it from this model's kv_cache_specs()")
        self.kv_cache_config = kv_cache_config
        # Each layer group's sliding window (0: full attention), carried by its step metadata.
        self.group_windows = [group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else 0
                              for group in kv_cache_config.groups]
        self.attention = attention
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.input_batch = InputBatch(len(kv_cache_config.groups))
        self.kv_cache_tensors = KVCacheTensors.allocate(kv_cache_config, kv_dtype, device)
        if compiled:
            mark_cache_shapes_static(self.kv_caches)

    @property
    def kv_caches(self) -> list[KVCache]:
        """(key, value) cache of each layer."""
        return self.kv_cache_tensors.layers

    @property
    def block_size(self) -> int:
        return self.kv_cache_config.block_size

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        """`token_mask` restricts the constrained rows' next token to their grammars."""
        if output.finished_req_ids:
            self.sampler.token_counts.remove(output.finished_req_ids)
        if output.blocks_to_copy:
            self.kv_cache_tensors.copy_blocks(output.blocks_to_copy)
        states = self.input_batch.apply(output)
        if not states:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], logprobs=[])
        inputs = self.prepare_inputs(states)
        hidden = self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        plan = PromptLogprobsPlan.from_scheduled(inputs.requests)  # rows in the flattened order
        prompt_logprobs = {} if plan is None else compute_prompt_logprobs(hidden, plan, self.model.compute_logits)
        sampling = [state for state in states if state.samples]
        if not sampling:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs=prompt_logprobs)
        rows = hidden[inputs.logits_indices]
        if any(state.spec_token_ids for state in sampling):
            return self._verify(sampling, self._logits(rows, token_mask), prompt_logprobs)
        batch = SamplingBatch.from_requests(sampling, self.model_config.vocab_size, self.eos_token_ids, self.device)
        sampled = self._greedy_without_logits(rows, batch) if token_mask is None else None
        if sampled is None:
            sampled = self.sampler(self._logits(rows, token_mask), batch)
        return ModelRunnerOutput(
            request_ids=[state.request_id for state in sampling],
            sampled_token_ids=[[token_id] for token_id in sampled.token_ids],
            logprobs=[None if entry is None else [entry] for entry in sampled.logprobs],
            prompt_logprobs=prompt_logprobs,
        )

    def _logits(self, rows: torch.Tensor, token_mask: TokenMask | None) -> torch.Tensor:
        logits = self.model.compute_logits(rows)
        return logits if token_mask is None else apply_token_mask(logits, token_mask)

    def _greedy_without_logits(self, rows: torch.Tensor, batch: SamplingBatch) -> SamplerOutput | None:
        """A plain greedy batch's tokens straight from the model's head (protocol.py's optional
        greedy_tokens: the [rows, vocab] logits are never written), or None."""
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        if not batch.is_plain_greedy or greedy_tokens is None:
            return None
        tokens = greedy_tokens(rows)
        return None if tokens is None else SamplerOutput(token_ids=tokens.tolist(), logprobs=[None] * batch.num_rows)

    def _verify(self, sampling: list[CachedRequestState], logits: torch.Tensor,
                prompt_logprobs: dict) -> ModelRunnerOutput:
        """A step with drafts: one sampling row per position (engine/spec_decode/verification.py),
        each request keeping its matching drafts and the token after them."""
        rows = [state for state in sampling for _ in range(len(state.spec_token_ids) + 1)]
        offsets = [offset for state in sampling for offset in range(len(state.spec_token_ids) + 1)]
        batch = SamplingBatch.from_requests(rows, self.model_config.vocab_size, self.eos_token_ids, self.device,
                                             draft_offsets=offsets)
        sampled = self.sampler(logits, batch)
        token_ids, logprobs, first = [], [], 0
        for state in sampling:
            count = len(state.spec_token_ids) + 1
            tokens = sampled.token_ids[first:first + count]
            kept = num_kept(tokens, state.spec_token_ids)
            token_ids.append(tokens[:kept])
            entries = sampled.logprobs[first:first + kept]
            logprobs.append(None if entries[0] is None else entries)
            first += count
        return ModelRunnerOutput(request_ids=[state.request_id for state in sampling], sampled_token_ids=token_ids,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def prepare_inputs(self, states: list[CachedRequestState]) -> StepInputs:
        """Flattens the step (`states` in the scheduler's order, diffs applied) with single-token
        requests (decodes) first, as the attention kernels want; `logits_indices` stays in the
        scheduler's order of sampling requests."""
        query_lens = [state.num_new_tokens for state in states]
        if max(query_lens) == 1:  # all decodes (steady state): already in order
            order, batch, batch_lens = list(range(len(states))), states, query_lens
            token_ids = [state.all_token_ids[state.num_computed_tokens] for state in batch]
        else:
            order = sorted(range(len(states)), key=lambda i: query_lens[i] != 1)  # stable
            batch = [states[i] for i in order]
            batch_lens = [query_lens[i] for i in order]
            token_ids = [t for state in batch for t in state.step_token_ids()]
        tables = [[state.block_ids[group] for state in batch] for group in range(len(self.kv_cache_config.groups))]
        flat = build_flat_batch(batch_lens, [state.num_computed_tokens for state in batch], tables, self.block_size,
                                self.device, self.group_windows)
        group_metadata = [self.attention.prepare(meta) for meta in flat.group_metadata]
        # Request i of the scheduler's order is flattened request position[i], whose last row is
        # ends[position[i]] - 1.
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        ends = np.cumsum(batch_lens)
        sampling = [i for i, state in enumerate(states) if state.samples]
        logits_indices = ends[position[sampling]] - 1
        if any(states[i].spec_token_ids for i in sampling):  # a request with k drafts samples its last k + 1 rows
            logits_indices = np.concatenate([np.arange(end - len(states[i].spec_token_ids), end + 1)
                                             for i, end in zip(sampling, logits_indices.tolist())])
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=flat.positions,
            attn_metadata=[group_metadata[group] for group in self.kv_cache_tensors.group_of_layer],
            logits_indices=torch.from_numpy(logits_indices).to(self.device),
            requests=batch,
        )

    @torch.inference_mode()
    def warm_up(self, max_step_tokens: int | None = None) -> None:
        """Runs the forward on the kinds of step that get their own compiled graph: one token,
        several requests with a decode and a prompt chunk, and the same with more rows than the
        layers' few-row kernels take (bf16 and int8 layers branch on the row count: FEW_ROWS_MAX,
        PACKED_MAX_ROWS; bf16 layers with a higher limit (packed_linear.few_rows_limit) at theirs,
        where a step of `max_step_tokens`, the token budget, can pass it), so that no step compiles
        while serving.
        Writes only into block 0, which holds nothing yet. Compiled, the first warm-up then binds
        the layers straight to their compiled graphs (compilation.bind_compiled_graphs)."""
        wide_chunk = max(2, FEW_ROWS_MAX + 1 - 16, PACKED_MAX_ROWS + 1 - 16)
        steps = [[1], [1, 2], [1] * 16 + [wide_chunk]]
        higher_limits = {module.few_rows_max for module in self.model.modules()
                         if getattr(module, "packed_weight", None) is not None} - {FEW_ROWS_MAX}
        for limit in sorted(limit for limit in higher_limits if limit < (max_step_tokens or 0)):
            # Chunks of a widely supported length (a context of 64 tokens), together past the limit.
            steps.append([1] * 16 + [64] * (limit // 64) + [1])
        forwards = [functools.partial(self._warm_up_forward, lens) for lens in steps]
        if self.compiled and not self.graphs_bound:
            self.graphs_bound = bind_compiled_graphs(self.model, forwards)
            # Compiled first, so that a step the fused layers do not fit finds its graph ready.
            self._fuse_small_steps(forwards)
        else:
            for forward in forwards:
                forward()

    def _fuse_small_steps(self, forwards: list[functools.partial]) -> None:
        """Where the model is made of plain Llama blocks on the CPU kernels, steps of up to the
        few-row kernel's rows run all layers in one call (engine/model/fused_decode.py); the
        warm-up's steps run once more through it, so a problem shows at start-up."""
        fused = FusedDecodeLayers.build(self.model, self.attention)
        if fused is None:
            return
        self.model.fused_layers = fused
        logger.info("steps of up to %d rows run the %d layers in one call (kvserve's bf16 kernels)",
                    fused.max_rows, len(fused.blocks))
        for forward in forwards:
            forward()

    def _warm_up_forward(self, query_lens: list[int]) -> None:
        # Every position of a request maps to block 0 (a chunk longer than a block writes its slots again).
        tables = [[[0] * -(-n // self.block_size) for n in query_lens] for _ in self.kv_cache_config.groups]
        flat = build_flat_batch(query_lens, [0] * len(query_lens), tables, self.block_size, self.device,
                                self.group_windows)
        metadata = [self.attention.prepare(meta) for meta in flat.group_metadata]
        input_ids = torch.zeros(flat.positions.shape[0], dtype=torch.int64, device=self.device)
        self._forward(input_ids, flat.positions, [metadata[g] for g in self.kv_cache_tensors.group_of_layer])

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        if not self.compiled:
            return self.model(input_ids, positions, self.kv_caches, meta, self.attention)
        with symbolic_sizes():
            return self.model(input_ids, positions, self.kv_caches, meta, self.attention)
