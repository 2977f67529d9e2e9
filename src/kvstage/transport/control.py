"""ZeroMQ control plane: one channel per agent, driven by its owner's loop on one thread, never blocking it.

Owns: `ControlChannel`, the only code that touches the agent's ZeroMQ sockets. A channel binds one ROUTER socket
(its inbound address, which peers learn through the bootstrap service or a Hello) and keeps one DEALER socket per
peer it sends to. Frames are single-part byte strings produced and read by the protocol codec.

The channel has no thread of its own. Its owner (the agent's reactor thread, runtime/agent.py) waits on `fileno()`
together with its other wake-ups, calls `receive()` when the channel may hold frames (`readable()`), and sends from
the same loop: a frame goes from the owner's `send` straight into ZeroMQ, which moves it from its own native I/O
thread. So a control message costs no hand-off between Python threads on either side.

Invariants:
- exactly one thread, the owner, uses and closes every socket of the channel (ZeroMQ sockets are not thread-safe;
  sharing one corrupted frames upstream, #29984): after `adopt()`, a call from any other thread raises
  `TransportError`. `start()` binds on the calling thread, which may hand the channel to its owner's thread once
  (starting that thread is the memory barrier ZeroMQ asks for);
- `send` never blocks: a frame ZeroMQ cannot take at once (the peer's queue is full), or cannot take at all (too
  many peers, a bad address, the channel closed, a frame over `max_frame_bytes`), raises `TransportError` with the
  reason, which the caller turns into a room failure; nothing is dropped silently;
- with a shared secret (`auth`), every frame is sealed with HMAC-SHA256 bound to the receiver's address
  (transport/auth.py) and an inbound frame is opened before it is decoded: a frame without the secret is
  dropped as "auth", a replayed one as "replay". Without a secret the channel refuses to bind beyond loopback
  unless `insecure` (`check_bind`);
- an inbound frame that is multi-part, larger than `max_frame_bytes` or undecodable is counted by reason and
  dropped; it never stops the loop. ZeroMQ itself drops connections that send more than `2 * max_frame_bytes`,
  so no peer can make the channel hold an unbounded frame;
- memory is bounded: the peer count and the per-socket high-water marks are fixed at construction, what ZeroMQ
  may queue per inbound connection is bounded in bytes (`ChannelConfig.recv_queue_bytes`: the receive high-water
  mark, in frames, is derived from it and the largest frame ZeroMQ accepts), and a frame is handed to the owner as
  it is read, so nothing waits between the socket and the owner. The owner closes the socket of a peer whose
  session ended (`forget_peer`), so the peer count follows the peers alive now.

Called by runtime/ agents (start, adopt, fileno, readable, receive, send, forget_peer, close) and by tests. It
knows nothing of rooms: `deliver` carries each inbound message to the owner, which maps it to a protocol event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import zmq

from kvstage.errors import ProtocolError, TransportError
from kvstage.transport.auth import OVERHEAD, FrameAuth, check_bind

log = logging.getLogger(__name__)

M = TypeVar("M")  # what the owner sends (`encode` makes a frame of it)
In = TypeVar("In")  # what the owner receives (`decode` makes it of a frame)

#: Reasons under which inbound frames are rejected (metric label values).
REJECT_MULTIPART = "multipart"
REJECT_OVERSIZE = "oversize"
REJECT_UNDECODABLE = "undecodable"

#: Reasons under which a frame cannot be sent (the `TransportError`'s message starts with one).
SEND_PEER_BUSY = "peer queue full"
SEND_TOO_MANY_PEERS = "too many peers"
SEND_CLOSED = "channel closed"
SEND_BAD_ADDRESS = "bad peer address"
SEND_OVERSIZE = "frame over max_frame_bytes"


class ChannelClosed(TransportError):
    """The channel is closed (or was never started); nothing can be sent through it."""


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Bounds of one channel. Every number caps memory or time; none grows from the wire."""

    max_frame_bytes: int = 1 << 20
    max_peers: int = 256
    peer_send_hwm: int = 10_000
    #: Frames ZeroMQ may queue per inbound connection before the owner reads them, at most; fewer where
    #: `recv_queue_bytes` says so.
    recv_hwm: int = 1000
    #: Bytes ZeroMQ may queue per inbound connection before the owner reads them: the receive high-water mark
    #: is `recv_queue_bytes // max_message_bytes` frames (at least 1, at most `recv_hwm`), and ZeroMQ holds at most
    #: one more frame per connection while it reads it (docs/security.md, "Bounds").
    recv_queue_bytes: int = 64 * 2**20
    #: Frames one `receive()` reads at most, so that a flood cannot keep the owner's loop from its other work.
    recv_batch: int = 256
    #: Rejected frames are logged at most once per this many seconds per reason (with the count since the last
    #: line), so a flood of bad frames cannot flood the log; every one is still counted.
    reject_log_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_peers", "peer_send_hwm", "recv_hwm", "recv_queue_bytes", "recv_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def max_message_bytes(self) -> int:
        """The largest frame ZeroMQ accepts (a larger one closes its connection): twice `max_frame_bytes` sealed,
        so a frame somewhat over the bound is still read, counted and dropped as "oversize"."""
        return 2 * (self.max_frame_bytes + OVERHEAD)

    @property
    def receive_hwm(self) -> int:
        """ZeroMQ's receive high-water mark per inbound connection, in frames (see `recv_queue_bytes`)."""
        return max(1, min(self.recv_hwm, self.recv_queue_bytes // self.max_message_bytes))


class ControlChannel(Generic[M, In]):
    """A bound ROUTER plus per-peer DEALERs, used by one owner thread (see the module docstring).

    `encode` runs inside `send`; `decode` and `deliver` run inside `receive`, on the owner's thread. `decode`
    signals a bad frame by raising `ProtocolError`.
    """

    def __init__(
        self,
        bind: str,
        *,
        encode: Callable[[M], bytes],
        decode: Callable[[bytes], In],
        deliver: Callable[[In], None],
        on_reject: Callable[[str], None] | None = None,
        config: ChannelConfig | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        name: str = "control",
        auth: FrameAuth | None = None,
        insecure: bool = False,
    ) -> None:
        self._bind = bind
        self._auth = auth
        self._insecure = insecure
        self._encode = encode
        self._decode = decode
        self._deliver = deliver
        self._on_reject = on_reject
        self.config = config or ChannelConfig()
        self._context = context or zmq.Context.instance()
        self.name = name
        self._router: zmq.Socket[bytes] | None = None
        self._fd = -1
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._owner = threading.get_ident()
        self._address = ""
        self.rejected: Counter[str] = Counter()
        self.received = 0
        self.sent = 0
        self._reject_logged: dict[str, tuple[float, int]] = {}  # reason -> (last line, rejects since)

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> ControlChannel[M, In]:
        """Bind the ROUTER on the calling thread (`TransportError` if binding failed, `ConfigError` for a bind
        beyond loopback without a secret or `insecure`)."""
        check_bind(self._bind, self._auth is not None, self._insecure, f"control channel {self.name}")
        router = self._context.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            router.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
            router.bind(self._bind)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            raise TransportError(f"{self.name}: cannot bind {self._bind}: {exc}") from exc
        self._address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._fd = int(router.getsockopt(zmq.FD))
        self._router = router
        self._owner = threading.get_ident()
        return self

    def adopt(self) -> None:
        """The calling thread becomes the channel's only user (the owner's loop calls this as it starts)."""
        self._owner = threading.get_ident()

    @property
    def address(self) -> str:
        """The bound inbound address, with any wildcard port resolved; peers connect here."""
        return self._address

    @property
    def open_peers(self) -> int:
        """DEALER sockets open now."""
        return len(self._peers)

    def close(self) -> None:
        """Close every socket; later sends raise `ChannelClosed`. Idempotent; on the owner's thread (or once the
        owner's loop has ended)."""
        router, self._router = self._router, None
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if router is not None:
            router.close(linger=0)

    def __enter__(self) -> ControlChannel[M, In]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the owner's loop ---------------------------------------------------------------------------------

    def fileno(self) -> int:
        """A descriptor that becomes readable when the ROUTER's state changes (ZeroMQ's edge-triggered `FD`): wait
        on it only while `readable()` is False."""
        self._open()
        return self._fd

    def readable(self) -> bool:
        """Whether a frame may be waiting (ask before every wait on `fileno()`)."""
        router = self._router
        return router is not None and bool(int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def receive(self) -> int:
        """Read up to `recv_batch` waiting frames and deliver each; returns how many were read (bad ones too)."""
        router = self._open()
        read = 0
        while read < self.config.recv_batch:
            try:
                parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            read += 1
            message = self._check(parts)
            if message is not None:
                self._deliver(message)
                self.received += 1  # counted once handled: the owner's work for it is done
        return read

    def send(self, peer: str, message: M) -> None:
        """Hand `message` to ZeroMQ for `peer` without blocking; `TransportError` (naming the reason) if it cannot."""
        frame = self._encode(message)
        if len(frame) > self.config.max_frame_bytes:
            raise TransportError(f"{SEND_OVERSIZE}: {self.name}: a frame of {len(frame)} bytes, the bound is "
                                 f"{self.config.max_frame_bytes}")  # fmt: skip
        if self._auth is not None:
            frame = self._auth.seal(frame, peer.encode())
        self._check_owner()
        sock = self._peers.get(peer)
        if sock is None:
            sock = self._connect(peer)
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            raise TransportError(f"{SEND_PEER_BUSY}: {self.name} -> {peer}") from exc
        self.sent += 1

    def forget_peer(self, peer: str) -> None:
        """Close the outbound socket to `peer` (its session ended or moved); a later send reconnects. Frames
        still waiting in its socket are dropped (the peer is gone). A no-op once the channel is closed."""
        self._check_owner()
        sock = self._peers.pop(peer, None)
        if sock is not None:
            sock.close(linger=0)

    # ---- internals -----------------------------------------------------------------------------------------

    def _open(self) -> zmq.Socket[bytes]:
        self._check_owner()
        if self._router is None:
            raise ChannelClosed(f"{SEND_CLOSED}: {self.name} is not running")
        return self._router

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise TransportError(f"{self.name}: used from a thread other than its owner's (sockets are not shared)")

    def _connect(self, peer: str) -> zmq.Socket[bytes]:
        self._open()
        if len(self._peers) >= self.config.max_peers:
            raise TransportError(f"{SEND_TOO_MANY_PEERS}: {self.name} has {len(self._peers)} peer sockets open")
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.peer_send_hwm)
        try:
            sock.connect(peer)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("%s: cannot connect to %r: %s", self.name, peer, exc)
            raise TransportError(f"{SEND_BAD_ADDRESS}: {self.name} -> {peer!r}: {exc}") from exc
        self._peers[peer] = sock
        return sock

    def _check(self, parts: list[bytes]) -> In | None:
        """The message in one read, or None (counted by reason) for a frame that is bad."""
        if len(parts) != 2:
            self._reject(REJECT_MULTIPART)
            return None
        frame = parts[1]
        if len(frame) > self.config.max_frame_bytes + (0 if self._auth is None else OVERHEAD):
            self._reject(REJECT_OVERSIZE)
            return None
        if self._auth is not None:
            opened = self._auth.open(frame, self._address.encode())
            if isinstance(opened, str):
                self._reject(opened)
                return None
            frame = opened.payload
        try:
            return self._decode(frame)
        except ProtocolError as exc:
            self._reject(REJECT_UNDECODABLE, f"{len(frame)} bytes: {exc}")
            return None

    def _reject(self, reason: str, detail: str = "") -> None:
        self.rejected[reason] += 1
        now = time.monotonic()
        last, since = self._reject_logged.get(reason, (-1e18, 0))
        if now - last >= self.config.reject_log_interval_s:
            log.warning("%s: rejected an inbound frame (%s%s); %d more since the last such line", self.name, reason,
                        f": {detail}" if detail else "", since)  # fmt: skip
            self._reject_logged[reason] = (now, 0)
        else:
            self._reject_logged[reason] = (last, since + 1)
        if self._on_reject is not None:
            self._on_reject(reason)
