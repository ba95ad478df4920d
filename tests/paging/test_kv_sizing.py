import pytest

from kvserve.paging import KVCacheTooSmallError
from kvserve.paging.kv_sizing import PRESETS, ModelShape, num_blocks_for_memory, parse_memory_size

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


def test_window_layers_keep_their_window_and_reproduce_the_mistral_figure():
    mistral = PRESETS["mistral-7b-v0.1"]
    # fp16, 32k context: the window layers keep 4,096 tokens each, 1/8 of the full cache.
    assert mistral.kv_cache_bytes(2, 32768) == 32 * 4096 * 4096 == 2**29  # 0.54 GB
    assert mistral.as_global().kv_cache_bytes(2, 32768) == 2**32  # 4.29 GB
    assert mistral.kv_cache_bytes(2, 2048) == mistral.as_global().kv_cache_bytes(2, 2048)  # inside the window
    gemma = PRESETS["gemma-3-27b"]
    assert (gemma.num_global_layers, gemma.num_window_layers, gemma.sliding_window) == (10, 52, 1024)
    per_layer_token = 2 * 16 * 128 * 2
    assert gemma.global_bytes(2, 131072) == 10 * 131072 * per_layer_token
    assert gemma.window_bytes(2, 131072) == 52 * 1024 * per_layer_token
    assert PRESETS["qwen3-8b"].num_window_layers == 0 and PRESETS["gemma-3-4b"].num_window_layers == 29


def test_a_decoding_request_holds_a_window_of_blocks_per_window_group():
    from kvserve.paging.kv_sizing import blocks_per_decoding_request

    mistral = PRESETS["mistral-7b-v0.1"]
    assert blocks_per_decoding_request(mistral, 2, 32768) == 4095 // 16 + 1 + 1 == 257  # one group of 32 layers
    assert blocks_per_decoding_request(mistral, 2, 100) == 7
    assert blocks_per_decoding_request(PRESETS["llama-7b"], 2, 4096) == 256
    with pytest.raises(ValueError, match="window layers need a positive sliding_window"):
        ModelShape("bad", 4, 8, 8, 64, num_window_layers=2)
