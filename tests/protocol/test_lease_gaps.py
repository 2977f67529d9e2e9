"""`lease_gaps`: whether a decode rank's timing covers a writer's lease when the two instances are configured apart
(docs/protocol.md, "Writer leases", "Across instances"). Pure values; the runtime check is tests/runtime/
test_timing_compat.py."""

from __future__ import annotations

import itertools

from kvstage.protocol import Timing
from kvstage.protocol.config import lease_gaps


def _timing(dead_after_s: float, **kw: float) -> Timing:
    return Timing(heartbeat_s=0.1, dead_after_s=dead_after_s, retry_initial_s=0.05, retry_max_s=0.4, **kw)


def test_the_reviewed_pair_a_writer_with_a_long_lease_and_a_decode_rank_that_gives_up_early_has_gaps():
    writer, decode = _timing(10.0), _timing(3.0)  # lease_s 4.5 against dead_after_s 3
    gaps = lease_gaps(decode, writer)
    assert len(gaps) == 2
    assert "Timing.dead_after_s=3.0 is less than the writer's quarantine 9.01802" in gaps[0]
    assert "Timing.quarantine_s=2.70541" in gaps[1]
    assert lease_gaps(writer, decode) == [], "the other way round the lease is covered"


def test_one_timing_on_both_sides_has_no_gap():
    for dead_after_s in (1.0, 3.0, 10.0, 60.0):
        assert lease_gaps(_timing(dead_after_s), _timing(dead_after_s)) == []


def test_decode_exactly_at_the_writers_quarantine_is_covered():
    writer = _timing(10.0, lease_s=2.0, max_write_s=2.0, clock_drift=0.0)
    assert lease_gaps(_timing(4.0, lease_s=2.0, max_write_s=2.0, clock_drift=0.0), writer) == []
    assert lease_gaps(_timing(4.0, lease_s=2.0, max_write_s=1.999, clock_drift=0.0), writer) != []


def test_no_gap_means_both_of_decodes_bounds_cover_the_writers_quarantine_under_the_larger_drift():
    values = (1.0, 2.0, 5.0, 10.0)
    drifts = (0.0, 0.001, 0.05)
    timings = [_timing(d, clock_drift=c) for d, c in itertools.product(values, drifts)]
    for decode, writer in itertools.product(timings, timings):
        drift = max(decode.clock_drift, writer.clock_drift)
        need = (writer.lease_s + writer.max_write_s) * (1 + drift) / (1 - drift)
        covered = decode.dead_after_s >= need and decode.quarantine_s >= need
        assert (lease_gaps(decode, writer) == []) == covered, (decode, writer)
