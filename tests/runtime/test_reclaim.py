"""When the engine takes a room's pages back (a preemption): no gather reads them once `reclaim` returns (CPU), and
state for the room goes with its outcome. The GPU half is in test_gpu_agents.py."""

from __future__ import annotations

import re
import threading

import pytest

from kvstage.errors import KVStageError
from kvstage.runtime.reclaim import RECLAIMED, PageClaims


def test_reclaim_returns_only_after_a_gather_that_is_reading_the_pages_has_finished() -> None:
    claims, order = PageClaims(), []
    reading, release = threading.Event(), threading.Event()

    def gather() -> None:
        with claims.reading(1, None):
            reading.set()
            release.wait(10)
            order.append("gather done")

    thread = threading.Thread(target=gather)
    thread.start()
    assert reading.wait(10)
    reclaimer = threading.Thread(target=lambda: (claims.reclaim(1), order.append("reclaimed")))
    reclaimer.start()
    release.set()
    reclaimer.join(10)
    thread.join(10)
    assert order == ["gather done", "reclaimed"]


def test_no_gather_of_a_reclaimed_room_starts_and_other_rooms_are_untouched() -> None:
    claims = PageClaims()
    assert claims.reclaim(1) is None  # on the CPU there is no event to wait on
    with pytest.raises(KVStageError, match=re.escape(RECLAIMED)), claims.reading(1, None):
        pytest.fail("a gather of a reclaimed room ran")
    with claims.reading(2, None):
        pass


def test_a_rooms_claims_go_with_its_outcome() -> None:
    claims = PageClaims()
    claims.reclaim(1)
    assert len(claims) == 1
    claims.forget(1)
    assert len(claims) == 0
    with claims.reading(1, None):  # a room id is never reused by one engine; forgetting lets go of everything
        pass
