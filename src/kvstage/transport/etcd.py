"""The directory on etcd: peer records under etcd leases, followed through a watch (`bootstrap: etcd://HOST:PORT`).

Owns:
- `EtcdAddress`: `etcd://HOST:PORT[/NAMESPACE][?lease_s=N]` parsed; the records live under `/NAMESPACE/peers/`
  (default namespace `kvstage`), one key per peer id;
- `EtcdDirectory`: the methods of `BootstrapClient` (register, renew, unregister, lookup, lookup_instance,
  wait_for_instance, close) over etcd's v3 API through its JSON gateway (the etcd3gw client for requests; the watch
  stream is read here, see `_Watch`), plus `records()` (every record, for discovery).

How records live: `register` puts the record under this client's lease (granted on first use, `lease_s` long) with
a compare-and-swap on the key's revision, so an older session never replaces a newer one; `renew` keeps the lease
alive (every third of its TTL) and, if etcd let it expire, takes a new one and puts every record again. A record
disappears `lease_s` after its owner stops renewing (killed, or cut off from etcd); `unregister` deletes it at once
(only while it still holds that session). A client that only looks up never writes.

How lookups work: without `follow`, each lookup reads the whole prefix (one range request). With `follow` (the
agents' resolver), the first lookup reads the prefix into a mirror and starts a watch from the revision read; the
watch applies every put and delete to the mirror and calls `on_change`, and lookups answer from the mirror. When
the watch breaks (etcd stopped, compacted, unreachable), the mirror is stale: the next lookup reads the prefix
again, and while etcd does not answer every lookup raises `TransportError` (its callers log it and retry). Rooms
that run need no lookup, so they are unaffected.

Invariants: with a shared secret every value is sealed (HMAC-SHA256, transport/auth.py) bound to its key, and a
value that does not open under the secret, does not decode within `PeerRecord`'s bounds, or names another peer id
than its key is refused and counted in `rejected` by reason, never used. The mirror holds at most `MAX_RECORDS`
records; a range reads at most that many; a watch message is at most `MAX_WATCH_LINE` bytes, a longer one breaks
the watch (counted) and the mirror is read again. One client is for one thread; its watch runs on a thread of its
own that `close` stops. Called through transport/directory.py by runtime/ (agents, resolver) and router/.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar
from urllib.parse import parse_qs, urlsplit

import etcd3gw
import msgspec
from etcd3gw.exceptions import Etcd3Exception

from kvstage.errors import ConfigError, ProtocolError, TransportError
from kvstage.transport.auth import FrameAuth
from kvstage.transport.bootstrap import (
    MAX_RECORDS,
    InstanceEntry,
    PeerRecord,
    Role,
    instance_entries,
    wait_for_instance,
)

log = logging.getLogger(__name__)

SCHEME: Final = "etcd"  # transport/directory.py sends addresses of this scheme here (ETCD_SCHEME)
DEFAULT_NAMESPACE: Final = "kvstage"
#: How long a record outlives its owner's last lease renewal, by default.
DEFAULT_LEASE_S: Final = 15
#: What a record's seal is bound to, followed by its key.
RECORD_CONTEXT: Final = b"kvstage directory record "
#: The longest watch message read (etcd's default request limit is 1.5 MiB; a put event carries one value).
MAX_WATCH_LINE: Final = 16 * 2**20
#: The reasons a record is refused (`EtcdDirectory.rejected`).
REJECT_AUTH: Final = "auth"
REJECT_BAD_RECORD: Final = "bad record"
REJECT_WRONG_KEY: Final = "wrong key"
REJECT_FULL: Final = "full"
#: Compare-and-swap attempts before `register` gives up on a key other writers keep changing.
CAS_ATTEMPTS: Final = 8


@dataclass(frozen=True)
class EtcdAddress:
    host: str
    port: int
    namespace: str = DEFAULT_NAMESPACE
    lease_s: int = DEFAULT_LEASE_S

    @classmethod
    def parse(cls, address: str) -> EtcdAddress:
        """`etcd://HOST:PORT[/NAMESPACE][?lease_s=N]`; `ConfigError` naming what is wrong."""
        parts = urlsplit(address)
        query = parse_qs(parts.query)
        try:
            port = parts.port
            lease_s = int(query.pop("lease_s", [str(DEFAULT_LEASE_S)])[-1])
        except ValueError as exc:
            raise ConfigError(f"bad etcd address {address!r}: {exc}") from exc
        if parts.scheme != SCHEME or not parts.hostname or port is None or query or lease_s < 1:
            raise ConfigError(f"expected etcd://HOST:PORT[/NAMESPACE][?lease_s=N (>= 1)], got {address!r}")
        return cls(parts.hostname, port, parts.path.strip("/") or DEFAULT_NAMESPACE, lease_s)

    @property
    def prefix(self) -> bytes:
        return f"/{self.namespace}/peers/".encode()

    def key(self, peer_id: str) -> bytes:
        return self.prefix + peer_id.encode()

    def __str__(self) -> str:
        return f"etcd {self.host}:{self.port}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Header(msgspec.Struct):
    revision: int = 0


class _KV(msgspec.Struct):
    key: bytes  # base64 on the wire, decoded by msgspec
    value: bytes = b""
    mod_revision: int = 0


class _RangeReply(msgspec.Struct):
    header: _Header
    kvs: list[_KV] = []
    more: bool = False


class _TxnReply(msgspec.Struct):
    header: _Header
    succeeded: bool = False


class _LeaseGrant(msgspec.Struct):
    ID: int
    TTL: int = 0


class _KeepAliveResult(msgspec.Struct):
    TTL: int = -1  # absent when the lease has expired


class _KeepAlive(msgspec.Struct):
    result: _KeepAliveResult = msgspec.field(default_factory=_KeepAliveResult)


class _Event(msgspec.Struct):
    kv: _KV
    type: Literal["PUT", "DELETE"] = "PUT"


class _WatchResult(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    events: list[_Event] = []
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""


class _WatchMessage(msgspec.Struct):
    result: _WatchResult | None = None
    error: dict[str, Any] | None = None


_Reply = TypeVar("_Reply", _RangeReply, _TxnReply, _LeaseGrant, _KeepAlive)

_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(PeerRecord)
_watch_decoder = msgspec.json.Decoder(_WatchMessage, strict=False)  # the gateway writes int64 as strings


class _Seal:
    """Records to values and back: sealed under the secret and bound to their key, or plain without one."""

    def __init__(self, secret: bytes | None) -> None:
        self._auth = None if secret is None else FrameAuth(secret)

    def seal(self, key: bytes, record: PeerRecord) -> bytes:
        value = _record_encoder.encode(record)
        return value if self._auth is None else self._auth.seal(value, RECORD_CONTEXT + key)

    def open(self, key: bytes, value: bytes, peer_id: str) -> PeerRecord | str:
        """The record under `key`, or the reason it is refused."""
        if self._auth is not None:
            opened = self._auth.verify(value, RECORD_CONTEXT + key)
            if isinstance(opened, str):
                return REJECT_AUTH
            value = opened.payload
        try:
            record = _record_decoder.decode(value)
        except msgspec.MsgspecError:
            return REJECT_BAD_RECORD
        return record if record.peer_id == peer_id else REJECT_WRONG_KEY


class EtcdDirectory:
    """`BootstrapClient`'s methods over etcd; for one thread (its watch, with `follow`, runs on its own)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        secret: bytes | None = None,
        follow: bool = False,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self.where = EtcdAddress.parse(address)
        self.timeout_s = timeout_s
        self._seal = _Seal(secret)
        self._client = etcd3gw.Etcd3Client(self.where.host, self.where.port, timeout=timeout_s, api_path="/v3/")
        self._follow = follow
        self._on_change = on_change
        self.rejected: Counter[str] = Counter()
        self._lock = threading.Lock()  # the mirror, shared with the watch thread
        self._mirror: dict[str, PeerRecord] = {}
        self._watch: _Watch | None = None
        self._lease: int | None = None
        self._renewed_at = 0.0
        self._mine: dict[str, PeerRecord] = {}  # records registered through this client, put again on a new lease

    # ---- writing -----------------------------------------------------------------------------------------

    def register(self, record: PeerRecord) -> None:
        """Put `record` under this client's lease; `TransportError` if etcd holds a newer session of the peer."""
        lease = self._lease if self._lease is not None else self._grant()
        key = self.where.key(record.peer_id)
        for _ in range(CAS_ATTEMPTS):
            held, mod_revision = self._held(key, record.peer_id)
            if held is not None and held.session > record.session:
                raise TransportError(f"{self.where}: peer {record.peer_id!r} is registered with a newer session")
            put = {"request_put": {"key": _b64(key), "value": _b64(self._seal.seal(key, record)), "lease": str(lease)}}
            if self._swap(key, mod_revision, put):
                self._mine[record.peer_id] = record
                with self._lock:
                    self._mirror[record.peer_id] = record  # the watch brings the same put again
                return
        raise TransportError(f"{self.where}: the record of {record.peer_id!r} kept changing; not registered")

    def renew(self) -> None:
        """Keep this client's lease alive (at most every third of its TTL); if etcd let it expire, take a new one
        and register every record of this client again. `TransportError` if etcd does not answer."""
        if self._lease is None or not self._mine or time.monotonic() - self._renewed_at < self.where.lease_s / 3:
            return
        if self._call("/lease/keepalive", {"ID": str(self._lease)}, _KeepAlive).result.TTL > 0:
            self._renewed_at = time.monotonic()
            return
        log.warning("%s: lease %x expired; registering %s again", self.where, self._lease, sorted(self._mine))
        self._lease = None
        for record in list(self._mine.values()):
            self.register(record)

    def unregister(self, peer_id: str, session: int) -> None:
        """Delete the record of `peer_id` if it still holds `session`."""
        self._mine.pop(peer_id, None)
        key = self.where.key(peer_id)
        held, mod_revision = self._held(key, peer_id)
        if held is not None and held.session == session:
            self._swap(key, mod_revision, {"request_delete_range": {"key": _b64(key)}})

    # ---- reading -----------------------------------------------------------------------------------------

    def lookup(self, peer_ids: list[str]) -> dict[str, PeerRecord]:
        """Records of the registered peers among `peer_ids` (absent ones are missing from the result)."""
        records = self._current()
        return {p: records[p] for p in peer_ids if p in records}

    def lookup_instance(self, instance: str, role: Role) -> list[PeerRecord]:
        """Every registered rank of `instance` in `role`, by rank."""
        found = [r for r in self._current().values() if r.instance == instance and r.role == role]
        return sorted(found, key=lambda r: r.rank)

    def wait_for_instance(self, instance: str, role: Role, tp_size: int, timeout_s: float) -> list[PeerRecord]:
        """Poll until all `tp_size` ranks of `instance` are registered; `TransportError` after `timeout_s`."""
        return wait_for_instance(self.lookup_instance, instance, role, tp_size, timeout_s)

    def records(self) -> list[PeerRecord]:
        """Every registered record, by peer id."""
        return sorted(self._current().values(), key=lambda r: r.peer_id)

    def list_instances(self) -> list[InstanceEntry]:
        """Every instance with a registered rank, summed up (`InstanceEntry`), sorted by (role, name), as
        `BootstrapClient.list_instances` gives them (what `kvstage router --discover` follows)."""
        return instance_entries(self.records())

    def close(self) -> None:
        """Stop the watch. The lease is left to expire: records registered here and not withdrawn outlive the
        client by `lease_s`."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._client.session.close()

    # ---- internals ---------------------------------------------------------------------------------------

    def _current(self) -> dict[str, PeerRecord]:
        """The records now: the mirror while the watch follows etcd, else read from etcd (and, with `follow`, the
        watch started again from there)."""
        if self._watch is not None and self._watch.alive():
            with self._lock:
                return dict(self._mirror)
        if self._watch is not None:
            self._watch.stop()  # ended: its connection is closed here
            self._watch = None
        revision, records = self._read_prefix()
        if not self._follow:
            return records
        with self._lock:
            self._mirror = dict(records)
        self._watch = _Watch(self.where, self.timeout_s, revision + 1, self._apply)
        return records

    def _read_prefix(self) -> tuple[int, dict[str, PeerRecord]]:
        prefix = self.where.prefix
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)), "limit": MAX_RECORDS}
        reply = self._call("/kv/range", body, _RangeReply)
        if reply.more:
            log.warning("%s: more than %d records under %r; reading the first ones", self.where, MAX_RECORDS, prefix)
        records: dict[str, PeerRecord] = {}
        for kv in reply.kvs:
            record = self._open(kv.key, kv.value)
            if record is not None:
                records[record.peer_id] = record
        return reply.header.revision, records

    def _open(self, key: bytes, value: bytes) -> PeerRecord | None:
        """The record under `key`, or None (refused: counted and logged)."""
        peer_id = key[len(self.where.prefix) :].decode(errors="replace")
        opened = self._seal.open(key, value, peer_id)
        if isinstance(opened, str):
            self.rejected[opened] += 1
            log.warning("%s: refused the record under %r (%s)", self.where, key, opened)
            return None
        return opened

    def _apply(self, events: list[_Event]) -> None:
        """The watch thread: apply puts and deletes to the mirror, then tell `on_change`."""
        with self._lock:
            for event in events:
                key = event.kv.key
                peer_id = key[len(self.where.prefix) :].decode(errors="replace")
                if event.type == "DELETE":
                    self._mirror.pop(peer_id, None)
                    continue
                record = self._open(key, event.kv.value)
                if record is None:
                    self._mirror.pop(peer_id, None)
                elif peer_id in self._mirror or len(self._mirror) < MAX_RECORDS:
                    self._mirror[peer_id] = record
                else:
                    self.rejected[REJECT_FULL] += 1
        if events and self._on_change is not None:
            self._on_change()

    def _held(self, key: bytes, peer_id: str) -> tuple[PeerRecord | None, int]:
        """The record under `key` now (None if absent or refused) and the key's mod revision (0: absent)."""
        reply = self._call("/kv/range", {"key": _b64(key)}, _RangeReply)
        if not reply.kvs:
            return None, 0
        kv = reply.kvs[0]
        opened = self._seal.open(key, kv.value, peer_id)
        return (None if isinstance(opened, str) else opened), kv.mod_revision

    def _swap(self, key: bytes, mod_revision: int, request: dict[str, Any]) -> bool:
        """Run `request` if `key` is still at `mod_revision` (0: still absent); whether it ran."""
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}
        return self._call("/kv/txn", {"compare": [compare], "success": [request]}, _TxnReply).succeeded

    def _grant(self) -> int:
        self._lease = self._call("/lease/grant", {"TTL": self.where.lease_s, "ID": 0}, _LeaseGrant).ID
        self._renewed_at = time.monotonic()
        return self._lease

    def _call(self, path: str, body: dict[str, Any], reply_type: type[_Reply]) -> _Reply:
        """POST `body` to the gateway's `path`; its reply as `reply_type`. `TransportError` if etcd does not answer
        (or answers an error), `ProtocolError` for a reply that is not what the API says."""
        try:
            reply = self._client.post(self._client.get_url(path), json=body)
        except Etcd3Exception as exc:
            raise TransportError(f"{self.where} did not answer {path}: {exc.detail_text or exc!r}") from exc
        except ValueError as exc:  # a body that is not JSON
            raise ProtocolError(f"{self.where} answered {path} with something else than JSON: {exc}") from exc
        try:
            return msgspec.convert(reply, reply_type, strict=False)  # the gateway writes int64 as strings
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"{self.where} answered {path} unexpectedly: {exc}") from exc


