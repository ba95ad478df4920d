"""What the client measured for one request: plain data that the metrics reduce."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(str, enum.Enum):
    """Why a request failed. HTTP errors are further split by status code (see `error_type`)."""

    HTTP_STATUS = "http"  # the server answered with a status >= 400
    TIMEOUT = "timeout"  # --request-timeout passed, or a connect/read timeout fired
    CONNECT = "connect"  # the server could not be reached
    DISCONNECT = "disconnect"  # the stream ended before `data: [DONE]` (server closed or crashed)
    STREAM_ERROR = "stream_error"  # the server sent an error object inside the stream
    BAD_RESPONSE = "bad_response"  # a chunk that is not the OpenAI streaming format
    EMPTY_OUTPUT = "empty_output"  # the stream finished without a single generated token
    TRANSPORT = "transport"  # any other HTTP transport failure (write error, TLS, proxy, ...)


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome. Times are seconds; `start_s` is `time.perf_counter()` at send."""

    start_s: float
    prompt_len: int  # the server's usage.prompt_tokens when given, else the dataset's estimate
    output_tokens: int = 0  # the server's usage.completion_tokens when given, else content chunks
    content_chunks: int = 0  # stream chunks that carried generated text
    usage_completion_tokens: int | None = None
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between consecutive content chunks
    e2e_s: float | None = None
    error: ErrorKind | None = None
    status_code: int | None = None
    error_message: str = ""
    generated_text: str = ""

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def error_type(self) -> str:
        """A stable label to count errors by, e.g. "http_500", "timeout", "disconnect"."""
        if self.error is None:
            raise ValueError("error_type asked of a successful request")
        if self.error is ErrorKind.HTTP_STATUS:
            return f"http_{self.status_code}"
        return self.error.value

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; undefined for single-token outputs."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def usage_mismatch(self) -> bool:
        """The server's token count disagrees with the number of chunks it streamed.

        Not an error (a server may put several tokens in one chunk, or hold back a partial UTF-8
        character), but worth reporting: ITL is measured per chunk, TPOT per usage token.
        """
        return self.usage_completion_tokens is not None and self.usage_completion_tokens != self.content_chunks


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]  # every request that finished, successfully or not
    cancelled: int  # sent but still in flight when the duration cap hit
    not_sent: int  # never sent because the duration cap hit first
    duration_s: float  # from the first send to the last finish (or to the cap)
    hit_duration_cap: bool
