"""The HTTP server's own settings (the engine's live in `EngineConfig`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine import ConfigError
from kvserve.server.limits import ServerLimits
from kvserve.server.reasoning import REASONING_PARSERS, ReasoningStyle
from kvserve.server.tool_parsers import FAMILY_CALL_IDS, TOOL_CALL_PARSERS, OutputParser, new_call_id

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (tests)
    api_key: str | None = None
    # Sequences (prompts x n) allowed to wait beyond the engine's max_num_seqs running slots;
    # past that, new requests get 503 + Retry-After instead of piling up unbounded latency.
    max_queued_requests: int = 256
    shutdown_grace_period: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    # Open HTTP connections allowed (more are answered 503 and closed at once), and the seconds a
    # connection may take to send a request's headers: half-open connections cannot pile up.
    max_connections: int = 1024
    header_timeout: float = 10.0
    retry_after_s: int = 1
    log_level: str = "info"
    limits: ServerLimits = field(default_factory=ServerLimits)
    # tool_choice "auto": the model's calls are parsed out of its text by this family's parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a key of TOOL_CALL_PARSERS (vLLM's names)
    reasoning_parser: str | None = None  # a key of REASONING_PARSERS (vLLM's names)
    # /v1/responses `store`: finished responses kept in memory (least recently used dropped first)
    # for previous_response_id and GET /v1/responses/{id}.
    enable_responses_store: bool = True
    responses_store_max_responses: int = 1024
    responses_store_max_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"--port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ConfigError("--host", "--host must not be empty (use 0.0.0.0 to listen on all interfaces)")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key", "--api-key must not be empty or blank; omit it to disable auth")
        if self.max_queued_requests < 0:
            raise ConfigError("--max-queued-requests",
                              f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.max_connections < 1:
            raise ConfigError("--max-connections", f"--max-connections must be >= 1, got {self.max_connections}")
        if not math.isfinite(self.header_timeout) or self.header_timeout <= 0:
            raise ConfigError("--header-timeout", f"--header-timeout must be > 0 seconds, got {self.header_timeout}")
        if not math.isfinite(self.shutdown_grace_period) or self.shutdown_grace_period < 0:
            raise ConfigError("--shutdown-grace-period",
                              f"--shutdown-grace-period must be >= 0 seconds, got {self.shutdown_grace_period}")
        if self.retry_after_s < 1:
            raise ConfigError("--retry-after", f"Retry-After must be at least 1 second, got {self.retry_after_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError("--tool-call-parser", f"--tool-call-parser must be one of "
                              f"{', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--tool-call-parser", "--enable-auto-tool-choice needs --tool-call-parser "
                              f"({', '.join(TOOL_CALL_PARSERS)}): the model family's way of writing a call")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError("--reasoning-parser", f"--reasoning-parser must be one of "
                              f"{', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.responses_store_max_responses < 1:
            raise ConfigError("--responses-store-max-responses", "--responses-store-max-responses must be >= 1, "
                              f"got {self.responses_store_max_responses} (use --no-enable-responses-store to turn "
                              "the store off)")
        if self.responses_store_max_bytes < 1:
            raise ConfigError("--responses-store-max-bytes",
                              f"--responses-store-max-bytes must be >= 1, got {self.responses_store_max_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("--log-level", f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def auto_tool_parser(self) -> OutputParser | None:
        """The parser for tool_choice "auto", or None when auto tool choice is off."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            return None
        return TOOL_CALL_PARSERS[self.tool_call_parser]

    @property
    def reasoning_style(self) -> ReasoningStyle | None:
        return REASONING_PARSERS[self.reasoning_parser] if self.reasoning_parser is not None else None

    @property
    def new_tool_call_id(self) -> Callable[[], str]:
        """Ids for every reported call, in the style the model family's chat template accepts back."""
        return FAMILY_CALL_IDS.get(self.tool_call_parser or "", new_call_id)
