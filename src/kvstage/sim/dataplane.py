"""The simulated data plane: bulk and direct writes, scatters and scatter fences, and fenced writers.

Owns the `DataPlane` part of `World`. A `WriteRegion` / `WriteDirect` is gathered from the prefill rank's KV
memory when issued and lands after 1 ms plus the network delay (or fails, or is dropped because decode has
fenced its writer's incarnation), in the decode rank's staging bytes or KV pages; a `Scatter` copies staging
bytes into the room's decode pages at its token range when it completes; a `FenceScatter` completes once the
room has no scatter in flight. The checker is called at every landing and scatter (S1, S2).

Called by world.py (executing actions, and the LAND / SCATTER events).
"""

from __future__ import annotations

import numpy as np

from kvstage.protocol import Completion, FencePeer, FenceScatter, Scatter, WriteDirect, WriteRegion
from kvstage.sim.clock import EventKind
from kvstage.sim.core import WorldCore
from kvstage.sim.memory import Words
from kvstage.sim.records import SCATTER_S, WRITE_PER_BYTE_S, WRITE_S, InflightWrite, Node
from kvstage.sim.trace import describe


class DataPlane(WorldCore):
    """Writes, scatters and fences of one seeded run (a part of World)."""

    def _issue_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        target = self.nodes.get(action.peer)
        state = self.rooms.get(action.room)
        assert node.pool is not None
        self.checker.check_source_pages(node, action)
        if target is None or target.side != "decode" or state is None:
            self._complete(node, node.session, Completion(action.token, False, "no such decode peer"), self.queue.now)
            return
        payload = self._gather(node, action) if self.payloads else None
        nbytes = action.block.nbytes if isinstance(action, WriteRegion) else action.num_tokens
        at = self.queue.now + WRITE_S + nbytes * WRITE_PER_BYTE_S + self.network.delay()
        if self.profile.slow_writes and self.rng.random() < self.profile.slow_writes:
            at += self.rng.uniform(0.01, 0.06)
        if self.network.cut(node.peer_id, target.peer_id, self.queue.now):
            self._complete(node, node.session, Completion(action.token, False, "partitioned"), at)
            return
        ok = not (self.profile.write_failure and self.rng.random() < self.profile.write_failure)
        incarnation = (action.writer_session, action.writer_epoch)
        self._tokens += 1
        self.writes[self._tokens] = InflightWrite(node, node.session, incarnation, target, action, payload, ok)
        self.queue.push(at, EventKind.LAND, self._tokens)

    def _gather(self, node: Node, action: WriteRegion | WriteDirect) -> bytes | Words:
        assert node.kv is not None
        transfer = action.block.transfer if isinstance(action, WriteRegion) else action.transfer
        values = node.kv.read(action.src_pages, 0, action.num_tokens, transfer.src_head_start, transfer.num_heads)
        return values.tobytes() if isinstance(action, WriteRegion) else values

    def _on_land(self, payload: int) -> None:
        write = self.writes.pop(payload)
        target, action = write.target, write.action
        fenced = target.fenced.get(write.writer.peer_id)
        if fenced is not None and write.incarnation <= fenced:
            self.trace.record(self.queue.now, target.peer_id, "write dropped", f"fenced {describe(action)}")
            self._complete(write.writer, write.session, Completion(action.token, False, "fenced"), self.queue.now)
            return
        self.trace.record(self.queue.now, target.peer_id, "write lands", action)
        if isinstance(action, WriteRegion):
            self.checker.check_region_write(target, action)
            if self.payloads and target.staging is not None:
                data = write.payload
                assert isinstance(data, bytes)
                target.staging.write(action.dst_offset, data if write.ok else data[: len(data) // 2])
        else:
            self.checker.check_direct_write(target, action)
            if self.payloads and target.kv is not None and write.ok:
                assert isinstance(write.payload, np.ndarray)
                target.kv.write(action.dst_pages, 0, action.transfer.dst_head_start, write.payload)
        reason = "" if write.ok else "simulated transfer failure"
        self._complete(write.writer, write.session, Completion(action.token, write.ok, reason), self.queue.now)

    def _issue_scatter(self, node: Node, action: Scatter) -> None:
        self.scatters.setdefault((node.peer_id, action.room), set()).add(action.token)
        self.queue.push(self.queue.now + SCATTER_S, EventKind.SCATTER, (node, node.session, action))

    def _on_scatter_done(self, payload: tuple[Node, int, Scatter]) -> None:
        node, session, action = payload
        if node.session != session:
            return
        ok = not (self.profile.scatter_failure and self.rng.random() < self.profile.scatter_failure)
        self.checker.check_scatter(node, action)
        if ok and self.payloads:
            self._scatter_bytes(node, action)
        key = (node.peer_id, action.room)
        self.scatters[key].discard(action.token)
        self.feed(node, Completion(action.token, ok, "" if ok else "simulated scatter failure"))
        if not self.scatters[key]:
            del self.scatters[key]
            for waiter, waiter_session, token in self.fences.pop(key, []):
                self._complete(waiter, waiter_session, Completion(token), self.queue.now)

    def _scatter_bytes(self, node: Node, action: Scatter) -> None:
        """Into the room's pages at the Scatter's token range, as production scatters into the room's slots."""
        assert node.staging is not None and node.kv is not None
        layout = self.layout
        pages = self.rooms[action.room].decode_pages[node.rank]
        for block in action.plan.blocks:
            raw = node.staging.read(action.region.offset + block.offset, block.nbytes)
            shape = (2, layout.num_layers, action.num_tokens, block.transfer.num_heads, layout.head_dim)
            node.kv.write(pages, action.token_start, block.transfer.dst_head_start, _words(raw).reshape(shape))

    def _issue_fence(self, node: Node, action: FenceScatter) -> None:
        key = (node.peer_id, action.room)
        if self.scatters.get(key):
            self.fences.setdefault(key, []).append((node, node.session, action.token))
        else:
            self._complete(node, node.session, Completion(action.token), self.queue.now)

    def _fence_peer(self, node: Node, action: FencePeer) -> None:
        if node.side == "decode":
            fenced = (action.session, action.epoch)
            node.fenced[action.peer] = max(node.fenced.get(action.peer, fenced), fenced)


def _words(raw: bytes) -> Words:
    return np.frombuffer(raw, dtype=np.uint16)
