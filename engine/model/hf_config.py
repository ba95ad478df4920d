"""Reading a Hugging Face config.json (and generation_config.json): the fields every family
spells the same way. Each family's parser (engine/model/registry.py) builds on these."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError, ModelNotFoundError
from kvserve.paging.kv_sizing import ModelShape


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None). transformers 4 writes rope_theta + rope_scaling; transformers 5
    writes rope_parameters."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def eos_token_ids(hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (often the complete list, e.g.
    Llama 3's <|eot_id|>)."""
    eos = _eos_ids(hf.get("eos_token_id"))
    for extra in _eos_ids((generation or {}).get("eos_token_id")):
        eos += (extra,) if extra not in eos else ()
    return eos


def shape_from_hf_dict(name: str, hf: Mapping[str, Any]) -> ModelShape:
    """The KV-deciding fields of a config.json, under Llama's names or GPT-2's (n_layer, n_head,
    n_embd), for any family: `kvserve kv-size` plans for models the engine does not run. A
    multimodal config (Gemma 3's) is read for its text model (`text_config`)."""
    if "num_hidden_layers" not in hf and isinstance(hf.get("text_config"), Mapping):
        hf = hf["text_config"]
    layers = hf.get("num_hidden_layers", hf.get("n_layer"))
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    hidden = hf.get("hidden_size", hf.get("n_embd"))
    if layers is None or heads is None or hidden is None:
        raise CorruptModelError(
            f"config {name!r} lacks the layer count, head count or hidden size "
            "(num_hidden_layers, num_attention_heads, hidden_size)"
        )
    heads = int(heads)
    window, num_window_layers = window_layers_from_hf(hf, int(layers))
    try:
        return ModelShape(
            name=name,
            num_layers=int(layers),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hidden) // heads),
            max_position_embeddings=hf.get("max_position_embeddings", hf.get("n_positions")),
            sliding_window=window,
            num_window_layers=num_window_layers,
        )
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc


QWEN_MODEL_TYPES = ("qwen2", "qwen3")
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default


def qwen_window_layers(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers in it) of a Qwen2/Qwen3 config.json, as transformers reads it: only with
    use_sliding_window (shipped configs mostly say false, and then their sliding_window means
    nothing); its `layer_types` where written, else the layers from max_window_layers on."""
    window = hf.get("sliding_window")
    if not (hf.get("use_sliding_window") and window):
        return None, None
    kinds = hf.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise ModelConfigError(f"config.json layer_types {kinds!r} does not name each of the {num_layers} layers")
        layers = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    else:
        layers = tuple(range(int(hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)), num_layers))
    return (int(window), layers) if layers else (None, None)


def window_layers_from_hf(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, int]:
    """(sliding window, how many layers use it) as transformers reads a config.json: its
    `layer_types` where written ("sliding_attention" layers), else Gemma 3's
    sliding_window_pattern (every n-th layer global), Gemma 2's alternation (even layers
    windowed), Mistral's window on every layer, a windowed Qwen2/Qwen3's from max_window_layers
    on; (None, 0) for a model without one."""
    window = hf.get("sliding_window")
    if not window:
        return None, 0
    model_type = str(hf.get("model_type", ""))
    if model_type in QWEN_MODEL_TYPES:
        window, layers = qwen_window_layers(hf, num_layers)
        return window, len(layers or ())
    if isinstance(hf.get("layer_types"), list):
        count = sum(kind == "sliding_attention" for kind in hf["layer_types"])
    elif model_type.startswith("gemma3"):
        pattern = int(hf.get("sliding_window_pattern", 6))
        count = sum((i + 1) % pattern != 0 for i in range(num_layers))
    elif model_type == "gemma2":
        count = (num_layers + 1) // 2
    elif model_type == "mistral":
        count = num_layers
    else:
        count = 0
    return (int(window), count) if count else (None, 0)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc}); re-download the model") from exc


def read_hf_config(path: Path) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
    """(config.json's path, its contents, generation_config.json's or None) from a model
    directory or a config.json path."""
    config_json = path / "config.json" if path.is_dir() else path
    if not config_json.is_file():
        raise ModelNotFoundError(f"{path}: expected a .gguf file, a model directory with config.json, or a config.json")
    generation_json = config_json.parent / "generation_config.json"
    generation = read_json(generation_json) if generation_json.is_file() else None
    return config_json, read_json(config_json), generation
