"""Bootstrap and rendezvous: where ranks register who they are and how to reach them, and check compatibility.

Owns:
- `PeerRecord`: what one rank publishes — peer id, role, instance, TP size and rank, `KVLayout`, control-plane
  address, data backend, its transport descriptors (a decode rank publishes its staging ring's descriptor
  here, which is how writers learn where to write), its session (new and larger on every restart), and its
  lease-relevant timing (`TimingRecord`: the agents refuse a peer whose timing breaks the writer-lease rule,
  docs/protocol.md "Writer leases"), and the OpenAI URL of its instance's server when it publishes one (what
  `kvstage router --discover` follows);
- `InstanceEntry` / `instance_entries`: one instance summed up from its ranks' records (name, role, TP size, URL,
  layout, whether every rank is registered), what `BootstrapClient.list_instances` returns;
- `BootstrapServer`: a small ZeroMQ ROUTER service, one thread owning its socket, holding at most
  `max_records` records (a newer session replaces an older one; an older session never replaces a newer one),
  each for `record_ttl_s` after its last registration (agents register again every `REREGISTER_S`, so the record
  of a rank killed without unregistering goes within a minute);
- `BootstrapClient`: blocking request/reply with a timeout, for one thread (agent start-up and the agents'
  resolver threads, never an engine's scheduler thread); `renew` registers its records again every `REREGISTER_S`.
  transport/etcd.py's `EtcdDirectory` offers the same methods over etcd (transport/directory.py picks one by address);
- `check_compatible`: the rendezvous check that both sides agree on layers, head_dim, dtype and KV
  heads; a mismatch raises `CompatibilityError` naming both values.

Invariants: every request and record is decoded with msgspec under explicit bounds (frame size, string lengths,
descriptor sizes, record count); a bad request gets an error reply and is counted, never crashes the service.
With a shared secret (transport/auth.py) every request is sealed with HMAC-SHA256 and opened before it is decoded;
the server answers only authentic, fresh requests (others get a fixed unsigned refusal and are counted by reason
in `rejected`), so the memory descriptors it holds never reach a stranger, and it seals each reply bound to the
request it answers. Without a secret the server refuses to bind beyond loopback unless `insecure`.
Called by runtime/ agents, `kvstage bench`, and tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated, Final, Literal

import msgspec
import zmq
from msgspec import Meta

from kvstage.errors import CompatibilityError, ProtocolError, TransportError
from kvstage.layout import KVLayout
from kvstage.transport.auth import OVERHEAD, TAG_BYTES, FrameAuth, check_bind

log = logging.getLogger(__name__)

MAX_FRAME_BYTES: Final = 8 * 2**20
MAX_RECORDS: Final = 4096
MAX_DESCRIPTORS: Final = 16
MAX_DESCRIPTOR_BYTES: Final = 2**20 + 4096
MAX_URL_CHARS: Final = 512
#: What a bootstrap request's tag is bound to (transport/auth.py); a reply is bound to its request's tag.
REQUEST_CONTEXT: Final = b"kvstage bootstrap request"
#: How long a record lives after its last registration, and how often a live agent registers again.
RECORD_TTL_S: Final = 60.0
REREGISTER_S: Final = 10.0
#: The reason counted for a request that is not decodable.
REJECT_BAD_REQUEST: Final = "bad request"

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Role = Literal["prefill", "decode"]


class LayoutRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`KVLayout` on the wire."""

    num_layers: Annotated[int, Meta(ge=1, le=4096)]
    num_kv_heads: Annotated[int, Meta(ge=1, le=4096)]
    head_dim: Annotated[int, Meta(ge=1, le=65536)]
    dtype: Annotated[str, Meta(max_length=32)]
    page_size: Annotated[int, Meta(ge=1, le=2**20)]

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutRecord:
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.page_size)

    def to_layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.page_size)


#: The largest timing value a record may carry, in seconds (a day): anything larger is a mistake, and no value is
#: infinite or NaN.
MAX_TIMING_S: Final = 86400.0
Seconds = Annotated[float, Meta(gt=0, le=MAX_TIMING_S)]


class TimingRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The lease-relevant part of a rank's `Timing` on the wire (`lease_s` and `max_write_s` as derived)."""

    dead_after_s: Seconds
    lease_s: Seconds
    max_write_s: Seconds
    clock_drift: Annotated[float, Meta(ge=0, lt=0.5)]


class PeerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's published identity, layout, addresses and transport descriptors."""

    peer_id: Name
    role: Role
    instance: Name
    tp_size: Annotated[int, Meta(ge=1, le=1024)]
    rank: Annotated[int, Meta(ge=0, lt=1024)]
    layout: LayoutRecord
    control_address: Name
    backend: Annotated[str, Meta(max_length=32)]
    session: Annotated[int, Meta(ge=0)]
    descriptors: Annotated[
        dict[Annotated[str, Meta(max_length=64)], Annotated[bytes, Meta(max_length=MAX_DESCRIPTOR_BYTES)]],
        Meta(max_length=MAX_DESCRIPTORS),
    ] = {}
    chunk_tokens: Annotated[int, Meta(ge=0)] = 0
    #: Agents always publish it; a record without it (a tool's, a test's) is refused by `runtime.config.check_peer`.
    timing: TimingRecord | None = None
    #: The instance's OpenAI base URL (what `kvstage router --discover` sends requests to); "" when not published.
    url: Annotated[str, Meta(max_length=MAX_URL_CHARS)] = ""


class InstanceEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One instance as `list_instances` sums it up from its ranks' records: who it is, where its OpenAI server is,
    and whether every rank of it is registered (`complete`)."""

    instance: Name
    role: Role
    tp_size: Annotated[int, Meta(ge=1, le=1024)]
    url: Annotated[str, Meta(max_length=MAX_URL_CHARS)]
    layout: LayoutRecord
    complete: bool


def instance_entries(records: list[PeerRecord]) -> list[InstanceEntry]:
    """The instances among `records`, sorted by (role, name). An instance is `complete` when ranks 0..tp_size-1
    are registered, all under one TP size; its URL, TP size and layout are rank 0's (else the lowest rank's)."""
    groups: dict[tuple[str, str], list[PeerRecord]] = {}
    for record in records:
        groups.setdefault((record.role, record.instance), []).append(record)
    entries = []
    for (_role, _name), group in sorted(groups.items()):
        group.sort(key=lambda r: r.rank)
        first = group[0]
        complete = {r.tp_size for r in group} == {first.tp_size} and [r.rank for r in group] == list(
            range(first.tp_size)
        )
        entries.append(InstanceEntry(first.instance, first.role, first.tp_size, first.url, first.layout, complete))
    return entries


class _Register(msgspec.Struct, frozen=True, tag="register"):
    record: PeerRecord


class _Unregister(msgspec.Struct, frozen=True, tag="unregister"):
    peer_id: Name
    session: Annotated[int, Meta(ge=0)]


class _Lookup(msgspec.Struct, frozen=True, tag="lookup"):
    peer_ids: Annotated[list[Name], Meta(max_length=MAX_RECORDS)]


class _LookupInstance(msgspec.Struct, frozen=True, tag="lookup_instance"):
    instance: Name
    role: Role


class _ListInstances(msgspec.Struct, frozen=True, tag="list_instances"):
    pass


_Request = _Register | _Unregister | _Lookup | _LookupInstance | _ListInstances


class _Reply(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    records: list[PeerRecord] = []
    instances: Annotated[list[InstanceEntry], Meta(max_length=MAX_RECORDS)] = []


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(_Request)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)
_REFUSED = _encoder.encode(_Reply(False, "unauthenticated request: kvstage bootstrap needs the shared secret"))


def check_compatible(mine: KVLayout, theirs: PeerRecord, *, me: str = "this rank") -> None:
    """`CompatibilityError` unless `theirs` uses the same layers, head_dim, dtype and KV heads. The page sizes
    may differ: each side addresses its own pages, and the chunk grid is decode's (docs/layout.md)."""
    other = theirs.layout
    for field in ("num_layers", "head_dim", "dtype", "num_kv_heads"):
        a, b = getattr(mine, field), getattr(other, field)
        if a != b:
            raise CompatibilityError(
                f"{field} mismatch: {me} has {field}={a!r} but {theirs.role} rank {theirs.peer_id!r} "
                f"({theirs.instance}, rank {theirs.rank}/{theirs.tp_size}) has {field}={b!r}; "
                "both sides of a handoff must serve the same model with the same KV cache settings"
            )


