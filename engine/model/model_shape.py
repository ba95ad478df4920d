"""Which model `kvserve kv-size` plans for: a preset name, or a checkpoint's attention shape.

The shape is read by the functions that build the engine's ModelConfig (`shape_from_hf_dict`,
`shape_from_gguf`), so planning and serving agree on a model's KV size. Only metadata is read,
never weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.engine.model import gemma3_multimodal
from kvserve.engine.model.gguf_metadata import read_gguf, shape_from_gguf
from kvserve.engine.model.hf_config import shape_from_hf_dict
from kvserve.engine.model.model_errors import CorruptModelError
from kvserve.paging.kv_sizing import PRESETS, ModelShape


def resolve_model_shape(model: str) -> ModelShape:
    """A preset name (case-insensitive) or a path to a config.json, an HF model folder or a .gguf file."""
    preset = PRESETS.get(model.lower())
    if preset is not None:
        return preset
    path = Path(model)
    if path.exists():
        return read_model_shape(path)
    raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}) or a path to a config.json, an HF model folder or a .gguf file")


def read_model_shape(path: Path) -> ModelShape:
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path / "config.json"
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"{path} has no config.json and {len(ggufs)} .gguf files: pass the file itself")
            path = ggufs[0]
    if path.suffix == ".gguf":
        return shape_from_gguf(read_gguf(path), path)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc})") from exc
    if (config.get("architectures") or [None])[0] == gemma3_multimodal.HF_CLASS:
        # Its shipped text_config leaves out what transformers fills with defaults.
        config = {**config, "text_config": gemma3_multimodal.text_config(config)}
    return shape_from_hf_dict(path.parent.name if path.name == "config.json" else path.stem, config)
