"""Sliding windows from GGUF metadata: llama.cpp's converter writes `{arch}.attention.sliding_window`
for Gemma 3 and Phi-3 (read by their families), none for its `llama` architecture (Mistral 7B v0.1
included) or `qwen2`. A window key in a `llama` GGUF is read as every layer's; a Mistral GGUF
without one is served with full attention, as llama.cpp serves it, and the load says so once."""

from __future__ import annotations

import logging

import torch

from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.registry import load_model_config
from tests.engine.test_model_gguf import hf_weights, write_gguf


def test_a_llama_gguf_window_key_windows_every_layer(tmp_path):
    path = tmp_path / "windowed.gguf"
    write_gguf(path, hf_weights(), configure=lambda writer: writer.add_sliding_window(32))
    config = load_model_config(path)
    assert config.sliding_window == 32 and config.kv_shape().num_window_layers == config.num_layers


def test_a_mistral_gguf_without_a_window_is_served_with_full_attention_and_the_load_says_so_once(tmp_path, caplog):
    path = tmp_path / "mistral.gguf"
    write_gguf(path, hf_weights(), configure=lambda writer: writer.add_name("Mistral 7B v0.1"))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.model.model_loader"):
        config, _ = load_model(ModelSource("gguf", path), torch.float32, torch.device("cpu"))
    assert config.sliding_window is None
    notes = [r.getMessage() for r in caplog.records if "sliding window" in r.getMessage()]
    assert len(notes) == 1 and "full attention" in notes[0] and "Hugging Face folder" in notes[0]


def test_a_llama_gguf_says_nothing_about_windows(tmp_path, caplog):
    path = tmp_path / "llama.gguf"
    write_gguf(path, hf_weights(), configure=lambda writer: writer.add_name("Llama 3.2 1B"))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.model.model_loader"):
        config, _ = load_model(ModelSource("gguf", path), torch.float32, torch.device("cpu"))
    assert config.sliding_window is None and not caplog.records
