"""A real decode agent with its bootstrap service and the prefill instances that serve it.

Shared by the tests of this directory: `Deployment` runs one decode rank (TP=1) in this process; `instance()`
starts a legitimate prefill instance (TP=2, in this process) and `run_room` hands one room from it to decode.
The tests send hostile frames with `Stranger` (kvstage.e2e.stranger), a raw ZeroMQ DEALER at the control socket
under any sender id.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvstage.dataplane import KVPool
from kvstage.layout import KVLayout
from kvstage.protocol import Limits, Timing
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, RoomOutcome, peer_id
from kvstage.runtime.outbox import ParkLimits
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.control import ChannelConfig

Outcome = RoomOutcome
WORKER = Path(__file__).with_name("decode_worker.py")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, retry_initial_s=0.02, retry_max_s=0.2)
# For tests that do not exercise liveness: decode counts a writer as heard at `expect`, and a loaded machine (CI,
# or strangers flooding the agent) must not turn a slow start or a late heartbeat into "peer dead" (seen in CI and
# under load with the 1 s bound).
PATIENT = Timing(heartbeat_s=0.1, dead_after_s=10.0, retry_initial_s=0.02, retry_max_s=0.2)
CHUNK = 8
PREFILL_TP = 2
ROOM_TOKENS = 24


@dataclass(frozen=True)
class Caps:
    """Per-peer caps of the decode agent (the defaults unless a test lowers them), and every agent's timing."""

    timing: Timing = TIMING
    limits: Limits = field(default_factory=Limits)
    park: ParkLimits = field(default_factory=ParkLimits)
    channel: ChannelConfig = field(default_factory=lambda: ChannelConfig(max_frame_bytes=DEFAULT_MAX_FRAME_BYTES))


def config(
    instance: str,
    rank: int,
    tp: int,
    bootstrap: str,
    caps: Caps = Caps(),
    secret: bytes | None = None,
    control_bind: str = "tcp://127.0.0.1:*",
) -> AgentConfig:
    return AgentConfig(
        instance=instance,
        control_bind=control_bind,
        rank=rank,
        tp_size=tp,
        layout=LAYOUT,
        bootstrap=bootstrap,
        timing=caps.timing,
        limits=caps.limits,
        park=caps.park,
        channel=caps.channel,
        secret=secret,
        chunk_tokens=CHUNK,
        ring_bytes=16384,
        staging_bytes=16384,
    )


def wait_outcomes(agent: DecodeAgent | PrefillAgent, rooms: Iterable[int], timeout_s: float = 20) -> dict[int, Outcome]:
    want = set(rooms)
    got: dict[int, RoomOutcome] = {}
    deadline = time.monotonic() + timeout_s
    while want - set(got) and time.monotonic() < deadline:
        got.update({o.room: o for o in agent.poll()})
        time.sleep(0.005)
    assert not want - set(got), f"{agent.peer_id}: no outcome for rooms {sorted(want - set(got))} in {timeout_s}s"
    return got


def prefill_instance(
    name: str,
    bootstrap: str,
    caps: Caps = Caps(),
    secret: bytes | None = None,
    pages: int = 16,
    binds: tuple[str, ...] = ("tcp://127.0.0.1:*",) * PREFILL_TP,
) -> list[PrefillAgent]:
    """A prefill instance of PREFILL_TP ranks, each one's control socket bound to its entry of `binds`."""
    return [
        PrefillAgent(
            config(name, r, PREFILL_TP, bootstrap, caps, secret, binds[r]),
            KVPool.for_rank(LAYOUT, PREFILL_TP, r, pages),
        ).start()
        for r in range(PREFILL_TP)
    ]


def start_room(agent: PrefillAgent, room: int, num_tokens: int = ROOM_TOKENS) -> list[int]:
    """Attach `room` on one prefill rank and declare all its KV computed, in pages it allocates (returned)."""
    pages = agent.pool.allocator.allocate(-(-num_tokens // LAYOUT.page_size), room)
    agent.attach_room(room, num_tokens, 1, timeout_s=20)
    agent.compute_scheduled(room, num_tokens)
    agent.kv_ready(room, num_tokens, tuple(pages))
    return pages


def expect_room(decode: DecodeAgent, room: int, instance: str, num_tokens: int = ROOM_TOKENS) -> tuple[int, ...]:
    """Admit `room` of prefill instance `instance` (both ranks) on `decode`, in pages it allocates (returned)."""
    pages = tuple(decode.pool.allocator.allocate(-(-num_tokens // LAYOUT.page_size), room))
    peers = tuple(peer_id(instance, r) for r in range(PREFILL_TP))
    decode.expect_room(room, peers, num_tokens, 0, pages, timeout_s=20)
    return pages


def peer_tables(agent: DecodeAgent | PrefillAgent) -> dict[str, int]:
    """Entries of every per-peer table of `agent`, now (its `kvstage_peer_state` metric lags by up to a sweep)."""
    return {
        "records": len(agent._records),
        "sockets": agent.channel.open_peers,
        "resolver": agent.resolver.wanted(),
        "parked": len(agent._parked),
        "held": len(agent._held.peers()),
        "endpoint": len(agent.endpoint.peers()),
    }


class Deployment:
    """A bootstrap service and one decode rank (instance "D"), in this process."""

    def __init__(self, caps: Caps = Caps(), secret: bytes | None = None) -> None:
        self.caps, self.secret = caps, secret
        self.bootstrap = BootstrapServer(secret=secret).start()
        pool = KVPool.for_rank(LAYOUT, 1, 0, 256)
        self.decode = DecodeAgent(config("D", 0, 1, self.bootstrap.address, caps, secret), pool).start()

    def expect(self, room: int, instance: str, num_tokens: int = ROOM_TOKENS) -> tuple[int, ...]:
        return expect_room(self.decode, room, instance, num_tokens)

    def run_room(self, room: int, instance: str, prefill: list[PrefillAgent]) -> list[RoomOutcome]:
        """Hand `room` from `prefill` (instance `instance`) to decode; the outcomes on decode and on each rank."""
        pages = self.expect(room, instance)
        held = [start_room(agent, room) for agent in prefill]
        outcomes = [wait_outcomes(self.decode, [room])[room]]
        self.decode.pool.allocator.free(list(pages))
        for agent, agent_pages in zip(prefill, held, strict=True):
            outcomes.append(wait_outcomes(agent, [room])[room])
            agent.pool.allocator.free(agent_pages)
        return outcomes

    def tables(self) -> dict[str, int]:
        """Entries of every per-peer table of the decode agent."""
        return peer_tables(self.decode)

    def close(self) -> None:
        self.decode.close()
        self.bootstrap.close()


class DecodeProcess:
    """decode_worker.py in a process of its own (its RSS is its own), driven over its stdin and stdout."""

    def __init__(self, bootstrap: str, secret: bytes) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), bootstrap, secret.hex()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.address = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"decode worker exited with {self.proc.poll()}"
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def state(self) -> dict:
        return self.ask_json("state")

    def ask_json(self, command: str) -> dict:
        return json.loads(self.ask(command))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
