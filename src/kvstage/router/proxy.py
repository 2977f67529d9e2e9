"""The router's request path: one client request through a prefill and a decode instance, with retries and
fallbacks, in structured concurrency.

Owns `ProxyEndpoint` (the ASGI endpoint of `/v1/completions` and `/v1/chat/completions`) and `request_id_of`.
The state it shares with other requests (instances, choices, metrics) is `router.core.Router`.

One client request (`ProxyEndpoint`, then `_Exchange`):
1. take a concurrency slot (429 when none is left) and read the body (bounded: 413; not a JSON object: 400);
2. an attempt: choose a decode instance by the router's policy (among those up, allowed by their breaker, whose
   TP size lookup has not just failed, and not yet tried for this request) and a prefill instance likewise, draw a
   new room and send both upstream requests at once. Decode's answer is held back until its first body byte: its
   headers alone prove nothing (vLLM may send them before it has the KV);
3. decode fails before that byte (connect error, 5xx, timeout, broken connection, not registered): the attempt's
   prefill request is cancelled and a new attempt starts on another decode instance with a new room, up to
   `max_attempts` attempts in all; a refused request (decode's 4xx) is the client's answer;
4. prefill fails before decode's first byte (refuses, 5xx, unreachable, times out, breaks the connection): the
   decode request is cancelled (its connection is closed: vLLM aborts it, and kvstage's connector the room) and
   sent again to the same decode instance without a room, which computes the prompt itself. After that byte a
   prefill failure is only logged: decode's room fails and vLLM recomputes what it misses;
5. no prefill instance can take the request, the client asks for beam search, or (prefix policy) the decode
   chosen likely holds all of the prompt but less than a block: decode alone, without a room;
6. decode's first byte arrived: its status, content type and body are relayed chunk by chunk, never buffered;
   once decode's answer has ended, a prefill request still running is cancelled;
7. the client disconnecting at any point cancels everything still running.

Each upstream request counts in its instance's load (`Pool.busy`) while it is open.

Invariants: everything one request starts runs in that request's task group (`_Exchange.run`), and its slot is
given back only once that group has ended, so at most `max_concurrent` prefill and `max_concurrent` decode
requests are ever open; every log line about a request names its request id; upstream requests carry the
router's request id and upstream key, never the client's `Authorization`. Called by `router.app`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from anyio.abc import TaskGroup
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from kvstage.router.core import Route, Router, error_response, failure_response, outcome_of
from kvstage.router.instances import Instance, InstanceUnavailable
from kvstage.router.metrics import RouterMetrics
from kvstage.router.select import NO_BLOCKS, prompt_blocks
from kvstage.router.upstream import (
    JSONBody,
    UpstreamFailure,
    decode_body,
    decode_only_reason,
    failure_from_exception,
    failure_from_response,
    new_room,
    prefill_body,
    read_bounded,
    upstream_headers,
)

log = logging.getLogger("kvstage.router")


def request_id_of(scope: Scope) -> str:
    """The request id that `router.app`'s middleware gave this request."""
    return str(scope["state"]["request_id"])


