"""What the server needs from an engine. `kvserve.engine.AsyncEngine` provides it; tests use a fake.

Written as Protocols so the HTTP layer can be exercised without a model, and so the seam between
server and engine is visible in one place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import torch

from kvserve.engine import EngineConfig, EngineLoad, ModelConfig, RequestOutput, SamplingParams


class ServingTokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_text(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...


class ServingEngine(Protocol):
    config: EngineConfig
    tokenizer: ServingTokenizer
    max_model_len: int
    # What the worker-info probes report (server/worker_info_routes.py).
    model_config: ModelConfig
    block_size: int
    num_kv_blocks: int
    dtype: torch.dtype
    device: torch.device

    @property
    def is_dead(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    @property
    def load(self) -> EngineLoad: ...

    async def check_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                            priority: int = 0, cache_salt: str | None = None) -> None:
        """Raises AdmissionError for a request the engine would refuse (awaited: compiling a
        constraint takes time, spent off the event loop)."""

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str,
                 *, priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]: ...

