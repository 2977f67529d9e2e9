"""A decode rank ("D/0", TP=1) in its own process, driven over stdin/stdout, for the live fuzz test (its RSS is
its own). Run as `python decode_worker.py BOOTSTRAP SECRET_HEX`. Commands, one per line:
`expect ROOM INSTANCE` (admit a room of the prefill instance's two ranks), `outcomes` (rooms ended since the last
call, as JSON), `state` (RSS, its peak since the last `reset-peak`, rejected frames by reason, as JSON),
`reset-peak` (start measuring the peak RSS anew; answers `state`). Prints the control address first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deployment import LAYOUT, PREFILL_TP, ROOM_TOKENS, config

from kvstage.dataplane import KVPool
from kvstage.runtime import DecodeAgent, peer_id


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    bootstrap, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
    agent = DecodeAgent(config("D", 0, 1, bootstrap, secret=secret), KVPool.for_rank(LAYOUT, 1, 0, 1024)).start()
    print(agent.channel.address, flush=True)
    pages: dict[int, list[int]] = {}
    for line in sys.stdin:
        command, *args = line.split()
        if command == "expect":
            room, instance = int(args[0]), args[1]
            pages[room] = agent.pool.allocator.allocate(-(-ROOM_TOKENS // LAYOUT.page_size), room)
            peers = tuple(peer_id(instance, r) for r in range(PREFILL_TP))
            agent.expect_room(room, peers, ROOM_TOKENS, 0, tuple(pages[room]), timeout_s=60)
            print("ok", flush=True)
        elif command == "outcomes":
            ended = agent.poll()
            for outcome in ended:
                agent.pool.allocator.free(pages.pop(outcome.room))
            print(json.dumps({o.room: [o.ok, o.reason] for o in ended}), flush=True)
        elif command in ("state", "reset-peak"):
            if command == "reset-peak":
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
            rejected = {reason: n for reason, n in agent.channel.rejected.items()}
            metric = agent.metrics.value("kvstage_rejected_frames_total", reason="auth")
            state = {"rss": _status("VmRSS"), "peak": _status("VmHWM"), "rejected": rejected, "metric_auth": metric,
                     "received": agent.channel.received}  # fmt: skip
            print(json.dumps(state), flush=True)
    agent.close()


if __name__ == "__main__":
    main()