class _BadBody(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


async def _close(response: httpx.Response) -> None:
    """Close an upstream response, even in a cancelled scope (closing its connection is what cancels upstream)."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


class ProxyEndpoint:
    """The ASGI endpoint of one OpenAI path: a slot, the body, then an `_Exchange`; the outcome recorded once."""

    def __init__(self, router: Router, path: str, *, chat: bool) -> None:
        self.router = router
        self.path = path
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        router = self.router
        outcome = _Outcome(router.metrics, self.path)
        if not router.take_slot():
            outcome.set("busy")
            busy = error_response(429, f"the router has {router.config.max_concurrent} requests in flight", "busy")
            await busy(scope, receive, send)
            return
        try:
            await self._serve(scope, receive, send, outcome)
        finally:
            outcome.set("client_disconnected")  # unless the request reached an end of its own
            router.release_slot()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, outcome: _Outcome) -> None:
        try:
            body = await _read_json(Request(scope, receive), self.router.config.max_body_bytes)
        except _BadBody as exc:
            outcome.set("bad_request")
            await error_response(exc.status, str(exc), "invalid_request_error")(scope, receive, send)
            return
        except ClientDisconnect:
            return
        exchange = _Exchange(self.router, self.path, self.chat, request_id_of(scope), body, outcome)
        await exchange.run(scope, receive, send)


class _Outcome:
    """How one request ended, recorded once (`requests_total`, `request_seconds`), as soon as it is known: before
    the answer's last byte goes out, so that whoever has the answer finds it counted."""

    def __init__(self, metrics: RouterMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.started = time.monotonic()  # when the request arrived
        self.value: str | None = None

    def set(self, outcome: str) -> None:
        if self.value is not None:
            return
        self.value = outcome
        self.metrics.request_done(self.endpoint, outcome)
        self.metrics.request_seconds.labels(self.endpoint).observe(time.monotonic() - self.started)


@dataclass
class _Opened:
    """Decode's answer up to its first body byte (b"" when its body is empty)."""

    decode: Instance
    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes]


class _PrefillRun:
    """One attempt's prefill request, run in the exchange's task group."""

    def __init__(self, instance: Instance, body: JSONBody, room: int) -> None:
        self.instance = instance
        self.body = body
        self.room = room
        self.scope = anyio.CancelScope()  # the prefill request; cancelled when it is no longer needed
        self.decode_waits = anyio.CancelScope()  # decode's wait for its first byte; cancelled when prefill fails
        self.answering = False  # decode's first byte has arrived


class _Exchange:
    """One client request's attempts and answer, all in one task group (`run`)."""

    def __init__(
        self, router: Router, path: str, chat: bool, request_id: str, body: JSONBody, outcome: _Outcome
    ) -> None:
        self.router = router
        self.config = router.config
        self.metrics = router.metrics
        self.path = path
        self.chat = chat
        self.request_id = request_id
        self.body = body
        self.headers = upstream_headers(request_id, self.config.upstream_api_key)
        self.outcome = outcome

    def _log(self, level: int, message: str, *args: object) -> None:
        log.log(level, "request %s: " + message, self.request_id, *args)

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._watch_client, receive, tasks)
            await self._answer(scope, receive, send, tasks)
            tasks.cancel_scope.cancel()  # the client watch, and a prefill request still running

    async def _watch_client(self, receive: Receive, tasks: TaskGroup) -> None:
        while (await receive())["type"] != "http.disconnect":
            continue
        if self.outcome.value is None:
            self._log(logging.INFO, "the client went away; cancelling the upstream requests")
        tasks.cancel_scope.cancel()

    async def _answer(self, scope: Scope, receive: Receive, send: Send, tasks: TaskGroup) -> None:
        decode_only = decode_only_reason(self.body)
        if decode_only is not None:
            self.metrics.fallback(decode_only)
            self._log(logging.INFO, "served by decode alone (%s)", decode_only)
        blocks = NO_BLOCKS
        if self.config.policy == "prefix":
            blocks = prompt_blocks(self.body, chat=self.chat, block_tokens=self.config.prefix_block_tokens)
        tried: frozenset[Instance] = frozenset()
        failure: UpstreamFailure | None = None
        for _ in range(self.config.max_attempts):
            route = self.router.pick_decode(blocks, exclude=tried)
            if route is None:
                break
            if failure is not None:
                self.metrics.retries.labels(failure.reason).inc()
                self._log(logging.WARNING, "trying again on %s with a new room", route.decode.describe())
            tried |= {route.decode}
            with self.router.decode.busy(route.decode):
                result = await self._try(route, decode_only is not None, tasks)
                if isinstance(result, _Opened):
                    self.router.served(route.decode, blocks)
                    await self._relay(result, send)
                    return
            failure = result
            if not failure.retryable:
                break
        failure = failure or self.router.unavailable(self.router.decode)
        self.outcome.set(outcome_of(failure))
        await failure_response(failure)(scope, receive, send)

    async def _try(self, route: Route, decode_only: bool, tasks: TaskGroup) -> _Opened | UpstreamFailure:
        """One attempt on `route.decode`: with a prefill instance, or decode alone."""
        if decode_only:
            return await self._decode_alone(route.decode)
        if route.skip_prefill:
            return await self._fall_back(route.decode, "prefix_cached", "decode likely holds the whole prompt")
        return await self._attempt(route.decode, tasks)

    async def _attempt(self, decode: Instance, tasks: TaskGroup) -> _Opened | UpstreamFailure:
        """One room through `decode` and the next prefill instance; its prefill request runs in `tasks`."""
        prefill = self.router.pick_prefill()
        if prefill is None:
            return await self._fall_back(decode, "no_prefill", "no prefill instance can take it")
        decode_tp, prefill_tp = await self._tp_sizes(decode, prefill)
        if isinstance(decode_tp, InstanceUnavailable):
            failure = UpstreamFailure(decode, decode_tp.reason, 503, str(decode_tp))
            self._upstream_failed(failure, "decode unavailable")
            return failure
        if isinstance(prefill_tp, InstanceUnavailable):
            self._upstream_failed(UpstreamFailure(prefill, prefill_tp.reason, 503, str(prefill_tp)), "prefill skipped")
            return await self._fall_back(decode, "no_prefill", f"{prefill.describe()} is not usable")
        room = new_room()
        to_prefill = prefill_body(self.body, chat=self.chat, room=room, decode=decode, decode_tp=decode_tp)
        run = _PrefillRun(prefill, to_prefill, room)
        tasks.start_soon(self._prefill, run)
        to_decode = decode_body(self.body, room=room, prefill=prefill, prefill_tp=prefill_tp)
        with run.decode_waits:
            opened = await self._open_decode(decode, to_decode)
            run.answering = isinstance(opened, _Opened)
            if not run.answering:
                run.scope.cancel()
            return opened
        why = f"room {room} failed at prefill before decode's first byte"
        return await self._fall_back(decode, "prefill_failed", why)

    async def _fall_back(self, decode: Instance, reason: str, why: str) -> _Opened | UpstreamFailure:
        self.metrics.fallback(reason)
        self._log(logging.INFO, "%s: %s computes the prompt itself", why, decode.describe())
        return await self._decode_alone(decode)

    async def _decode_alone(self, decode: Instance) -> _Opened | UpstreamFailure:
        return await self._open_decode(decode, decode_body(self.body, room=None, prefill=None, prefill_tp=0))

    async def _tp_sizes(
        self, decode: Instance, prefill: Instance
    ) -> tuple[int | InstanceUnavailable, int | InstanceUnavailable]:
        """Both TP sizes, looked up at once."""
        sizes: dict[Instance, int | InstanceUnavailable] = {}

        async def size(instance: Instance) -> None:
            try:
                sizes[instance] = await self.router.tp.tp_size(instance)
            except InstanceUnavailable as exc:
                sizes[instance] = exc

        async with anyio.create_task_group() as lookups:
            lookups.start_soon(size, decode)
            lookups.start_soon(size, prefill)
        return sizes[decode], sizes[prefill]

    async def _open_decode(self, decode: Instance, body: JSONBody) -> _Opened | UpstreamFailure:
        """Decode's response up to its first body byte, or why it failed (recorded); cancelling it closes it."""
        client = self.router.client
        request = client.build_request("POST", decode.url + self.path, json=body, headers=self.headers)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            return self._decode_failed(failure_from_exception(decode, exc))
        opened: _Opened | None = None
        try:
            if response.status_code >= 400:
                raw = await _error_body(response)
                return self._decode_failed(failure_from_response(decode, response.status_code, raw))
            chunks = response.aiter_raw()
            opened = _Opened(decode, response, await anext(chunks, b""), chunks)
        except httpx.HTTPError as exc:
            return self._decode_failed(failure_from_exception(decode, exc))
        finally:
            if opened is None:
                await _close(response)
        self.router.decode.succeeded(decode)
        return opened

    def _decode_failed(self, failure: UpstreamFailure) -> UpstreamFailure:
        self._upstream_failed(failure, "decode failed before its first byte")
        self.router.decode.failed(failure)
        return failure

    def _upstream_failed(self, failure: UpstreamFailure, what: str) -> None:
        self.metrics.upstream_error(failure.instance.role, failure.instance.name, failure.reason)
        self._log(logging.WARNING, "%s: %s", what, failure)

    async def _prefill(self, run: _PrefillRun) -> None:
        with run.scope, self.router.prefill.busy(run.instance):
            failure = await self._prefill_request(run)
            if failure is None:
                return
            self.router.prefill.failed(failure)
            if run.answering:
                self._upstream_failed(failure, f"room {run.room} failed at prefill after decode's first byte")
            else:
                self._upstream_failed(failure, f"room {run.room} failed at prefill")
                run.decode_waits.cancel()

    async def _prefill_request(self, run: _PrefillRun) -> UpstreamFailure | None:
        started = time.monotonic()
        timeout = self.config.prefill_timeout_s
        url = run.instance.url + self.path
        try:
            with anyio.fail_after(timeout):
                async with self.router.client.stream("POST", url, json=run.body, headers=self.headers) as response:
                    raw = await read_bounded(response)
        except TimeoutError:
            return UpstreamFailure(run.instance, "timeout", 504, f"no answer within {timeout}s")
        except httpx.HTTPError as exc:
            return failure_from_exception(run.instance, exc)
        if response.status_code >= 400:
            return failure_from_response(run.instance, response.status_code, raw)
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        self.router.prefill.succeeded(run.instance)
        return None

    async def _relay(self, opened: _Opened, send: Send) -> None:
        """Decode's answer to the client as it comes; a break mid-answer ends an SSE stream with an error event and
        cuts any other answer (the client sees a broken response, never a truncated one that looks whole)."""
        response = opened.response
        content_type = response.headers.get("content-type")
        headers = [] if content_type is None else [(b"content-type", content_type.encode("latin-1"))]
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            first_byte_s = time.monotonic() - self.outcome.started
            self.metrics.first_byte_seconds.labels(self.path).observe(first_byte_s)
            self.metrics.ttft_seconds.labels(opened.decode.name).observe(first_byte_s)
            await send({"type": "http.response.body", "body": opened.first, "more_body": True})
            try:
                async for chunk in opened.rest:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                failure = failure_from_exception(opened.decode, exc)
                self._upstream_failed(failure, "decode broke off its answer")
                self.router.decode.failed(failure)
                self.outcome.set(outcome_of(failure))
                if not (content_type or "").startswith("text/event-stream"):
                    return  # without the end of the body, the server cuts the connection
                event = f"data: {json.dumps(failure.error_body())}\n\n".encode()
                await send({"type": "http.response.body", "body": event, "more_body": True})
            else:
                self.outcome.set("ok")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await _close(response)


async def _error_body(response: httpx.Response) -> bytes:
    """An upstream error reply's body (bounded), or b"" when the connection breaks while it is read."""
    try:
        return await read_bounded(response)
    except httpx.HTTPError:
        return b""
