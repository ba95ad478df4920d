"""Loading one tensor-parallel rank: each rank's module holds exactly its slice of the unsharded
weights (fused q/k/v and gate/up split per section, row-parallel columns, vocabulary rows padded
to equal counts), from safetensors and from GGUF (quantized rows, block-aligned and unaligned
column ranges, llama.cpp's Q/K permutation undone per head), and reads no more than that slice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.model.llama import LLAMA
from kvserve.engine.model.model_loader import build_model, load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.registry import load_model_config
from kvserve.engine.model.safetensors_checkpoint import SafetensorsCheckpoint
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from tests.engine.test_model_gguf import hf_weights, write_gguf
from tests.server.tiny_checkpoint import write_tiny_checkpoint

CPU = torch.device("cpu")
# Building and loading never communicate; only a forward would use the group.
NO_COLLECTIVES = object()


def _rank(rank: int, world: int) -> TensorParallel:
    return SINGLE if world == 1 else TensorParallel(rank, world, NO_COLLECTIVES)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelSource]:
    folder = tmp_path_factory.mktemp("sharded")
    # The byte-level vocabulary has 259 tokens: 130 rows per rank of 2, the last one padding.
    hf = write_tiny_checkpoint(folder / "hf", num_layers=2, hidden=64, heads=4, kv_heads=2)
    gguf_path = folder / "tiny.gguf"
    # ffn_down's 96 columns split into 48 (not whole Q8_0 blocks of 32), attn_output's 64 into 32 (whole).
    write_gguf(gguf_path, hf_weights(seed=5),
               quantize=("blk.1.ffn_down.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight"))
    return {"hf": ModelSource("hf", hf), "gguf": ModelSource("gguf", gguf_path)}


def _rows(weight: torch.Tensor, rank: int, world: int, sections: list[int]) -> torch.Tensor:
    return torch.cat([part.chunk(world)[rank] for part in weight.split(sections)])


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_each_rank_holds_exactly_its_slice_of_the_unsharded_weights(sources: dict[str, ModelSource], fmt: str) -> None:
    config, full = load_model(sources[fmt], torch.float32, CPU)
    world = 2
    q, kv = config.q_size, config.kv_size
    for rank in range(world):
        _, part = load_model(sources[fmt], torch.float32, CPU, _rank(rank, world))
        for whole, mine in zip(full.layers, part.layers, strict=True):
            assert torch.equal(mine.self_attn.qkv_proj.weight, _rows(whole.self_attn.qkv_proj.weight, rank, world, [q, kv, kv]))
            assert torch.equal(mine.self_attn.o_proj.linear.weight, whole.self_attn.o_proj.weight.chunk(world, dim=1)[rank])
            ffn = config.intermediate_size
            assert torch.equal(mine.mlp.gate_up_proj.weight, _rows(whole.mlp.gate_up_proj.weight, rank, world, [ffn, ffn]))
            assert torch.equal(mine.mlp.down_proj.linear.weight, whole.mlp.down_proj.weight.chunk(world, dim=1)[rank])
            assert torch.equal(mine.input_layernorm.weight, whole.input_layernorm.weight)
            assert (mine.self_attn.num_heads, mine.self_attn.num_kv_heads) == (config.num_heads // 2, config.num_kv_heads // 2)
        per_rank = -(-config.vocab_size // world)
        rows = full.embed_tokens.weight[rank * per_rank:(rank + 1) * per_rank]
        embedding = part.embed_tokens.weight
        assert embedding.shape[0] == per_rank and part.embed_tokens.start == rank * per_rank
        assert torch.equal(embedding[:rows.shape[0]], rows) and not embedding[rows.shape[0]:].any()
        assert part.lm_head.linear.weight is embedding  # tied, as in the checkpoint
        assert torch.equal(part.norm.weight, full.norm.weight)


class CountingCheckpoint:
    """Counts the elements each read returns."""

    def __init__(self, inner: SafetensorsCheckpoint) -> None:
        self.inner, self.where, self.elements = inner, inner.where, 0

    def names(self) -> frozenset[str]:
        return self.inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def read(self, *args: object) -> torch.Tensor:
        tensor = self.inner.read(*args)
        self.elements += tensor.numel()
        return tensor


def test_a_rank_reads_only_its_slices(sources: dict[str, ModelSource]) -> None:
    path = sources["hf"].path
    config = load_model_config(path)
    reads = []
    for world in (1, 2):
        with SafetensorsCheckpoint(path) as opened:
            counting = CountingCheckpoint(opened)
            model = build_model(LLAMA, config, counting, torch.float32, CPU, _rank(1, world) if world > 1 else SINGLE)
        # Every element read is one the rank keeps (the vocabulary's padding row is made, not read).
        kept = sum(p.numel() for p in model.parameters())
        reads.append(counting.elements)
        assert counting.elements <= kept
    norms = (2 * config.num_layers + 1) * config.hidden_size
    assert reads[1] - norms <= (reads[0] - norms) // 2 + config.hidden_size
