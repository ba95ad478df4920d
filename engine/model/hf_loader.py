"""Hugging Face safetensors checkpoints (single file or sharded) -> a state dict in HF names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.engine.model.model_errors import CorruptModelError, ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
# Old checkpoints saved derived buffers; we recompute them from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CorruptModelError(f"{index} is not a valid safetensors index ({exc}); re-download the model") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CorruptModelError(f"{model_dir}: shards {', '.join(missing)} listed in {INDEX_FILE} are missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def load_hf_weights(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not name.endswith(IGNORED_SUFFIXES):
                        weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except Exception as exc:  # safetensors raises its own error types for bad headers/truncation
            if isinstance(exc, CorruptModelError):
                raise
            raise CorruptModelError(f"{file} cannot be read ({type(exc).__name__}: {exc}); re-download it") from exc
    return weights
