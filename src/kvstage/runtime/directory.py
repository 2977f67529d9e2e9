"""Where each peer lives: a background resolver that keeps an agent's view of its peers' directory records fresh.

Owns `Resolver`: one thread with its own directory client (transport/directory.py: `kvstage bootstrap` or etcd)
that looks up, in one request per round, every peer id the agent has asked about, and posts a record to the agent
whenever a peer is new or its registration changed (a restart registers a newer session, often with a new control
address and new transport descriptors). It also owns the agent's own record: `start` registers it through the
resolver's client, every round keeps it alive (`renew`: the bootstrap lets a record go `RECORD_TTL_S` after its last
registration, etcd when its lease is not renewed) and registers it again if the directory lost it (a restarted
bootstrap starts empty), so the directory heals without restarting any rank; `close` withdraws it. On etcd a round
also runs as soon as the watch sees a record change.

Invariants: the reactor never blocks on the directory (lookups happen here); a failed lookup is logged when
the trouble starts (and when it ends) and retried next round, never fatal. The set of peers asked about is bounded
in count and time: at most `max_peers`; a peer still unresolved `unresolved_ttl_s` after it was last asked about is
dropped (a stranger that named itself in one frame and never registered); a newcomer over the cap evicts the
unresolved entry asked about longest ago, so strangers never lock a registered peer out; a resolved peer is kept
(its restarts are watched) until the agent `forget`s it when its session ends. Called by runtime/agent.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstage.errors import KVStageError
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.directory import Directory, open_directory

log = logging.getLogger(__name__)


class Resolver:
    """Resolves peer ids to `PeerRecord`s; `post(record)` is called on this thread for every new registration."""

    def __init__(
        self,
        bootstrap: str,
        post: Callable[[PeerRecord], None],
        *,
        refresh_s: float = 1.0,
        max_peers: int = 1024,
        unresolved_ttl_s: float = 30.0,
        secret: bytes | None = None,
        timeout_s: float = 5.0,
        name: str = "resolver",
    ) -> None:
        self._bootstrap = bootstrap
        self._wake = threading.Event()  # set by `want`, `close` and the directory's watch: a round runs now
        self._client: Directory = open_directory(
            bootstrap, timeout_s=timeout_s, secret=secret, follow=True, on_change=self._wake.set
        )
        self._failing = False  # the last round failed (logged once, until a round succeeds)
        self._post = post
        self._refresh_s = refresh_s
        self._max_peers = max_peers
        self._unresolved_ttl_s = unresolved_ttl_s
        self._lock = threading.Lock()
        self._wanted: dict[str, float] = {}  # peer id -> when it was last asked about (monotonic)
        self._seen: dict[str, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._own: PeerRecord | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{name}", daemon=True)

    def start(self, own: PeerRecord | None = None) -> Resolver:
        """Register `own` (this agent's record; a `KVStageError` if the directory refuses or does not answer), then
        start the thread that keeps it registered and resolves peers."""
        if own is not None:
            try:
                self._client.register(own)
            except BaseException:
                self._client.close()
                raise
        self._own = own
        self._thread.start()
        return self

    def want(self, peer_id: str) -> bool:
        """Ask for `peer_id` to be resolved (now and on every refresh); False if the cap is reached and every
        entry is resolved (none can be evicted)."""
        with self._lock:
            if peer_id not in self._wanted and len(self._wanted) >= self._max_peers:
                unresolved = [p for p in self._wanted if p not in self._seen]
                if not unresolved:
                    return False
                del self._wanted[min(unresolved, key=self._wanted.__getitem__)]
            self._wanted[peer_id] = time.monotonic()
            self._seen.pop(peer_id, None)
        self._wake.set()
        return True

    def wants(self, peer_id: str) -> bool:
        """Whether `peer_id` is asked about now (not evicted, forgotten or expired since)."""
        with self._lock:
            return peer_id in self._wanted

    def forget(self, peer_id: str) -> None:
        """Stop resolving `peer_id` (its session ended); a later `want` starts over."""
        with self._lock:
            self._wanted.pop(peer_id, None)
            self._seen.pop(peer_id, None)

    def wanted(self) -> int:
        """Peers asked about now (resolved or not)."""
        with self._lock:
            return len(self._wanted)

    def close(self) -> None:
        """Stop the thread, withdraw this agent's record (a failure is logged: the record then expires), close."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)
        own = self._own
        if own is not None:
            try:
                self._client.unregister(own.peer_id, own.session)
            except KVStageError as exc:
                log.warning("%s: could not withdraw the record of %s: %s", self._bootstrap, own.peer_id, exc)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._refresh_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._round()

    def _round(self) -> None:
        with self._lock:
            cutoff = time.monotonic() - self._unresolved_ttl_s
            for peer_id in [p for p, when in self._wanted.items() if when < cutoff and p not in self._seen]:
                del self._wanted[peer_id]
            wanted = sorted(self._wanted)
        own = self._own
        if own is not None:
            wanted.append(own.peer_id)
        if not wanted:
            return
        try:
            records = self._client.lookup(wanted)
            if own is not None and own.peer_id not in records:
                log.warning("%s lost the record of %s; registering it again", self._bootstrap, own.peer_id)
                self._client.register(own)
            self._client.renew()
        except KVStageError as exc:
            if not self._failing:
                log.warning("%s: lookups and registration fail; new peers wait, retrying every %.1fs: %s",
                            self._bootstrap, self._refresh_s, exc)  # fmt: skip
            self._failing = True
            return
        if self._failing:
            log.info("%s answers again", self._bootstrap)
            self._failing = False
        if own is not None:
            records.pop(own.peer_id, None)  # an agent never needs its own record posted back
        for peer_id, record in records.items():
            key = (record.session, record.control_address)
            with self._lock:
                if peer_id not in self._wanted or self._seen.get(peer_id) == key:
                    continue  # forgotten while the lookup ran, or nothing new
                self._seen[peer_id] = key
            self._post(record)
