"""A write that the transport failed because decode is gone ends its room as "peer dead", like the liveness check;
any other failed write ends it as "transfer failed" (reasons.py)."""

from __future__ import annotations

import pytest
from protocol_harness import all_quiescent, full_room, make_pump

from kvstage.protocol import Completion, WriteRegion, reasons


@pytest.mark.parametrize(("peer_gone", "reason"), [(True, reasons.PEER_DEAD), (False, reasons.TRANSFER_FAILED)])
def test_failed_write_ends_its_room_as_peer_dead_only_when_the_transport_says_the_peer_is_gone(
    peer_gone: bool, reason: str
) -> None:
    pump = make_pump()
    pump.hold = lambda src, action: isinstance(action, WriteRegion) and action.room == 1
    full_room(pump, 1, 16)
    full_room(pump, 2, 16)
    held, pump.held = pump.held, []
    assert held, "room 1 has writes in flight"
    for src, action in held:
        assert isinstance(action, WriteRegion)
        pump.queue.append((src, Completion(action.token, False, "the peer's process exited", peer_gone=peer_gone)))
    pump.run()
    assert pump.outcome("p0", 1) == reason
    assert pump.outcome("p0", 2) == "ok", "the cause of one write fails its own room only"
    assert all_quiescent(pump)
