"""ZeroMQ control plane: one channel per agent, one I/O thread per channel, bounded and non-blocking for callers.

Owns: `ControlChannel`, the only code that touches the agent's ZeroMQ sockets. A channel binds one ROUTER socket
(its inbound address, which peers learn through the bootstrap service or a Hello) and keeps one DEALER socket per
peer it sends to. Frames are single-part byte strings produced and read by the protocol codec.

Invariants:
- exactly one thread, the channel's I/O thread, creates, uses and closes every socket of the channel (ZeroMQ
  sockets are not thread-safe; sharing one corrupted frames upstream, #29984);
- `send` never blocks: it encodes on the caller's thread, appends to a bounded outbox and wakes the I/O thread
  through a socket pair; a full outbox raises `OutboxFull`, which the caller turns into a room failure;
- a frame the I/O thread cannot hand to ZeroMQ (peer's queue full, too many peers, channel closing) is reported
  through `on_send_failure` with the original message, never dropped silently;
- with a shared secret (`auth`), every frame is sealed with HMAC-SHA256 bound to the receiver's address
  (transport/auth.py) and an inbound frame is opened before it is decoded: a frame without the secret is
  dropped as "auth", a replayed one as "replay". Without a secret the channel refuses to bind beyond loopback
  unless `insecure` (`check_bind`);
- an inbound frame that is multi-part, larger than `max_frame_bytes` or undecodable is counted by reason and
  dropped; it never stops the thread. ZeroMQ itself drops connections that send more than `2 * max_frame_bytes`,
  so no peer can make the channel hold an unbounded frame;
- memory is bounded: outbox capacity, peer count and per-socket high-water marks are all fixed at construction,
  and what ZeroMQ may queue per inbound connection is bounded in bytes (`ChannelConfig.recv_queue_bytes`: the
  receive high-water mark, in frames, is derived from it and the largest frame ZeroMQ accepts).
  The owner closes the socket of a peer whose session ended (`forget_peer`, never refused for a full outbox:
  it frees what the outbox guards), so the peer count follows the peers alive now.

Called by runtime/ agents (send, forget_peer, close) and by tests. It knows nothing of rooms: callbacks carry
messages back to the owner, which maps them to protocol events.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter, deque
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
REJECT_INBOX_FULL = "inbox full"

#: Reasons under which queued frames fail to leave (passed to `on_send_failure`).
SEND_PEER_BUSY = "peer queue full"
SEND_TOO_MANY_PEERS = "too many peers"
SEND_CLOSED = "channel closed"
SEND_BAD_ADDRESS = "bad peer address"


class OutboxFull(TransportError):
    """The channel's bounded outbox is full; the send did not happen and will not happen."""


