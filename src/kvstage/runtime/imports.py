"""What a prefill rank imported of its decode peers' memory: `PeerImports`.

Owns, per decode peer, the ring and the KV pool or engine KV imported from the record of one session (kept with
that session, so that a write goes only into memory of the session that granted it), the imports under way, and
when a peer whose import failed, or was dropped to reconnect, is imported again (at most every IMPORT_RETRY_S).

Invariants: the transport's imports run on the importer thread only (NIXL connects to the peer inside one, seen
blocking 11 s, and the reactor must go on answering its peers meanwhile); their results are applied on the
reactor, handed back through `post` as `AgentTask`s; a result for a session no longer wanted (the peer fenced
or replaced meanwhile) is forgotten, never installed. Everything but the importer's job runs on the reactor.
Called by `PrefillAgent` (prefill.py), which decides when to import, drop and reconnect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from kvstage.dataplane import PoolGeometry
from kvstage.dataplane.engine_blocks import EngineBlocks
from kvstage.errors import KVStageError
from kvstage.layout import heads_of_rank
from kvstage.protocol import WriteDirect, WriteRegion
from kvstage.runtime.agent import AgentTask, published_blocks
from kvstage.runtime.metrics import AgentMetrics
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.data import DataTransport, RemoteRegion, decode_descriptor

log = logging.getLogger(__name__)

#: How often a decode peer whose descriptors could not be imported (or were dropped to reconnect) is tried again,
#: when a write to it is issued.
IMPORT_RETRY_S = 1.0


class PeerImports:
    """The decode peers' rings and pools this prefill rank can write, keyed by peer, each with its session."""

    def __init__(
        self, transport: DataTransport, post: Callable[[AgentTask], None], metrics: AgentMetrics, owner: str
    ) -> None:
        self._transport, self._post, self._metrics, self._owner = transport, post, metrics, owner
        self._rings: dict[str, tuple[int, RemoteRegion]] = {}
        self._pools: dict[str, tuple[int, RemoteRegion, PoolGeometry | EngineBlocks]] = {}
        self._loading: dict[str, int] = {}  # peer -> the session the importer thread is importing
        self._retry_at: dict[str, float] = {}  # peer whose import failed or was dropped -> when to try again
        self._dropped: set[str] = set()  # peers dropped to reconnect, until imported again
        self._importer = ThreadPoolExecutor(1, thread_name_prefix="kvstage-prefill-import")

    def target(self, action: WriteRegion | WriteDirect) -> tuple[int, RemoteRegion] | None:
        """The session and memory a write to the action's peer goes into (its ring, or its KV for the direct path)."""
        if isinstance(action, WriteRegion):
            return self._rings.get(action.peer)
        pool = self._pools.get(action.peer)
        return None if pool is None else (pool[0], pool[1])

    def geometry(self, peer: str) -> PoolGeometry | EngineBlocks:
        return self._pools[peer][2]

    def holds(self, record: PeerRecord) -> bool:
        """Whether the record's session is imported or being imported."""
        ring = self._rings.get(record.peer_id)
        return (ring is not None and ring[0] == record.session) or self._loading.get(record.peer_id) == record.session

    def loading(self, peer: str) -> bool:
        return peer in self._loading

    def dropped(self, peer: str) -> bool:
        """Whether the peer's imports were dropped to reconnect and are not made again yet."""
        return peer in self._dropped

    def start(self, record: PeerRecord) -> None:
        """Import the record's ring (and pool or engine KV, for the direct path) on the importer thread."""
        if self._loading.get(record.peer_id) == record.session:
            return
        self._loading[record.peer_id] = record.session
        self._importer.submit(self._load, record)

    def retry(self, record: PeerRecord) -> None:
        """Import the peer again if its last import failed, or was dropped, at least IMPORT_RETRY_S ago."""
        peer = record.peer_id
        if peer in self._rings or peer in self._loading or peer not in self._retry_at:
            return
        if time.monotonic() >= self._retry_at[peer]:
            self.start(record)

    def drop(self, peer: str, *, reconnect: bool = False) -> None:
        """Forget the peer's imports. `reconnect`: made again at a write IMPORT_RETRY_S from now (NIXL connects
        anew then); else (the peer fenced or replaced) an import under way is dropped when it lands."""
        if reconnect:
            self._dropped.add(peer)
            self._retry_at[peer] = time.monotonic() + IMPORT_RETRY_S
        else:
            self._dropped.discard(peer)
            self._retry_at.pop(peer, None)
            self._loading.pop(peer, None)
        ring = self._rings.pop(peer, None)
        if ring is not None:
            self._transport.forget_remote(ring[1])
        pool = self._pools.pop(peer, None)
        if pool is not None:
            self._transport.forget_remote(pool[1])

    def close(self) -> None:
        self._importer.shutdown(wait=False, cancel_futures=True)  # one under way ends when the transport closes

    def _load(self, record: PeerRecord) -> None:
        """Importer thread: import the peer's descriptors and hand them to the reactor."""
        regions: list[RemoteRegion | None] = [None, None, None]
        try:
            regions[0] = self._import(record, "ring")
            if regions[0] is not None:
                regions[1] = self._import(record, "pool")
                regions[2] = None if published_blocks(record) is None else self._import(record, "engine")
        except Exception:  # a bug: logged and counted; what was imported is handed over, the peer tried again
            log.exception("%s: importing decode peer %r failed", self._owner, record.peer_id)
            self._metrics.internal_error()
        self._post(AgentTask(partial(self._loaded, record, *regions)))

    def _import(self, record: PeerRecord, name: str) -> RemoteRegion | None:
        blob = record.descriptors.get(name)
        if blob is None:
            return None
        try:
            return self._transport.import_remote(decode_descriptor(blob))
        except KVStageError as exc:
            log.error("%s: cannot import the %s of %r: %s", self._owner, name, record.peer_id, exc)
            return None

    def _loaded(
        self, record: PeerRecord, ring: RemoteRegion | None, pool: RemoteRegion | None, engine: RemoteRegion | None
    ) -> None:
        """Agent thread: the importer's result for `record`, installed unless that session is no longer wanted."""
        peer = record.peer_id
        if self._loading.get(peer) != record.session:
            for region in (ring, pool, engine):
                if region is not None:
                    self._transport.forget_remote(region)
            return
        del self._loading[peer]
        if ring is None:
            log.error("%s: no usable ring of decode peer %r; tried again at its next write", self._owner, peer)
            self._retry_at[peer] = time.monotonic() + IMPORT_RETRY_S
            return
        self._retry_at.pop(peer, None)
        self._dropped.discard(peer)
        self._rings[peer] = (record.session, ring)
        if pool is not None:
            layout = record.layout.to_layout()  # decode's: its page size may differ from this rank's
            heads = len(heads_of_rank(layout.num_kv_heads, record.tp_size, record.rank))
            pages = pool.nbytes // layout.bytes_per_page(heads)
            self._pools[peer] = (record.session, pool, PoolGeometry(layout, heads, pages))
        blocks = published_blocks(record)
        if blocks is not None and engine is not None:
            self._pools[peer] = (record.session, engine, blocks)
