"""A tiny deterministic message pump for protocol tests: real endpoints, FIFO delivery, no sockets, no faults.

Every Send is delivered (through the real codec, as bytes) unless a test's `drop` filter says otherwise; every
WriteRegion / WriteDirect / Scatter / FenceScatter is completed ok on the next pump step unless the test holds
it. A held write lands when the test releases it, even if its writer was fenced meanwhile (as a real one-sided
write would). At each landing WriteRegion the pump checks that its region is still allocated (no late write into
freed space) and S1 on the destination ring: no other live allocation overlaps the written bytes. The seeded
fault simulator lives in kvstage.sim; this harness only wires two or more endpoints together so that each rule
can be shown in a short, readable test.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import assert_never

from kvstage.layout import KVLayout
from kvstage.protocol import (
    Action,
    AttachRoom,
    Codec,
    Completion,
    ComputeScheduled,
    DecodeConfig,
    DecodeEndpoint,
    Event,
    ExpectRoom,
    FencePeer,
    FenceScatter,
    FreePages,
    KVReady,
    Limits,
    PrefillConfig,
    PrefillEndpoint,
    Received,
    ReceivedFrame,
    RoomFailed,
    RoomSucceeded,
    Scatter,
    Send,
    Timing,
    WriteDirect,
    WriteRegion,
)
from kvstage.protocol.messages import PROTOCOL_VERSION, Envelope, Metadata

Endpoint = DecodeEndpoint | PrefillEndpoint
TIMING = Timing(heartbeat_s=0.5, dead_after_s=3.0, retry_initial_s=0.05, retry_max_s=0.4)


@dataclass
class Pump:
    endpoints: dict[str, Endpoint]
    now: float = 0.0
    drop: Callable[[str, str, Envelope], bool] | None = None  # (src, dst, envelope) -> lose it
    hold: Callable[[str, Action], bool] | None = None  # keep this completion back (write still in flight)
    queue: deque[tuple[str, Event]] = field(default_factory=deque)
    held: list[tuple[str, Action]] = field(default_factory=list)
    log: list[tuple[str, Action]] = field(default_factory=list)
    codec: Codec = field(default_factory=Codec)
    writes_landed: int = 0
    fenced: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (decode, writer) -> incarnation
    posted: dict[tuple[str, int], float] = field(default_factory=dict)  # (writer, token) -> when its write was posted

    def call(self, name: str, event: Event) -> list[Action]:
        actions = self.endpoints[name].handle(event, self.now)
        for action in actions:
            self._execute(name, action)
        return actions

    def _execute(self, src: str, action: Action) -> None:
        self.log.append((src, action))
        match action:
            case Send():
                if self.drop is None or not self.drop(src, action.peer, action.envelope):
                    self.queue.append((action.peer, ReceivedFrame(self.codec.encode(action.envelope))))
            case FencePeer():
                self.fenced[(src, action.peer)] = (action.session, action.epoch)
            case WriteRegion() | WriteDirect() | Scatter() | FenceScatter():
                if self.hold is not None and self.hold(src, action):
                    self.held.append((src, action))
                    self.posted[(src, action.token)] = self.now
                else:
                    self.complete(src, action)
            case FreePages() | RoomSucceeded() | RoomFailed():
                pass  # outcomes and page returns: tests read them from the log
            case _:
                assert_never(action)

    def complete(self, src: str, action: Action, ok: bool = True) -> None:
        """Deliver the completion of `action` (a held one, or one just issued). A write held longer than
        `Timing.max_write_s` fails without landing: the transports' bound on a write's lifetime."""
        assert isinstance(action, WriteRegion | WriteDirect | Scatter | FenceScatter)
        reason = "" if ok else "injected failure"
        if isinstance(action, WriteRegion | WriteDirect):
            posted = self.posted.pop((src, action.token), self.now)
            if ok and self.now - posted > TIMING.max_write_s:
                ok, reason = False, "write timed out"
        if ok and isinstance(action, WriteRegion):
            self._land(src, action)
        self.queue.append((src, Completion(action.token, ok, reason)))

    def release_held(self, ok: bool = True) -> None:
        held, self.held = self.held, []
        for src, action in held:
            self.complete(src, action, ok)

    def _land(self, src: str, write: WriteRegion) -> None:
        """A write lands whenever its completion is released, fenced writer or not (a one-sided write cannot be
        recalled): its region must still be allocated to it, and no other live allocation may overlap it."""
        decode = self.endpoints[write.peer]
        assert isinstance(decode, DecodeEndpoint)
        if decode.session != write.dst_session:
            return  # aimed at a ring of a decode process that has restarted since: the old registration is gone
        start, end = write.dst_offset, write.dst_offset + write.block.nbytes
        assert write.region.offset <= start and end <= write.region.end, "write outside its grant"
        assert write.region in decode.ring.live(), f"late write: {write} lands after its region was freed"
        for other in decode.ring.live():  # older live allocations may hold data; newer ones wait for this one
            if other.epoch < write.region.epoch and other.offset < end and start < other.end:
                raise AssertionError(f"S1: write {write} overlaps live allocation {other}")
        self.writes_landed += 1

    def run(self, max_steps: int = 200_000) -> None:
        steps = 0
        while self.queue:
            steps += 1
            assert steps < max_steps, "pump did not settle"
            name, event = self.queue.popleft()
            if name in self.endpoints:
                self.call(name, event)

    def advance(self, until: float) -> None:
        """Run messages and timers, in time order, up to time `until`."""
        self.run()
        while True:
            timers = [t for ep in self.endpoints.values() if (t := ep.next_timer()) is not None]
            if not timers or min(timers) > until:
                break
            self.now = max(self.now, min(timers))
            for name, ep in self.endpoints.items():
                timer = ep.next_timer()
                if timer is not None and timer <= self.now:
                    for action in ep.tick(self.now):
                        self._execute(name, action)
            self.run()
        self.now = max(self.now, until)

    # ---- outcomes ---------------------------------------------------------------------------------------------
    def outcome(self, name: str, room: int) -> str | None:
        """'ok', the failure reason, or None; raises if the room ended twice on that endpoint."""
        ends = [
            "ok" if isinstance(a, RoomSucceeded) else a.reason
            for src, a in self.log
            if src == name and isinstance(a, RoomSucceeded | RoomFailed) and a.room == room
        ]
        assert len(ends) <= 1, f"room {room} ended {len(ends)} times on {name}: {ends}"
        return ends[0] if ends else None

    def actions_of(self, name: str, kind: type) -> list[Action]:
        return [a for src, a in self.log if src == name and isinstance(a, kind)]

    def freed_pages(self, name: str, room: int) -> list[tuple[int, ...]]:
        return [a.pages for a in self.actions_of(name, FreePages) if isinstance(a, FreePages) and a.room == room]


def layout(num_kv_heads: int = 8, page_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=num_kv_heads, head_dim=8, dtype="bfloat16", page_size=page_size)


def make_pump(
    *,
    heads: int = 8,
    prefill_tp: int = 2,
    decode_tp: int = 1,
    page_size: int = 4,
    chunk_tokens: int = 8,
    ring_bytes: int = 1 << 20,
    attention: str = "gqa",
    limits: Limits | None = None,
    prefill_instances: int = 1,
    prefill_page_size: int | None = None,
    prefill_timing: Timing = TIMING,
) -> Pump:
    """Decode ranks d0.. and prefill ranks p0.. (instance k's ranks are named pk.0, pk.1, ... when k > 0); prefill's
    page size is decode's `page_size` unless `prefill_page_size` says otherwise, its timing `TIMING` unless
    `prefill_timing` does."""
    kv = layout(heads, page_size)
    prefill_kv = layout(heads, prefill_page_size or page_size)
    lim = limits or Limits()
    endpoints: dict[str, Endpoint] = {}
    for rank in range(decode_tp):
        cfg = DecodeConfig(
            f"d{rank}", kv, decode_tp, rank, chunk_tokens, ring_bytes, attention=attention, timing=TIMING, limits=lim
        )
        endpoints[cfg.peer_id] = DecodeEndpoint(cfg, session=1)
    for instance in range(prefill_instances):
        for rank in range(prefill_tp):
            name = prefill_name(instance, rank)
            endpoints[name] = PrefillEndpoint(
                PrefillConfig(name, prefill_kv, prefill_tp, rank, prefill_timing, lim), session=1
            )
    return Pump(endpoints)


def decode(pump: Pump, name: str = "d0") -> DecodeEndpoint:
    ep = pump.endpoints[name]
    assert isinstance(ep, DecodeEndpoint)
    return ep


def prefill(pump: Pump, name: str = "p0") -> PrefillEndpoint:
    ep = pump.endpoints[name]
    assert isinstance(ep, PrefillEndpoint)
    return ep


def writes_of(name: str):
    """A `Pump.hold` filter: hold every write of endpoint `name`."""
    return lambda src, a: src == name and isinstance(a, WriteRegion | WriteDirect)


def prefill_name(instance: int, rank: int) -> str:
    return f"p{rank}" if instance == 0 else f"p{instance}.{rank}"


def decode_names(pump: Pump) -> list[str]:
    return [n for n, ep in pump.endpoints.items() if isinstance(ep, DecodeEndpoint)]


def prefill_names(pump: Pump, instance: int = 0) -> list[str]:
    tp = next(ep.config.tp_size for ep in pump.endpoints.values() if isinstance(ep, PrefillEndpoint))
    return [prefill_name(instance, r) for r in range(tp)]


def expect(
    pump: Pump,
    room: int,
    num_tokens: int,
    *,
    prefix: int = 0,
    deadline: float = 30.0,
    instance: int = 0,
    prompt: bytes = b"",
):
    """Register `room` on every decode rank (pages numbered from room*1000)."""
    peers = tuple(prefill_names(pump, instance))
    for name in decode_names(pump):
        ep = pump.endpoints[name]
        page_size = ep.config.layout.page_size
        pages = tuple(room * 1000 + i for i in range(-(-num_tokens // page_size)))
        pump.call(name, ExpectRoom(room, peers, num_tokens, prefix, pages, deadline, prompt))


def attach(
    pump: Pump,
    room: int,
    num_tokens: int,
    *,
    deadline: float = 30.0,
    instance: int = 0,
    prompt: bytes = b"",
    decode_tp: int | None = None,
    claim_s: float = 0.0,
) -> None:
    """Attach `room` on every prefill rank of the instance, for the pump's decode TP unless `decode_tp` says
    otherwise (0: not known yet, learned from decode's Metadata)."""
    decode_tp = len(decode_names(pump)) if decode_tp is None else decode_tp
    for name in prefill_names(pump, instance):
        pump.call(name, AttachRoom(room, num_tokens, decode_tp, deadline, prompt, claim_s))


def compute(pump: Pump, room: int, end: int, *, instance: int = 0) -> None:
    """The prefill engine computes tokens [0, end) of `room` on every rank of the instance."""
    for name in prefill_names(pump, instance):
        ep = pump.endpoints[name]
        page_size = ep.config.layout.page_size
        pump.call(name, ComputeScheduled(room, end))
        pump.call(name, KVReady(room, end, tuple(50_000 + room * 1000 + i for i in range(-(-end // page_size)))))


def full_room(pump: Pump, room: int, num_tokens: int, *, prefix: int = 0, instance: int = 0) -> None:
    expect(pump, room, num_tokens, prefix=prefix, instance=instance)
    attach(pump, room, num_tokens, instance=instance)
    compute(pump, room, num_tokens, instance=instance)
    pump.run()


def all_quiescent(pump: Pump) -> bool:
    return all(ep.is_quiescent() for ep in pump.endpoints.values())


def metadata(room: int, **changes: object) -> Metadata:
    """Metadata as d0 (decode TP 1) of the default pump sends it for a 16-token staged room; `changes` override."""
    fields: dict[str, object] = {
        "room": room,
        "decode_rank": 0,
        "decode_tp": 1,
        "prefill_tp": 2,
        "num_tokens": 16,
        "prefix_tokens": 0,
        "chunk_tokens": 8,
        "page_size": 4,
        "path": "staged",
        "epoch": 1,
        "ttl_s": 10.0,
    }
    fields.update(changes)
    return Metadata(**fields)  # type: ignore[arg-type]


def inject(pump: Pump, dst: str, sender: str, body: object, *, session: int = 1, epoch: int = 0) -> list[Action]:
    """Deliver `body` to `dst` as if `sender` (incarnation session/epoch) had sent it; returns dst's actions."""
    envelope = Envelope(
        version=PROTOCOL_VERSION, sender=sender, session=session, epoch=epoch, seq=0, watermark=None, body=body
    )  # type: ignore[arg-type]
    return pump.call(dst, Received(envelope))


def sent(actions: list[Action], body_type: type, peer: str | None = None) -> list[object]:
    """Bodies of type `body_type` among the Send actions (to `peer`, if given)."""
    return [
        a.envelope.body
        for a in actions
        if isinstance(a, Send) and isinstance(a.envelope.body, body_type) and (peer is None or a.peer == peer)
    ]


def sends_from(pump: Pump, name: str, body_type: type) -> list[object]:
    return sent([a for src, a in pump.log if src == name], body_type)
