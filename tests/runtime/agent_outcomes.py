"""Waiting for an agent's room outcomes in the runtime tests (one helper for every test file of this folder)."""

from __future__ import annotations

import time

from kvstage.runtime import RoomOutcome


def wait_outcomes(agent, count: int, timeout: float = 20.0) -> dict[int, RoomOutcome]:
    """Poll `agent` until `count` rooms have ended (by room id); fail naming the agent and what did arrive."""
    got: dict[int, RoomOutcome] = {}
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.update({o.room: o for o in agent.poll()})
        time.sleep(0.005)
    assert len(got) == count, f"{agent.peer_id}: {len(got)} of {count} outcomes: {got}"
    return got
