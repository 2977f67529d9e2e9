"""A prefill instance (TP=2, both ranks in this process) that serves one room to decode "D" and then waits, for
the peer-churn test to kill it with SIGKILL. Run as `python churn_worker.py INSTANCE BOOTSTRAP ROOM`; it prints
"served" once every rank's room succeeded (or "failed ..." otherwise)."""

from __future__ import annotations

import sys

from deployment import prefill_instance, start_room, wait_outcomes


def main() -> None:
    instance, bootstrap, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
    agents = prefill_instance(instance, bootstrap)
    for agent in agents:
        start_room(agent, room)
    outcomes = [wait_outcomes(agent, [room])[room] for agent in agents]
    print("served" if all(o.ok for o in outcomes) else f"failed {outcomes}", flush=True)
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    main()
