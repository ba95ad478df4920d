"""`kvserve kv-size`'s model shapes: presets, config.json of any family, GGUF metadata; the same
parsing as the engine's ModelConfig, so planning and serving agree."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from kvserve.engine.model.registry import load_model_config
from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError
from kvserve.engine.model.model_shape import resolve_model_shape
from kvserve.paging.kv_sizing import PRESETS

from tests.engine.test_model_config import LLAMA3_HF


def _attention(shape) -> tuple[int, int, int, int]:
    return shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim


def test_presets_resolve_case_insensitively_and_unknown_names_list_them():
    assert resolve_model_shape("Llama-70B") is PRESETS["llama-70b"]
    with pytest.raises(ValueError, match="gpt2, llama-7b, llama-70b, gpt3-175b, smollm2-135m"):
        resolve_model_shape("no-such-model")


def test_reads_llama_and_gpt2_configs(tmp_path):
    llama = tmp_path / "tiny-llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "max_position_embeddings": 2048}
    ))  # fmt: skip
    shape = resolve_model_shape(str(llama))
    assert (shape.name, *_attention(shape), shape.max_position_embeddings) == ("tiny-llama", 4, 8, 2, 64, 2048)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}))
    assert resolve_model_shape(str(gpt2)).bytes_per_token(2) == PRESETS["gpt2"].bytes_per_token(2)
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(CorruptModelError, match="lacks the layer count"):
        resolve_model_shape(str(broken))
    broken.write_text("{not json")
    with pytest.raises(CorruptModelError, match="not valid JSON"):
        resolve_model_shape(str(broken))


def test_planning_and_serving_read_the_same_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_HF))
    assert _attention(resolve_model_shape(str(tmp_path))) == _attention(load_model_config(tmp_path).kv_shape()) == (32, 32, 8, 128)


def test_heads_that_cannot_be_grouped_are_a_model_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_HF, "num_key_value_heads": 5}))
    with pytest.raises(ModelConfigError, match="multiple of num_kv_heads"):
        resolve_model_shape(str(tmp_path))


def _metadata_only_gguf(path: Path, head_count_kv: int | list[int]) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_head_count(8)
    writer.add_head_count_kv(head_count_kv)
    writer.add_embedding_length(256)
    writer.add_context_length(1024)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reads_gguf_metadata_and_takes_the_largest_per_layer_kv_head_count(tmp_path):
    shape = resolve_model_shape(str(_metadata_only_gguf(tmp_path / "tiny.gguf", 2)))
    assert (shape.name, *_attention(shape), shape.max_position_embeddings) == ("tiny", 2, 8, 2, 32, 1024)
    per_layer = resolve_model_shape(str(_metadata_only_gguf(tmp_path / "per-layer.gguf", [1, 4])))
    assert per_layer.num_kv_heads == 4


@pytest.mark.slow  # GGUFReader parses the whole 49k-token vocabulary: ~4 s
def test_reads_the_default_models_gguf_metadata(smollm2_source):
    shape = resolve_model_shape(str(smollm2_source.path))
    expected = PRESETS["smollm2-135m"]
    assert (*_attention(shape), shape.max_position_embeddings) == (*_attention(expected), 8192)