def wait_for_instance(
    lookup_instance: Callable[[str, Role], list[PeerRecord]], instance: str, role: Role, tp_size: int, timeout_s: float
) -> list[PeerRecord]:
    """Poll `lookup_instance` until all `tp_size` ranks of `instance` are registered; `TransportError` after
    `timeout_s` naming the ranks seen. Shared by every directory client."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = lookup_instance(instance, role)
        if len(records) == tp_size and [r.rank for r in records] == list(range(tp_size)):
            return records
        if time.monotonic() > deadline:
            raise TransportError(
                f"bootstrap: {role} instance {instance!r} has ranks {[r.rank for r in records]} "
                f"registered after {timeout_s}s, expected {tp_size}"
            )
        time.sleep(0.05)


class BootstrapServer:
    """Registry of `PeerRecord`s behind one ROUTER socket, owned by one thread."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        max_records: int = MAX_RECORDS,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        secret: bytes | None = None,
        insecure: bool = False,
        record_ttl_s: float = RECORD_TTL_S,
    ) -> None:
        self._bind = bind
        self._record_ttl_s = record_ttl_s
        self._refreshed: dict[str, float] = {}  # peer id -> when its record was last registered (monotonic)
        self._auth = None if secret is None else FrameAuth(secret)
        self._insecure = insecure
        self._max_records = max_records
        self._context = context or zmq.Context.instance()
        self._records: dict[str, PeerRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: zmq.ZMQError | None = None
        self._address = ""
        self.rejected: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="kvstage-bootstrap", daemon=True)

    @property
    def address(self) -> str:
        return self._address

    def start(self) -> BootstrapServer:
        """Bind and serve; `TransportError` if binding failed, `ConfigError` for an open bind without a secret."""
        check_bind(self._bind, self._auth is not None, self._insecure, "kvstage bootstrap")
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise TransportError(f"bootstrap: cannot bind {self._bind}: {self._start_error}")
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def records(self) -> list[PeerRecord]:
        with self._lock:
            return list(self._records.values())

    def _run(self) -> None:
        try:
            sock = self._context.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + OVERHEAD)
            sock.bind(self._bind)
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100, zmq.POLLIN):
                    continue
                parts = sock.recv_multipart(zmq.NOBLOCK)
                if len(parts) != 3 or parts[1] != b"":
                    self.rejected["multipart"] += 1
                    continue
                try:
                    sock.send_multipart([parts[0], b"", self._answer(parts[2])], zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("bootstrap: reply dropped, client %r is not reading", parts[0])
        finally:
            sock.close(linger=0)

    def _answer(self, frame: bytes) -> bytes:
        """The reply frame to one request frame: opened first when there is a secret, sealed to the request."""
        if self._auth is None:
            return _encoder.encode(self._handle(frame))
        opened = self._auth.open(frame, REQUEST_CONTEXT)
        if isinstance(opened, str):
            self.rejected[opened] += 1
            return _REFUSED
        return self._auth.seal(_encoder.encode(self._handle(opened.payload)), opened.tag)

    def _handle(self, frame: bytes) -> _Reply:
        try:
            request = _request_decoder.decode(frame)
        except msgspec.MsgspecError as exc:
            self.rejected[REJECT_BAD_REQUEST] += 1
            return _Reply(False, f"bad request: {exc}")
        with self._lock:
            self._expire()
            if isinstance(request, _Register):
                return self._register(request.record)
            if isinstance(request, _Unregister):
                held = self._records.get(request.peer_id)
                if held is not None and held.session == request.session:
                    del self._records[request.peer_id], self._refreshed[request.peer_id]
                return _Reply(True)
            if isinstance(request, _Lookup):
                return _Reply(True, records=[self._records[p] for p in request.peer_ids if p in self._records])
            if isinstance(request, _ListInstances):
                return _Reply(True, instances=instance_entries(list(self._records.values())))
            found = [r for r in self._records.values() if r.instance == request.instance and r.role == request.role]
            return _Reply(True, records=sorted(found, key=lambda r: r.rank))

    def _register(self, record: PeerRecord) -> _Reply:
        held = self._records.get(record.peer_id)
        if held is not None and held.session > record.session:
            return _Reply(False, f"peer {record.peer_id!r} is registered with a newer session {held.session}")
        if held is None and len(self._records) >= self._max_records:
            return _Reply(False, f"bootstrap is full ({self._max_records} records)")
        self._records[record.peer_id] = record
        self._refreshed[record.peer_id] = time.monotonic()
        return _Reply(True)

    def _expire(self) -> None:
        """Drop the records not registered again within `record_ttl_s` (their ranks died without unregistering)."""
        cutoff = time.monotonic() - self._record_ttl_s
        for peer_id in [p for p, when in self._refreshed.items() if when < cutoff]:
            del self._records[peer_id], self._refreshed[peer_id]


class BootstrapClient:
    """Blocking client of a `BootstrapServer`, for one thread; every call times out after `timeout_s`."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._auth = None if secret is None else FrameAuth(secret)
        self._context = context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._registered: dict[str, tuple[PeerRecord, float]] = {}  # peer id -> (record, when registered)

    def register(self, record: PeerRecord) -> None:
        self._call(_Register(record))
        self._registered[record.peer_id] = (record, time.monotonic())

    def renew(self) -> None:
        """Register again each record registered through this client more than `REREGISTER_S` ago (the service
        lets a record go `RECORD_TTL_S` after its last registration)."""
        due = [record for record, at in self._registered.values() if time.monotonic() - at > REREGISTER_S]
        for record in due:
            self.register(record)

    def unregister(self, peer_id: str, session: int) -> None:
        self._call(_Unregister(peer_id, session))
        self._registered.pop(peer_id, None)

    def lookup(self, peer_ids: list[str]) -> dict[str, PeerRecord]:
        """Records of the registered peers among `peer_ids` (absent ones are missing from the result)."""
        return {r.peer_id: r for r in self._call(_Lookup(peer_ids)).records}

    def lookup_instance(self, instance: str, role: Role) -> list[PeerRecord]:
        """Every registered rank of `instance` in `role`, by rank."""
        return self._call(_LookupInstance(instance, role)).records

    def list_instances(self) -> list[InstanceEntry]:
        """Every instance with a registered rank, summed up (`InstanceEntry`), sorted by (role, name)."""
        return self._call(_ListInstances()).instances

    def wait_for_instance(self, instance: str, role: Role, tp_size: int, timeout_s: float) -> list[PeerRecord]:
        """Poll until all `tp_size` ranks of `instance` are registered; `TransportError` after `timeout_s`."""
        return wait_for_instance(self.lookup_instance, instance, role, tp_size, timeout_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _call(self, request: _Request) -> _Reply:
        if self._sock is None:
            self._sock = self._context.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + OVERHEAD)
            self._sock.connect(self.address)
        frame = _encoder.encode(request)
        if self._auth is not None:
            frame = self._auth.seal(frame, REQUEST_CONTEXT)
        self._sock.send(frame)
        if not self._sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            self.close()  # a REQ socket that missed its reply cannot send again; start over next call
            raise TransportError(f"bootstrap {self.address} did not answer within {self.timeout_s}s")
        answer = self._sock.recv()
        if self._auth is not None:
            opened = self._auth.open(answer, frame[-TAG_BYTES:])  # bound to this request's tag
            if isinstance(opened, str):
                self.close()
                raise TransportError(
                    f"bootstrap {self.address} answered without authentication ({opened}): is the shared secret the "
                    "same on both sides?"
                )
            answer = opened.payload
        try:
            reply = _reply_decoder.decode(answer)
        except msgspec.MsgspecError as exc:
            self.close()
            raise ProtocolError(f"bootstrap {self.address} sent a bad reply: {exc}") from exc
        if not reply.ok:
            raise TransportError(f"bootstrap {self.address}: {reply.error}")
        return reply
