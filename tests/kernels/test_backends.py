"""Backend choice: auto picks by device, a forced choice is honoured or refused with a reason."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend, select_attention_backend
from tests.kernels.paged_batch import MIXED_QUERY_LENS, MIXED_SEQ_LENS, TOLERANCES, dense_attention, make_batch


def metadata(reference, slot_mapping: torch.Tensor, block_tables: torch.Tensor | None = None) -> AttentionMetadata:
    """The step's metadata for a reference batch, as the engine builds it."""
    q_lens = reference.query_start_loc[1:] - reference.query_start_loc[:-1]
    return AttentionMetadata(
        slot_mapping=slot_mapping.long(),
        block_tables=(reference.block_tables if block_tables is None else block_tables).int(),
        seq_lens=reference.seq_lens.int(), query_start_loc=reference.query_start_loc.int(),
        max_query_len=int(q_lens.max()), max_seq_len=int(reference.seq_lens.max()), num_decodes=0,
    )


def test_auto_picks_torch_on_cpu() -> None:
    assert select_attention_backend("auto", torch.device("cpu")) == TorchAttentionBackend(validate=False)
    assert select_attention_backend("torch", torch.device("cpu"), debug=True) == TorchAttentionBackend(validate=True)


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda() -> None:
    assert select_attention_backend("auto", torch.device("cuda")).name == "triton"


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="--attention-backend torch"):
        select_attention_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention_backend("triton", torch.device("cpu"), debug=True) == TritonAttentionBackend(debug=True)


def test_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, torch, triton"):
        select_attention_backend("flash", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TorchAttentionBackend(validate=False), TritonAttentionBackend(debug=True)],
                         ids=["torch", "torch-serving", "triton"])
def test_backends_write_then_attend_like_dense(backend) -> None:
    reference, key, value, slots = _written_batch()
    kv_cache = (torch.zeros_like(reference.key_cache), torch.zeros_like(reference.value_cache))
    # Every request's K/V in one step's write, into the slots the reference used; then two
    # "layers" through one prepared metadata (the second reuses what the first set up).
    meta = backend.prepare(metadata(reference, slots))
    backend.write_kv_cache(key, value, kv_cache, meta)
    for _ in range(2):
        out = backend.paged_attention(reference.query, kv_cache, meta, reference.scale)
        torch.testing.assert_close(out, dense_attention(reference), **TOLERANCES[torch.float32])


def _written_batch():
    """A mixed batch's K/V as one step's rows, their slots, and the reference (empty caches)."""
    reference = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3)
    block_size = reference.key_cache.shape[2]
    slots = [reference.block_tables[i, torch.arange(k.shape[0]) // block_size].long() * block_size + torch.arange(k.shape[0]) % block_size
             for i, k in enumerate(reference.dense_keys)]
    return reference, torch.cat(reference.dense_keys), torch.cat(reference.dense_values), torch.cat(slots)


def test_the_serving_backend_refuses_a_block_past_the_cache() -> None:
    # Unvalidated CPU calls go straight to the C++ op where it builds: it still checks what it reads.
    reference = make_batch([17, 5], [1, 5], group=2)
    tables = reference.block_tables.clone()
    tables[0, 1] = reference.key_cache.shape[0]
    meta = metadata(reference, torch.zeros(6, dtype=torch.long), tables)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = \d+ is outside"):
        TorchAttentionBackend(validate=False).paged_attention(
            reference.query, (reference.key_cache, reference.value_cache), meta, reference.scale)


@pytest.mark.slow  # one torch.compile, ~15 s
def test_the_serving_backend_compiles_into_one_graph_that_writes_the_cache_in_place() -> None:
    backend = TorchAttentionBackend(validate=False)
    reference, key, value, slots = _written_batch()
    key_cache, value_cache = torch.zeros_like(reference.key_cache), torch.zeros_like(reference.value_cache)

    def layer(query, key, value, kv_cache, meta):
        backend.write_kv_cache(key * 1.0, value, kv_cache, meta)  # the math around it, as in a layer
        return backend.paged_attention(query * 1.0, kv_cache, meta, reference.scale) + 0.0

    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    out = compiled(reference.query, key, value, (key_cache, value_cache), backend.prepare(metadata(reference, slots)))
    torch.testing.assert_close(out, dense_attention(reference), **TOLERANCES[torch.float32])
    block_size = key_cache.shape[2]
    torch.testing.assert_close(key_cache[slots // block_size, :, slots % block_size], key, rtol=0, atol=0)
