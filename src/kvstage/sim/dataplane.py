"""The simulated data plane: posting, bulk and direct writes that land when their delay says, scatters and fences.

Owns the `DataPlane` part of `World`. A `WriteRegion` / `WriteDirect` is posted after a posting delay (the
runtime's gather and queue time); at that moment the writer's lease towards the decode peer is checked with the
writer's own clock (else the write is answered `ok=False` and never posted), its KV is gathered from the prefill
rank's memory, and it lands after 1 ms plus the network delay, in the decode rank's staging bytes or KV pages.
A write slower than the transport's bound (`max_write_s`) fails at that bound without landing; a write to a
decode session that is gone (crashed, restarted) fails without landing (its memory registration is gone). Nothing
else stops a posted write: one-sided transports cannot refuse a writer decode has fenced, so its late writes land
too, and the checker judges every landing (W1, S1). A `Scatter` copies staging bytes into the room's decode pages
at its token range when it completes; a `FenceScatter` completes once the room has no scatter in flight.

Called by world.py (executing actions, and the POST / LAND / SCATTER events).
"""

from __future__ import annotations

import numpy as np

from kvstage.protocol import Completion, FenceScatter, PrefillEndpoint, Scatter, WriteDirect, WriteRegion, reasons
from kvstage.sim.clock import EventKind
from kvstage.sim.core import WorldCore
from kvstage.sim.memory import Words
from kvstage.sim.records import (
    POST_MEAN_S,
    SCATTER_S,
    WRITE_PER_BYTE_S,
    WRITE_S,
    InflightWrite,
    Node,
    PendingPost,
)
from kvstage.sim.trace import describe


