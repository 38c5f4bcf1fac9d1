"""The ASGI application: ``create_app(load)`` -> a FastAPI app that loads the model in the background and serves it.

- ``GET /``: the chat page (``static/chat.html``: one file that streams ``/v1/chat/completions``). It holds no
  data, so it needs no API key (a browser cannot send one when it navigates); the calls it makes do.
- ``GET /health``: 503 ``{"status": "loading"}`` until the model is loaded, then 200 ``{"status": "ok"}`` (503
  ``{"status": "error"}`` if loading failed). It needs no API key.
- ``GET /metrics``: Prometheus metrics (:mod:`freetoken.serve.metrics`).
- the OpenAI endpoints (:mod:`freetoken.serve.openai_api`), the Anthropic Messages endpoints
  (:mod:`freetoken.serve.anthropic_api`) and the anchor endpoints (:mod:`freetoken.serve.anchors_api`).

With an API key every endpoint but ``/`` and ``/health`` wants ``Authorization: Bearer KEY`` (or
``x-api-key: KEY``, as Anthropic clients send it), compared in constant time. Every error, a malformed body
included, is a JSON body in the OpenAI error shape, or under ``/v1/messages`` in the Anthropic one
(:mod:`freetoken.serve.errors`).
"""

from __future__ import annotations

import hmac
import importlib.resources
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from freetoken.serve import anchors_api, anthropic_api, responses_api
from freetoken.serve.batch_worker import BatchWorker
from freetoken.serve.errors import APIError, validation_error
from freetoken.serve.metrics import CONTENT_TYPE, ServerMetrics
from freetoken.serve.openai_api import ENDPOINTS, router
from freetoken.serve.worker import EngineWorker

log = logging.getLogger("freetoken.serve")

OPEN_PATHS = {"/", "/health"}
#: The chat page's headers: it loads nothing from elsewhere and talks only to this server.
PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                           "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'"}


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets (the ``serve`` command's sampling flags)."""

    max_tokens: int = 1024
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_tokens_limit: int | None = None  # the most tokens of one reply, whatever it asks for (None: the context's)


@dataclass
class ServerState:
    model_name: str  # the id /v1/models lists and replies carry
    defaults: Defaults
    api_key: str | None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    worker: EngineWorker | None = None
    load_error: BaseException | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # more names requests may use (an agent that sends its own model name)

    def ready(self) -> EngineWorker:
        """The worker, or a 503 while the model loads (or after its load failed)."""
        if self.worker is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise APIError(503, "the model is still loading (GET /health says when it is ready)",
                           code="model_loading")
        return self.worker


def create_app(load: Callable[[], object], model_name: str | list[str], api_key: str | None = None,
               defaults: Defaults = Defaults(), on_load_error: Callable[[BaseException], None] | None = None,
               on_ready: Callable[[object], None] | None = None, script: list[str] | None = None,
               max_seqs: int = 1, step_tokens: int | None = None) -> FastAPI:
    """``load()`` returns the :class:`freetoken.engine.generation.generate.Model`; it runs on a thread once the app
    starts, so ``/health`` answers (503) meanwhile. ``on_load_error(e)`` / ``on_ready(model)`` are told how it went.
    ``script``: replies the worker gives instead of generating (tests; :class:`EngineWorker`). ``max_seqs`` > 1:
    requests batched, that many at once, ``step_tokens`` a step (:class:`freetoken.serve.batch_worker.BatchWorker`)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    state = ServerState(model_name=names[0], aliases=tuple(names[1:]), defaults=defaults, api_key=api_key or None)

    def load_in_background():
        try:
            model = load()
        except BaseException as e:  # noqa: BLE001 - reported through /health and on_load_error
            state.load_error = e
            if on_load_error is not None:
                on_load_error(e)
            return
        if max_seqs > 1 and script is None:
            state.worker = BatchWorker(model, on_finish=state.metrics.job_finished, max_seqs=max_seqs,
                                       step_tokens=step_tokens)
        else:
            state.worker = EngineWorker(model, on_finish=state.metrics.job_finished, script=script)
        state.metrics.worker = state.worker
        if on_ready is not None:
            on_ready(model)

    @asynccontextmanager
    async def lifespan(app):
        loader = threading.Thread(target=load_in_background, name="freetoken-load", daemon=True)
        loader.start()
        try:
            yield
        finally:
            if state.worker is not None:
                state.worker.close()

    app = FastAPI(title="freetoken", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    app.add_middleware(AuthAndCount, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError):  # the routes parse bodies themselves
        return validation_error(e.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        code="not_found" if e.status_code == 404 else None).response(request.url.path)

    @app.get("/health")
    async def health():
        if state.worker is not None:
            return {"status": "ok"}
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": str(state.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.api_route("/", methods=["GET", "HEAD"])  # agents probe the server with HEAD / (Claude Code does)
    async def chat_page():
        page = importlib.resources.files("freetoken.serve").joinpath("static/chat.html").read_text("utf-8")
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(router)
    app.include_router(anthropic_api.router)
    app.include_router(anchors_api.router)
    app.include_router(responses_api.router)
    return app


class AuthAndCount:
    """The API key check and the request count, as plain ASGI middleware around the routes.

    Plain ASGI and not starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``): that one hands the routes a
    wrapped ``receive`` on which ``request.is_disconnected()`` never sees the client leave, so a non-streamed request
    whose client gave up went on generating. A route's exception becomes the API's JSON 500 here (logged and
    counted in ``requests_failed_total``), where starlette would answer with a text/plain 500."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        path = scope["path"]
        status = None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if state.api_key is not None and path not in OPEN_PATHS and not _key_matches(Headers(scope=scope),
                                                                                     state.api_key):
            error = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (or "
                             "'x-api-key: KEY')", code="invalid_api_key")
            await error.response(path)(scope, receive, send_counted)
        else:
            try:
                await self.app(scope, receive, send_counted)
            except Exception as e:  # noqa: BLE001 - a bug: the client gets the API's JSON 500, the log the traceback
                log.exception("internal error on %s %s", scope.get("method"), path)
                state.metrics.failed.inc()
                if status is None:  # nothing sent yet (once a response has started, the connection just ends)
                    error = APIError(500, f"internal error: {type(e).__name__}: {e}"[:500], code="internal_error")
                    await error.response(path)(scope, receive, send_counted)
                else:
                    status = 500
        state.metrics.requests.labels(endpoint=_endpoint(path), status=str(status or 500)).inc()


def _key_matches(headers: Headers, key: str) -> bool:
    given = headers.get("authorization", "")
    if given[:7].lower() == "bearer ":
        given = given[7:].strip()
    else:
        given = headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


def _endpoint(path: str) -> str:
    """The endpoint a path is (an unknown path counts as "other": a scan cannot grow the label set)."""
    if path.startswith("/v1/anchors/"):
        return "/v1/anchors/{id}"
    if path.startswith("/v1/responses/"):
        return responses_api.ONE_RESPONSE
    known = (path in OPEN_PATHS or path in ENDPOINTS or path in anthropic_api.ENDPOINTS or path in anchors_api.ENDPOINTS
             or path in responses_api.ENDPOINTS or path == "/metrics")
    return path if known else "other"
