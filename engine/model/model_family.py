"""What a model family registers (engine/model/registry.py): how to read its config, where each
checkpoint tensor goes in its module, and which decoder class to build.

    config.json `architectures` / GGUF `general.architecture` ──► ModelFamily
        config_from_hf / config_from_gguf ──► ModelConfig (or the family's subclass of it)
        checkpoint_layout(config)         ──► our parameter <- checkpoint tensors (HF names), and
                                               how tensor parallelism splits it
        gguf_tensor(config, name)         ──► the HF name of a GGUF tensor (and llama.cpp's Q/K
                                               row permutation, where the family has it)
        build(config, parallel)           ──► the decoder (engine/model/protocol.py's CausalLM),
                                               with one rank's local sizes
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.model.tensor_parallel import TensorParallel


class Split(Enum):
    """How a parameter is cut over tensor-parallel ranks (engine/model/parallel_layers.py)."""

    REPLICATED = "replicated"  # every rank holds all of it (norms)
    COLUMN = "column"  # output features (dim 0); each source (q, k, v) is split separately
    ROW = "row"  # input features (dim 1)
    VOCAB = "vocab"  # vocabulary rows (dim 0): ceil(vocab / N) per rank, zero rows past the end


@dataclass(frozen=True)
class WeightTarget:
    name: str  # our parameter, e.g. "layers.0.self_attn.qkv_proj.weight"
    sources: tuple[str, ...]  # checkpoint tensors (HF names), concatenated along dim 0 in this order
    split: Split = Split.REPLICATED
    # A single source that is itself fused (Phi-3's qkv_proj: q, k, v rows; gate_up_proj): the
    # rows of each section, which a column split cuts separately, as it does separate sources.
    sections: tuple[int, ...] = ()


@dataclass(frozen=True)
class CheckpointLayout:
    targets: tuple[WeightTarget, ...]
    # Tensors a checkpoint may hold that are not loaded (a tied model's copy of lm_head), and
    # name prefixes of such tensors (DeepSeek-V3's multi-token-prediction layer).
    ignored: frozenset[str] = field(default_factory=frozenset)
    ignored_prefixes: tuple[str, ...] = ()
    # Checkpoint name prefixes read under another name before any of the above is matched (old ->
    # new; engine/model/renamed_checkpoint.py): one layout for two spellings of one checkpoint.
    renames: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GGUFTensor:
    """Where a GGUF tensor goes: its HF name, and, when llama.cpp's converter permuted its rows
    for interleaved rope (Llama's Q and K), the rows of one head (the permutation is per head);
    `shift`: what the converter added to every value (Gemma's norms: +1), subtracted on load."""

    hf_name: str
    rope_rows_per_head: int | None = None
    # llama.cpp stacks a MoE layer's experts in one [experts, out, in] tensor: hf_name holds "{}"
    # for the expert index, and expert e's slice is that transformers tensor.
    stacked_experts: bool = False
    # Newer llama.cpp converters split DeepSeek's kv_b_proj per head into attn_k_b ([heads,
    # latent, nope], transposed) and attn_v_b ([heads, v, latent]): "k" or "v", rejoined on load.
    kv_b_part: str | None = None
    shift: float = 0.0


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # Our architecture names -> config.json's `architectures` class names ("llama" -> "LlamaForCausalLM").
    architectures: Mapping[str, str]
    # GGUF `general.architecture` -> our architecture name (llama.cpp writes Mistral as "llama").
    gguf_architectures: Mapping[str, str]
    # (our architecture, config.json, generation_config.json or None) -> config
    config_from_hf: Callable[[str, Mapping[str, Any], Mapping[str, Any] | None], ModelConfig]
    # (our architecture, the GGUF's metadata) -> config
    config_from_gguf: Callable[[str, GGUFFields], ModelConfig]
    checkpoint_layout: Callable[[ModelConfig], CheckpointLayout]
    # A GGUF tensor's place, or None for a tensor that only carries configuration (rope_freqs);
    # raises ModelConfigError for a tensor the family has no place for.
    gguf_tensor: Callable[[ModelConfig, str], GGUFTensor | None]
    build: Callable[[ModelConfig, TensorParallel], CausalLM]