class DataPlane(WorldCore):
    """Writes, scatters and fences of one seeded run (a part of World)."""

    @property
    def max_write_s(self) -> float:
        """The transport's bound on a write's lifetime: it lands within this long of posting, or never."""
        return self.config.timing.max_write_s

    def _issue_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        """The endpoint asked for a write: the runtime posts it after gathering and queueing it."""
        post = PendingPost(node, node.session, action)
        self.queue.push(self.queue.now + self.rng.expovariate(1 / POST_MEAN_S), EventKind.POST, post)
        if node.pause_armed:
            self._pause(node)
        elif node.edge_armed:
            self._stall_to_lease_edge(node, action)

    def _on_post(self, post: PendingPost) -> None:
        node, action = post.node, post.action
        if node.session != post.session or node.endpoint is None:
            return  # the process crashed before posting: nothing is posted, and nobody waits for an answer
        if node.paused_until is not None:
            node.held.append(post)
            return
        self._post_checked(node, action)

    def _post_checked(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        if self._lease_ok(node, action):
            self._post_write(node, action)

    def _lease_ok(self, node: Node, action: WriteRegion | WriteDirect) -> bool:
        """The runtime's check at the moment of posting, `may_post` read with the writer's own clock: its lease
        towards the decode peer has not run out and the write's epoch is still current (docs/protocol.md, R13);
        else the write is answered `lease expired` and never posted."""
        endpoint = node.endpoint
        assert isinstance(endpoint, PrefillEndpoint)
        if endpoint.may_post(action, node.clock.read(self.queue.now)):
            return True
        self.trace.record(self.queue.now, node.peer_id, "lease expired", describe(action))
        self.feed(node, Completion(action.token, False, reasons.LEASE_EXPIRED))
        return False

    def _post_write(self, node: Node, action: WriteRegion | WriteDirect) -> None:
        target = self.nodes.get(action.peer)
        state = self.rooms.get(action.room)
        assert node.pool is not None
        self.checker.check_source_pages(node, action)
        if target is None or target.side != "decode" or state is None:
            self._complete(node, node.session, Completion(action.token, False, "no such decode peer"), self.queue.now)
            return
        payload = self._gather(node, action) if self.payloads else None
        delay = self._write_delay(node, action)
        edge, node.edge_post = node.edge_post, False
        if self.network.cut(node.peer_id, target.peer_id, self.queue.now, data=True):
            self._complete(node, node.session, Completion(action.token, False, "partitioned"), self.queue.now + delay)
            return
        if delay > self.max_write_s:
            self.trace.record(self.queue.now, node.peer_id, "write stalls", f"past max_write_s: {describe(action)}")
            failed = Completion(action.token, False, "write timed out")
            self._complete(node, node.session, failed, self.queue.now + self.max_write_s)
            return
        ok = not (self.profile.write_failure and self.rng.random() < self.profile.write_failure)
        self._tokens += 1
        self.writes[self._tokens] = InflightWrite(node, node.session, action, payload, ok)
        self.queue.push(self.queue.now + delay, EventKind.LAND, self._tokens)
        decode, writer = self.decode[target.instance], self.prefill[node.instance]
        if decode.crash_armed:
            self._crash_decode(decode)
        if writer.restart_armed or edge:
            self._restart_writer(writer, at_once=edge)

    def _write_delay(self, node: Node, action: WriteRegion | WriteDirect) -> float:
        """How long a write posted now takes to land: 1 ms, its bytes and the network delay, plus the faults' share
        (slow, stalled), at least 0.5-1 x max_write_s for a writer in trouble (about to crash, just back from a
        stall, or cut off on the control plane), at least 0.9-1 x max_write_s for the write of an edge restart."""
        nbytes = action.block.nbytes if isinstance(action, WriteRegion) else action.num_tokens
        delay = WRITE_S + nbytes * WRITE_PER_BYTE_S + self.network.delay()
        if self.profile.slow_writes and self.rng.random() < self.profile.slow_writes:
            delay += self.rng.uniform(0.01, 0.06)
        if self.profile.stalled_writes and self.rng.random() < self.profile.stalled_writes:
            delay += self.rng.uniform(0.1, 1.5) * self.max_write_s
        now = self.queue.now
        troubled = self.prefill[node.instance].restart_armed or node.resumed_at == now
        if troubled or self.network.control_cut_off(node.peer_id, now):
            delay = max(delay, self.rng.uniform(0.5, 1.0) * self.max_write_s)
        if node.edge_post:
            delay = max(delay, self.edge_rng.uniform(0.9, 1.0) * self.max_write_s)
        return delay

    def _gather(self, node: Node, action: WriteRegion | WriteDirect) -> bytes | Words:
        assert node.kv is not None
        transfer = action.block.transfer if isinstance(action, WriteRegion) else action.transfer
        first, heads = action.src_offset, (transfer.src_head_start, transfer.num_heads)
        values = node.kv.read(action.src_pages, first, first + action.num_tokens, *heads)
        return values.tobytes() if isinstance(action, WriteRegion) else values

    def _on_land(self, payload: int) -> None:
        write = self.writes.pop(payload)
        action = write.action
        target = self.nodes.get(action.peer)
        if target is None or target.endpoint is None or target.session != action.dst_session:
            self.trace.record(self.queue.now, action.peer, "write fails", f"decode session gone: {describe(action)}")
            gone = Completion(action.token, False, "decode session gone", peer_gone=True)
            self._complete(write.writer, write.session, gone, self.queue.now)
            return
        self.trace.record(self.queue.now, target.peer_id, "write lands", action)
        self.checker.check_landing(target, action)
        if isinstance(action, WriteRegion):
            if self.payloads and target.staging is not None:
                data = write.payload
                assert isinstance(data, bytes)
                target.staging.write(action.dst_offset, data if write.ok else data[: len(data) // 2])
        elif self.payloads and target.kv is not None and write.ok:
            assert isinstance(write.payload, np.ndarray)
            target.kv.write(action.dst_pages, 0, action.transfer.dst_head_start, write.payload)
        reason = "" if write.ok else "simulated transfer failure"
        self._complete(write.writer, write.session, Completion(action.token, write.ok, reason), self.queue.now)

    def _issue_scatter(self, node: Node, action: Scatter) -> None:
        self.scatters.setdefault((node.peer_id, action.room), set()).add(action.token)
        self.queue.push(self.queue.now + SCATTER_S, EventKind.SCATTER, (node, node.session, action))

    def _on_scatter_done(self, payload: tuple[Node, int, Scatter]) -> None:
        node, session, action = payload
        if node.session != session or node.endpoint is None:
            return  # its process crashed: the scatter went with it
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


def _words(raw: bytes) -> Words:
    return np.frombuffer(raw, dtype=np.uint16)
