"""kvserve.engine: model loading, the Llama-family forward, sampling, and the engines.

This namespace is the engine's public API, and the only door the server uses: `kvserve.server`
imports these names and no module inside the engine (an import-linter contract in pyproject.toml
checks it), so the engine's files can move without the server knowing. The scheduler's and the
paging layer's types that callers need (sampling parameters, finish reasons, logprobs, KV-cache
sizing) are re-exported here too, so the server never imports `kvserve.scheduler` or
`kvserve.paging` itself.
"""

from kvserve.engine.admission import AdmissionError, PromptTooLongError
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.config import (DEFAULT_MODEL, KV_CACHE_DTYPES, SUPPORTED_DTYPES, SUPPORTED_QUANTIZATIONS,
                                   ConfigError, EngineConfig)
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelNotFoundError
from kvserve.engine.model.model_shape import resolve_model_shape
from kvserve.engine.model.model_source import resolve_model
from kvserve.engine.model.registry import hf_architecture_name, load_model_config
from kvserve.engine.model.tensor_parallel import check_tensor_parallel
from kvserve.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from kvserve.engine.stats import EngineLoad, FinishedRequestStats, StatsListener, StepStats
from kvserve.paging import SUPPORTED_BLOCK_SIZES
from kvserve.paging.kv_sizing import PRESETS as MODEL_SHAPE_PRESETS
from kvserve.paging.kv_sizing import ModelShape, blocks_per_decoding_request, num_blocks_for_memory, parse_memory_size
from kvserve.scheduler import FinishReason, SamplingParams, SamplingParamsError, TokenLogprobs
from kvserve.scheduler.structured_output_params import GrammarKind, StructuredOutputParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncEngine",
    "EngineDeadError",
    "AdmissionError",
    "PromptTooLongError",
    "EngineConfig",
    "ConfigError",
    "DEFAULT_MODEL",
    "KV_CACHE_DTYPES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_QUANTIZATIONS",
    "RequestOutput",
    "CompletionOutput",
    "OutputAccumulator",
    "FinishReason",
    "TokenLogprobs",
    "SamplingParams",
    "SamplingParamsError",
    "GrammarKind",
    "StructuredOutputParams",
    # What the engine reports as it runs (metrics, logs, the load gauges)
    "EngineLoad",
    "StepStats",
    "FinishedRequestStats",
    "StatsListener",
    # The model: where it is, what it is (flag checks before it loads, the worker-info probes)
    "ModelConfig",
    "ModelNotFoundError",
    "resolve_model",
    "load_model_config",
    "hf_architecture_name",
    "check_tensor_parallel",
    # KV-cache sizing (`kvserve kv-size`, --kv-cache-memory)
    "SUPPORTED_BLOCK_SIZES",
    "ModelShape",
    "MODEL_SHAPE_PRESETS",
    "blocks_per_decoding_request",
    "num_blocks_for_memory",
    "parse_memory_size",
    "resolve_model_shape",
]
