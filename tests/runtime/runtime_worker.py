"""A tiny engine in its own process, driving one PrefillAgent or DecodeAgent for the multi-process tests.

Run as `python runtime_worker.py SPEC.json`. The spec names the role, rank, backend, bootstrap address and the room
phases. Every process derives the same rooms from the seed (sizes, prefixes, which rooms are aborted and by which
side), so prefill and decode agree without talking except through kvstage.

Prefill fills each room's pages with seeded random KV for the heads it holds, and records a SHA-256 per (room,
global head) of the tokens that must move. Decode records the same digest of what landed in its pages for each
room that succeeded. The test compares them: that is the bit-exact check across processes.

Between phases a worker waits for a file to appear (the test creates it, e.g. after restarting a killed rank).
A phase with `hold_after_first_chunk` computes only each room's first chunk, leaving the rooms mid-transfer (its
`marker` file appears once its first writes have landed); with
`release` too, its first rooms also schedule their second chunk (so its grant is requested and held), and it
computes the rest of each of them when the `release` file appears (after the test killed decode, the write of the
held grant goes to a dead peer); with `resume` instead, it computes the rest of every room when that file appears.
A phase with `cut` (a marker path) and a `release` makes this rank a writer cut off from decode: on the release it
first stalls its data transport (its transfer threads stop before they start their next write, as in a long pause
or a congested link), then computes the held rooms, and once a write of them waits in the transport it drops every
control frame to and from its peers from then on (the data path stays up) and creates the `cut` file. It lets the
data path go on when the `unstall` file appears (its rooms cannot end before: their writes are in flight); its
report lists every transfer completion seen after the cut.

A decode rank's phase may take its rooms from another prefill instance (`peer_instance`, `peer_tp`); its reports
carry a digest of every 4 KiB block of its staging ring (`ring_blocks`), so a test can tell whether any byte of the
ring changed between two reports.

After its last phase a worker waits for quiescence, writes its result JSON, and then stays alive (its peers may
still need its acknowledgements) until its stdin is closed. On SIGUSR1 it writes the Python stack of every thread
to its log (the test asks for that when something stalls). A worker dies with the process that started it
(PR_SET_PDEATHSIG on Linux; elsewhere it exits when its stdin closes, after its phases), so a killed test run
leaves no worker behind.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstage.dataplane import KVPool
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, RoomOutcome, peer_id
from kvstage.transport.data import Completion, DataTransport, TransportConfig
from kvstage.transport.data.loopback import die_with_parent


@dataclass(frozen=True)
class RoomPlan:
    room: int
    num_tokens: int
    prefix_tokens: int
    abort_side: str  # "", "decode" or "prefill"
    abort_after_s: float


def plan_room(seed: int, room: int, max_tokens: int, page_size: int, abort_fraction: float) -> RoomPlan:
    rng = random.Random(seed * 1_000_003 + room)
    num_tokens = rng.randint(1, max_tokens)
    prefix = 0
    if num_tokens > page_size and rng.random() < 0.3:
        prefix = page_size * rng.randint(1, (num_tokens - 1) // page_size)
    abort_side = ""
    if rng.random() < abort_fraction:
        abort_side = rng.choice(("decode", "prefill"))
    return RoomPlan(room, num_tokens, prefix, abort_side, rng.uniform(0.0, 0.03))


def room_kv(seed: int, plan: RoomPlan, layout: KVLayout) -> torch.Tensor:
    """Seeded KV bytes of the whole room: uint8 `[2, L, tokens, H, head_bytes]`."""
    gen = torch.Generator().manual_seed(seed * 7919 + plan.room)
    shape = (2, layout.num_layers, plan.num_tokens, layout.num_kv_heads, layout.head_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def byte_view(pool: KVPool) -> torch.Tensor:
    """`[2, L, slots, heads, head_bytes]` uint8 view of a pool."""
    g = pool.geometry
    return pool.flat.view(2, pool.layout.num_layers, g.num_slots, pool.num_heads, pool.layout.head_bytes)


def head_digests(pool: KVPool, heads: range, pages: list[int], start: int, end: int) -> dict[str, str]:
    slots = pool.slot_indices(pages, start, end)
    data = byte_view(pool).index_select(2, slots)
    return {
        str(h): hashlib.sha256(data[:, :, :, i].contiguous().numpy().tobytes()).hexdigest() for i, h in enumerate(heads)
    }


#: Block size of the ring digests in a decode rank's report.
RING_BLOCK = 4096


class ControlCut:
    """The test-side fault of a writer cut off from decode, on a running agent: `stall` holds every transfer thread
    of the data transport before it starts its next write (writes submitted meanwhile wait in the backend's queue,
    not started: a long pause or a congested link; the local backend moves bytes on the agent's reactor, which then
    stalls whole, as in a long GC pause), `cut` drops every control frame in and out from then on, `unstall` lets
    the transfer threads go on. Completions polled after the cut are recorded with their wall time."""

    def __init__(self, agent: PrefillAgent | DecodeAgent) -> None:
        self.agent = agent
        self._go = threading.Event()
        self._go.set()
        self.held = 0  # transfer threads waiting to start a write
        self.completions: list[dict] = []
        self.is_cut = False
        transport: DataTransport = agent.transport
        runner = getattr(transport, "_writer", None)  # mooncake's and nixl's writer threads
        if runner is None:  # local moves the bytes inside the write call, on the agent's reactor: it stalls there
            move = transport._move
            transport._move = lambda job: self._before(move, job)
        else:
            run = runner._run
            runner._run = lambda job: self._before(run, job)
        poll = transport.poll
        transport.poll = lambda: self._record(poll())  # type: ignore[method-assign]
        channel = agent.channel
        send, deliver = channel.send, channel._deliver
        channel.send = lambda peer, message: None if self.is_cut else send(peer, message)  # type: ignore[method-assign]
        channel._deliver = lambda message: None if self.is_cut else deliver(message)

    def _before(self, run: Callable[[object], Completion], job: object) -> Completion:
        if not self._go.is_set():
            self.held += 1
            self._go.wait()
        return run(job)

    def _record(self, completions: list[Completion]) -> list[Completion]:
        if self.is_cut:
            self.completions += [{"ok": c.ok, "reason": c.reason, "t": time.time()} for c in completions]
        return completions

    def stall(self) -> None:
        self._go.clear()

    def write_waits(self) -> bool:
        """A write waits in the stalled transport, not started."""
        return self.held > 0

    def cut(self) -> None:
        self.is_cut = True

    def unstall(self) -> None:
        self._go.set()


#: Rooms of a `release` phase that hold a grant for their second chunk (more would fill the small test ring with
#: grants nobody writes until the release, and the other rooms' first chunks could never be granted).
RELEASED_ROOMS = 2


class Worker:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.layout = KVLayout(**spec["layout"])
        self.role = spec["role"]
        self.tp = spec["tp"]
        self.rank = spec["rank"]
        self.heads = heads_of_rank(self.layout.num_kv_heads, self.tp, self.rank)
        page_size = self.layout.page_size
        self.max_pages = -(-spec["max_tokens"] // page_size)
        self.pool = KVPool(self.layout, len(self.heads), self.max_pages * spec["concurrency"])
        timing = Timing(**spec["timing"])
        config = AgentConfig(
            instance=spec["instance"],
            rank=self.rank,
            tp_size=self.tp,
            layout=self.layout,
            bootstrap=spec["bootstrap"],
            transport=TransportConfig(backend=spec["backend"]),
            timing=timing,
            chunk_tokens=spec["chunk_tokens"],
            ring_bytes=spec["ring_bytes"],
            staging_bytes=spec["ring_bytes"],
        )
        agent_cls = DecodeAgent if self.role == "decode" else PrefillAgent
        self.agent = agent_cls(config, self.pool)
        self.control_cut: ControlCut | None = None
        self.results: dict[str, dict] = {}
        self.digests: dict[str, dict[str, str]] = {}

    def peer_ids(self, phase: dict) -> tuple[str, ...]:
        """The prefill peers of a decode phase's rooms: the phase's own `peer_instance`, else the spec's."""
        instance = phase.get("peer_instance", self.spec["peer_instance"])
        return tuple(peer_id(instance, r) for r in range(phase.get("peer_tp", self.spec["peer_tp"])))

    def plans(self, phase: dict) -> list[RoomPlan]:
        s = self.spec
        return [
            plan_room(s["seed"], room, s["max_tokens"], self.layout.page_size, s["abort_fraction"])
            for room in range(phase["first_room"], phase["first_room"] + phase["rooms"])
        ]

    def run(self) -> None:
        self.agent.start()
        if any(phase.get("cut") for phase in self.spec["phases"]):
            self.control_cut = ControlCut(self.agent)
        try:
            if self.role == "decode":  # like an engine at start-up: admit rooms once every prefill rank is up
                self.agent.connect(self.spec["peer_instance"], self.spec["peer_tp"], timeout_s=120)
            for phase in self.spec["phases"]:
                if phase.get("wait_for"):
                    wait_for_file(phase["wait_for"])
                self.run_phase(phase)
                if phase.get("report"):
                    self.report(phase["report"])
            for _ in sys.stdin:
                pass
        finally:
            self.agent.close()

    def run_phase(self, phase: dict) -> None:
        self.results, self.digests = {}, {}
        todo = self.plans(phase)
        todo.reverse()
        open_rooms: dict[int, tuple[RoomPlan, list[int], float]] = {}
        aborts: list[tuple[float, int]] = []
        hold = phase.get("hold_after_first_chunk", False)
        self.held: dict[int, list[int]] = {}
        self.landed_at: float | None = None
        while todo or open_rooms:
            while todo and len(open_rooms) < self.spec["concurrency"]:
                plan = todo.pop()
                pages = self.pool.allocator.allocate(-(-plan.num_tokens // self.layout.page_size), plan.room)
                self.submit(plan, pages, hold, phase, release=bool(phase.get("release")))
                open_rooms[plan.room] = (plan, pages, time.monotonic())
                if plan.abort_side == self.role:
                    aborts.append((time.monotonic() + plan.abort_after_s, plan.room))
            now = time.monotonic()
            for due, room in [a for a in aborts if a[0] <= now]:
                aborts.remove((due, room))
                if room in open_rooms:
                    self.agent.abort(room)
            if hold and not todo and phase.get("marker") and self.first_chunks_landed(phase):
                Path(phase["marker"]).touch()  # the rooms are mid-transfer
            if self.held and Path(phase.get("release") or phase.get("resume", "")).is_file():
                if self.control_cut is not None:
                    self.control_cut.stall()
                self.release_held(open_rooms)
            if phase.get("cut"):
                self.cut_once_a_write_waits(phase["cut"])
                if Path(phase["unstall"]).is_file():  # its rooms end only once their writes have
                    self.control_cut.unstall()
            for outcome in self.agent.poll():
                plan, pages, _ = open_rooms.pop(outcome.room)
                self.finish(plan, pages, outcome)
            time.sleep(0.005)

    def submit(self, plan: RoomPlan, pages: list[int], hold: bool, phase: dict, release: bool = False) -> None:
        timeout = self.spec["room_timeout_s"]
        if self.role == "decode":
            peers = self.peer_ids(phase)
            self.agent.expect_room(plan.room, peers, plan.num_tokens, plan.prefix_tokens, tuple(pages), timeout)
            return
        kv = room_kv(self.spec["seed"], plan, self.layout)[:, :, :, self.heads.start : self.heads.stop]
        slots = self.pool.slot_indices(pages, 0, plan.num_tokens)
        byte_view(self.pool).index_copy_(2, slots, kv.contiguous())
        self.digests[str(plan.room)] = head_digests(self.pool, self.heads, pages, plan.prefix_tokens, plan.num_tokens)
        decode_tp = 0 if phase.get("sequential") else self.spec["peer_tp"]  # 0: decode not known yet (vLLM's flow)
        self.agent.attach_room(plan.room, plan.num_tokens, decode_tp, timeout, claim_s=phase.get("claim_s", 0.0))
        step = 2 * self.spec["chunk_tokens"]
        ends = [*range(step, plan.num_tokens, step), plan.num_tokens]
        if hold:  # only the first chunk's KV is ready (until a release): the room stays mid-transfer
            first = min(plan.num_tokens, plan.prefix_tokens + self.spec["chunk_tokens"])
            scheduled = first
            if release and first < plan.num_tokens and len(self.held) < RELEASED_ROOMS:
                scheduled = min(plan.num_tokens, first + self.spec["chunk_tokens"])  # its grant is held
                self.held[plan.room] = [end for end in ends if end > first]
            elif phase.get("resume") and first < plan.num_tokens:
                self.held[plan.room] = [end for end in ends if end > first]
            self.agent.compute_scheduled(plan.room, scheduled)
            self.agent.kv_ready(plan.room, first, tuple(pages))
            return
        for end in ends:
            self.agent.compute_scheduled(plan.room, end)
            self.agent.kv_ready(plan.room, end, tuple(pages))

    def cut_once_a_write_waits(self, marker: str) -> None:
        """Cut the control traffic (once) as soon as a write of the released rooms waits in the stalled transport."""
        cut = self.control_cut
        if cut is not None and not cut.is_cut and cut.write_waits():
            cut.cut()
            Path(marker).touch()

    def first_chunks_landed(self, phase: dict) -> bool:
        """True once a write of this rank completed (decode is up and granting), and half a second later (so the
        first chunks that can get ring space land; the rest of a small ring is held by the other writer's grants)."""
        if not self.agent.metrics.value("kvstage_transfer_ops_total"):
            return False
        if self.landed_at is None:
            self.landed_at = time.monotonic()
        return time.monotonic() > self.landed_at + 0.5

    def release_held(self, open_rooms: dict[int, tuple[RoomPlan, list[int], float]]) -> None:
        """Compute the rest of every held room that is still open."""
        for room, ends in self.held.items():
            if room in open_rooms:
                for end in ends:
                    self.agent.kv_ready(room, end, tuple(open_rooms[room][1]))
        self.held = {}

    def finish(self, plan: RoomPlan, pages: list[int], outcome: RoomOutcome) -> None:
        entry = {"ok": outcome.ok, "reason": outcome.reason, "t": time.time()}
        if self.role == "decode" and outcome.ok:
            self.digests[str(plan.room)] = head_digests(
                self.pool, self.heads, pages, plan.prefix_tokens, plan.num_tokens
            )
        if self.role == "decode" and not outcome.ok:
            entry["pages_returned"] = sorted(outcome.pages) == sorted(pages)
        self.pool.allocator.free(pages)
        self.results[str(plan.room)] = entry

    def report(self, path: str) -> None:
        quiescent = self.agent.wait_quiescent(self.spec["quiesce_timeout_s"])
        snap = self.agent.snapshot()
        if self.role == "decode":
            ring = self.agent.ring_region.tensor
            blocks = [digest_bytes(ring[i : i + RING_BLOCK]) for i in range(0, ring.numel(), RING_BLOCK)]
        out = {
            "role": self.role,
            "rank": self.rank,
            "rooms": self.results,
            "digests": self.digests,
            "quiescent": quiescent,
            "ring_live_bytes": snap.ring_live_bytes,
            "ring_high_water": snap.ring_high_water,
            "pages_in_use": self.pool.allocator.in_use,
            "stats": snap.stats,
            "rejected_frames": self.agent.channel.rejected.total(),
            "ring_blocks": blocks if self.role == "decode" else [],
            "completions_after_cut": [] if self.control_cut is None else self.control_cut.completions,
        }
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(out))
        tmp.rename(path)


def digest_bytes(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def wait_for_file(path: str) -> None:
    while not Path(path).exists():
        time.sleep(0.02)


def main() -> None:
    die_with_parent(int(os.environ.get("KVSTAGE_TEST_PARENT", os.getppid())))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {sys.argv[1]} %(name)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack on a stall
    torch.set_num_threads(1)
    Worker(json.loads(Path(sys.argv[1]).read_text())).run()
    logging.warning("closed")
    sys.stdout.flush()
    os._exit(0)  # results are written and the agent is closed: skip native libraries' slow teardown


if __name__ == "__main__":
    main()
