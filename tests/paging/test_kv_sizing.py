import pytest

from kvserve.paging import KVCacheTooSmallError
from kvserve.paging.kv_sizing import (
    PRESETS,
    ModelShape,
    check_max_model_len_fits,
    max_model_len_that_fits,
    num_blocks_for_memory,
    parse_memory_size,
    plan_num_kv_blocks,
)

GB = 10**9


@pytest.mark.parametrize(
    ("model", "num_tokens", "mha", "expected_gb"),
    [
        ("llama-7b", 4096, False, 2.1),
        ("llama-7b", 32768, False, 17),
        ("gpt2", 4096, False, 0.15),
        ("llama-70b", 32768, True, 86),
        ("llama-70b", 32768, False, 11),
    ],
)
def test_cross_check_figures_in_gb(model, num_tokens, mha, expected_gb):
    shape = PRESETS[model].as_mha() if mha else PRESETS[model]
    size_gb = shape.kv_cache_bytes(2, num_tokens) / GB
    assert size_gb == pytest.approx(expected_gb, rel=0.03)


def test_bytes_per_token_of_known_models():
    assert PRESETS["llama-7b"].bytes_per_token(2) == 512 * 2**10
    assert PRESETS["smollm2-135m"].bytes_per_token(2) == 22.5 * 2**10
    assert PRESETS["smollm2-135m"].bytes_per_token(4) == 45 * 2**10
    assert PRESETS["llama-70b"].bytes_per_token(1) == 2 * 80 * 8 * 128
    assert PRESETS["gpt3-175b"].bytes_per_token(2) == 2 * 96 * 12288 * 2
    assert PRESETS["gpt2"].kv_cache_bytes(2, 1024, batch=8) == 8 * 1024 * 36864


def test_gqa_factor_and_attention_kind():
    assert (PRESETS["llama-70b"].gqa_factor, PRESETS["llama-70b"].attention_kind) == (8, "GQA")
    assert (PRESETS["llama-7b"].gqa_factor, PRESETS["llama-7b"].attention_kind) == (1, "MHA")
    assert ModelShape("m", 2, 8, 1, 64).attention_kind == "MQA"
    with pytest.raises(ValueError, match="cannot be grouped"):
        ModelShape("bad", 2, 9, 2, 64)
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        ModelShape("bad", 0, 8, 8, 64)


def test_bytes_per_token_needs_a_positive_element_size():
    with pytest.raises(ValueError, match="dtype_bytes must be positive"):
        PRESETS["gpt2"].bytes_per_token(0)


def test_blocks_for_memory_round_down_to_whole_blocks():
    shape = PRESETS["smollm2-135m"]  # 23,040 bytes/token, 368,640 bytes per 16-token block
    assert num_blocks_for_memory(368_640 * 10, shape, 2) == 10
    assert num_blocks_for_memory(368_640 * 10 - 1, shape, 2) == 9
    assert num_blocks_for_memory(368_640 * 10, shape, 2, block_size=32) == 5


def test_too_small_cache_names_the_largest_max_model_len_that_fits():
    assert max_model_len_that_fits(100, 16) == 1600
    check_max_model_len_fits(1600, 100, 16)
    with pytest.raises(KVCacheTooSmallError, match="largest max_model_len that fits is 1600: pass --max-model-len 1600") as info:
        check_max_model_len_fits(8192, 100, 16)
    assert info.value.largest_fitting == 1600


def test_plan_num_kv_blocks_prefers_an_explicit_count_and_checks_the_fit():
    shape = PRESETS["smollm2-135m"]
    assert plan_num_kv_blocks(shape, 2, 16, 8192, num_kv_blocks=512, kv_cache_memory=1) == 512
    assert plan_num_kv_blocks(shape, 2, 16, 8192, kv_cache_memory=2 * GB) == 2 * GB // 368_640
    with pytest.raises(KVCacheTooSmallError, match="--max-model-len 4336"):
        plan_num_kv_blocks(shape, 2, 16, 8192, kv_cache_memory=100_000_000)
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        plan_num_kv_blocks(shape, 2, 16, 8192)


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GB", 80 * GB), ("80 gb", 80 * GB), ("74.5GiB", int(74.5 * 2**30)), ("24e9", 24 * GB), ("1048576", 2**20), ("512MiB", 2**29), ("1.5TB", 1.5e12)],
)
def test_parse_memory_size(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "80XB", "-1GB", "0"])
def test_parse_memory_size_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_memory_size(text)
