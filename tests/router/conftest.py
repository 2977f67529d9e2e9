"""Real HTTP on loopback for the router's tests: small OpenAI-style upstreams that record what they receive.

`FakeVLLM` is a Starlette app served by uvicorn on 127.0.0.1 (a port of its own) in a thread. It records every
request (body and headers), whether its client went away before the answer ended, and answers like vLLM's OpenAI
server (JSON, or SSE chunks when `stream` is true). Its `mode` picks the behaviour: "ok", "error500", "refuse"
(400), "hang" (never answers; waits for the client to go), "break" (the status line, then the connection is cut),
"hang_stream" (one SSE chunk, then waits for the client to go) and "break_stream" (one SSE chunk, then the
connection is cut); `delay_s` is waited first. Its `/health` answers 200 while `healthy`, else 503.
With `wait_for_peer`, it answers only once the other side has received the same room (so a router that sends
its two requests one after the other fails). With `needs_kv` (decode's default), a request with a room waits, as vLLM's
connector does, until prefill has answered that room successfully (or the client goes away); one without a room
is computed at once. A real `BootstrapServer` holds the instances' records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvstage.layout import KVLayout
from kvstage.router.app import create_app
from kvstage.router.config import RouterConfig
from kvstage.router.core import Router
from kvstage.router.instances import Instance, Role
from kvstage.transport.bootstrap import BootstrapClient, BootstrapServer, LayoutRecord, PeerRecord

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 16, "temperature": 0.0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_size=16)
PREFILL_TP = 2
DECODE_TP = 1


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


class ServedApp:
    """An ASGI app served by uvicorn on 127.0.0.1 in a thread of this process."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, f"uvicorn at {self.url} to start")

    def stop(self) -> None:
        """Ask the server to stop; `close` waits for it."""
        self._server.should_exit = True

    def close(self) -> None:
        self.stop()
        self._thread.join(10)
        self._sock.close()


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at: float

    @property
    def room(self) -> int:
        return int(self.body["kv_transfer_params"]["kvstage_room"])


@dataclass
class Rooms:
    """Which roles have received which room (shared by the two sides of one test)."""

    seen: dict[int, set[str]] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)  # rooms prefill answered successfully
    lock: threading.Lock = field(default_factory=threading.Lock)

    def arrive(self, room: int, role: str) -> None:
        with self.lock:
            self.seen.setdefault(room, set()).add(role)

    def deliver(self, room: int) -> None:
        with self.lock:
            self.delivered.add(room)

    def has_kv(self, room: int) -> bool:
        with self.lock:
            return room in self.delivered

    def both(self, room: int) -> bool:
        with self.lock:
            return self.seen.get(room, set()) == {"prefill", "decode"}


