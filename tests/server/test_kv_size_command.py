import argparse
import json
import re

import pytest

from kvserve.server.kv_size_command import add_parser, run


def kv_size(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command"))
    code = run(parser.parse_args(["kv-size", *argv]))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_rows(out: str) -> dict[int, list[float]]:
    """tokens -> the numbers after the batch column (GB, GiB[, as-MHA GB])."""
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^\s*([\d,]+)\s+(\d+)\s+([\d.,]+)\s+([\d.,]+)(?:\s+([\d.,]+))?\s*$", line)
        if match:
            rows[int(match.group(1).replace(",", ""))] = [float(v.replace(",", "")) for v in match.groups()[2:] if v]
    return rows


@pytest.mark.parametrize(
    ("model", "num_tokens", "expected_gb"),
    [("llama-7b", 4096, 2.1), ("llama-7b", 32768, 17), ("gpt2", 4096, 0.15)],
)
def test_mha_figures_in_gb(capsys, model, num_tokens, expected_gb):
    code, out, _ = kv_size(capsys, "--model", model, "--tokens", str(num_tokens), "--kv-dtype", "fp16")
    assert code == 0
    assert table_rows(out)[num_tokens][0] == pytest.approx(expected_gb, rel=0.03)
    assert "MHA" in out


def test_llama_70b_with_and_without_gqa(capsys):
    code, out, _ = kv_size(capsys, "--model", "llama-70b", "--tokens", "4096", "32768")
    assert code == 0
    gqa_gb, gqa_gib, mha_gb = table_rows(out)[32768]
    assert gqa_gb == pytest.approx(11, rel=0.03)
    assert gqa_gib == pytest.approx(10.0)
    assert mha_gb == pytest.approx(86, rel=0.03)
    assert "GQA, 8 query heads share each KV head" in out and "8x smaller" in out


def test_batch_multiplies_and_dtype_scales(capsys):
    _, fp16, _ = kv_size(capsys, "--model", "llama-7b", "--tokens", "4096", "--batch", "8")
    _, fp8, _ = kv_size(capsys, "--model", "llama-7b", "--tokens", "4096", "--batch", "8", "--kv-dtype", "fp8")
    assert table_rows(fp16)[4096][0] == pytest.approx(8 * 2.147, rel=1e-3)
    assert table_rows(fp8)[4096][0] == pytest.approx(8 * 2.147 / 2, rel=1e-3)


def test_int8_counts_a_float32_scale_per_token_head_and_k_or_v(capsys):
    # llama-7b: 32 layers x 32 KV heads x 2 (K, V) x (128 int8 values + a 4-byte scale) = 270,336 bytes a token.
    code, out, _ = kv_size(capsys, "--model", "llama-7b", "--tokens", "4096", "--kv-dtype", "int8", "--memory", "80GB")
    assert code == 0
    assert "KV per token (int8): 270,336 bytes" in out
    assert table_rows(out)[4096][0] == pytest.approx(270_336 * 4096 / 1e9, abs=0.005)  # printed to 2 decimals
    assert "of 16 tokens (4.325 MB each)" in out  # the blocks the engine would allocate count the scales too


def test_int8_is_refused_for_latent_attention(capsys):
    code, _, err = kv_size(capsys, "--model", "deepseek-v3", "--tokens", "4096", "--kv-dtype", "int8")
    assert code == 2 and "latent attention (MLA)" in err


def test_memory_gives_blocks_and_concurrent_requests(capsys):
    code, out, _ = kv_size(capsys, "--model", "smollm2-135m", "--tokens", "8192", "--memory", "2GiB")
    assert code == 0
    # 2 GiB / (22.5 KiB * 16 tokens) = 5825 blocks; an 8192-token request needs 512 of them.
    assert "5,825 blocks of 16 tokens" in out and "= 93,200 tokens" in out
    assert "requests of 8,192 tokens that fit at once: 11" in out


def test_reads_a_config_json_path(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}))
    code, out, _ = kv_size(capsys, "--model", str(config), "--tokens", "4096")
    assert code == 0 and table_rows(out)[4096][0] == pytest.approx(2.15, abs=0.005)


