"""Authenticated frames under a shared secret: HMAC-SHA256 (standard library) with a replay guard.

Owns `load_secret` (where the secret comes from), `check_bind` (refusing an open bind without a secret),
`FrameAuth` (sealing and opening one frame) and `ReplayWindow` (per-session sequence numbers with a window).

Wire form of a sealed frame:

    version (1 byte) | session (8 bytes, big-endian) | seq (8 bytes) | payload | tag (32 bytes)
    tag = HMAC-SHA256(secret, len(context) (2 bytes) | context | version | session | seq | payload)

`session` is drawn at random by each sender when it starts (a restart is a new session) and `seq` counts up from 1
per session. `context` binds a frame to where it is going, so a frame captured on its way to one agent is refused
by every other: for control frames it is the receiver's control address, for a bootstrap reply the tag of the
request it answers. Bootstrap requests are bound only to their purpose (`bootstrap.REQUEST_CONTEXT`), since
clients and the service may name its address differently. It is not sent; each side knows it.

Invariants:
- `open` checks the length, the version and the tag (in constant time, `hmac.compare_digest`) before anything
  else reads the payload, so a frame without the secret is dropped before it is decoded;
- a frame whose (session, seq) was already accepted, or is older than the newest accepted seq of its session by
  `window` or more, is refused as a replay; sessions are remembered up to `max_sessions` (least recently used
  forgotten first), so the guard's memory is bounded; a forgotten session's frames, and every frame after the
  receiver restarts, are accepted again (docs/security.md says what that allows and what bounds it);
- no cryptography of our own: HMAC-SHA256 from `hmac`/`hashlib`, randomness from `secrets`.

Called by transport/control.py (every control frame), transport/bootstrap.py (every request and reply) and
transport/etcd.py (every record, sealed under its key, read with `verify`); the command line and the vLLM connector
call `load_secret`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import secrets
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvstage.errors import ConfigError

log = logging.getLogger(__name__)

#: Environment variable holding the shared secret (used when no secret file is given).
SECRET_ENV: Final = "KVSTAGE_SECRET"
#: Shortest secret accepted, in bytes (HMAC-SHA256 keys shorter than this are guessable).
MIN_SECRET_BYTES: Final = 16
VERSION: Final = 1
_HEADER = struct.Struct(">BQQ")
TAG_BYTES: Final = hashlib.sha256().digest_size
#: Bytes a sealed frame adds to its payload.
OVERHEAD: Final = _HEADER.size + TAG_BYTES

#: Why `open` refused a frame (metric label values).
REJECT_AUTH: Final = "auth"
REJECT_REPLAY: Final = "replay"


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The shared secret: the contents of `secret_file` (surrounding whitespace stripped) if given, else the
    `KVSTAGE_SECRET` environment variable, else None (no authentication). `ConfigError` for an unreadable file or
    a secret shorter than `MIN_SECRET_BYTES`."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the secret file {secret_file}: {exc}") from exc
        source = f"secret file {secret_file}"
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].strip().encode()
        source = SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the secret from {source} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only: ipc://, inproc://, or tcp:// on a loopback
    address or "localhost"."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: may be reachable from elsewhere


def check_bind(endpoint: str, authenticated: bool, insecure: bool, what: str) -> None:
    """Refuse (`ConfigError`) to bind `endpoint` beyond loopback unless `authenticated` (a secret) or `insecure`
    (then logged as a warning)."""
    if authenticated or is_loopback_endpoint(endpoint):
        return
    if insecure:
        log.warning("%s listens on %s without a shared secret (insecure): anyone who reaches it can use it", what,
                    endpoint)  # fmt: skip
        return
    raise ConfigError(
        f"{what} would listen on {endpoint}, beyond this host, without a shared secret: set {SECRET_ENV} or "
        "give a secret file (--secret-file), or opt out with --insecure (anyone who reaches the port can "
        "then steer transfers)"
    )


class ReplayWindow:
    """Accepted sequence numbers per session: the newest one and a bitmap of the `window` before it."""

    def __init__(self, window: int = 4096, max_sessions: int = 4096) -> None:
        if window <= 0 or max_sessions <= 0:
            raise ValueError(f"window and max_sessions must be positive, got {window}, {max_sessions}")
        self.window = window
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[int, tuple[int, int]] = OrderedDict()  # session -> (newest seq, seen bitmap)
        self._lock = threading.Lock()

    def accept(self, session: int, seq: int) -> bool:
        """Record (session, seq) and return True, or False if it is a replay or too old."""
        with self._lock:
            newest, seen = self._sessions.get(session, (0, 0))
            if seq > newest:
                shift = seq - newest
                seen = ((seen << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
                newest = seq
            else:
                age = newest - seq
                if age >= self.window or seen >> age & 1:
                    return False
                seen |= 1 << age
            self._sessions[session] = (newest, seen)
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return True

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass(frozen=True, slots=True)
class Opened:
    """An authentic frame: its payload, the sender's session and seq, and its tag (which a reply is bound to)."""

    payload: bytes
    session: int
    seq: int
    tag: bytes


class FrameAuth:
    """Seals outgoing frames and opens incoming ones under one secret; one instance per socket owner."""

    def __init__(self, secret: bytes, *, window: int = 4096, max_sessions: int = 4096) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"a secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self.session = secrets.randbits(64)
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self.replays = ReplayWindow(window, max_sessions)

    def seal(self, payload: bytes, context: bytes) -> bytes:
        """`payload` sealed for the receiver identified by `context`."""
        with self._seq_lock:
            seq = next(self._seq)
        header = _HEADER.pack(VERSION, self.session, seq)
        return header + payload + self._tag(context, header, payload)

    def open(self, frame: bytes, context: bytes) -> Opened | str:
        """The authentic payload of `frame`, or why it was refused (`REJECT_AUTH` or `REJECT_REPLAY`)."""
        opened = self.verify(frame, context)
        if isinstance(opened, str):
            return opened
        if not self.replays.accept(opened.session, opened.seq):
            return REJECT_REPLAY
        return opened

    def verify(self, frame: bytes, context: bytes) -> Opened | str:
        """`open` without the replay guard, for a sealed value that is read again and again (a directory record on
        etcd, transport/etcd.py): the authentic payload of `frame`, or `REJECT_AUTH`."""
        if len(frame) < OVERHEAD or frame[0] != VERSION:
            return REJECT_AUTH
        header, payload, tag = frame[: _HEADER.size], frame[_HEADER.size : -TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(context, header, payload)):
            return REJECT_AUTH
        _, session, seq = _HEADER.unpack(header)
        return Opened(payload, session, seq, tag)

    def _tag(self, context: bytes, header: bytes, payload: bytes) -> bytes:
        mac = hmac.new(self._secret, len(context).to_bytes(2, "big"), hashlib.sha256)
        mac.update(context)
        mac.update(header)
        mac.update(payload)
        return mac.digest()
