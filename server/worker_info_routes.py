"""The metadata and load probes a router makes of its workers (SGLang Model Gateway's, in
particular), answered with this replica's real values.

When the gateway registers a worker it reads `/server_info` and `/model_info` (falling back to the
older `/get_server_info` and `/get_model_info`): the model id it routes by comes from
`served_model_name`. Its load monitor (power_of_two policy, `/get_loads`) reads `/get_load`, a
list with one entry per data-parallel rank whose `num_tokens` it sums.

    GET /server_info   -> served model name, context length, block size, batch limits, KV capacity
    GET /model_info    -> architecture, vocab, layers, heads
    GET /get_load      -> [{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}]

`model_path` and `tokenizer_path` are left out on purpose: the gateway loads a tokenizer from
them (a Hugging Face hub id would make it download one). kvserve tokenizes itself, so the router
needs none; the model's path is reported as `kvserve_model` instead.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvserve.engine import hf_architecture_name
from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.errors import unavailable
from kvserve.server.info_routes import kvserve_version
from kvserve.server.serving_state import ServingState


def worker_info_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    def loaded_engine() -> ServingEngine:
        # Static facts stay readable while draining; only a replica still loading has none yet.
        engine = state.engine
        if engine is None:
            raise unavailable("The model is still loading; retry shortly.", state.settings.retry_after_s)
        return engine

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        engine = loaded_engine()
        config = engine.config
        return {
            "served_model_name": config.model_name,
            "model_id": config.model_name,
            "kvserve_model": config.model,
            "version": kvserve_version(),
            "max_model_len": engine.max_model_len,
            "context_length": engine.max_model_len,
            "block_size": engine.block_size,
            "page_size": engine.block_size,
            "num_kv_blocks": engine.num_kv_blocks,
            "max_total_tokens": engine.num_kv_blocks * engine.block_size,
            "max_running_requests": config.max_num_seqs,
            "max_prefill_tokens": config.max_num_batched_tokens,
            "max_queued_requests": state.settings.max_queued_requests,
            "enable_prefix_caching": config.enable_prefix_caching,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": config.kv_cache_dtype,
            "device": str(engine.device),
            "dp_size": 1,
            "tp_size": config.tensor_parallel_size,
        }

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        engine = loaded_engine()
        shape = engine.model_config
        return {
            "served_model_name": engine.config.model_name,
            "kvserve_model": engine.config.model,
            "is_generation": True,
            "model_type": shape.architecture,
            "architectures": [hf_architecture_name(shape.architecture)],
            "max_model_len": engine.max_model_len,
            "vocab_size": shape.vocab_size,
            "num_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
        }

    @router.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        engine = loaded_engine()
        load = engine.load
        return [{"dp_rank": 0, "num_reqs": load.num_running + load.num_waiting, "num_waiting_reqs": load.num_waiting,
                 "num_tokens": load.kv_blocks_used * engine.block_size}]

    return router


