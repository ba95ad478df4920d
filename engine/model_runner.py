"""ModelRunner: owns the KV cache tensors and turns a SchedulerOutput into one forward pass.

    SchedulerOutput ──► input_ids, positions, AttentionMetadata ──► model.forward ──► hidden
    hidden[last row of each sampling request] ──► logits ──► Sampler ──► ModelRunnerOutput

Metadata is built with numpy over whole arrays: one Python iteration per request, none per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.attention_metadata import AttentionMetadata
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
from kvserve.engine.sampling.sampler import Sampler, SamplingBatch
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask
from kvserve.kernels import AttentionBackend
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


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


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        attention: AttentionBackend,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.model_dtype = next(model.parameters()).dtype
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

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        """`token_mask` restricts the constrained rows' next token to their grammars."""
        if output.blocks_to_copy:
            self._copy_blocks(output.blocks_to_copy)
        inputs = self.prepare_inputs(output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, self.attention)
        plan = PromptLogprobsPlan.from_scheduled(output.scheduled)
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
        scheduled = output.scheduled
        block_size = self.kv_spec.block_size
        query_lens = np.fromiter((len(r.token_ids) for r in scheduled), dtype=np.int64, count=len(scheduled))
        computed = np.fromiter((r.num_computed_tokens for r in scheduled), dtype=np.int64, count=len(scheduled))
        seq_lens = computed + query_lens
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # positions: for request i, computed[i] .. seq_lens[i]-1, laid end to end.
        request_of_token = np.repeat(np.arange(len(scheduled)), query_lens)
        positions = computed[request_of_token] + (np.arange(num_tokens) - query_start_loc[request_of_token])

        max_blocks = max(len(r.block_ids) for r in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        for i, r in enumerate(scheduled):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size

        input_ids = np.fromiter((t for r in scheduled for t in r.token_ids), dtype=np.int64, count=num_tokens)
        sampling_rows = np.fromiter((i for i, r in enumerate(scheduled) if r.samples), dtype=np.int64)
        logits_indices = query_start_loc[sampling_rows + 1] - 1

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            attn_metadata=meta,
            logits_indices=torch.from_numpy(logits_indices).to(device),
        )

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]
