"""The Prometheus exporter behind `GET /metrics`.

`ServerMetrics` is an engine `StatsListener` (see engine/stats.py) plus the HTTP layer's counters.
It owns its own `CollectorRegistry`: two servers in one process (tests do this) never share or
clash over series, and nothing is registered in prometheus-client's global default registry.

Every metric is prefixed `kvserve_` and carries the `model_name` label, so one Prometheus can
scrape several deployments and a dashboard can select a model.

Request intervals (all measured from engine timestamps, in seconds):

    arrival ──queue──▶ first scheduled ──prefill──▶ first token ──decode──▶ last token
    └──────────────── time to first token ─────────┘
    └───────────────────────────── e2e ──────────────────────────────────────┘

- queue: arrival to first scheduled (not observed for a request aborted before it ran).
- TTFT: arrival to the first generated token (only for requests that produced one).
- ITL: the gap between each pair of consecutive generated tokens (one observation per gap).
- prefill: first scheduled to first token; decode: first token to last token.
- e2e: arrival to the last token; for a request that produced no token (aborted while queued or
  mid-prefill), arrival to when it finished, so every finished request is counted exactly once.

Token counters come from the per-step records: `kvserve_prompt_tokens_total` counts prompt tokens
*computed* (prefix-cache hits are not computed; a preempted request's recomputation is), which is
the figure that matches prefill throughput. The per-request histograms count each request's prompt
and output length once.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from kvserve.engine import EngineLoad, FinishedRequestStats, FinishReason, StepStats
from kvserve.server.connection_guard import REFUSED_HEADER_TIMEOUT, REFUSED_HEADERS_TOO_LARGE, REFUSED_LIMIT

# Buckets span a slow CPU deployment (a 135M model decodes at ~30 ms/token and a long prompt can
# queue for minutes) and a fast GPU one (single-millisecond steps), so both see useful quantiles.
REQUEST_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
STEP_DURATION_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
HTTP_DURATION_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# 1-2-5 series: token counts range from a one-token prompt to a full long context.
TOKEN_COUNT_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
)  # fmt: skip

KV_BLOCK_STATES = ("free", "used", "cached")


class ServerMetrics:
    """Implements engine/stats.py's `StatsListener` and records HTTP traffic.

    `on_step` and `on_request_finished` run on the engine thread and `observe_http` on the event
    loop; prometheus-client's metric children are thread-safe, and every per-model child is bound
    once here so the hot path does no label lookups.
    """

    def __init__(self, model_name: str, info: Mapping[str, str]) -> None:
        if not model_name:
            raise ValueError("ServerMetrics needs a non-empty model_name (the served model name)")
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._define_engine_metrics()
        self._define_request_metrics()
        self._define_http_metrics()
        self._config_info = Info(
            "kvserve_cache_config",
            "Cache and model configuration (block size, number of blocks, dtypes, model, max_model_len, prefix caching).",
            labelnames=["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self.set_config_info(info)

    def set_config_info(self, info: Mapping[str, str]) -> None:
        """Replace the info metric's labels: the server knows the resolved values (number of KV
        blocks, the dtype "auto" chose) only once the model has loaded, after construction."""
        self._config_info.info({key: str(value) for key, value in info.items()})

    def _define_engine_metrics(self) -> None:
        labels = ["model_name"]
        registry = self.registry
        name = self.model_name
        self._running = Gauge("kvserve_num_requests_running", "Requests in the running batch.", labels, registry=registry).labels(name)
        self._waiting = Gauge("kvserve_num_requests_waiting", "Requests waiting to be scheduled (including preempted ones).", labels, registry=registry).labels(name)
        self._kv_usage = Gauge("kvserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks referenced by a request (0-1).", labels, registry=registry).labels(name)
        kv_blocks = Gauge("kvserve_kv_cache_blocks", "KV-cache blocks by state: used by a request, free, or free but holding a cached prefix.", [*labels, "state"], registry=registry)
        self._kv_blocks = {state: kv_blocks.labels(name, state) for state in KV_BLOCK_STATES}
        self._prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded, recomputation after preemption included).", labels, registry=registry).labels(name)
        self._generation_tokens = Counter("kvserve_generation_tokens", "Generated tokens.", labels, registry=registry).labels(name)
        self._preemptions = Counter("kvserve_num_preemptions", "Requests preempted because the KV cache was full.", labels, registry=registry).labels(name)
        self._prefix_queries = Counter("kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=registry).labels(name)
        self._prefix_hits = Counter("kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=registry).labels(name)
        self._iteration_tokens = Histogram("kvserve_iteration_tokens", "Tokens scheduled in one engine step.", labels, registry=registry, buckets=TOKEN_COUNT_BUCKETS).labels(name)
        # Speculative decoding, as vLLM names its counters.
        self._spec_drafts = Counter("kvserve_spec_decode_num_drafts", "Requests that verified drafted tokens in a step (speculative decoding).", labels, registry=registry).labels(name)
        self._spec_draft_tokens = Counter("kvserve_spec_decode_num_draft_tokens", "Drafted tokens verified.", labels, registry=registry).labels(name)
        self._spec_accepted_tokens = Counter("kvserve_spec_decode_num_accepted_tokens", "Drafted tokens kept.", labels, registry=registry).labels(name)
        self._spec_accepted_per_pos = Counter("kvserve_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens kept, by their position in the draft (0 = first).", [*labels, "position"], registry=registry)
        self._step_duration = Histogram("kvserve_step_duration_seconds", "Duration of one engine step (schedule + forward + update).", labels, registry=registry, buckets=STEP_DURATION_BUCKETS_S).labels(name)

    def _define_request_metrics(self) -> None:
        labels = ["model_name"]
        registry = self.registry
        name = self.model_name
        success = Counter("kvserve_request_success", "Finished requests by finish reason (stop, length, abort).", [*labels, "finished_reason"], registry=registry)
        # Pre-created so each reason is a zero series from the start: rate() then works at once.
        self._success = {reason: success.labels(name, reason.value) for reason in FinishReason}

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, labels, registry=registry, buckets=buckets).labels(name)

        self._ttft = histogram("kvserve_time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS_S)
        self._itl = histogram("kvserve_inter_token_latency_seconds", "Gap between consecutive generated tokens.", INTER_TOKEN_BUCKETS_S)
        self._e2e = histogram("kvserve_e2e_request_latency_seconds", "Arrival to last generated token (to finish when none was generated).", REQUEST_LATENCY_BUCKETS_S)
        self._queue = histogram("kvserve_request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS_S)
        self._prefill = histogram("kvserve_request_prefill_time_seconds", "First scheduled to first generated token.", REQUEST_LATENCY_BUCKETS_S)
        self._decode = histogram("kvserve_request_decode_time_seconds", "First generated token to last generated token.", REQUEST_LATENCY_BUCKETS_S)
        self._request_prompt_tokens = histogram("kvserve_request_prompt_tokens", "Prompt length of each finished request.", TOKEN_COUNT_BUCKETS)
        self._request_generation_tokens = histogram("kvserve_request_generation_tokens", "Generated tokens of each finished request.", TOKEN_COUNT_BUCKETS)

    def _define_http_metrics(self) -> None:
        labels = ["model_name", "route", "method", "status"]
        self._errors = Counter("kvserve_request_errors", "Requests answered with an error, by HTTP status code.", ["model_name", "code"], registry=self.registry)
        self._http_requests = Counter("kvserve_http_requests", "HTTP requests by route template, method and status.", labels, registry=self.registry)
        self._http_duration = Histogram("kvserve_http_request_duration_seconds", "HTTP request latency (until the last byte for streams) by route, method and status.", labels, registry=self.registry, buckets=HTTP_DURATION_BUCKETS_S)
        refused = Counter("kvserve_http_connections_refused", "HTTP connections closed unserved: over --max-connections (connection_limit) headers not complete within --header-timeout (header_timeout), or headers over 64 KiB (headers_too_large).", ["model_name", "reason"], registry=self.registry)
        self._connections_refused = {reason: refused.labels(self.model_name, reason)
                                     for reason in (REFUSED_LIMIT, REFUSED_HEADER_TIMEOUT, REFUSED_HEADERS_TOO_LARGE)}
        self._open_connections = Gauge("kvserve_http_open_connections", "Open HTTP connections (see --max-connections).", ["model_name"], registry=self.registry).labels(self.model_name)

    # --- StatsListener -------------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        self.observe_load(EngineLoad(stats.num_running, stats.num_waiting, stats.kv_blocks_total,
                                     stats.kv_blocks_used, stats.kv_blocks_cached, stats.kv_blocks_free))
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        self._preemptions.inc(stats.num_preempted)
        self._prefix_queries.inc(stats.prefix_cache_queries)
        self._prefix_hits.inc(stats.prefix_cache_hits)
        self._iteration_tokens.observe(stats.num_scheduled_tokens)
        self._step_duration.observe(stats.duration_s)
        if stats.spec_num_drafts:
            self._spec_drafts.inc(stats.spec_num_drafts)
            self._spec_draft_tokens.inc(stats.spec_num_draft_tokens)
            self._spec_accepted_tokens.inc(stats.spec_num_accepted_tokens)
            for position, count in enumerate(stats.spec_accepted_per_position):
                self._spec_accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        self._success[stats.finish_reason].inc()
        self._request_prompt_tokens.observe(stats.num_prompt_tokens)
        self._request_generation_tokens.observe(stats.num_generation_tokens)
        end = stats.last_token_time if stats.last_token_time is not None else stats.finished_time
        self._e2e.observe(end - stats.arrival_time)
        if stats.first_scheduled_time is not None:
            self._queue.observe(stats.first_scheduled_time - stats.arrival_time)
        if stats.first_token_time is not None:
            self._ttft.observe(stats.first_token_time - stats.arrival_time)
            if stats.first_scheduled_time is not None:
                self._prefill.observe(stats.first_token_time - stats.first_scheduled_time)
            if stats.last_token_time is not None:
                self._decode.observe(stats.last_token_time - stats.first_token_time)
        for gap in stats.inter_token_latencies:
            self._itl.observe(gap)

    def observe_load(self, load: EngineLoad) -> None:
        """Set the gauges. Steps do it, and so does every scrape (from the engine's live load):
        requests can leave without a step (aborts, disconnects), and an idle engine steps no more."""
        self._running.set(load.num_running)
        self._waiting.set(load.num_waiting)
        self._kv_usage.set(load.kv_usage)
        self._kv_blocks["free"].set(load.kv_blocks_free)
        self._kv_blocks["used"].set(load.kv_blocks_used)
        self._kv_blocks["cached"].set(load.kv_blocks_cached)

    # --- HTTP layer ----------------------------------------------------------------------------

    def observe_http(self, route: str, method: str, status: int, duration_s: float) -> None:
        """`route` must be the route *template* (e.g. "/v1/completions"), never the raw path:
        raw paths would let any client create unbounded label values."""
        labels = (self.model_name, route, method.upper(), str(status))
        self._http_requests.labels(*labels).inc()
        self._http_duration.labels(*labels).observe(duration_s)

    def count_error(self, code: int) -> None:
        self._errors.labels(self.model_name, str(code)).inc()

    # --- connections (server/connection_guard.py's ConnectionListener) --------------------------

    def on_connection_refused(self, reason: str) -> None:
        self._connections_refused[reason].inc()

    def on_open_connections(self, count: int) -> None:
        self._open_connections.set(count)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for the `/metrics` response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