class FakeVLLM:
    """One fake vLLM OpenAI server; its attributes steer its answers and record what it received."""

    def __init__(self, name: str, role: Role, rooms: Rooms) -> None:
        self.name = name
        self.role = role
        self.rooms = rooms
        self.mode = "ok"
        self.healthy = True
        self.delay_s = 0.0
        self.wait_for_peer = False
        self.needs_kv = role == "decode"
        self.chunks = 3
        self.chunk_delay_s = 0.0
        self.received: list[Received] = []
        self.gone: list[int] = []  # rooms whose client went away before the answer ended
        self.sent_chunks = 0
        self.open = 0  # requests being answered now
        self.waiting = 0.0  # what its /metrics says of vLLM's waiting queue
        self.external_tokens = 0.0  # ... and of the prompt tokens its connector loaded
        app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ]
        )
        self.served = ServedApp(app)
        self.url = self.served.url
        self.instance = Instance(name, role, self.url)

    def close(self) -> None:
        self.served.close()

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        """A few lines of vLLM's Prometheus exposition."""
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
            "# TYPE vllm:prompt_tokens_by_source counter\n"
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="external_kv_transfer"}} {self.external_tokens}\n'
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} 99.0\n'
        )
        return Response(text, media_type="text/plain; version=0.0.4")

    async def _models(self, request: Request) -> Response:
        model = {"id": f"model-of-{self.name}", "object": "model", "created": 1, "owned_by": "fake"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _complete(self, request: Request) -> Response:
        self.open += 1
        try:
            return await self._answer(request)
        except ClientDisconnect:
            self.gone.append(0)  # went away while the body was still coming
            return Response(status_code=204)
        finally:
            self.open -= 1

    async def _answer(self, request: Request) -> Response:
        body = await request.json()
        got = Received(request.url.path, body, dict(request.headers), time.monotonic())
        self.received.append(got)
        room = int(body.get("kv_transfer_params", {}).get("kvstage_room", 0))
        self.rooms.arrive(room, self.role)
        await asyncio.sleep(self.delay_s)
        if self.mode == "hang" or (self.needs_kv and room and not await self._kv_arrives(request, room)):
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            self.gone.append(room)
            return Response(status_code=204)
        if self.wait_for_peer:
            deadline = time.monotonic() + 3.0
            while not self.rooms.both(room):
                if time.monotonic() > deadline:
                    return JSONResponse({"error": {"message": "the peer never got this room"}}, status_code=500)
                await asyncio.sleep(0.01)
        if self.mode == "error500":
            error = {"message": f"boom from {self.name}", "type": "InternalServerError", "code": 500}
            return JSONResponse({"error": error}, status_code=500)
        if self.mode == "refuse":
            error = {"message": f"{self.name} refuses this request", "type": "BadRequestError", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        if self.mode == "break":
            return StreamingResponse(_broken(), media_type="application/json")
        if room and self.role == "prefill":
            self.rooms.deliver(room)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("stream"):
            return StreamingResponse(self._stream(room, chat), media_type="text/event-stream")
        text = f"{self.name} answers room {room}"
        return JSONResponse(_completion(text, chat, body.get("model", "m")))

    async def _kv_arrives(self, request: Request, room: int) -> bool:
        """Whether prefill delivers the room's KV before the client goes away (the connector's wait)."""
        while not self.rooms.has_kv(room):
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.01)
        return True

    async def _stream(self, room: int, chat: bool) -> AsyncIterator[bytes]:
        done = False
        try:
            for i in range(self.chunks):
                yield _sse(_chunk(f"t{i} ", chat, finish=i == self.chunks - 1))
                self.sent_chunks += 1
                if self.mode == "hang_stream":
                    await asyncio.sleep(3600)
                if self.mode == "break_stream":
                    raise ConnectionAbortedError("the fake breaks off its stream")  # uvicorn cuts the connection
                await asyncio.sleep(self.chunk_delay_s)
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.gone.append(room)


async def _broken() -> AsyncIterator[bytes]:
    yield b'{"id": '
    raise ConnectionAbortedError("the fake breaks off its answer")  # uvicorn cuts the connection


def _completion(text: str, chat: bool, model: str) -> dict[str, Any]:
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return {
            "id": "c1",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    return {"id": "c1", "object": "text_completion", "created": 1, "model": model, "choices": [choice], "usage": usage}


def _chunk(text: str, chat: bool, *, finish: bool) -> dict[str, Any]:
    reason = "stop" if finish else None
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": reason}
        return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": "c1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def peer_record(instance: str, role: Role, tp: int, rank: int, session: int = 1, url: str = "") -> PeerRecord:
    return PeerRecord(
        peer_id=f"{instance}-{rank}",
        role=role,
        instance=instance,
        tp_size=tp,
        rank=rank,
        layout=LayoutRecord.of(LAYOUT),
        control_address=f"tcp://127.0.0.1:{6000 + rank}",
        backend="local",
        session=session,
        url=url,
    )


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    """A real bootstrap with prefill instances P0, P1 (TP 2) and decode instances D0, D1 (TP 1) registered."""
    with BootstrapServer() as server:
        register_instances(server.address)
        yield server


def register_instances(address: str, secret: bytes | None = None) -> None:
    client = BootstrapClient(address, secret=secret)
    for name in ("P0", "P1"):
        for rank in range(PREFILL_TP):
            client.register(peer_record(name, "prefill", PREFILL_TP, rank))
    for name in ("D0", "D1"):
        for rank in range(DECODE_TP):
            client.register(peer_record(name, "decode", DECODE_TP, rank))
    client.close()


@pytest.fixture
def serving() -> Iterator[list[ServedApp]]:
    """The servers a test started (fakes and routers): all stopped at once at its end, which saves their shutdown
    times."""
    served: list[ServedApp] = []
    yield served
    for s in served:
        s.stop()
    for s in served:
        s.close()


@pytest.fixture
def upstreams(serving: list[ServedApp]) -> Callable[[str, Role], FakeVLLM]:
    """Makes fake vLLM servers that share one room book."""
    rooms = Rooms()

    def make(name: str, role: Role) -> FakeVLLM:
        fake = FakeVLLM(name, role, rooms)
        serving.append(fake.served)
        return fake

    return make


@dataclass
class RunningRouter:
    url: str
    router: Router

    def metric(self, name: str, **labels: str) -> float:
        return self.router.metrics.value(name, **labels)


@pytest.fixture
def start_router(bootstrap: BootstrapServer, serving: list[ServedApp]) -> Callable[..., RunningRouter]:
    """Starts a router (real uvicorn on loopback) in front of the given instances (and `bootstrap`, unless the
    options name another)."""

    def start(prefill: list[Instance], decode: list[Instance], **options: Any) -> RunningRouter:
        address = options.pop("bootstrap", bootstrap.address)
        config = RouterConfig(address, tuple(prefill), tuple(decode), **options)
        app = create_app(config)
        serving.append(ServedApp(app))
        return RunningRouter(serving[-1].url, app.state.router)

    return start


def closed_port_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logged(level: int) -> Iterator[list[logging.LogRecord]]:
    """The records at `level` and above of uvicorn's servers and of the router while the block runs. Start the
    servers first: a uvicorn server that starts configures uvicorn's loggers anew, which drops this handler."""
    handler = _Records(level)
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("kvstage.router")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def logged_errors() -> AbstractContextManager[list[logging.LogRecord]]:
    """The ERROR records (`logged`)."""
    return logged(logging.ERROR)
