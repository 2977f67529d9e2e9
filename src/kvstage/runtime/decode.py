"""`DecodeAgent`: the decode rank's agent. It owns the staging ring's bytes and scatters arrived chunks.

Owns: the ring region (allocated from the data transport and published in the bootstrap record as "ring", which
is how writers learn where to write), the registration of its KV for direct-path writes (a `KVPool` as "pool"; an
engine's own KV in vLLM's CPU format, all layers in one allocation, as "engine" with its "engine_blocks", where the
backend can export it; any other `EngineKV` is staged only, matched TP too: `DecodeConfig.staged_only`), the rooms
whose path waits for their writers' records (a matched-TP room into an engine's KV goes direct only from writers
whose blocks are laid out as this rank's, same format and block size, `_with_path`; at most `bootstrap_timeout_s`,
then it stages), each open room's decode slots (its pages checked and looked up once, at `expect_room`; every
scatter of the room takes a view), scatters in flight per room, and the pairing of RoomFailed with FreePages so a
failed room's outcome reaches the engine only when its pages are truly free.

Where the KV is on a GPU and the backend moves GPU memory (cuda_ipc, nixl), the ring lives on that GPU
(`DataTransport.staging_device`); otherwise in host memory.

Event-fenced release: a scatter is queued by the reactor itself on the agent's stream (`DeviceWork`), after the event
recorded on the engine's stream when the room was expected (so it waits for what the engine had queued on those
pages then, never for the engine's later steps), and followed by a `CopyFence` (one CUDA event per chunk). The
chunk's Completion, which frees its ring space, is given only once that fence is done, found by polling it every
turn of the reactor (never a wait, never a whole-stream synchronize). A room counts its scatters until their fences
are done, so FenceScatter (sent before a failed or aborted room's pages go back) completes only after its in-flight
scatters have landed. On the CPU a scatter copies in place and its fence is done at once.

Invariants: a scatter writes the token range its Scatter action names, and its ring region is freed (by the
endpoint) only after its fence is done; FenceScatter completes only once the room has no scatter queued or landing;
a failed room is reported with its pages only after the endpoint released them (FreePages); a room's slots are kept
from its acceptance to its outcome, no longer. Called by decode engines through `kvstage.runtime`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, assert_never

import torch

from kvstage.dataplane import EngineKV, KVStore, RequestSlots, queue_scatter_region
from kvstage.dataplane.engine_blocks import EngineBlocks
from kvstage.errors import ConfigError
from kvstage.protocol import (
    AbortRoom,
    Action,
    DecodeConfig,
    DecodeEndpoint,
    ExpectRoom,
    FencePeer,
    FenceScatter,
    FreePages,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.reasons import ABORTED_BY_DECODE
from kvstage.ring import StagingRing
from kvstage.runtime.agent import BaseAgent, published_blocks
from kvstage.runtime.canary import CanaryRing
from kvstage.runtime.config import AgentConfig, AgentSnapshot, RoomOutcome
from kvstage.runtime.reactor import CopyDone
from kvstage.transport.bootstrap import PeerRecord
from kvstage.transport.data import (
    LocalRegion,
    encode_descriptor,
)


class DecodeAgent(BaseAgent):
    """Decode rank: owns the staging ring's bytes, scatters arrived chunks into the engine's KV (a `KVPool` or the
    engine's own tensors, `EngineKV`)."""

    role = "decode"
    peer_role = "prefill"
    endpoint: DecodeEndpoint

    def __init__(self, config: AgentConfig, kv: KVStore) -> None:
        if config.ring_bytes <= 0 or config.chunk_tokens <= 0:
            raise ConfigError("a decode agent needs ring_bytes > 0 and chunk_tokens > 0")
        super().__init__(config, kv)
        self._endpoint_config = self._decode_config()  # validated here: a ConfigError refuses the construction
        self._failed: dict[int, str] = {}
        self._freed: dict[int, tuple[int, ...]] = {}
        self._scatters: dict[int, int] = {}  # room -> scatters queued or landing (fence not done yet)
        self._landing: deque[tuple[Scatter, CopyDone]] = deque()  # queued scatters whose fences are not done yet
        self._fences: dict[int, list[int]] = {}  # room -> FenceScatter tokens waiting for those scatters
        self._slots: dict[int, RequestSlots] = {}  # open room -> its decode slots, looked up at expect_room
        #: room -> the event recorded on the engine's stream at expect_room (GPU KV), set on the engine's thread and
        #: taken by the reactor with the room's ExpectRoom; the room's scatters wait for it
        self._posted_ready: dict[int, torch.cuda.Event] = {}
        self._pages_ready: dict[int, torch.cuda.Event] = {}
        self._unplaced: dict[int, tuple[float, ExpectRoom]] = {}  # rooms waiting for their writers' records (engine KV)
        self._decided: set[int] = set()  # rooms handed on without those records: they stage
        self._engine_direct = False  # an engine's own KV exported for direct writes (`_setup_memory`)
        self.ring_region: LocalRegion

    # ---- engine-facing -----------------------------------------------------------------------------------

    def expect_room(
        self,
        room: int,
        prefill_peers: tuple[str, ...],
        num_tokens: int,
        prefix_tokens: int,
        pages: tuple[int, ...],
        timeout_s: float,
        prompt: bytes = b"",
    ) -> None:
        """Register `room` before anything is announced (R2). `pages` are the engine's pages for tokens
        [0, num_tokens); kvstage writes tokens [prefix_tokens, num_tokens) into them until the room's outcome.
        `prompt` is a digest of the prompt's tokens (empty: unchecked): prefill fails a room computing another."""
        deadline = time.monotonic() + timeout_s
        pages = tuple(pages)
        if self.pool.device.type == "cuda":  # what the engine queued on these pages so far comes before any scatter
            self._posted_ready[room] = torch.cuda.current_stream(self.pool.device).record_event()
        self._mailbox.put(ExpectRoom(room, tuple(prefill_peers), num_tokens, prefix_tokens, pages, deadline, prompt))

    # ---- hooks -------------------------------------------------------------------------------------------

    def _handle(self, event: Any) -> list[Any]:
        """An ExpectRoom's pages are checked and its slots looked up before the endpoint sees it: invalid pages
        reject the call at once, and every scatter of the room takes a view of the slots. A room whose path depends
        on its writers' records waits for them first (`_with_path`)."""
        if isinstance(event, AbortRoom) and event.room in self._unplaced:
            self._claims.forget(event.room)  # never placed: no scatter of it ran
            self._posted_ready.pop(event.room, None)
            pages = self._unplaced.pop(event.room)[1].pages
            self._outcome(RoomOutcome(event.room, False, ABORTED_BY_DECODE, pages))
            return []
        if not isinstance(event, ExpectRoom):
            return super()._handle(event)
        ready = self._posted_ready.pop(event.room, None)
        slots = self.pool.request_slots(event.pages, event.prefix_tokens, event.num_tokens)
        expect = self._with_path(event)
        if expect is None:  # waits for its writers' records, and is handled again then
            if ready is not None:
                self._posted_ready[event.room] = ready
            return []
        actions = super()._handle(expect)
        self._slots[event.room] = slots
        if ready is not None:
            self._pages_ready[event.room] = ready
        return actions

    def _with_path(self, event: ExpectRoom) -> ExpectRoom | None:
        """The room as the endpoint should take it: an engine's KV goes page to page (matched TP) only from writers
        whose engine blocks are laid out as this rank's (same format and block size), which their records say. A
        room whose writers' records are not here yet waits for them (None), up to `bootstrap_timeout_s`, then
        stages (`_place_waiting`)."""
        mine = self.engine_blocks if self._engine_direct else None
        matched = len(event.prefill_peers) == self.config.tp_size
        if mine is None or not matched or event.room in self._decided:
            self._decided.discard(event.room)
            return event
        records = [self._records.get(peer) for peer in event.prefill_peers]
        if None in records:
            self._unplaced[event.room] = (time.monotonic(), event)
            for peer in event.prefill_peers:
                self.resolver.want(peer)
            return None
        return replace(event, direct=all(_lays_out_as(mine, record) for record in records))

    def _place_waiting(self) -> None:
        """Hand waiting rooms to the endpoint once their writers' records are here, or after `bootstrap_timeout_s`
        without them (the room then stages)."""
        expired = time.monotonic() - self.config.bootstrap_timeout_s
        for room, (since, event) in list(self._unplaced.items()):
            known = all(peer in self._records for peer in event.prefill_peers)
            if known or since < expired:
                del self._unplaced[room]
                if not known:
                    self._decided.add(room)
                    event = replace(event, direct=False)
                self._feed(event)

    def _setup_memory(self) -> dict[str, bytes]:
        self.ring_region = self._host_region(self.config.ring_bytes)
        exported = self.export_pool()
        # writers can reach the engine's own KV page to page; an MLA latent cache stages (the page-to-page path into
        # an engine's blocks was checked for MHA/GQA caches only)
        self._engine_direct = "engine" in exported and self.config.attention != "mla"
        return {"ring": encode_descriptor(self.transport.export(self.ring_region)), **exported}

    def _decode_config(self) -> DecodeConfig:
        cfg = self.config
        return DecodeConfig(
            peer_id=self.peer_id,
            layout=cfg.layout,
            tp_size=cfg.tp_size,
            rank=cfg.rank,
            chunk_tokens=cfg.chunk_tokens,
            ring_bytes=cfg.ring_bytes,
            ring_alignment=cfg.ring_alignment,
            attention=cfg.attention,
            timing=cfg.timing,
            limits=cfg.limits,
            staged_only=isinstance(self.pool, EngineKV),  # until its KV is exported (`_make_endpoint`)
        )

    def _make_endpoint(self) -> DecodeEndpoint:
        """After `_setup_memory`: an engine's KV is written page to page only where it was exported."""
        cfg = self.config
        ring = (
            CanaryRing(cfg.ring_bytes, cfg.ring_alignment, self.ring_region.tensor, self.metrics.canary_violated)
            if cfg.ring_canary
            else StagingRing(cfg.ring_bytes, cfg.ring_alignment)
        )
        config = self._endpoint_config
        if self._engine_direct:
            config = replace(config, staged_only=False)
        return DecodeEndpoint(config, self.session, ring=ring, codec=self._codec)

    def _execute(self, action: Action) -> None:
        match action:
            case Scatter():
                self._scatter(action)
            case FenceScatter():
                if self._scatters.get(action.room):
                    self._fences.setdefault(action.room, []).append(action.token)
                else:
                    self._complete(action.token, True)
            case FreePages():
                self._freed[action.room] = tuple(action.pages)
                self._maybe_report_failure(action.room)
            case RoomFailed():
                self._failed[action.room] = action.reason
                self._maybe_report_failure(action.room)
            case RoomSucceeded():
                self._forget_room(action.room)
                self._outcome(RoomOutcome(action.room, True, aux=action.aux))
            case WriteRegion() | WriteDirect() | Send() | FencePeer():
                raise TypeError(f"decode agent cannot execute {action!r}")
            case _:
                assert_never(action)

    def _maybe_report_failure(self, room: int) -> None:
        if room in self._failed and room in self._freed:
            self._forget_room(room)
            self._outcome(RoomOutcome(room, False, self._failed.pop(room), self._freed.pop(room)))

    def _forget_room(self, room: int) -> None:
        self._slots.pop(room, None)
        self._pages_ready.pop(room, None)
        self._claims.forget(room)  # its outcome is out: no scatter of it is left

    def _scatter(self, action: Scatter) -> None:
        """Queue the scatter on the agent's stream (on the CPU: copy it now); the room's in-flight count lets
        FenceScatter wait for it until its fence is done."""
        self._scatters[action.room] = self._scatters.get(action.room, 0) + 1
        self.trace.mark(action.room, action.chunk, "scatter_issued")

        def job() -> int:
            self.trace.mark(action.room, action.chunk, "scatter_begin")
            slots = self._slots[action.room]  # stored when the room was accepted, dropped with its outcome
            ready = self._pages_ready.get(action.room)
            if ready is not None and self.device_work.stream is not None:
                self.device_work.stream.wait_event(ready)
            chunk_slots = slots.range(action.token_start, action.token_end)
            with self._claims.reading(action.room, self.device_work.stream):  # refused once the engine reclaimed
                return queue_scatter_region(self.ring_region.tensor, action.region.offset, action.plan, self.pool,
                                            chunk_slots)  # fmt: skip

        done = self.device_work.run(job, f"scatter of room {action.room} chunk {action.chunk}")
        self.trace.mark(action.room, action.chunk, "scatter_end")
        self._landing.append((action, done))
        self._land()

    def _land(self) -> None:
        """Finish every queued scatter whose fence is done (polled, never waited for)."""
        still: deque[tuple[Scatter, CopyDone]] = deque()
        for action, done in self._landing:
            try:
                landed = done.fence.done()
            except RuntimeError as exc:  # the device failed the copy: the chunk fails, the room with it
                self._landed(action, done, f"scatter failed on the device: {exc}")
                continue
            if landed:
                self._landed(action, done, "" if done.ok else f"scatter failed: {done.reason}")
            else:
                still.append((action, done))
        self._landing = still

    def _landed(self, action: Scatter, done: CopyDone, failure: str) -> None:
        self._progressed()
        room = action.room
        self.trace.mark(room, action.chunk, "landed")
        left = self._scatters[room] - 1
        if left:
            self._scatters[room] = left
        else:
            del self._scatters[room]
        if not failure:
            self.metrics.copy_done("scatter", time.perf_counter() - done.started)
        self._complete(action.token, not failure, failure)
        if not left:
            for fence in self._fences.pop(room, []):
                self._complete(fence, True)

    def _busy(self) -> bool:
        """Scatters landing: the loop polls their fences at the busy rate."""
        return bool(self._landing)

    def _after_turn(self) -> None:
        if self._landing:
            self._land()
        if self._unplaced:
            self._place_waiting()

    def _gauges(self) -> None:
        ring = self.endpoint.ring
        live = ring.live()
        lag = 0
        if live:
            wm = ring.watermark
            lag = (live[-1].round - wm.round) * ring.capacity_bytes + live[-1].end - wm.tail
        self.metrics.set_ring(ring.live_bytes, ring.high_water, lag)

    def _make_snapshot(self, stats: dict[str, int]) -> AgentSnapshot:
        base = super()._make_snapshot(stats)
        ring = self.endpoint.ring
        return AgentSnapshot(
            open_rooms=base.open_rooms,
            quiescent=base.quiescent
            and not (
                self._failed or self._freed or self._scatters or self._slots or self._unplaced or len(self._claims)
            ),
            ring_live_bytes=ring.live_bytes,
            ring_high_water=ring.high_water,
            pending_sends=base.pending_sends,
            stats=stats,
        )


def _lays_out_as(mine: EngineBlocks, record: PeerRecord | None) -> bool:
    """Whether the writer of `record` holds its engine KV in blocks laid out as this rank's `mine`."""
    theirs = None if record is None else published_blocks(record)
    return theirs is not None and theirs.compatible(mine)
