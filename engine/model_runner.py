"""ModelRunner: owns the KV cache tensors and turns a SchedulerOutput into one forward pass.

    SchedulerOutput ──► input_ids, positions, AttentionMetadata ──► model.forward ──► hidden
    hidden[last row of each sampling request] ──► logits ──► Sampler ──► ModelRunnerOutput

Metadata is built once per step (attention_metadata.build_flat_batch), with decodes first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.attention_metadata import AttentionMetadata, build_flat_batch
from kvserve.engine.compilation import bind_compiled_graphs, compile_layers, mark_cache_shapes_static, symbolic_sizes
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
from kvserve.engine.sampling.sampler import Sampler, SamplingBatch
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask
from kvserve.kernels import AttentionBackend
from kvserve.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    def bytes(self, model_config: ModelConfig) -> int:
        return model_config.kv_shape().bytes_per_block(self.dtype.itemsize, self.block_size) * self.num_blocks


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # row of each sampling request's last token in the flat batch
    requests: list[ScheduledRequest]  # in the flattened order (decodes first)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        attention: AttentionBackend,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        *,
        compiled: bool = False,
    ) -> None:
        """compiled: run the decoder layers through torch.compile (engine/compilation.py); call
        `warm_up` once before serving so that compiling happens at start-up."""
        self.model = model
        self.compiled = compiled
        self.graphs_bound = False  # layers called straight through their compiled graphs (warm_up)
        if compiled:
            compile_layers(model)
        self.model_dtype = model.dtype
        self.model_config = model_config
        self.kv_spec = kv_spec
        self.attention = attention
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        shape = (kv_spec.num_blocks, model_config.num_kv_heads, kv_spec.block_size, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_spec.dtype, device=device), torch.zeros(shape, dtype=kv_spec.dtype, device=device))
            for _ in range(model_config.num_layers)
        ]
        if compiled:
            mark_cache_shapes_static(self.kv_caches)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        """`token_mask` restricts the constrained rows' next token to their grammars."""
        if output.blocks_to_copy:
            self._copy_blocks(output.blocks_to_copy)
        inputs = self.prepare_inputs(output)
        hidden = self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        plan = PromptLogprobsPlan.from_scheduled(inputs.requests)  # rows in the flattened order
        prompt_logprobs = {} if plan is None else compute_prompt_logprobs(hidden, plan, self.model.compute_logits)
        sampling = [r for r in output.scheduled if r.samples]
        if not sampling:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if token_mask is not None:
            logits = apply_token_mask(logits, token_mask)
        batch = SamplingBatch.from_requests(sampling, self.model_config.vocab_size, self.eos_token_ids,
                                             self.device)
        sampled = self.sampler(logits, batch)
        return ModelRunnerOutput(
            request_ids=[r.request_id for r in sampling],
            sampled_token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def prepare_inputs(self, output: SchedulerOutput) -> StepInputs:
        """Flattens the step with single-token requests (decodes) first, as the attention
        kernels want; `logits_indices` stays in the scheduler's order of sampling requests."""
        scheduled = output.scheduled
        query_lens = [len(r.token_ids) for r in scheduled]
        if max(query_lens, default=0) == 1:  # all decodes (steady state): already in order
            order, batch, batch_lens = list(range(len(scheduled))), list(scheduled), query_lens
        else:
            order = sorted(range(len(scheduled)), key=lambda i: query_lens[i] != 1)  # stable
            batch = [scheduled[i] for i in order]
            batch_lens = [query_lens[i] for i in order]
        flat = build_flat_batch(batch_lens, [r.num_computed_tokens for r in batch],
                                [r.block_ids for r in batch], self.kv_spec.block_size, self.device)
        input_ids = np.fromiter((t for r in batch for t in r.token_ids), dtype=np.int64, count=flat.attn_metadata.num_tokens)
        # Request i of the scheduler's order is flattened request position[i], whose last row is
        # ends[position[i]] - 1.
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        ends = np.cumsum(batch_lens)
        logits_indices = ends[position[[i for i, r in enumerate(scheduled) if r.samples]]] - 1
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=flat.positions,
            attn_metadata=flat.attn_metadata,
            logits_indices=torch.from_numpy(logits_indices).to(self.device),
            requests=batch,
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs the forward on the two kinds of step that get their own compiled graph: one
        token, and several requests with a decode and a prompt chunk. Writes only into block 0,
        which holds nothing yet. Compiled, the first warm-up then binds the layers straight to
        their compiled graphs (compilation.bind_compiled_graphs)."""
        forwards = [functools.partial(self._warm_up_forward, lens) for lens in ([1], [1, 2])]
        if self.compiled and not self.graphs_bound:
            self.graphs_bound = bind_compiled_graphs(self.model, forwards)
        else:
            for forward in forwards:
                forward()

    def _warm_up_forward(self, query_lens: list[int]) -> None:
        flat = build_flat_batch(query_lens, [0] * len(query_lens), [[0]] * len(query_lens),
                                self.kv_spec.block_size, self.device)
        input_ids = torch.zeros(flat.attn_metadata.num_tokens, dtype=torch.int64, device=self.device)
        self._forward(input_ids, flat.positions, flat.attn_metadata)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.compiled:
            return self.model(input_ids, positions, self.kv_caches, meta, self.attention)
        with symbolic_sizes():
            return self.model(input_ids, positions, self.kv_caches, meta, self.attention)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]
