"""Writer leases across instances (docs/protocol.md, "Writer leases"): each rank's bootstrap record carries its
lease-relevant timing, and `check_peer` refuses a peer whose timing lets decode reuse ring space that a write under
the writer's lease can still reach, on the decode side and on the writer's side. Through real records, and through
real agents over real sockets and the local transport: a mismatched pair never runs a room."""

from __future__ import annotations

import logging

import msgspec
import pytest
from agent_outcomes import wait_outcomes

from kvstage.dataplane import KVPool
from kvstage.errors import ConfigError
from kvstage.layout import KVLayout
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.runtime.config import check_peer
from kvstage.transport.bootstrap import BootstrapServer, PeerRecord

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
CHUNK = 8
TOKENS = 16
SHORT = Timing(heartbeat_s=0.1, dead_after_s=1.0, retry_initial_s=0.02, retry_max_s=0.2)
LONG = Timing(heartbeat_s=0.1, dead_after_s=5.0, retry_initial_s=0.02, retry_max_s=0.2)  # lease_s 2.25


def _config(
    instance: str, timing: Timing, bootstrap: str = "tcp://127.0.0.1:1", tp: int = 1, rank: int = 0
) -> AgentConfig:
    return AgentConfig(
        instance=instance,
        rank=rank,
        tp_size=tp,
        layout=LAYOUT,
        bootstrap=bootstrap,
        timing=timing,
        chunk_tokens=CHUNK,
        ring_bytes=16384,
        staging_bytes=16384,
    )


def _record(config: AgentConfig, role: str) -> PeerRecord:
    """`config`'s record as it would arrive from the bootstrap: published, encoded and decoded."""
    record = config.record(role, "tcp://127.0.0.1:5000", 1, {})
    return msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=PeerRecord)


def _check_both_ways(decode: AgentConfig, prefill: AgentConfig) -> None:
    check_peer(decode, "decode", "prefill", _record(prefill, "prefill"))
    check_peer(prefill, "prefill", "decode", _record(decode, "decode"))


def test_a_record_carries_the_senders_lease_timing():
    record = _record(_config("P", LONG), "prefill")
    assert record.timing is not None
    assert (record.timing.dead_after_s, record.timing.lease_s, record.timing.max_write_s) == (5.0, 2.25, 2.25)
    assert record.timing.clock_drift == LONG.clock_drift


@pytest.mark.parametrize(
    ("decode_timing", "prefill_timing"), [(SHORT, SHORT), (LONG, LONG), (LONG, SHORT)], ids=["same", "same", "d>p"]
)
def test_instances_whose_timings_keep_the_lease_safe_are_accepted_both_ways(decode_timing, prefill_timing):
    _check_both_ways(_config("D", decode_timing), _config("P", prefill_timing))


def test_decode_refuses_a_writer_whose_lease_outlasts_decodes_liveness_bound_naming_both_values():
    decode, prefill = _config("D", SHORT), _config("P", LONG)
    need = f"{LONG.quarantine_s:.6g}"
    with pytest.raises(ConfigError, match="timing mismatch") as refused:
        check_peer(decode, "decode", "prefill", _record(prefill, "prefill"))
    message = str(refused.value)
    for part in ("'D/0'", "'P/0'", "Timing.dead_after_s=1.0", need, "lease_s=2.25", "max_write_s=2.25",
                 f"raise decode's Timing.dead_after_s to at least {need}"):  # fmt: skip
        assert part in message, message


def test_a_writer_refuses_a_decode_rank_that_would_give_up_on_it_within_its_lease():
    decode, prefill = _config("D", SHORT), _config("P", LONG)
    with pytest.raises(ConfigError, match=r"decode's Timing\.dead_after_s=1\.0 is less than the writer's quarantine"):
        check_peer(prefill, "prefill", "decode", _record(decode, "decode"))


def test_decode_whose_own_quarantine_is_shorter_than_the_writers_lease_is_refused_for_restarts():
    """Decode waits its own `quarantine_s` for a restarted writer's old writes: a long liveness bound alone with a
    short lease of its own does not cover a writer with a longer lease."""
    short_lease = Timing(heartbeat_s=0.1, dead_after_s=10.0, retry_initial_s=0.02, retry_max_s=0.2, lease_s=1.0,
                         max_write_s=1.0)  # fmt: skip
    decode, prefill = _config("D", short_lease), _config("P", LONG)
    with pytest.raises(ConfigError, match=r"Timing\.quarantine_s=2\.004.*after the writer restarts") as refused:
        check_peer(decode, "decode", "prefill", _record(prefill, "prefill"))
    assert "dead_after_s" not in str(refused.value).split("quarantine_s=")[0], "dead_after_s=10 covers the lease"
    with pytest.raises(ConfigError, match="after the writer restarts"):
        check_peer(prefill, "prefill", "decode", _record(decode, "decode"))


