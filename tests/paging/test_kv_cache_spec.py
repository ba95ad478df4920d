"""Layer specs, their grouping into shared-pool layer groups, and the start-up sizing."""

import pytest

from kvserve.paging import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTooSmallError,
    MLAAttentionSpec,
    group_layers,
    plan_kv_cache_config,
)
from kvserve.paging.kv_cache_spec import check_max_model_len_fits
from kvserve.paging.kv_sizing import PRESETS

GB = 10**9
SMOLLM2 = FullAttentionSpec(num_kv_heads=3, head_size=64, dtype="bfloat16", dtype_bytes=2)
A = FullAttentionSpec(2, 16, "float32", 4)
B = FullAttentionSpec(1, 32, "float32", 4)  # a different spec with the same page size
WIDE = FullAttentionSpec(4, 32, "float32", 4)  # a page 4x A's


def test_a_uniform_model_is_one_group_whose_slots_are_its_layers():
    groups = group_layers([SMOLLM2] * 30)
    assert groups == (KVCacheGroupSpec(tuple(range(30)), SMOLLM2),)
    config = KVCacheConfig(100, 16, groups)
    assert (config.num_slots, config.page_bytes, config.bytes_per_block) == (30, 2 * 3 * 64 * 2 * 16, 368_640)
    assert config.slot_of_layer() == [(0, layer) for layer in range(30)]
    assert config.bytes_per_block == PRESETS["smollm2-135m"].bytes_per_block(2)  # the planning tool agrees


def test_kinds_of_equal_size_form_one_group_each_and_share_the_slots():
    groups = group_layers([A, A, B, A, A, B, B, B])
    assert groups == (KVCacheGroupSpec((0, 1, 3, 4), A), KVCacheGroupSpec((2, 5, 6, 7), B))
    config = KVCacheConfig(10, 16, groups)
    # Slot j holds layer j of each group: 4 slots, not 8, and a block costs 4 pages.
    assert config.num_slots == 4 and config.bytes_per_block == 4 * A.page_bytes(16)
    assert config.slot_of_layer() == [(0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]


def test_a_rare_kind_sets_the_group_size_and_the_common_kind_is_cut_into_groups():
    # Gemma 3's pattern: five window-like layers per global one.
    specs = ([A] * 5 + [B]) * 2
    groups = group_layers(specs)
    assert [g.layer_indices for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert [g.spec for g in groups] == [A] * 5 + [B]
    assert KVCacheConfig(10, 16, groups).num_slots == 2


def test_nearly_equal_kinds_keep_one_group_each():
    groups = group_layers([A] * 9 + [B] * 8)  # 9 < 8 * 1.25: one group per kind, one slot unused by B
    assert [len(g.layer_indices) for g in groups] == [9, 8]
    assert KVCacheConfig(10, 16, groups).num_slots == 9
    assert [len(g.layer_indices) for g in group_layers([A] * 10 + [B] * 8)] == [8, 2, 8]  # 10 = 8 * 1.25: cut


def test_pages_are_as_large_as_the_largest_spec():
    config = KVCacheConfig(10, 16, group_layers([A, WIDE, A, WIDE]))
    assert config.page_bytes == WIDE.page_bytes(16) == 4 * A.page_bytes(16)
    assert config.bytes_per_block == 2 * WIDE.page_bytes(16)


def test_every_layer_belongs_to_exactly_one_group():
    with pytest.raises(ValueError, match="exactly one group"):
        KVCacheConfig(10, 16, (KVCacheGroupSpec((0, 2), A),))
    with pytest.raises(ValueError, match="at least 1"):
        FullAttentionSpec(0, 16, "float32", 4)
    with pytest.raises(ValueError, match="at least one attention layer"):
        group_layers([])


def test_plan_prefers_an_explicit_count_and_buys_whole_blocks_with_memory():
    specs = [SMOLLM2] * 30
    assert plan_kv_cache_config(specs, 16, 8192, num_kv_blocks=512, kv_cache_memory=1).num_blocks == 512
    assert plan_kv_cache_config(specs, 16, 8192, kv_cache_memory=2 * GB).num_blocks == 2 * GB // 368_640
    with pytest.raises(KVCacheTooSmallError, match="--max-model-len 4336"):
        plan_kv_cache_config(specs, 16, 8192, kv_cache_memory=100_000_000)
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        plan_kv_cache_config(specs, 16, 8192)


def test_one_request_must_fit_in_every_group_at_once():
    groups = group_layers([A, B])
    check_max_model_len_fits([g.spec for g in groups], 800, 100, 16)  # 50 blocks in each of 2 tables
    with pytest.raises(KVCacheTooSmallError, match="largest max_model_len that fits is 800: pass --max-model-len 800") as info:
        check_max_model_len_fits([g.spec for g in groups], 801, 100, 16)
    assert info.value.largest_fitting == 800
    with pytest.raises(KVCacheTooSmallError):
        plan_kv_cache_config([A, B], 16, 801, num_kv_blocks=100)


# DeepSeek-V3's latent: kv_lora_rank 512 + rope 64 values per token, in bf16.
LATENT = MLAAttentionSpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", dtype_bytes=2)


def test_a_latent_layer_keeps_one_vector_per_token_in_one_part():
    assert LATENT.bytes_per_token == 576 * 2
    assert LATENT.page_parts(16) == (576 * 2 * 16,)
    assert LATENT.max_num_blocks(33, 16) == 3  # every block of the context, as full attention
    config = KVCacheConfig(10, 16, group_layers([LATENT] * 61))
    # One plane of whole latent pages per slot: a block costs 61 latent pages, nothing for V.
    assert (config.num_planes, config.plane_bytes) == (1, 576 * 2 * 16)
    assert config.bytes_per_block == 61 * 576 * 2 * 16
    assert config.part_places(0) == [(0, 0, 576 * 2 * 16)]
    with pytest.raises(ValueError, match="kv_lora_rank must be at least 1"):
        MLAAttentionSpec(0, 64, "bfloat16", 2)


def test_full_attention_keeps_k_and_v_in_planes_of_their_own():
    config = KVCacheConfig(10, 16, group_layers([SMOLLM2] * 30))
    half = SMOLLM2.page_bytes(16) // 2
    assert (config.num_planes, config.plane_bytes) == (2, half)
    assert config.part_places(0) == [(0, 0, half), (1, 0, half)]


def test_latent_and_full_attention_layers_share_one_plane_of_whole_pages():
    wide = FullAttentionSpec(4, 64, "bfloat16", 2)  # 2 * 4 * 64 = 512 values a token, the latent 576
    config = KVCacheConfig(10, 16, group_layers([LATENT, wide, LATENT, wide]))
    assert config.num_planes == 1 and config.plane_bytes == LATENT.page_bytes(16)
    assert config.bytes_per_block == 2 * LATENT.page_bytes(16)
    full = [i for i, g in enumerate(config.groups) if g.spec == wide][0]
    half = wide.page_bytes(16) // 2
    assert config.part_places(full) == [(0, 0, half), (0, half, half)]  # K then V, side by side
