"""--max-num-batched-tokens' default: 2048 on a GPU; on a CPU that multiplies the model's dtype in
matrix tiles (AMX, bf16) 768 tokens a thread between 1536 and 2048; on other CPUs 256 tokens a
thread between 512 and 2048; never below
--max-num-seqs. The engine resolves it once and every part sees that number."""

from __future__ import annotations

import pytest

from kvserve.engine import LLM
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.step_tokens import default_max_num_batched_tokens
from kvserve.kernels.cpu_bf16_gemm import bf16_matrix_tiles
from tests.engine.tiny_model_dir import write_tiny_model


@pytest.mark.parametrize(("device", "threads", "max_num_seqs", "expected"), [
    ("cpu", 1, 128, 512),  # the floor
    ("cpu", 2, 128, 512),
    ("cpu", 3, 128, 768),
    ("cpu", 4, 128, 1024),
    ("cpu", 8, 128, 2048),
    ("cpu", 64, 128, 2048),  # the ceiling
    ("cpu", 2, 600, 600),  # every running request's decode fits one step
    ("cuda", 1, 128, 2048),
    ("cuda", 1, 4096, 4096),
])
def test_default_by_device(device: str, threads: int, max_num_seqs: int, expected: int) -> None:
    assert default_max_num_batched_tokens(device, threads, max_num_seqs) == expected


@pytest.mark.parametrize(("threads", "max_num_seqs", "expected"), [(1, 128, 1536), (2, 128, 1536), (3, 128, 2048),
                                                                  (64, 128, 2048), (2, 3000, 3000)])
def test_matrix_tiles_take_larger_steps(threads: int, max_num_seqs: int, expected: int) -> None:
    assert default_max_num_batched_tokens("cpu", threads, max_num_seqs, matrix_tiles=True) == expected


def test_bf16_matrix_tiles_reads_amx_bf16() -> None:
    assert bf16_matrix_tiles(frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))
    assert not bf16_matrix_tiles(frozenset({"avx512f", "avx512_bf16"}))  # vectors only (Zen 4, Cooper Lake)


def test_config_leaves_it_to_the_engine_and_still_refuses_zero() -> None:
    assert EngineConfig().max_num_batched_tokens is None
    with pytest.raises(ConfigError) as error:
        EngineConfig(max_num_batched_tokens=0)
    assert error.value.option == "--max-num-batched-tokens"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.mark.parametrize(("options", "expected"), [
    ({"cpu_threads": 1}, 512),
    ({"cpu_threads": 1, "max_num_seqs": 700}, 700),
    ({"cpu_threads": 1, "max_num_batched_tokens": 48}, 48),  # given: kept as it is
])
def test_engine_resolves_the_default_once(tiny_dir, options: dict, expected: int) -> None:
    llm = LLM(str(tiny_dir), dtype="float32", enforce_eager=True, num_kv_blocks=64, **options)
    try:
        assert llm.engine.config.max_num_batched_tokens == expected
        assert llm.engine.scheduler.config.max_num_batched_tokens == expected
    finally:
        llm.close()


@pytest.mark.parametrize(("dtype", "tiles", "expected"), [
    ("bfloat16", True, 1536),
    ("float32", True, 512),  # fp32 matmuls stay on vectors even where the CPU has AMX
    ("bfloat16", False, 512),
])
def test_engine_asks_the_cpu_about_matrix_tiles(tiny_dir, monkeypatch, dtype: str, tiles: bool,
                                                expected: int) -> None:
    monkeypatch.setattr("kvserve.engine.engine_builder.bf16_matrix_tiles", lambda: tiles)
    llm = LLM(str(tiny_dir), dtype=dtype, enforce_eager=True, num_kv_blocks=64, cpu_threads=1)
    try:
        assert llm.engine.config.max_num_batched_tokens == expected
    finally:
        llm.close()
