"""kvserve.engine: model loading, the Llama-family forward, sampling, and the engines.

This namespace is the engine's public API, and the only door the server uses: the scheduler's
and the paging layer's types that callers need (sampling parameters, finish reasons, logprobs,
KV-cache sizing) are re-exported here, so `kvserve.server` never imports `kvserve.scheduler` or
`kvserve.paging` itself (an import-linter contract in pyproject.toml checks it).
"""

from kvserve.engine.admission import AdmissionError, PromptTooLongError
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model.model_shape import resolve_model_shape
from kvserve.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
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
    "RequestOutput",
    "CompletionOutput",
    "OutputAccumulator",
    "FinishReason",
    "TokenLogprobs",
    "SamplingParams",
    "SamplingParamsError",
    "GrammarKind",
    "StructuredOutputParams",
    # KV-cache sizing (`kvserve kv-size`, --kv-cache-memory)
    "SUPPORTED_BLOCK_SIZES",
    "ModelShape",
    "MODEL_SHAPE_PRESETS",
    "blocks_per_decoding_request",
    "num_blocks_for_memory",
    "parse_memory_size",
    "resolve_model_shape",
]
