"""The per-prefill-instance service sglang starts as a transfer backend's "bootstrap server", and its client.

Owns `KVStageBootstrapServer` (sglang's `BaseKVBootstrapServer`: sglang builds it on the prefill instance with its
`--host` and `--disaggregation-bootstrap-port`) and `MailboxClient`. Where the built-in backends' bootstrap server
tells decode ranks how to reach prefill, this one answers the one question kvstage's protocol cannot: which
instance of kvstage's directory a prefill bootstrap address is. It holds the prefill instance's name and TP size
(posted by prefill's rank 0 at start); a decode rank asks for them once per bootstrap address, as sglang's decode
asks for prefill's parallel info.

Nothing of a request passes here: the KV and each request's aux row (first output token, logprobs, room id) move
through kvstage's agents and directory (`KVSTAGE_BOOTSTRAP`); the aux row rides the room's last chunk.

Invariants: one thread owns the socket; every request is decoded with msgspec under a frame bound and a bad one
gets an error reply and is counted, never crashes the service; it holds one instance record, whatever it is
asked; it binds beyond loopback only with `KVSTAGE_INSECURE=1` (its requests are not authenticated:
docs/sglang.md). The client is blocking with a timeout, for background threads only (manager.py's worker), never
sglang's scheduler thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Final

import msgspec
import zmq

from kvstage.transport.auth import check_bind

log = logging.getLogger(__name__)

MAX_FRAME_BYTES: Final = 2**16


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`op`: "put_info" (instance, tp_size) or "get_info"."""

    op: str
    instance: str = ""
    tp_size: int = 0


class Reply(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    instance: str = ""
    tp_size: int = 0


class Mailbox:
    """The service's state: the prefill instance's info. Used by the server thread only."""

    def __init__(self) -> None:
        self.instance = ""
        self.tp_size = 0

    def handle(self, req: Request) -> Reply:
        if req.op == "put_info" and req.instance and 0 < req.tp_size <= 4096 and len(req.instance) <= 256:
            self.instance, self.tp_size = req.instance, req.tp_size
            return Reply(True)
        if req.op == "get_info":
            return Reply(bool(self.instance), "" if self.instance else "no prefill rank posted yet",
                         self.instance, self.tp_size)  # fmt: skip
        return Reply(False, f"bad request {req.op!r}")


class KVStageBootstrapServer:
    """sglang's bootstrap server for the kvstage backend: `Mailbox` behind a ZeroMQ ROUTER at tcp://host:port."""

    def __init__(self, host: str, port: int) -> None:
        self.endpoint = f"tcp://{host}:{port}"
        check_bind(self.endpoint, False, os.environ.get("KVSTAGE_INSECURE") == "1", "kvstage's sglang mailbox")
        self.rejected: Counter[str] = Counter()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._mailbox = Mailbox()
        self._thread = threading.Thread(target=self._run, name="kvstage-sglang-mailbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder, poller = msgspec.msgpack.Decoder(Request), zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                self.rejected["frames"] += 1
                continue
            try:
                reply = self._mailbox.handle(decoder.decode(frames[2]))
            except msgspec.DecodeError as exc:
                self.rejected["undecodable"] += 1
                reply = Reply(False, f"undecodable request: {exc}")
            self._sock.send_multipart([frames[0], b"", msgspec.msgpack.encode(reply)])
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MailboxClient:
    """Blocking requests to one prefill instance's `KVStageBootstrapServer` (`addr`: "host:port")."""

    def __init__(self, addr: str, timeout_s: float = 5.0) -> None:
        self.endpoint = f"tcp://{addr}"
        self.timeout_ms = int(timeout_s * 1000)
        self._decoder = msgspec.msgpack.Decoder(Reply)

    def ask(self, req: Request) -> Reply:
        """The service's reply, or `Reply(False, why)` when it cannot be reached in time (never raises)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        try:
            sock.connect(self.endpoint)
            sock.send(msgspec.msgpack.encode(req))
            return self._decoder.decode(sock.recv())
        except (zmq.ZMQError, msgspec.DecodeError) as exc:
            return Reply(False, f"mailbox {self.endpoint} unreachable: {exc}")
        finally:
            sock.close()
