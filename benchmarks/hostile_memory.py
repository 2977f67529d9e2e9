"""What hostile control frames cost a real decode agent's memory (docs/security.md, "Bounds").

A decode agent (instance "D", TP=1, the default caps) runs in a child process of its own, so its RSS is its own;
the parent runs the bootstrap service, and sends frames at the agent's control socket through a raw ZeroMQ DEALER.
Scenarios, each in a fresh child:

- `near-limit`: 150 frames of a near-`max_frame_bytes` direct-path Metadata (about 2 million page ids), sealed with
  the deployment's secret, from a registered prefill rank under its own id and session (an insider); the peak RSS
  above the idle agent's (VmHWM, reset before the burst) is the figure;
- `near-limit-stranger`: the same frames from a sender that holds the secret but no bootstrap record (held while
  the agent looks it up);
- `fuzz`: 100,000 small hostile frames (random bytes, envelopes for random rooms under registered and random
  sender ids, stale and newer sessions) at an agent without a secret (loopback), so every one is decoded; the RSS
  growth once they are all handled is the figure.

Run: `python benchmarks/hostile_memory.py [--runs 5] [--scenario NAME ...]`; prints one line per run and the
median with min-max per scenario (MiB), and a JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvstage.dataplane import KVPool
from kvstage.e2e.stranger import Stranger
from kvstage.layout import KVLayout
from kvstage.protocol import Timing
from kvstage.protocol.codec import DEFAULT_MAX_FRAME_BYTES
from kvstage.protocol.messages import (
    MAX_PAGES,
    PROTOCOL_VERSION,
    Abort,
    Body,
    ChunkReady,
    Envelope,
    Heartbeat,
    Metadata,
    StagingRequest,
)
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent
from kvstage.transport.bootstrap import BootstrapServer

SECRET = b"hostile memory benchmark secret!"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=10.0, retry_initial_s=0.02, retry_max_s=0.2)
NEAR_LIMIT_FRAMES = 150
FUZZ_FRAMES = 100_000
MIB = 2**20


def agent_config(instance: str, rank: int, tp: int, bootstrap: str, secret: bytes | None) -> AgentConfig:
    return AgentConfig(instance=instance, rank=rank, tp_size=tp, layout=LAYOUT, bootstrap=bootstrap, timing=TIMING,
                       secret=secret, chunk_tokens=8, ring_bytes=16384, staging_bytes=16384)  # fmt: skip


# ---- the child: one decode agent, driven over stdin/stdout ---------------------------------------------------------
def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def serve(bootstrap: str, secret: bytes | None) -> None:
    agent = DecodeAgent(agent_config("D", 0, 1, bootstrap, secret), KVPool.for_rank(LAYOUT, 1, 0, 64)).start()
    print(agent.channel.address, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "reset-peak":
            Path("/proc/self/clear_refs").write_text("5")
        elif command != "state":
            raise ValueError(f"unknown command {command!r}")
        handled = agent.channel.received + sum(agent.channel.rejected.values())
        print(json.dumps({"rss": _status("VmRSS"), "peak": _status("VmHWM"), "handled": handled,
                          "rejected": dict(agent.channel.rejected)}), flush=True)  # fmt: skip
    agent.close()


class Child:
    def __init__(self, bootstrap: str, secret: bytes | None) -> None:
        args = [sys.executable, __file__, "--serve", bootstrap, secret.hex() if secret else ""]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"decode child exited with {self.proc.wait()}")
        return line.strip()

    def ask(self, command: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def wait_handled(self, count: int, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while (state := self.ask("state"))["handled"] < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"decode handled {state['handled']} of {count} frames in {timeout_s}s: {state}")
            time.sleep(0.2)
        return state

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def near_limit_metadata(room: int) -> Metadata:
    """A valid direct-path Metadata whose frame is just under DEFAULT_MAX_FRAME_BYTES: MAX_PAGES page ids, enough
    of them above 2**32 (9 msgpack bytes each, the others 5) to fill the frame."""
    big = (DEFAULT_MAX_FRAME_BYTES - 4096 - 5 * MAX_PAGES) // 4
    pages = tuple(range(2**32, 2**32 + big)) + tuple(range(2**16, 2**16 + MAX_PAGES - big))
    return Metadata(room=room, decode_rank=0, decode_tp=1, prefill_tp=2, num_tokens=len(pages) * 4, prefix_tokens=0,
                    chunk_tokens=8, page_size=4, path="direct", epoch=1, ttl_s=30.0, pages=pages)  # fmt: skip


def fuzz_frame(rng: random.Random, sender: Stranger, registered: list[tuple[str, int]]) -> bytes:
    if rng.random() < 0.2:
        return rng.randbytes(rng.randrange(1, 200))
    room = rng.randrange(1, 1000)
    body: Body = rng.choice([Heartbeat(), Abort(room=room, reason="aborted by prefill"),
                             StagingRequest(room=room, chunk=rng.randrange(2**16)),
                             ChunkReady(room=room, chunk=rng.randrange(2**16), epoch=rng.getrandbits(32))])  # fmt: skip
    if rng.random() < 0.5:
        name, session = rng.choice(registered)
        session += rng.choice((-1, 0, 1, rng.getrandbits(40)))  # stale, current, a restart, a stranger's
        return sender.frame(name, body, max(0, session))
    return sender.frame(f"evil-{rng.randrange(10**6)}/0", body, rng.getrandbits(62))


# ---- scenarios -----------------------------------------------------------------------------------------------------
def run_near_limit(insider: bool) -> float:
    with BootstrapServer(secret=SECRET) as bootstrap:
        child = Child(bootstrap.address, SECRET)
        prefill = PrefillAgent(agent_config("P", 0, 2, bootstrap.address, SECRET), KVPool.for_rank(LAYOUT, 2, 0, 8))
        prefill.start()
        sender = Stranger(child.address, SECRET)
        try:
            name, session = (prefill.peer_id, prefill.session) if insider else ("evil/0", 7)
            payload = sender.codec.encode(Envelope(PROTOCOL_VERSION, name, session, 0, 1, None, near_limit_metadata(1)))
            time.sleep(0.5)
            base = child.ask("reset-peak")
            for _ in range(NEAR_LIMIT_FRAMES):
                sender.send_raw(sender.seal(payload))
            after = child.wait_handled(base["handled"] + NEAR_LIMIT_FRAMES)
        finally:
            sender.close()
            prefill.close()
            child.close()
    return (after["peak"] - base["rss"]) / MIB


def run_fuzz() -> float:
    with BootstrapServer() as bootstrap:
        child = Child(bootstrap.address, None)
        prefill = PrefillAgent(agent_config("P", 0, 2, bootstrap.address, None), KVPool.for_rank(LAYOUT, 2, 0, 8))
        prefill.start()
        sender = Stranger(child.address, None)
        rng = random.Random(26)
        try:
            time.sleep(0.5)
            base = child.ask("state")
            registered = [(prefill.peer_id, prefill.session)]
            for start in range(0, FUZZ_FRAMES, 1000):
                for _ in range(1000):
                    sender.send_raw(fuzz_frame(rng, sender, registered))
                child.wait_handled(base["handled"] + start + 1000 - 5000)  # keep at most ~5,000 frames in flight
            after = child.wait_handled(base["handled"] + FUZZ_FRAMES)
        finally:
            sender.close()
            prefill.close()
            child.close()
    return (after["rss"] - base["rss"]) / MIB


SCENARIOS = {
    "near-limit": lambda: run_near_limit(insider=True),
    "near-limit-stranger": lambda: run_near_limit(insider=False),
    "fuzz": run_fuzz,
}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], bytes.fromhex(sys.argv[3]) if sys.argv[3] else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    summary = {}
    for name in args.scenario or list(SCENARIOS):
        values = []
        for run in range(args.runs):
            values.append(SCENARIOS[name]())
            print(f"{name} run {run + 1}: {values[-1]:+.1f} MiB", flush=True)
        summary[name] = {"median_mib": statistics.median(values), "min_mib": min(values), "max_mib": max(values)}
        print(f"{name}: median {summary[name]['median_mib']:+.1f} MiB (min {min(values):+.1f}, max {max(values):+.1f}, "
              f"{args.runs} runs)", flush=True)  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
