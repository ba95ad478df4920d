"""The runner's KV memory as the specs lay it out: K/V planes for full attention, one latent per
token for latent attention (MLA), both kinds side by side in one pool; copy-on-write copies every
plane."""

from __future__ import annotations

import torch

from kvserve.engine.kv_cache_tensors import KVCacheTensors
from kvserve.kernels.kv_quant import row_scales
from kvserve.paging import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec, SlidingWindowSpec, group_layers

BLOCK = 16


def test_the_latent_cache_holds_exactly_one_latent_vector_per_token_per_layer():
    spec = MLAAttentionSpec(kv_lora_rank=32, qk_rope_head_dim=16, dtype="bfloat16", dtype_bytes=2)
    num_layers, num_blocks = 3, 7
    config = KVCacheConfig(num_blocks, BLOCK, group_layers([spec] * num_layers))
    tensors = KVCacheTensors.allocate(config, torch.bfloat16, torch.device("cpu"))
    tokens = num_blocks * BLOCK
    # Read from the allocated tensors: (kv_lora_rank + rope_dim) x 2 bytes per token per layer.
    assert tensors.num_bytes == tokens * num_layers * (32 + 16) * 2 == config.total_bytes
    for key, value in tensors.layers:
        assert key.shape == (num_blocks, 1, BLOCK, 48) and value.shape == (num_blocks, 1, BLOCK, 32)
        assert key.untyped_storage().nbytes() == tokens * 48 * 2  # the layer's own latent storage, nothing else
        assert value.data_ptr() == key.data_ptr() and value.stride() == key.stride()  # a view of the latents
    distinct = {key.untyped_storage().data_ptr() for key, _ in tensors.layers}
    assert len(distinct) == num_layers
    # Writing a latent writes the values: they are its first kv_lora_rank entries.
    key, value = tensors.layers[1]
    key[2, 0, 5] = torch.arange(48, dtype=torch.bfloat16)
    assert torch.equal(value[2, 0, 5], torch.arange(32, dtype=torch.bfloat16))


def test_full_attention_keeps_separate_contiguous_k_and_v_tensors():
    spec = FullAttentionSpec(2, 8, "float32", 4)
    tensors = KVCacheTensors.allocate(KVCacheConfig(5, BLOCK, group_layers([spec] * 2)), torch.float32,
                                      torch.device("cpu"))
    for key, value in tensors.layers:
        assert key.shape == value.shape == (5, 2, BLOCK, 8)
        assert key.is_contiguous() and value.is_contiguous() and key.data_ptr() != value.data_ptr()
    assert tensors.num_bytes == 5 * BLOCK * 2 * (2 * 2 * 8 * 4)


def test_latent_and_full_attention_layers_share_the_pool_and_copy_on_write_copies_both():
    latent = MLAAttentionSpec(kv_lora_rank=16, qk_rope_head_dim=8, dtype="float32", dtype_bytes=4)  # 24 a token
    full = FullAttentionSpec(1, 8, "float32", 4)  # K 8 + V 8 a token: a page smaller than the latent's
    config = KVCacheConfig(4, BLOCK, group_layers([latent, full]))
    tensors = KVCacheTensors.allocate(config, torch.float32, torch.device("cpu"))
    (lk, lv), (fk, fv) = tensors.layers
    assert lk.shape == (4, 1, BLOCK, 24) and fk.shape == fv.shape == (4, 1, BLOCK, 8)
    assert lk.stride(0) == fk.stride(0) == fv.stride(0) == BLOCK * 24  # one plane of whole pages
    assert fv.data_ptr() - fk.data_ptr() == BLOCK * 8 * 4  # V right after K in the full layer's page
    assert lk.data_ptr() == fk.data_ptr()  # each layer is slot 0 of its group: a block id is one group's
    lk[1].fill_(1.0)  # block 1 held by the latent group, block 2 by the full-attention group
    fk[2].fill_(2.0)
    fv[2].fill_(3.0)
    tensors.copy_blocks([(1, 3), (2, 0)])
    assert bool((lk[3] == 1.0).all()) and bool((fk[0] == 2.0).all()) and bool((fv[0] == 3.0).all())


def test_an_int8_page_holds_each_part_s_rows_then_their_scales_and_copy_on_write_moves_both():
    spec = FullAttentionSpec(2, 16, "int8", 1)
    assert spec.bytes_per_token == 2 * 2 * (16 + 4)  # K and V: 16 int8 values and a float32 scale per head
    config = KVCacheConfig(5, BLOCK, group_layers([spec] * 2))
    tensors = KVCacheTensors.allocate(config, torch.int8, torch.device("cpu"))
    assert tensors.num_bytes == config.total_bytes == 5 * BLOCK * 2 * spec.bytes_per_token
    for key, value, *scale_bytes in tensors.layers:
        assert key.shape == value.shape == (5, 2, BLOCK, 16) and key.dtype == torch.int8
        key_scales, value_scales = (row_scales(s) for s in scale_bytes)  # the kernels read the bytes as floats
        assert key_scales.shape == value_scales.shape == (5, 2, BLOCK) and key_scales.dtype == torch.float32
        assert key_scales.stride(0) * 4 == key.stride(0)  # paged by the same block ids: one page a block
        assert key_scales.data_ptr() == key.data_ptr() + 2 * BLOCK * 16  # right after the block's rows
    key, value, key_scales, value_scales = tensors.layers[1]
    key_scales, value_scales = row_scales(key_scales), row_scales(value_scales)
    key[3].fill_(7)
    key_scales[3].fill_(0.5)
    value_scales[3].fill_(0.25)
    tensors.copy_blocks([(3, 0)])
    assert bool((key[0] == 7).all()) and bool((key_scales[0] == 0.5).all()) and bool((value_scales[0] == 0.25).all())
    assert bool((row_scales(tensors.layers[0][2]) == 0).all())  # the other layer's scales untouched


def test_int8_window_and_full_groups_share_the_pool_with_their_scales():
    full = FullAttentionSpec(2, 16, "int8", 1)
    window = SlidingWindowSpec(2, 16, "int8", 1, sliding_window=32)
    config = KVCacheConfig(4, BLOCK, group_layers([window, full, window, full]))
    tensors = KVCacheTensors.allocate(config, torch.int8, torch.device("cpu"))
    assert all(len(layer) == 4 and row_scales(layer[2]).shape == (4, 2, BLOCK) for layer in tensors.layers)
    assert tensors.num_bytes == config.total_bytes
