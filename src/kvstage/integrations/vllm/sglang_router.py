"""vLLM servers with the kvstage connector behind sglang-router (SMG) in its prefill/decode mode.

Owns two ASGI middlewares for vLLM's OpenAI server (`vllm serve ... --middleware kvstage.integrations.vllm.
sglang_router.PrefillBehindSGLangRouter`, or `...DecodeBehindSGLangRouter` on a decode instance), and `PrefillLocator`.

sglang-router (`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`) sends each request to a prefill and
a decode server at once, the client's JSON body unchanged but for three fields it adds: `bootstrap_room` (a random
63-bit integer), `bootstrap_host` and `bootstrap_port` (the prefill it chose: its URL's host, and the port given
after the URL). It answers the client with decode's response. vLLM ignores those fields (they never reach the
connector), so each middleware turns them into the `kv_transfer_params` the connector reads, and removes them:

- on prefill: `{"do_remote_decode": true, "kvstage_room": bootstrap_room}`, and one token to generate
  (`max_tokens`, `max_completion_tokens`): prefill computes the prompt and holds its KV in room `bootstrap_room` for
  a decode not known yet, as in vLLM's sequential flow (docs/vllm.md);
- on decode: `{"kvstage_room": bootstrap_room, "kvstage_peer": NAME, "kvstage_peer_tp": TP}`, the prefill's
  instance name and TP size found in kvstage's directory (`PrefillLocator`): the prefill instance whose published
  `url` (the connector's `url` setting) has host `bootstrap_host` and port `bootstrap_port`. So sglang-router must
  be given each prefill's OpenAI port as its bootstrap port: `--prefill http://10.0.0.2:8100 8100`.

A request without `bootstrap_room`, or that already names `kv_transfer_params`, passes unchanged; so does one whose
fields are malformed or (on decode) whose prefill the directory does not know: it runs without kvstage (decode
computes the prompt; prefill's room then ends as "unclaimed"), and the middleware logs why and counts it. A body
larger than `MAX_BODY_BYTES` is passed on unread. The middleware never raises into vLLM's server: a failure of its
own becomes a pass-through, logged.

Settings come from the environment (vLLM gives a middleware nothing else): `KVSTAGE_BOOTSTRAP` (the directory,
default `tcp://127.0.0.1:7100`) and `KVSTAGE_SECRET` (docs/security.md). Called by vLLM's API server.
"""

from __future__ import annotations

import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from kvstage.errors import KVStageError
from kvstage.integrations.vllm.params import MAX_ROOM, PEER_KEY, PEER_TP_KEY, REMOTE_DECODE_KEY, ROOM_KEY
from kvstage.transport.auth import load_secret
from kvstage.transport.discovery import InstanceDirectory, Listing, open_instance_directory

log = logging.getLogger("kvstage.sglang_router")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The OpenAI routes whose bodies sglang-router fills in.
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
#: The fields sglang-router adds to each body.
ROOM_FIELD, HOST_FIELD, PORT_FIELD = "bootstrap_room", "bootstrap_host", "bootstrap_port"
#: A larger body is passed on without being read into memory here.
MAX_BODY_BYTES = 64 * 2**20
#: Why a request from sglang-router ran without kvstage (the labels of `counts`).
BAD_ROOM, NO_PREFILL = "bad bootstrap_room", "no prefill for bootstrap_host:bootstrap_port"
#: How long a directory listing answers lookups before it is asked again.
LISTING_TTL_S = 10.0
#: A lookup that misses asks the directory again only if the listing is at least this old: requests naming hosts
#: nobody publishes cost the directory at most one listing per this many seconds.
MISS_RELIST_S = 1.0


