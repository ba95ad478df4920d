"""`build_app(engine, settings)`: the FastAPI application, wired from the pieces in this package.

`engine` may be None: the app then answers /health with 503 "loading" until
`serving_state(app).attach_engine(engine)` is called, which lets `kvserve serve` accept
connections (and report not-ready) while the model loads.
"""

from __future__ import annotations

from fastapi import FastAPI

from kvserve.server.anthropic import messages_router
from kvserve.server.auth import ApiKeyMiddleware
from kvserve.server.chat import chat_router
from kvserve.server.completions import completions_router
from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.errors import install_error_handlers
from kvserve.server.http_metrics import HttpMetrics, HttpMetricsMiddleware
from kvserve.server.ignored_fields import IgnoredFieldsHeaderMiddleware
from kvserve.server.info_routes import kvserve_version, models_router, operations_router
from kvserve.server.openapi import install_openapi
from kvserve.server.responses import responses_router
from kvserve.server.responses_store import ResponsesStore
from kvserve.server.serving_state import ServingState
from kvserve.server.settings import ServerSettings
from kvserve.server.tokenizer_info import tokenizer_info_router
from kvserve.server.worker_info_routes import worker_info_router


def build_app(engine: ServingEngine | None, settings: ServerSettings, *,
              metrics: HttpMetrics | None = None) -> FastAPI:
    state = ServingState(settings, engine)
    app = FastAPI(title="kvserve", version=kvserve_version(),
                  description="An OpenAI-compatible LLM server with a paged KV cache.")
    app.state.serving = state
    install_error_handlers(app)
    # With --api-key every route needs the key but auth.OPEN_PATHS: a new router is protected
    # by default (the middleware sees every request, whatever router serves it).
    app.include_router(completions_router(state))
    app.include_router(chat_router(state))
    store = ResponsesStore(settings.responses_store_max_responses, settings.responses_store_max_bytes) \
        if settings.enable_responses_store else None
    app.include_router(responses_router(state, store))
    app.include_router(messages_router(state))
    app.include_router(models_router(state))
    app.include_router(worker_info_router(state))
    app.include_router(tokenizer_info_router(state))
    app.include_router(operations_router(state, metrics))
    app.add_middleware(IgnoredFieldsHeaderMiddleware)
    install_openapi(app)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if metrics is not None:  # outermost of ours, so it also counts the 401s
        app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    return app


def serving_state(app: FastAPI) -> ServingState:
    state = app.state.serving
    assert isinstance(state, ServingState), "the app was not made by build_app"
    return state
