"""kvserve.engine: model loading, the Llama-family forward, sampling, and the engines."""

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine, PromptTooLongError
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.scheduler.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncEngine",
    "EngineDeadError",
    "PromptTooLongError",
    "EngineConfig",
    "ConfigError",
    "RequestOutput",
    "CompletionOutput",
    "SamplingParams",
    "SamplingParamsError",
]
