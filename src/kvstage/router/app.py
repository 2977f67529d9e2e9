"""The router's HTTP service: OpenAI-compatible endpoints in front of prefill and decode vLLM servers.

Owns `RouterConfig`, `create_app` (the FastAPI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, `/metrics`) and `serve` (uvicorn). Per client request (`Router.proxy`): take a concurrency slot (429
when none is left), read the body (bounded), pick one prefill and one decode instance in turn, draw a room, send
both upstream requests at once (`router.upstream` builds the bodies), then relay decode's answer byte for byte
(SSE included).

Failure policy (docs/vllm.md, "Router"):
- decode unreachable, unregistered, timing out or answering 5xx: the client gets 503 / 504 / 502 with a body
  naming the instance and the reason, and the prefill request is cancelled;
- prefill failing: logged and counted; the client's request goes on (decode's room fails and decode recomputes);
- the client disconnecting, before or during the answer: both upstream requests are cancelled (their
  connections are closed, which makes vLLM abort the request and the connector abort its room).

Invariants: a request holds its slot until both upstream requests have ended, so at most `max_concurrent`
prefill and `max_concurrent` decode requests are ever open; bodies are read up to `max_body_bytes`, upstream
error bodies up to `upstream.ERROR_BODY_BYTES`, and the answer is relayed chunk by chunk, never buffered.
Called by `kvstage router` (cli.py) and tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvstage.router.instances import Instance, InstanceUnavailable, RoundRobin, TPDirectory
from kvstage.router.metrics import RouterMetrics
from kvstage.router.upstream import (
    JSONBody,
    UpstreamFailure,
    decode_body,
    failure_from_exception,
    failure_from_response,
    new_room,
    prefill_body,
    read_bounded,
)

log = logging.getLogger("kvstage.router")

MODELS_BYTES = 2**20  # the most of an upstream /v1/models answer the router relays


@dataclass(frozen=True)
class RouterConfig:
    bootstrap: str
    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    max_concurrent: int = 256
    max_body_bytes: int = 8 * 2**20
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence from decode while it answers
    prefill_timeout_s: float = 300.0  # whole prefill request
    health_timeout_s: float = 2.0
    bootstrap_timeout_s: float = 2.0
    tp_refresh_s: float = 30.0  # how often an instance's TP size is looked up again
    secret: bytes | None = None  # the deployment's shared secret, for the bootstrap lookups


class _BadBody(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientGone(Exception):
    pass


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _failure_response(failure: UpstreamFailure) -> JSONResponse:
    return JSONResponse(failure.error_body(), status_code=failure.status)


def _outcome_of(failure: UpstreamFailure) -> str:
    return {503: "decode_unavailable", 504: "decode_timeout", 502: "decode_error"}.get(failure.status, "client_error")


async def _read_json(request: Request, limit: int) -> JSONBody:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _BadBody(413, f"request body of {declared} bytes is over the limit of {limit}")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _BadBody(413, f"request body is over the limit of {limit} bytes")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the decoder goes
        raise _BadBody(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadBody(400, "request body must be a JSON object")
    return body


def _upstream_headers(request: Request) -> dict[str, str]:
    headers = {"accept-encoding": "identity"}  # relayed as is, so never compressed
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (call once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


class _Exchange:
    """One client request: its slot, its prefill task, and how it ended (recorded once)."""

    def __init__(self, router: Router, endpoint: str) -> None:
        self.router = router
        self.endpoint = endpoint
        self.started = time.monotonic()
        self.prefill: asyncio.Task[None] | None = None
        self._finished = False

    def first_byte(self) -> None:
        self.router.metrics.first_byte_seconds.labels(self.endpoint).observe(time.monotonic() - self.started)

    def finish(self, outcome: str, *, cancel_prefill: bool) -> None:
        """Record the outcome; the slot is given back once the prefill request has ended too."""
        if self._finished:
            return
        self._finished = True
        metrics = self.router.metrics
        metrics.request_done(self.endpoint, outcome)
        metrics.request_seconds.labels(self.endpoint).observe(time.monotonic() - self.started)
        if self.prefill is None or self.prefill.done():
            self.router.release()
            return
        if cancel_prefill:
            self.prefill.cancel()
        self.prefill.add_done_callback(lambda _task: self.router.release())


class _Relay(StreamingResponse):
    """Decode's answer relayed chunk by chunk; whatever ends it (done, failed, client gone) closes both sides."""

    def __init__(self, upstream: httpx.Response, exchange: _Exchange, decode: Instance) -> None:
        self._upstream = upstream
        self._exchange = exchange
        self._decode = decode
        self._outcome = "client_disconnected"  # unless the relay reaches an end of its own
        self._chunks = self._relay()
        super().__init__(
            self._chunks, status_code=upstream.status_code, media_type=upstream.headers.get("content-type")
        )

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        first = True
        try:
            async for chunk in self._upstream.aiter_raw():
                if first:
                    self._exchange.first_byte()
                    first = False
                yield chunk
        except httpx.HTTPError as exc:
            failure = failure_from_exception(self._decode, exc)
            self._outcome = _outcome_of(failure)
            self._exchange.router.upstream_failed(failure, "decode broke off its answer")
            if not self.media_type or not self.media_type.startswith("text/event-stream"):
                raise  # the client sees a broken response, never a truncated one that looks whole
            yield f"data: {json.dumps(failure.error_body())}\n\n".encode()
        else:
            self._outcome = "ok"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._chunks.aclose()
            await self._upstream.aclose()
            self._exchange.finish(self._outcome, cancel_prefill=self._outcome == "client_disconnected")