def test_unknown_model_fails_with_the_presets_listed(capsys):
    code, out, err = kv_size(capsys, "--model", "nope", "--tokens", "1")
    assert code == 2 and out == ""
    assert "llama-70b" in err and "config.json" in err


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "10", "--memory", "lots"], ["--tokens", "10", "--kv-dtype", "fp4"]])
def test_bad_arguments_are_rejected_by_the_parser(capsys, argv):
    with pytest.raises(SystemExit):
        kv_size(capsys, "--model", "gpt2", *argv)


def window_rows(out: str) -> dict[int, list[float]]:
    """tokens -> global GB, window GB, KV GB, KV GiB, all-global GB, share %."""
    rows = {}
    for line in out.splitlines():
        numbers = re.findall(r"[\d][\d,]*\.?\d*", line)
        if line.rstrip().endswith("%") and len(numbers) == 8:
            values = [float(v.replace(",", "")) for v in numbers]
            rows[int(values[0])] = values[2:]
    return rows


def test_mistral_window_layers_at_32k_are_an_eighth_of_the_full_cache(capsys):
    code, out, _ = kv_size(capsys, "--model", "mistral-7b-v0.1", "--tokens", "4096", "32768")
    assert code == 0
    assert "layers: 0 global (every token) + 32 sliding-window (the last 4,096 tokens each)" in out
    global_gb, window_gb, kv_gb, kv_gib, all_global_gb, share = window_rows(out)[32768]
    assert (global_gb, window_gb, kv_gb, kv_gib, all_global_gb, share) == (0.0, 0.54, 0.54, 0.5, 4.29, 12.5)
    assert window_rows(out)[4096][-1] == 100.0


def test_gemma_3_global_and_window_layers_apart_with_memory(capsys):
    code, out, _ = kv_size(capsys, "--model", "gemma-3-4b", "--tokens", "131072", "--memory", "24GB")
    assert code == 0
    assert "layers: 5 global (every token) + 29 sliding-window (the last 1,024 tokens each)" in out
    global_gb, window_gb, kv_gb, _, all_global_gb, _ = window_rows(out)[131072]
    assert global_gb == pytest.approx(5 * 131072 * 4096 / 1e9, abs=0.01)
    assert window_gb == pytest.approx(29 * 1024 * 4096 / 1e9, abs=0.01)
    assert kv_gb < all_global_gb / 5
    assert "blocks each while decoding" in out


def test_reads_window_layers_from_a_config_json(capsys, tmp_path):
    config = tmp_path / "config.json"
    text = {"model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
            "hidden_size": 1024, "head_dim": 128, "sliding_window": 512, "sliding_window_pattern": 6}
    config.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    code, out, _ = kv_size(capsys, "--model", str(config), "--tokens", "8192")
    assert code == 0 and "layers: 2 global (every token) + 10 sliding-window (the last 512 tokens each)" in out
    config.write_text(json.dumps({"model_type": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8,
                                  "num_key_value_heads": 2, "hidden_size": 512, "sliding_window": 4096}))
    code, out, _ = kv_size(capsys, "--model", str(config), "--tokens", "8192")
    assert code == 0 and "layers: 0 global (every token) + 4 sliding-window (the last 4,096 tokens each)" in out


@pytest.mark.parametrize(("model", "layers", "heads", "saving"), [("deepseek-v2-lite", 27, 16, "8.9"), ("deepseek-v3", 61, 128, "71.1")])
def test_latent_attention_presets_against_the_same_models_mha_cache(capsys, model, layers, heads, saving):
    # MLA: one latent of 512 + 64 values per token and layer; MHA: 192-dim keys and 128-dim values per head.
    code, out, _ = kv_size(capsys, "--model", model, "--tokens", "32768", "--kv-dtype", "bf16", "--memory", "80GB")
    assert code == 0
    latent, mha = layers * 576 * 2, layers * heads * (192 + 128) * 2
    assert f"KV per token (bf16): {latent:,} bytes" in out and f"as MHA: {mha:,} bytes" in out
    assert "attention: MLA" in out and f"{saving}x smaller than with MHA" in out
    gb, _, mha_gb = table_rows(out)[32768]
    assert gb == pytest.approx(latent * 32768 / 1e9, abs=0.01) and mha_gb == pytest.approx(mha * 32768 / 1e9, abs=0.01)
    blocks = 80 * 10**9 // (latent * 16)
    assert f"{blocks:,} blocks of 16 tokens" in out
