"""The router's HTTP service: OpenAI-compatible endpoints in front of prefill and decode vLLM servers.

Owns `create_app` (the FastAPI app) and `serve` (uvicorn). The app serves `/v1/completions` and
`/v1/chat/completions` (`router.proxy.ProxyEndpoint`: the request path, retries and fallbacks), `/v1/models`,
`/health` (each instance as the router sees it: probe, breaker, TP size) and `/metrics`, and adds to all of them:
- a request id: the client's `X-Request-Id` when it is 1 to 128 visible ASCII characters, else a new one; it names
  the request in the router's log lines, goes to both upstreams as `X-Request-Id` (vLLM's request id), and comes
  back on every response, errors included;
- the client key: with `RouterConfig.api_key`, every `/v1/*` request needs `Authorization: Bearer KEY` (compared
  in constant time; 401 otherwise). The client's `Authorization` never goes upstream (`router.upstream`);
- one error shape: every status the router answers with, FastAPI's own 404, 405 and 422 and an unexpected 500
  included, has the OpenAI body `{"error": {"message", "type", "code"}}`.

The lifespan runs `Router.run` (the TP lookups and `/health` probes in the background) and starts serving once
each has had its first round. Called by `kvstage router` (cli.py) and tests.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstage.router.config import RouterConfig
from kvstage.router.core import Router, error_response
from kvstage.router.metrics import RouterMetrics
from kvstage.router.proxy import ProxyEndpoint, request_id_of

log = logging.getLogger("kvstage.router")

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is short and printable, else a new one."""
    given = Headers(scope=scope).get("x-request-id")
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class _RequestIds:
    """Gives every HTTP request its id (in `scope["state"]`) and puts it on the response as `X-Request-Id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _ClientKey:
    """Refuses `/v1/*` requests without `Authorization: Bearer KEY` (401, OpenAI-shaped)."""

    def __init__(self, app: ASGIApp, key: str, metrics: RouterMetrics) -> None:
        self.app = app
        self._key = key.encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._authorized(scope):
            self._metrics.unauthorized.inc()
            log.warning("request %s: refused %s: no valid API key", request_id_of(scope), scope["path"])
            message = "this router needs an API key: Authorization: Bearer KEY"
            refused = error_response(401, message, "authentication_error", {"www-authenticate": "Bearer"})
            await refused(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)


def _add_error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # registered for HTTPException only
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(exc.status_code, str(exc.detail), kind, exc.headers)

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)  # registered for RequestValidationError only
        return error_response(422, f"invalid request: {exc.errors()}", "invalid_request_error")

    async def internal(request: Request, exc: Exception) -> Response:
        # Sent by Starlette's outermost middleware, past `_RequestIds`: the id goes on here.
        request_id = request_id_of(request.scope)
        log.error("request %s: the router failed: %r", request_id, exc)
        message = f"the router failed on this request (request id {request_id})"
        return error_response(500, message, "internal_error", {"x-request-id": request_id})

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, internal)


def create_app(config: RouterConfig) -> FastAPI:
    """The router's app; `app.state.router` is its `Router` (metrics and all)."""
    router = Router(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        log.info(
            "router: prefill %s, decode %s, bootstrap %s",
            ", ".join(i.describe() for i in config.prefill),
            ", ".join(i.describe() for i in config.decode),
            config.bootstrap,
        )
        async with anyio.create_task_group() as background:
            await background.start(router.run)
            yield
            background.cancel_scope.cancel()
        await router.aclose()
        log.info("router stopped")

    app = FastAPI(title="kvstage router", lifespan=lifespan)
    app.state.router = router
    _add_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(_ClientKey, key=config.api_key, metrics=router.metrics)
    app.add_middleware(_RequestIds)  # added last: the outermost, so that every response carries the id

    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        app.router.routes.append(Route(path, ProxyEndpoint(router, path, chat=chat), methods=["POST"]))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request_id_of(request.scope))

    @app.get("/health")
    async def health() -> Response:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(config: RouterConfig, host: str, port: int, *, log_level: str = "info") -> None:
    """Run the router until SIGINT or SIGTERM."""
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