class _BootstrapFields(ABC):
    """The ASGI plumbing both middlewares share: read a route's JSON body, let the role rewrite it, replay it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.counts: Counter[str] = Counter()  # "handed", or why a request ran without kvstage (a fixed label)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ROUTES:
            await self.app(scope, receive, send)
            return
        chunks, complete = await _read_body(receive)
        body = b"".join(chunks)
        if complete:
            body = await self._rewritten(body)
            scope = dict(scope, headers=_with_length(scope.get("headers", []), len(body)))
            chunks = [body]
        await self.app(scope, _replay(chunks, receive, complete), send)

    async def _rewritten(self, body: bytes) -> bytes:
        """`body` with sglang-router's fields turned into `kv_transfer_params`; `body` itself if it has none to turn."""
        try:
            request = json.loads(body)
        except ValueError:
            return body  # vLLM answers it with its own error
        if not isinstance(request, dict) or ROOM_FIELD not in request or "kv_transfer_params" in request:
            return body
        room = request.get(ROOM_FIELD)
        if not isinstance(room, int) or isinstance(room, bool) or not 0 < room <= MAX_ROOM:
            why = f"{ROOM_FIELD} must be an integer in [1, 2**63), got {room!r:.60}"
            return self._without_kvstage(body, BAD_ROOM, why)
        try:
            params = await self._params(request, room)
        except KVStageError as exc:
            return self._without_kvstage(body, NO_PREFILL, str(exc))
        for field in (ROOM_FIELD, HOST_FIELD, PORT_FIELD):
            request.pop(field, None)
        request["kv_transfer_params"] = params
        self.counts["handed"] += 1
        return json.dumps(request).encode()

    def _without_kvstage(self, body: bytes, label: str, why: str) -> bytes:
        self.counts[label] += 1  # a fixed label: what a client sends never adds a key
        log.warning("kvstage: a request from sglang-router runs without kvstage: %s", why)
        return body

    @abstractmethod
    async def _params(self, request: dict[str, Any], room: int) -> dict[str, object]:
        """subclass: the connector's `kv_transfer_params` for `request` in `room` (and any change of `request`);
        `KVStageError` naming why it cannot have any."""


class PrefillBehindSGLangRouter(_BootstrapFields):
    """On a prefill instance: compute the prompt, generate one token, hold the KV in sglang-router's room."""

    async def _params(self, request: dict[str, Any], room: int) -> dict[str, object]:
        for field in ("max_tokens", "max_completion_tokens"):
            if field in request:
                request[field] = 1
        if "max_completion_tokens" not in request:
            request["max_tokens"] = 1
        return {REMOTE_DECODE_KEY: True, ROOM_KEY: room}


class DecodeBehindSGLangRouter(_BootstrapFields):
    """On a decode instance: take the prompt's KV from the prefill sglang-router chose, in its room."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app)
        self.locator = PrefillLocator(os.environ.get("KVSTAGE_BOOTSTRAP", "tcp://127.0.0.1:7100"))

    async def _params(self, request: dict[str, Any], room: int) -> dict[str, object]:
        host, port = request.get(HOST_FIELD), request.get(PORT_FIELD)
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            raise KVStageError(f"bad {HOST_FIELD}/{PORT_FIELD}: {host!r:.60}, {port!r:.20}")
        name, tp = await self.locator.prefill_at(host, port)
        return {ROOM_KEY: room, PEER_KEY: name, PEER_TP_KEY: tp}


class PrefillLocator:
    """Which kvstage prefill instance serves at a host and port: from the directory's listing of instances (their
    published URLs), asked in a worker thread at most once per `LISTING_TTL_S`, and at a miss at most once per
    `MISS_RELIST_S`, one call at a time, so the event loop never waits on the directory."""

    def __init__(self, bootstrap: str, *, timeout_s: float = 2.0) -> None:
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._directory: InstanceDirectory | None = None
        self._listing: Listing = ()
        self._asked_at = -LISTING_TTL_S
        self._lock = anyio.Lock()

    async def prefill_at(self, host: str, port: int) -> tuple[str, int]:
        """(instance name, TP size) of the complete prefill instance at `host:port`; `KVStageError` if none is."""
        async with self._lock:
            found, age = self._find(host, port), time.monotonic() - self._asked_at
            if age > LISTING_TTL_S or (found is None and age > MISS_RELIST_S):
                self._listing = await anyio.to_thread.run_sync(self._list)
                self._asked_at = time.monotonic()
                found = self._find(host, port)
        if found is None:
            raise KVStageError(f"no prefill instance of {self._bootstrap} publishes url http://{host}:{port}")
        return found

    def _list(self) -> Listing:
        if self._directory is None:
            self._directory = open_instance_directory(self._bootstrap, timeout_s=self._timeout_s, secret=load_secret())
        return self._directory.list_instances()

    def _find(self, host: str, port: int) -> tuple[str, int] | None:
        for entry in self._listing:
            url = urlsplit(entry.url)
            if entry.role == "prefill" and entry.complete and url.hostname == host and url.port == port:
                return entry.instance, entry.tp_size
        return None


async def _read_body(receive: Receive) -> tuple[list[bytes], bool]:
    """The request's body chunks, and whether they are all of it (False: it passed `MAX_BODY_BYTES`, read no
    further; the rest is still in `receive`)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return chunks, False  # a disconnect: vLLM sees it when it reads on
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return chunks, True
        if size > MAX_BODY_BYTES:
            return chunks, False


def _replay(chunks: list[bytes], receive: Receive, complete: bool) -> Receive:
    """A `receive` that yields `chunks` first, then (when they were not the whole body) what `receive` has left."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or not complete}
        return await receive()

    return replay


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]
