"""The model families kvserve runs, and which one a checkpoint is.

config.json's `architectures[0]` (or its `model_type`) and a GGUF's `general.architecture` pick a
family (engine/model/model_family.py); the family then reads the config, lays out the checkpoint
and builds the decoder. A new family is one module defining a ModelFamily, added to FAMILIES.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from kvserve.engine.model.deepseek import DEEPSEEK
from kvserve.engine.model.gemma3 import GEMMA3
from kvserve.engine.model.gemma3_multimodal import GEMMA3_MULTIMODAL
from kvserve.engine.model.gguf_metadata import GGUFFields, read_gguf
from kvserve.engine.model.hf_config import read_hf_config
from kvserve.engine.model.llama import LLAMA
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError, UnsupportedArchitectureError
from kvserve.engine.model.model_family import ModelFamily
from kvserve.engine.model.phi3 import PHI3
from kvserve.engine.model.qwen3 import QWEN3

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, DEEPSEEK, QWEN3, PHI3, GEMMA3, GEMMA3_MULTIMODAL)

_BY_ARCHITECTURE: Mapping[str, ModelFamily] = {arch: f for f in FAMILIES for arch in f.architectures}
_BY_HF_CLASS: Mapping[str, str] = {hf: arch for f in FAMILIES for arch, hf in f.architectures.items()}
_BY_GGUF: Mapping[str, tuple[ModelFamily, str]] = {g: (f, arch) for f in FAMILIES for g, arch in f.gguf_architectures.items()}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCHITECTURE)


def _unsupported(architecture: str, where: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(architecture, where, SUPPORTED_ARCHITECTURES, tuple(_BY_HF_CLASS))


def family_of(config: ModelConfig) -> ModelFamily:
    family = _BY_ARCHITECTURE.get(config.architecture)
    if family is None:
        raise _unsupported(config.architecture, "ModelConfig")
    return family


def hf_architecture_name(architecture: str) -> str:
    """config.json's class name for one of our architecture names ("llama" -> "LlamaForCausalLM")."""
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise _unsupported(architecture, "kvserve")
    return family.architectures[architecture]


def model_config_from_hf_dict(hf: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                              where: str = "config.json") -> ModelConfig:
    """A parsed config.json (and generation_config.json, whose eos ids are often the complete
    list, e.g. Llama 3's <|eot_id|>) -> its family's config."""
    archs = hf.get("architectures") or []
    architecture = _BY_HF_CLASS.get(archs[0]) if archs else hf.get("model_type", "")
    if architecture not in _BY_ARCHITECTURE:
        raise _unsupported(archs[0] if archs else hf.get("model_type") or "<missing>", where)
    try:
        return _BY_ARCHITECTURE[architecture].config_from_hf(architecture, hf, generation)
    except KeyError as exc:
        raise CorruptModelError(f"{where} lacks the required field {exc.args[0]!r}") from exc


def model_config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    fields = GGUFFields(reader, path)
    found = _BY_GGUF.get(fields.architecture)
    if found is None:
        raise _unsupported(fields.architecture, str(path))
    family, architecture = found
    return family.config_from_gguf(architecture, fields)


def load_model_config(path: str | Path) -> ModelConfig:
    """From a .gguf file, an HF model directory or a config.json path. Reads metadata only."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return model_config_from_gguf(read_gguf(path), path)
    config_json, hf, generation = read_hf_config(path)
    return model_config_from_hf_dict(hf, generation, str(config_json))