class _Watch:
    """One watch stream over the directory's prefix from `revision`, on a thread of its own, until it breaks or is
    stopped; `apply` gets the events of each message. A broken watch is not restarted here: the directory's next
    lookup reads the prefix and starts another.

    etcd3gw has a watcher, but a stream that breaks ends its thread silently and a message is read whole whatever its
    size; so the stream is read here, over `http.client`, one bounded line at a time, with TCP keepalive on the
    socket so a peer that vanished without closing is noticed."""

    def __init__(
        self, where: EtcdAddress, timeout_s: float, revision: int, apply: Callable[[list[_Event]], None]
    ) -> None:
        self._where = where
        self._revision = revision
        self._apply = apply
        self._stopped = threading.Event()
        self._ended = threading.Event()
        self._conn = http.client.HTTPConnection(where.host, where.port, timeout_s)
        self._thread = threading.Thread(target=self._run, name="kvstage-etcd-watch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return not self._ended.is_set()

    def stop(self) -> None:
        self._stopped.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread out of its blocking read
            except OSError as exc:
                log.debug("etcd watch: socket already closed: %s", exc)
        self._thread.join(5)
        self._conn.close()

    def _run(self) -> None:
        try:
            self._stream()
            reason = "the stream ended"
        except (OSError, ValueError, http.client.HTTPException, msgspec.MsgspecError, TransportError) as exc:
            reason = str(exc) or type(exc).__name__
        finally:
            self._ended.set()
        if not self._stopped.is_set():
            log.warning("%s: watch lost (%s); lookups read etcd again, and wait for it while it is away", self._where,
                        reason)  # fmt: skip

    def _stream(self) -> None:
        prefix = self._where.prefix
        create = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)), "start_revision": str(self._revision)}
        self._conn.request("POST", "/v3/watch", json.dumps({"create_request": create}))
        response = self._conn.getresponse()
        if response.status != 200:
            raise TransportError(f"watch refused: HTTP {response.status}")
        self._keepalive()
        while not self._stopped.is_set():
            line = response.readline(MAX_WATCH_LINE + 1)
            if not line:
                return
            if len(line) > MAX_WATCH_LINE:
                raise TransportError(f"a watch message over {MAX_WATCH_LINE} bytes")
            if line.strip():
                self._handle(_watch_decoder.decode(line))

    def _handle(self, message: _WatchMessage) -> None:
        result = message.result
        if result is None:
            raise TransportError(f"watch error: {message.error}")
        if result.canceled or result.compact_revision:
            raise TransportError(f"watch cancelled ({result.cancel_reason or 'compacted'})")
        self._apply(result.events)

    def _keepalive(self) -> None:
        """TCP keepalive on the stream: an etcd that vanished without closing is noticed within about 11 s."""
        sock = self._conn.sock
        sock.settimeout(None)  # the stream waits for events as long as it takes
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