class ChannelClosed(TransportError):
    """The channel is closed (or was never started); nothing can be sent through it."""


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Bounds of one channel. Every number caps memory or time; none grows from the wire."""

    max_frame_bytes: int = 1 << 20
    outbox_capacity: int = 4096
    max_peers: int = 256
    peer_send_hwm: int = 10_000
    #: Frames ZeroMQ may queue per inbound connection before the I/O thread reads them, at most; fewer where
    #: `recv_queue_bytes` says so.
    recv_hwm: int = 1000
    #: Bytes ZeroMQ may queue per inbound connection before the I/O thread reads them: the receive high-water mark
    #: is `recv_queue_bytes // max_message_bytes` frames (at least 1, at most `recv_hwm`), and ZeroMQ holds at most
    #: one more frame per connection while it reads it (docs/security.md, "Bounds").
    recv_queue_bytes: int = 64 * 2**20
    recv_batch: int = 256
    poll_interval_s: float = 0.1
    #: Rejected frames are logged at most once per this many seconds per reason (with the count since the last
    #: line), so a flood of bad frames cannot flood the log; every one is still counted.
    reject_log_interval_s: float = 1.0

    def __post_init__(self) -> None:
        names = ("max_frame_bytes", "outbox_capacity", "max_peers", "peer_send_hwm", "recv_hwm", "recv_queue_bytes",
                 "recv_batch")  # fmt: skip
        for name in names:
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


@dataclass(frozen=True, slots=True)
class _Outgoing(Generic[M]):
    peer: str
    message: M
    frame: bytes


class _Forget:
    """Outbox command: close the DEALER socket of one peer."""

    __slots__ = ("peer",)

    def __init__(self, peer: str) -> None:
        self.peer = peer


class ControlChannel(Generic[M, In]):
    """A bound ROUTER plus per-peer DEALERs, driven by one I/O thread.

    `encode` runs on the caller's thread inside `send`; `decode` and the callbacks run on the I/O thread and must
    not block. `decode` signals a bad frame by raising `ProtocolError`. `admit(nbytes)`, if given, is asked before
    each decoded frame is delivered: False drops it (counted as "inbox full"), so the owner bounds in bytes what
    waits for it.
    """

    def __init__(
        self,
        bind: str,
        *,
        encode: Callable[[M], bytes],
        decode: Callable[[bytes], In],
        deliver: Callable[[In], None],
        on_send_failure: Callable[[str, M, str], None],
        on_reject: Callable[[str], None] | None = None,
        admit: Callable[[int], bool] | None = None,
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
        self._on_send_failure = on_send_failure
        self._on_reject = on_reject
        self._admit = admit
        self.config = config or ChannelConfig()
        self._context = context or zmq.Context.instance()
        self.name = name
        self._lock = threading.Lock()
        self._outbox: deque[_Outgoing[M] | _Forget] = deque()
        self._wake_pending = False
        self._wake_recv, self._wake_send = socket.socketpair()
        self._wake_recv.setblocking(False)
        self._wake_send.setblocking(False)
        self._closed = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._address = ""
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{name}-io", daemon=True)
        self.rejected: Counter[str] = Counter()
        self.received = 0
        self.sent = 0
        self.open_peers = 0  # DEALER sockets open now (written by the I/O thread)
        self._reject_logged: dict[str, tuple[float, int]] = {}  # reason -> (last line, rejects since)

    # ---- caller side -------------------------------------------------------------------------------------

    def start(self) -> ControlChannel[M, In]:
        """Start the I/O thread; returns once the ROUTER is bound (raises `TransportError` if binding failed, and
        `ConfigError` for a bind beyond loopback without a secret or `insecure`)."""
        check_bind(self._bind, self._auth is not None, self._insecure, f"control channel {self.name}")
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise TransportError(f"{self.name}: cannot bind {self._bind}: {self._start_error}") from self._start_error
        return self

    @property
    def address(self) -> str:
        """The bound inbound address, with any wildcard port resolved; peers connect here."""
        return self._address

    def send(self, peer: str, message: M) -> None:
        """Queue `message` for `peer` without blocking; `OutboxFull` or `ChannelClosed` if it cannot be queued."""
        frame = self._encode(message)
        if len(frame) > self.config.max_frame_bytes:
            raise TransportError(
                f"{self.name}: frame of {len(frame)} bytes exceeds max_frame_bytes={self.config.max_frame_bytes}"
            )
        if self._auth is not None:
            frame = self._auth.seal(frame, peer.encode())
        self._enqueue(_Outgoing(peer, message, frame))

    def forget_peer(self, peer: str) -> None:
        """Close the outbound socket to `peer` (its session ended or moved); a later send reconnects. Frames
        still waiting in its socket are dropped (the peer is gone). A no-op once the channel is closed."""
        self._enqueue(_Forget(peer))

    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread and close every socket; frames still queued fail with `SEND_CLOSED`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise TransportError(f"{self.name}: I/O thread did not stop within {timeout}s")
        self._wake_send.close()
        self._wake_recv.close()

    def __enter__(self) -> ControlChannel[M, In]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, item: _Outgoing[M] | _Forget) -> None:
        with self._lock:
            if self._closed or not self._started.is_set():
                if isinstance(item, _Forget):
                    return  # closing closes every socket anyway
                raise ChannelClosed(f"{self.name}: channel is not running")
            if len(self._outbox) >= self.config.outbox_capacity and not isinstance(item, _Forget):
                raise OutboxFull(f"{self.name}: outbox full ({self.config.outbox_capacity} frames queued)")
            self._outbox.append(item)
            must_wake = not self._wake_pending
            self._wake_pending = True
        if must_wake:
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_send.send(b"\x01")
        except BlockingIOError:
            log.debug("%s: wake-up pipe already full; the I/O thread is awake", self.name)
        except OSError as exc:  # closed during shutdown
            log.debug("%s: wake-up after close: %s", self.name, exc)

    # ---- I/O thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            router.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
            router.bind(self._bind)
            self._address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        peers: dict[str, zmq.Socket[bytes]] = {}
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_recv.fileno(), zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(int(self.config.poll_interval_s * 1000)))
                if router in ready:
                    self._receive(router)
                items, closing = self._take_outbox()
                self._flush(items, peers)
                if closing:
                    break
        finally:
            for leftover in self._take_outbox()[0]:
                self._fail(leftover, SEND_CLOSED)
            for sock in peers.values():
                sock.close(linger=0)
            router.close(linger=0)

    def _take_outbox(self) -> tuple[list[_Outgoing[M] | _Forget], bool]:
        while True:
            try:
                if not self._wake_recv.recv(4096):
                    break
            except BlockingIOError:
                break
        with self._lock:
            items = list(self._outbox)
            self._outbox.clear()
            self._wake_pending = False
            return items, self._closed

    def _flush(self, items: list[_Outgoing[M] | _Forget], peers: dict[str, zmq.Socket[bytes]]) -> None:
        for item in items:
            if isinstance(item, _Forget):
                sock = peers.pop(item.peer, None)
                if sock is not None:
                    sock.close(linger=0)
                    self.open_peers = len(peers)
                continue
            sock = peers.get(item.peer)
            if sock is None:
                if len(peers) >= self.config.max_peers:
                    self._fail(item, SEND_TOO_MANY_PEERS)
                    continue
                try:
                    sock = self._connect(item.peer)
                except zmq.ZMQError as exc:
                    log.warning("%s: cannot connect to %r: %s", self.name, item.peer, exc)
                    self._fail(item, SEND_BAD_ADDRESS)
                    continue
                peers[item.peer] = sock
                self.open_peers = len(peers)
            try:
                sock.send(item.frame, zmq.NOBLOCK, copy=False)
                self.sent += 1
            except zmq.Again:
                self._fail(item, SEND_PEER_BUSY)

    def _connect(self, peer: str) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.peer_send_hwm)
        try:
            sock.connect(peer)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _fail(self, item: _Outgoing[M] | _Forget, reason: str) -> None:
        if isinstance(item, _Forget):
            return
        try:
            self._on_send_failure(item.peer, item.message, reason)
        except Exception:
            log.exception("%s: on_send_failure callback raised for peer %r", self.name, item.peer)

    def _receive(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(self.config.recv_batch):
            try:
                parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                self._reject(REJECT_MULTIPART)
                continue
            frame = parts[1]
            if len(frame) > self.config.max_frame_bytes + (0 if self._auth is None else OVERHEAD):
                self._reject(REJECT_OVERSIZE)
                continue
            if self._auth is not None:
                opened = self._auth.open(frame, self._address.encode())
                if isinstance(opened, str):
                    self._reject(opened)
                    continue
                frame = opened.payload
            try:
                message = self._decode(frame)
            except ProtocolError as exc:
                self._reject(REJECT_UNDECODABLE, f"{len(frame)} bytes: {exc}")
                continue
            if self._admit is not None and not self._admit(len(frame)):
                self._reject(REJECT_INBOX_FULL)
                continue
            self.received += 1
            try:
                self._deliver(message)
            except Exception:
                log.exception("%s: deliver callback raised; message dropped", self.name)

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
            try:
                self._on_reject(reason)
            except Exception:
                log.exception("%s: on_reject callback raised", self.name)