class Router:
    """The request path and its shared state: instances, TP sizes, the upstream client, slots, metrics."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self._prefill = RoundRobin(config.prefill)
        self._decode = RoundRobin(config.decode)
        self.tp = TPDirectory(
            config.bootstrap, timeout_s=config.bootstrap_timeout_s, refresh_s=config.tp_refresh_s, secret=config.secret
        )
        upstreams = len(config.prefill) + len(config.decode)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                config.read_timeout_s, connect=config.connect_timeout_s, pool=config.connect_timeout_s
            ),
            limits=httpx.Limits(max_connections=2 * config.max_concurrent + upstreams, max_keepalive_connections=64),
        )
        self._slots = 0
        self._prefills: set[asyncio.Task[None]] = set()

    def release(self) -> None:
        self._slots -= 1
        self.metrics.in_flight.set(self._slots)

    def upstream_failed(self, failure: UpstreamFailure, what: str) -> None:
        self.metrics.upstream_error(failure.instance.role, failure.instance.name, failure.reason)
        log.warning("%s: %s", what, failure)

    async def proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        if self._slots >= self.config.max_concurrent:
            self.metrics.request_done(path, "busy")
            return _error(429, f"the router has {self.config.max_concurrent} requests in flight", "busy")
        self._slots += 1
        self.metrics.in_flight.set(self._slots)
        exchange = _Exchange(self, path)
        try:
            return await self._proxy(request, path, chat, exchange)
        except BaseException:  # cancelled (the server is stopping) or a bug: the slot still goes back
            exchange.finish("client_disconnected", cancel_prefill=True)
            raise

    async def _proxy(self, request: Request, path: str, chat: bool, exchange: _Exchange) -> Response:
        try:
            body = await _read_json(request, self.config.max_body_bytes)
        except _BadBody as exc:
            exchange.finish("bad_request", cancel_prefill=True)
            return _error(exc.status, str(exc), "invalid_request_error")
        except ClientDisconnect:
            exchange.finish("client_disconnected", cancel_prefill=True)
            return Response(status_code=499)
        prefill, decode = self._prefill.pick(), self._decode.pick()
        room = new_room()
        try:
            decode_tp = await self.tp.tp_size(decode)
        except InstanceUnavailable as exc:
            failure = UpstreamFailure(decode, exc.reason, 503, str(exc))
            self.upstream_failed(failure, "decode unavailable")
            exchange.finish("decode_unavailable", cancel_prefill=True)
            return _failure_response(failure)
        headers = _upstream_headers(request)
        try:
            prefill_tp = await self.tp.tp_size(prefill)
        except InstanceUnavailable as exc:
            self.upstream_failed(UpstreamFailure(prefill, exc.reason, 503, str(exc)), "prefill skipped")
            to_decode = decode_body(body, room=None, prefill=None, prefill_tp=0)
        else:
            to_prefill = prefill_body(body, chat=chat, room=room, decode=decode, decode_tp=decode_tp)
            exchange.prefill = self._start_prefill(prefill, path, to_prefill, headers, room)
            to_decode = decode_body(body, room=room, prefill=prefill, prefill_tp=prefill_tp)
        try:
            upstream = await self._open_decode_unless_gone(request, decode, path, to_decode, headers)
        except _ClientGone:
            exchange.finish("client_disconnected", cancel_prefill=True)
            return Response(status_code=499)
        except UpstreamFailure as failure:
            self.upstream_failed(failure, f"room {room} failed at decode")
            exchange.finish(_outcome_of(failure), cancel_prefill=True)
            return _failure_response(failure)
        return _Relay(upstream, exchange, decode)

    def _start_prefill(
        self, prefill: Instance, path: str, body: JSONBody, headers: dict[str, str], room: int
    ) -> asyncio.Task[None]:
        task = asyncio.create_task(self._run_prefill(prefill, path, body, headers, room), name=prefill.name)
        self._prefills.add(task)
        task.add_done_callback(self._prefill_done)
        return task

    def _prefill_done(self, task: asyncio.Task[None]) -> None:
        self._prefills.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: upstream failures are caught inside
            self.metrics.upstream_error("prefill", task.get_name(), "internal")
            log.error("prefill request to %r raised", task.get_name(), exc_info=task.exception())

    async def _run_prefill(
        self, prefill: Instance, path: str, body: JSONBody, headers: dict[str, str], room: int
    ) -> None:
        started = time.monotonic()
        timeout = self.config.prefill_timeout_s
        try:
            async with (
                asyncio.timeout(timeout),
                self._client.stream("POST", prefill.url + path, json=body, headers=headers) as response,
            ):
                raw = await read_bounded(response)
        except TimeoutError:
            failure = UpstreamFailure(prefill, "timeout", 504, f"no answer within {timeout}s")
        except httpx.HTTPError as exc:
            failure = failure_from_exception(prefill, exc)
        else:
            if response.status_code < 400:
                self.metrics.prefill_seconds.observe(time.monotonic() - started)
                return
            failure = failure_from_response(prefill, response.status_code, raw)
        self.upstream_failed(failure, f"room {room} failed at prefill (decode recomputes it)")

    async def _open_decode(
        self, decode: Instance, path: str, body: JSONBody, headers: dict[str, str]
    ) -> httpx.Response:
        request = self._client.build_request("POST", decode.url + path, json=body, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise failure_from_exception(decode, exc) from exc
        if response.status_code < 400:
            return response
        try:
            raw = await read_bounded(response)
        except httpx.HTTPError:
            raw = b""
        finally:
            await response.aclose()
        raise failure_from_response(decode, response.status_code, raw)

    async def _open_decode_unless_gone(
        self, request: Request, decode: Instance, path: str, body: JSONBody, headers: dict[str, str]
    ) -> httpx.Response:
        """Decode's response headers, unless the client disconnects first (`_ClientGone`; decode is cancelled)."""
        opening = asyncio.ensure_future(self._open_decode(decode, path, body, headers))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({opening, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not opening.done():
                opening.cancel()
        if not opening.cancelled():
            return opening.result()
        (late,) = await asyncio.gather(opening, return_exceptions=True)
        if isinstance(late, httpx.Response):
            await late.aclose()
        raise _ClientGone

    async def models(self, request: Request) -> Response:
        """The next decode instance's `/v1/models` (both roles serve the same model), read up to `MODELS_BYTES`."""
        decode = self._decode.pick()
        try:
            async with self._client.stream(
                "GET",
                decode.url + "/v1/models",
                headers=_upstream_headers(request),
                timeout=self.config.health_timeout_s,
            ) as response:
                raw = await read_bounded(response, MODELS_BYTES + 1)
        except httpx.HTTPError as exc:
            failure = failure_from_exception(decode, exc)
        else:
            if response.status_code >= 400:
                failure = failure_from_response(decode, response.status_code, raw)
            elif len(raw) > MODELS_BYTES:
                failure = UpstreamFailure(decode, "protocol", 502, f"/v1/models answer over {MODELS_BYTES} bytes")
            else:
                self.metrics.request_done("/v1/models", "ok")
                return Response(raw, media_type=response.headers.get("content-type"))
        self.upstream_failed(failure, "model list unavailable")
        self.metrics.request_done("/v1/models", _outcome_of(failure))
        return _failure_response(failure)

    async def health(self) -> tuple[int, JSONBody]:
        """Each instance's state; 200 while some decode instance is up (prefill being down only costs speed)."""
        probes = await asyncio.gather(*(self._probe(i) for i in (*self.config.prefill, *self.config.decode)))
        up = {role: any(p["up"] for p in probes if p["role"] == role) for role in ("prefill", "decode")}
        status = "ok" if all(p["up"] for p in probes) else "degraded" if up["decode"] else "down"
        return (200 if up["decode"] else 503), {"status": status, "instances": probes}

    async def _probe(self, instance: Instance) -> JSONBody:
        state: JSONBody = {"name": instance.name, "role": instance.role, "url": instance.url}
        try:
            state["tp_size"] = await self.tp.tp_size(instance)
        except InstanceUnavailable as exc:
            return {**state, "up": False, "reason": f"{exc.reason}: {exc}"}
        try:
            response = await self._client.get(instance.url + "/health", timeout=self.config.health_timeout_s)
        except httpx.HTTPError as exc:
            failure = failure_from_exception(instance, exc)
            return {**state, "up": False, "reason": f"{failure.reason}: {failure.detail}"}
        if response.status_code != 200:
            return {**state, "up": False, "reason": f"/health answered HTTP {response.status_code}"}
        return {**state, "up": True}

    async def aclose(self) -> None:
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
        await self._client.aclose()
        self.tp.close()


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
        yield
        await router.aclose()
        log.info("router stopped")

    app = FastAPI(title="kvstage router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        status, body = await router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(config: RouterConfig, host: str, port: int, *, log_level: str = "info") -> None:
    """Run the router until SIGINT or SIGTERM."""
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