def test_the_larger_clock_drift_of_the_two_counts():
    drifty = Timing(heartbeat_s=0.1, dead_after_s=5.0, retry_initial_s=0.02, retry_max_s=0.2, clock_drift=0.05)
    decode, prefill = _config("D", LONG), _config("P", drifty)  # same lease; the writer's drift is larger
    with pytest.raises(ConfigError, match=r"drift=0\.05, the larger clock_drift of the two"):
        check_peer(decode, "decode", "prefill", _record(prefill, "prefill"))


def test_a_peer_that_publishes_no_timing_is_refused():
    record = msgspec.structs.replace(_record(_config("P", SHORT), "prefill"), timing=None)
    with pytest.raises(ConfigError, match="publishes no timing"):
        check_peer(_config("D", SHORT), "decode", "prefill", record)


@pytest.mark.parametrize(
    ("field", "value"),
    [("dead_after_s", float("nan")), ("lease_s", float("inf")), ("max_write_s", 0.0), ("clock_drift", 0.5)],
)
def test_a_record_with_an_unbounded_timing_value_is_not_decodable(field, value):
    raw = msgspec.to_builtins(_record(_config("P", SHORT), "prefill"))
    raw["timing"][field] = value
    with pytest.raises(msgspec.ValidationError, match=f"timing.{field}"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=PeerRecord)


def _run_room(bootstrap: str, decode_timing: Timing, prefill_timing: Timing) -> tuple[tuple[bool, ...], float]:
    """One staged room from a prefill instance of TP 2 with `prefill_timing` to a decode instance of TP 1 with
    `decode_timing`: whether it succeeded on each rank (decode, then the prefill ranks), and decode's ring high
    water mark in bytes (0: no staging was ever granted, so no write was posted)."""
    decode = DecodeAgent(_config("D", decode_timing, bootstrap), KVPool.for_rank(LAYOUT, 1, 0, 16)).start()
    prefill = [
        PrefillAgent(_config("P", prefill_timing, bootstrap, tp=2, rank=r), KVPool.for_rank(LAYOUT, 2, r, 16)).start()
        for r in range(2)
    ]
    try:
        npages = TOKENS // LAYOUT.page_size
        pages = tuple(decode.pool.allocator.allocate(npages, 1))
        decode.expect_room(1, (peer_id("P", 0), peer_id("P", 1)), TOKENS, 0, pages, timeout_s=3)
        for agent in prefill:
            source = tuple(agent.pool.allocator.allocate(npages, 1))
            agent.attach_room(1, TOKENS, 1, timeout_s=3)
            agent.compute_scheduled(1, TOKENS)
            agent.kv_ready(1, TOKENS, source)
        ok = tuple(wait_outcomes(agent, 1)[1].ok for agent in [decode, *prefill])
        return ok, decode.metrics.value("kvstage_ring_high_water_bytes")
    finally:
        for agent in [*prefill, decode]:
            agent.close()


def test_a_room_between_instances_whose_timings_break_the_lease_fails_before_any_write(caplog):
    caplog.set_level(logging.ERROR, logger="kvstage")
    with BootstrapServer() as bootstrap:
        ok, high_water = _run_room(bootstrap.address, SHORT, SHORT)  # the same agents, matched: the room runs
        assert ok == (True, True, True) and high_water > 0
        caplog.clear()
        ok, high_water = _run_room(bootstrap.address, SHORT, LONG)
        assert ok == (False, False, False) and high_water == 0
    refusals = [r.getMessage() for r in caplog.records if "timing mismatch" in r.getMessage()]
    assert refusals, [r.getMessage() for r in caplog.records]
    assert any("D/0: timing mismatch" in message and "Timing.dead_after_s=1.0" in message for message in refusals)


def test_connect_refuses_an_instance_whose_timing_breaks_the_lease_naming_both_values():
    with BootstrapServer() as bootstrap:
        decode = DecodeAgent(_config("D", SHORT, bootstrap.address), KVPool.for_rank(LAYOUT, 1, 0, 16)).start()
        prefill = [
            PrefillAgent(_config("P", LONG, bootstrap.address, tp=2, rank=r), KVPool.for_rank(LAYOUT, 2, r, 16)).start()
            for r in range(2)
        ]
        try:
            with pytest.raises(ConfigError, match=r"timing mismatch.*dead_after_s=1.0"):
                decode.connect("P", 2, timeout_s=5)
        finally:
            for agent in [*prefill, decode]:
                agent.close()
