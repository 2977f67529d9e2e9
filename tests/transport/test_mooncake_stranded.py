"""The mooncake backend's record of slices still moving after their write gave up (`_Stranded`): a peer stays cut
off while any of its slices moves, and no longer once each has ended; the record is bounded. Mooncake's
`transfer_check_status` is stood for by a table of batch states, since what is tested is the bookkeeping; the
cutting itself runs against real sockets in test_tcp_guard.py and against a real one-way cut in
tests/e2e/test_hosts_agents.py."""

from __future__ import annotations

import pytest

from kvstage.transport.data import mooncake
from kvstage.transport.data.tcp_guard import endpoint

A = frozenset({endpoint("10.0.0.2", 16000)})
B = frozenset({endpoint("10.0.0.3", 16000), endpoint("fd00::3", 16000)})
MOVING = 0


def test_a_peer_is_held_while_any_of_its_kept_slices_moves_and_released_once_each_has_ended() -> None:
    stranded = mooncake._Stranded()
    states = {1: MOVING, 2: MOVING, 3: MOVING}
    stranded.add(A, [1, 2])
    stranded.add(B, [3])
    assert stranded.sweep(states.__getitem__) == A | B
    assert (stranded.moving(A), stranded.moving(B), stranded.moving(frozenset())) == (2, 1, 0)
    states.update({1: mooncake._LANDED, 3: mooncake._FAILED})
    assert stranded.sweep(states.__getitem__) == A
    assert (stranded.moving(A), stranded.moving(B)) == (1, 0)
    states[2] = mooncake._FAILED
    assert stranded.sweep(states.__getitem__) == set()
    assert len(stranded) == 0 and stranded.moving(A) == 0


def test_a_sweep_asks_about_each_kept_batch_once_and_never_again_after_it_ended() -> None:
    """Mooncake frees a batch when asked after its end, so asking again would name freed memory."""
    stranded = mooncake._Stranded()
    asked: list[int] = []

    def landed(batch: int) -> int:
        asked.append(batch)
        return mooncake._LANDED

    stranded.add(A, [7, 8])
    stranded.sweep(landed)
    stranded.sweep(landed)
    assert asked == [7, 8]


def test_beyond_its_bound_the_oldest_kept_batches_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "_MAX_STRANDED", 3)
    stranded = mooncake._Stranded()
    stranded.add(A, [1, 2])
    stranded.add(B, [3, 4])
    assert len(stranded) == 3
    assert (stranded.moving(A), stranded.moving(B)) == (1, 2)
