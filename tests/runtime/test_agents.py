"""Agents in one process over real sockets and the local shared-memory transport: handoff, aborts, metrics,
compatibility checks and failure paths. The cross-process acceptance is in test_multiprocess.py."""

from __future__ import annotations

import os
import resource
import threading
import time

import msgspec
import pytest
import torch
from agent_outcomes import wait_outcomes

from kvstage.dataplane import KVPool
from kvstage.errors import CompatibilityError, TransportError
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, RoomOutcome, peer_id
from kvstage.transport.bootstrap import BootstrapServer, PeerRecord

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=2.0, retry_initial_s=0.02, retry_max_s=0.2)
CHUNK = 8


def _byte_view(pool: KVPool) -> torch.Tensor:
    return pool.flat.view(2, LAYOUT.num_layers, pool.geometry.num_slots, pool.num_heads, LAYOUT.head_bytes)


class Cluster:
    def __init__(
        self,
        prefill_tp: int,
        decode_tp: int,
        layout: KVLayout = LAYOUT,
        ring_bytes: int = 16384,
        writes_per_peer: int = 2,
        device: str = "cpu",
    ) -> None:
        self.bootstrap = BootstrapServer().start()
        self.writes_per_peer, self.device = writes_per_peer, device
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.prefill = [self._agent(PrefillAgent, "P", prefill_tp, r, layout, ring_bytes) for r in range(prefill_tp)]
        self.decode = [self._agent(DecodeAgent, "D", decode_tp, r, LAYOUT, ring_bytes) for r in range(decode_tp)]

    def _agent(self, cls, instance, tp, rank, layout, ring_bytes):
        pool = KVPool.for_rank(layout, tp, rank, num_pages=64, device=self.device)
        config = AgentConfig(
            instance=instance,
            rank=rank,
            tp_size=tp,
            layout=layout,
            bootstrap=self.bootstrap.address,
            timing=TIMING,
            chunk_tokens=CHUNK,
            ring_bytes=ring_bytes,
            staging_bytes=ring_bytes,
            writes_per_peer=self.writes_per_peer,
        )
        return cls(config, pool).start()

    @property
    def prefill_peers(self) -> tuple[str, ...]:
        return tuple(peer_id("P", r) for r in range(self.prefill_tp))

    def close(self) -> None:
        for agent in self.decode + self.prefill:
            agent.close()
        self.bootstrap.close()


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(*args, **kw) -> Cluster:
        made.append(Cluster(*args, **kw))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def _run_room(
    cluster: Cluster, room: int, num_tokens: int, prefix: int = 0, hold_prefill_pages: bool = True, aux: bytes = b""
) -> dict:
    """Fill prefill pools with random KV, hand the room off, return the pages used on each side.

    `hold_prefill_pages=False` frees each prefill rank's pages before `kv_ready`, so its gathers fail; `aux` is the
    room's aux row, given by every prefill rank with its (one, completing) `kv_ready`."""
    kv = torch.randint(0, 256, (2, LAYOUT.num_layers, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_bytes)).to(
        torch.uint8
    )
    npages = -(-num_tokens // LAYOUT.page_size)
    sides = {"kv": kv, "decode": [], "prefill": []}
    for agent in cluster.decode:
        pages = agent.pool.allocator.allocate(npages, room)
        sides["decode"].append(pages)
        agent.expect_room(room, cluster.prefill_peers, num_tokens, prefix, tuple(pages), timeout_s=20)
    for rank, agent in enumerate(cluster.prefill):
        pages = agent.pool.allocator.allocate(npages, room)
        sides["prefill"].append(pages)
        heads = heads_of_rank(LAYOUT.num_kv_heads, cluster.prefill_tp, rank)
        slots = agent.pool.slot_indices(pages, 0, num_tokens)
        _byte_view(agent.pool).index_copy_(2, slots, kv[:, :, :, heads.start : heads.stop].to(agent.pool.device))
        if not hold_prefill_pages:
            agent.pool.allocator.free(pages)
        agent.attach_room(room, num_tokens, cluster.decode_tp, timeout_s=20)
        agent.compute_scheduled(room, num_tokens)
        agent.kv_ready(room, num_tokens, tuple(pages), aux=aux)
    return sides


def _assert_landed(cluster: Cluster, sides: dict, prefix: int) -> None:
    kv = sides["kv"]
    for rank, agent in enumerate(cluster.decode):
        heads = heads_of_rank(LAYOUT.num_kv_heads, cluster.decode_tp, rank)
        slots = agent.pool.slot_indices(sides["decode"][rank], prefix, kv.shape[2])
        got = _byte_view(agent.pool).index_select(2, slots).cpu()
        assert torch.equal(got, kv[:, :, prefix:, heads.start : heads.stop])


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_rooms_land_bit_exact_and_leave_the_ring_empty(make_cluster, prefill_tp, decode_tp):
    cluster = make_cluster(prefill_tp, decode_tp)
    rooms = {1: (37, 0), 2: (8, 0), 3: (50, 16)}
    sides = {room: _run_room(cluster, room, n, p) for room, (n, p) in rooms.items()}
    for agent in cluster.decode + cluster.prefill:
        outcomes = wait_outcomes(agent, len(rooms))
        assert all(o.ok for o in outcomes.values()), outcomes
    for room, (_, prefix) in rooms.items():
        _assert_landed(cluster, sides[room], prefix)
    for agent in cluster.decode:
        assert agent.wait_quiescent(5)
        assert agent.snapshot().ring_live_bytes == 0
        assert agent.metrics.value("kvstage_rooms", state="succeeded") == len(rooms)
        assert agent.metrics.value("kvstage_ring_high_water_bytes") > 0
    for agent in cluster.prefill:
        assert agent.wait_quiescent(5)
        assert agent.metrics.value("kvstage_transfer_bytes_total") > 0
        assert agent.metrics.value("kvstage_transfer_throughput_bytes_per_second") > 0


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_an_aux_row_given_with_the_last_kv_ready_arrives_in_every_decode_ranks_outcome(
    make_cluster, prefill_tp, decode_tp
):
    cluster = make_cluster(prefill_tp, decode_tp)
    rows = {1: b"first token 42 of room 1" * 100, 2: b"", 3: bytes(range(256))}
    sides = {room: _run_room(cluster, room, 37, aux=row) for room, row in rows.items()}
    for agent in cluster.decode:
        outcomes = wait_outcomes(agent, len(rows))
        assert {room: (o.ok, o.aux) for room, o in outcomes.items()} == {
            room: (True, row) for room, row in rows.items()
        }
    for agent in cluster.prefill:
        assert all(o.ok and o.aux == b"" for o in wait_outcomes(agent, len(rows)).values())
    for side in sides.values():
        _assert_landed(cluster, side, 0)


def test_agents_made_in_a_process_holding_over_1024_descriptors_hand_off_bit_exact(make_cluster):
    """An engine's process may hold many descriptors: the agents' eventfds and sockets then have numbers `select`
    refuses, and the reactor waits with `poll` instead of dying on its first wait."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.dup(0))
        cluster = make_cluster(2, 1)
        assert cluster.decode[0]._mailbox.fileno() >= 1024
        sides = _run_room(cluster, 1, 37)
        for agent in cluster.decode + cluster.prefill:
            assert wait_outcomes(agent, 1)[1].ok
        _assert_landed(cluster, sides, 0)
    finally:
        for fd in held:
            os.close(fd)


def test_a_refused_kv_ready_fails_its_room_at_once_on_both_sides_not_at_its_deadline(make_cluster):
    """An engine call the endpoint refuses (here an aux row on a `kv_ready` that does not complete the room) ends
    the room "invalid request" on prefill and "aborted by prefill" on decode within seconds, its pages back, not
    when its 20 s deadline comes."""
    cluster = make_cluster(1, 1)
    decode, prefill = cluster.decode[0], cluster.prefill[0]
    npages = -(-37 // LAYOUT.page_size)
    decode_pages = decode.pool.allocator.allocate(npages, 1)
    decode.expect_room(1, cluster.prefill_peers, 37, 0, tuple(decode_pages), timeout_s=20)
    pages = prefill.pool.allocator.allocate(npages, 1)
    prefill.attach_room(1, 37, 1, timeout_s=20)
    prefill.compute_scheduled(1, 37)
    started = time.monotonic()
    prefill.kv_ready(1, 16, tuple(pages), aux=b"not yet: the room has 37 tokens")
    failed = wait_outcomes(prefill, 1, timeout=5)[1]
    assert (failed.ok, failed.reason) == (False, "invalid request")
    ended = wait_outcomes(decode, 1, timeout=5)[1]
    assert (ended.ok, ended.reason) == (False, "aborted by prefill")
    assert time.monotonic() - started < 5
    assert prefill.metrics.value("kvstage_room_failures_total", reason="invalid request") == 1
    assert decode.wait_quiescent(5) and decode.snapshot().ring_live_bytes == 0


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_a_room_is_looked_up_once_on_each_side_on_the_reactor(make_cluster, prefill_tp, decode_tp):
    cluster = make_cluster(prefill_tp, decode_tp)
    callers: list[str] = []
    for agent in cluster.prefill + cluster.decode:
        look_up = agent.pool.request_slots

        def spy(*args, look_up=look_up):
            callers.append(threading.current_thread().name)
            return look_up(*args)

        agent.pool.request_slots = spy
    sides = _run_room(cluster, 1, 50)  # 7 chunks of 8 tokens
    for agent in cluster.decode + cluster.prefill:
        assert all(outcome.ok for outcome in wait_outcomes(agent, 1).values())
    _assert_landed(cluster, sides, 0)
    reactors = [name for name in callers if name.startswith("kvstage-")]  # the test itself looks up to verify
    assert all(name.endswith("-reactor") for name in reactors), callers
    assert len(reactors) == prefill_tp + decode_tp, "one lookup per rank: kv_ready or expect_room"


def test_a_writer_keeps_at_most_its_window_of_writes_in_flight_per_decode_peer(make_cluster):
    cluster = make_cluster(2, 1, ring_bytes=65536, writes_per_peer=1)
    seen: list[int] = []
    for agent in cluster.prefill:
        transport, submit = agent.transport, agent.transport.write_batch

        def counting(src, dst, slices, *more, transport=transport, submit=submit, **options):
            seen.append(transport.in_flight)  # writes already in flight when this one goes out
            return submit(src, dst, slices, *more, **options)

        transport.write_batch = counting
    sides = {room: _run_room(cluster, room, 64) for room in (1, 2)}  # 8 chunks each, all granted at once
    for agent in cluster.decode + cluster.prefill:
        assert all(o.ok for o in wait_outcomes(agent, 2).values())
    for room in sides:
        _assert_landed(cluster, sides[room], 0)
    assert len(seen) == 2 * 2 * 8 and max(seen) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_kv_on_a_gpu_is_staged_through_host_memory_bit_exact(make_cluster, prefill_tp, decode_tp):
    cluster = make_cluster(prefill_tp, decode_tp, device="cuda")
    rooms = {1: (37, 0), 2: (50, 16)}
    sides = {room: _run_room(cluster, room, n, p) for room, (n, p) in rooms.items()}
    for agent in cluster.decode + cluster.prefill:
        assert all(o.ok for o in wait_outcomes(agent, len(rooms)).values())
    for room, (_, prefix) in rooms.items():
        _assert_landed(cluster, sides[room], prefix)
    for agent in cluster.decode:
        assert agent.wait_quiescent(5) and agent.snapshot().ring_live_bytes == 0
        assert agent.metrics.value("kvstage_copy_seconds_count", kind="scatter") > 0


def test_aborted_room_fails_on_both_sides_and_decode_gets_its_pages_back(make_cluster):
    cluster = make_cluster(2, 1)
    decode = cluster.decode[0]
    pages = decode.pool.allocator.allocate(4, "room-9")
    decode.expect_room(9, cluster.prefill_peers, 16, 0, tuple(pages), timeout_s=20)
    for agent in cluster.prefill:
        agent.attach_room(9, 16, 1, timeout_s=20)  # never computed: the room waits for KV
    time.sleep(0.2)
    decode.abort(9)
    outcome = wait_outcomes(decode, 1)[9]
    assert not outcome.ok and outcome.reason == "aborted by decode"
    assert sorted(outcome.pages) == sorted(pages)
    for agent in cluster.prefill:
        assert wait_outcomes(agent, 1)[9].reason == "aborted by decode"
    assert decode.wait_quiescent(5)
    assert decode.metrics.value("kvstage_room_failures_total", reason="aborted by decode") == 1


def test_a_decode_room_the_engine_reclaims_mid_transfer_gets_no_byte_scattered_into_its_pages_afterwards(
    make_cluster, monkeypatch
):
    """sglang frees a request's pages as soon as another TP rank failed it: `reclaim` returns only once a scatter
    that is writing them has finished, and no scatter starts after it (later chunks never reach the pages)."""
    import kvstage.runtime.decode as decode_module

    real, armed, entered, release = (
        decode_module.queue_scatter_region,
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )

    def held_scatter(*args, **kw):  # the real scatter, held once armed: the reactor is inside it
        if armed.is_set() and not entered.is_set():
            entered.set()
            release.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(decode_module, "queue_scatter_region", held_scatter)
    cluster = make_cluster(2, 1)
    decode, tokens = cluster.decode[0], 5 * CHUNK
    kv = torch.randint(
        0, 256, (2, LAYOUT.num_layers, tokens, LAYOUT.num_kv_heads, LAYOUT.head_bytes), dtype=torch.uint8
    )
    pages = decode.pool.allocator.allocate(tokens // LAYOUT.page_size, "room-12")
    decode.expect_room(12, cluster.prefill_peers, tokens, 0, tuple(pages), timeout_s=20)
    prefill_pages = []
    for rank, agent in enumerate(cluster.prefill):
        prefill_pages.append(agent.pool.allocator.allocate(tokens // LAYOUT.page_size, "room-12"))
        heads = heads_of_rank(LAYOUT.num_kv_heads, 2, rank)
        slots = agent.pool.slot_indices(prefill_pages[rank], 0, tokens)
        _byte_view(agent.pool).index_copy_(2, slots, kv[:, :, :, heads.start : heads.stop])
        agent.attach_room(12, tokens, 1, timeout_s=20)

    def compute(end: int) -> None:
        for rank, agent in enumerate(cluster.prefill):
            agent.compute_scheduled(12, end)
            agent.kv_ready(12, end, tuple(prefill_pages[rank]))

    compute(CHUNK)
    first = decode.pool.slot_indices(pages, 0, CHUNK)
    deadline = time.monotonic() + 10
    while not torch.equal(_byte_view(decode.pool).index_select(2, first), kv[:, :, :CHUNK]):  # the first chunk
        assert time.monotonic() < deadline, "the first chunk never landed"
        time.sleep(0.01)
    armed.set()
    compute(2 * CHUNK)
    assert entered.wait(10), "the second chunk's scatter never started"
    order: list[str] = []
    reclaimer = threading.Thread(target=lambda: (decode.reclaim(12), order.append("reclaimed")))
    reclaimer.start()
    time.sleep(0.2)
    order.append("scatter released")
    release.set()
    reclaimer.join(10)
    assert order == ["scatter released", "reclaimed"], "reclaim returned while a scatter was writing the pages"
    after = _byte_view(decode.pool).index_select(2, decode.pool.slot_indices(pages, 0, tokens)).clone()
    compute(tokens)  # the rest of the prompt: its chunks must not reach the pages
    outcome = wait_outcomes(decode, 1)[12]
    assert not outcome.ok and outcome.reason == "aborted by decode"
    time.sleep(0.3)
    now = _byte_view(decode.pool).index_select(2, decode.pool.slot_indices(pages, 0, tokens))
    assert torch.equal(now, after), "a scatter wrote into pages the engine had taken back"
    assert decode.wait_quiescent(5)


def test_decode_refuses_a_room_whose_pages_are_not_allocated_at_once_and_keeps_serving(make_cluster):
    cluster = make_cluster(2, 1)
    decode = cluster.decode[0]
    pages = decode.pool.allocator.allocate(2, 1)
    decode.pool.allocator.free(pages[1:])
    decode.expect_room(1, cluster.prefill_peers, 8, 0, tuple(pages), timeout_s=20)
    refused = wait_outcomes(decode, 1)[1]
    assert not refused.ok and refused.reason.startswith("invalid request: ")
    assert f"pages [{pages[1]}] are not allocated" in refused.reason and refused.pages == tuple(pages)
    assert decode.metrics.value("kvstage_room_failures_total", reason="invalid request") == 1, "one bounded label"
    decode.pool.allocator.free(pages[:1])
    sides = _run_room(cluster, 2, 21)
    assert all(outcome.ok for agent in cluster.decode + cluster.prefill for outcome in wait_outcomes(agent, 1).values())
    _assert_landed(cluster, sides, 0)
    assert decode.wait_quiescent(5), "no slots or ring space kept for either room"


def test_a_repeated_room_id_is_refused_and_the_open_room_still_lands_in_its_own_pages(make_cluster):
    cluster = make_cluster(2, 1)
    decode = cluster.decode[0]
    sides = _run_room(cluster, 1, 40)
    other = decode.pool.allocator.allocate(-(-40 // LAYOUT.page_size), "other")
    decode.expect_room(1, cluster.prefill_peers, 40, 0, tuple(other), timeout_s=20)
    outcomes: list[RoomOutcome] = []
    deadline = time.monotonic() + 20
    while len(outcomes) < 2 and time.monotonic() < deadline:
        outcomes += decode.poll()
        time.sleep(0.005)
    refused = [o for o in outcomes if not o.ok]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    assert "already registered" in refused[0].reason and refused[0].pages == tuple(other)
    _assert_landed(cluster, sides, 0)  # the refused call did not replace the open room's slots
    assert not _byte_view(decode.pool)[:, :, decode.pool.slot_indices(other, 0, 40)].any()


def test_room_times_out_when_its_prefill_rank_never_registers(make_cluster):
    cluster = make_cluster(1, 2)
    decode = cluster.decode[0]
    pages = decode.pool.allocator.allocate(2, "r")
    decode.expect_room(5, ("ghost/0",), 8, 0, tuple(pages), timeout_s=0.5)
    outcome = wait_outcomes(decode, 1, timeout=10)[5]
    assert not outcome.ok and outcome.reason == "timeout"
    assert sorted(outcome.pages) == sorted(pages)


def test_incompatible_prefill_layout_is_refused_with_both_values(make_cluster):
    other = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=4)
    cluster = make_cluster(2, 1, layout=other)
    decode = cluster.decode[0]
    with pytest.raises(CompatibilityError, match=r"dtype=.float16.*dtype=.bfloat16."):
        decode.connect("P", 2, timeout_s=5)
    pages = decode.pool.allocator.allocate(2, "r")
    decode.expect_room(3, cluster.prefill_peers, 8, 0, tuple(pages), timeout_s=10)
    outcome = wait_outcomes(decode, 1)[3]
    assert not outcome.ok and outcome.reason == "send failed"


def test_compatible_instance_connects_and_returns_its_peer_ids(make_cluster):
    cluster = make_cluster(4, 2)
    assert cluster.decode[1].connect("P", 4, timeout_s=5) == cluster.prefill_peers


@pytest.mark.parametrize("writes_per_peer", [1, 2])
def test_failed_bulk_write_fails_the_room_with_a_reason_and_the_agents_keep_serving(make_cluster, writes_per_peer):
    """With a window of 1, the room's second write waits behind the first; it still goes out, fails and is
    confirmed, so the ring is released and nothing stays queued."""
    cluster = make_cluster(2, 1, writes_per_peer=writes_per_peer)
    decode = cluster.decode[0]
    decode.transport.unregister(decode.ring_region)  # the ring's memory is gone: every write into it fails
    _run_room(cluster, 4, 16)
    reasons = [wait_outcomes(agent, 1)[4].reason for agent in cluster.prefill]
    # the first writer to fail aborts the room; decode then aborts it on the other writer, whichever comes first
    assert "transfer failed" in reasons and set(reasons) <= {"transfer failed", "aborted by decode"}
    assert sum(a.metrics.value("kvstage_room_failures_total", reason="transfer failed") for a in cluster.prefill) >= 1
    decode_outcome = wait_outcomes(decode, 1)[4]
    assert not decode_outcome.ok and decode_outcome.reason == "aborted by prefill"
    assert decode.wait_quiescent(5) and decode.snapshot().ring_live_bytes == 0
    for agent in cluster.prefill:
        assert agent._thread.is_alive()
        assert agent.wait_quiescent(5) and agent.snapshot().writes_waiting == 0
        assert agent._slab.live_bytes == 0


def test_a_chunk_whose_pages_cannot_be_gathered_fails_its_room_with_the_reason_logged_and_frees_its_staging(
    make_cluster, caplog
):
    cluster = make_cluster(2, 1)
    sides = _run_room(cluster, 1, 8, hold_prefill_pages=False)  # KV "ready" in pages the pool does not hold
    reasons = [wait_outcomes(agent, 1)[1].reason for agent in cluster.prefill]
    assert "transfer failed" in reasons and set(reasons) <= {"transfer failed", "aborted by decode"}
    assert not wait_outcomes(cluster.decode[0], 1)[1].ok
    logged = [r.getMessage() for r in caplog.records if "gather failed" in r.getMessage()]
    writers = [message.split(":")[0] for message in logged]
    assert writers and len(set(writers)) == len(writers), "each writer's one write completes once"
    assert all("are not allocated" in message for message in logged)
    for agent in cluster.prefill:
        assert agent.wait_quiescent(5) and agent._slab.live_bytes == 0
        assert agent._thread.is_alive()
    assert cluster.decode[0].wait_quiescent(5) and cluster.decode[0].snapshot().ring_live_bytes == 0
    for agent, pages in zip(cluster.prefill, sides["prefill"], strict=True):
        agent.pool.allocator.allocate(len(pages), 2)  # the pool is whole again; the next room goes through
    sides = _run_room(cluster, 2, 24)
    for agent in cluster.decode + cluster.prefill:
        assert wait_outcomes(agent, 1)[2].ok
    _assert_landed(cluster, sides, 0)


def _same_record(record: PeerRecord) -> PeerRecord:
    return record  # what the resolver posts for a second lookup of the same session


def _older_session(record: PeerRecord) -> PeerRecord:
    return msgspec.structs.replace(record, session=record.session - 1)  # a lookup result from before a restart


@pytest.mark.parametrize("redelivered", [_same_record, _older_session], ids=["same-session", "older-session"])
def test_a_redelivered_or_older_decode_record_keeps_the_ring_import_that_writes_hold(make_cluster, redelivered):
    """Regressions. same-session (seen as a flaky multi-process test): a decode record delivered twice for one
    session used to forget and re-import the ring, so writes already queued against the first import failed as
    "not imported". older-session: as the bootstrap does, a record of an older session never replaces the newer
    one; it used to, and the next room failed on every writer."""
    cluster = make_cluster(2, 1)
    _run_room(cluster, 1, 24)
    for agent in cluster.prefill:
        assert wait_outcomes(agent, 1)[1].ok
    decode_peer = cluster.decode[0].peer_id
    records = [agent._records[decode_peer] for agent in cluster.prefill]
    rings = [agent.imports._rings[decode_peer][1] for agent in cluster.prefill]
    for agent, record in zip(cluster.prefill, records, strict=True):
        agent._mailbox.put(redelivered(record))
    sides = _run_room(cluster, 2, 24)  # queued behind the redelivered record on each agent thread
    assert all(o.ok for o in wait_outcomes(cluster.decode[0], 2).values())
    for agent in cluster.prefill:
        assert wait_outcomes(agent, 1)[2].ok
    _assert_landed(cluster, sides, 0)
    assert [agent._records[decode_peer] for agent in cluster.prefill] == records
    assert [agent.imports._rings[decode_peer][1] for agent in cluster.prefill] == rings
    assert all(agent.imports._rings[decode_peer][1] is ring for agent, ring in zip(cluster.prefill, rings, strict=True))


def test_a_matched_tp_room_on_the_local_backend_goes_page_to_page_into_the_decode_pool_without_the_ring(make_cluster):
    """P == D takes the direct path; the local backend reaches the decode pool with cross-memory writes."""
    cluster = make_cluster(2, 2)
    sides = _run_room(cluster, 6, 12)
    for agent in cluster.decode + cluster.prefill:
        assert wait_outcomes(agent, 1)[6].ok
    _assert_landed(cluster, sides, 0)
    for agent in cluster.decode:
        assert agent.wait_quiescent(5)
        assert agent.metrics.value("kvstage_ring_high_water_bytes") == 0


def test_garbage_on_an_agents_control_socket_is_counted_and_rooms_still_succeed(make_cluster):
    import zmq

    cluster = make_cluster(2, 1)
    decode = cluster.decode[0]
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(decode.channel.address)
    try:
        raw.send(b"\x93not an envelope")
        raw.send(b"\xff" * 64)
        sides = _run_room(cluster, 11, 20)
        assert wait_outcomes(decode, 1)[11].ok
        _assert_landed(cluster, sides, 0)
    finally:
        raw.close(linger=0)
    assert decode.metrics.value("kvstage_rejected_frames_total", reason="undecodable") == 2


def _bind_again(address: str, within_s: float = 10.0) -> BootstrapServer:
    """A bootstrap service on the address another one just closed: ZeroMQ releases a closed socket's port on its
    I/O thread, shortly after close() returns, so the first tries can find it still taken."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return BootstrapServer(address).start()
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_restarted_bootstrap_service_is_repopulated_by_the_running_agents():
    import socket

    from kvstage.transport.bootstrap import BootstrapClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    first = BootstrapServer(address).start()
    pool = KVPool.for_rank(LAYOUT, 1, 0, num_pages=8)
    config = AgentConfig(
        instance="P", rank=0, tp_size=1, layout=LAYOUT, bootstrap=address, timing=TIMING, resolve_refresh_s=0.1
    )
    agent = PrefillAgent(config, pool).start()
    try:
        first.close()  # the service dies and comes back empty on the same address
        second = _bind_again(address)
        try:
            client = BootstrapClient(address)
            deadline = time.monotonic() + 10
            while "P/0" not in client.lookup(["P/0"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            found = client.lookup(["P/0"])
            assert "P/0" in found, "the running agent did not register again with the restarted service in 10 s"
            record = found["P/0"]
            client.close()
            assert record.session == agent.session
            assert record.control_address == agent.channel.address
        finally:
            second.close()
    finally:
        agent.close()


def test_26501_scatter_and_abort_fence_never_touch_a_cuda_only_api(make_cluster, monkeypatch):
    # Upstream #26501: the scatter fence used events that exist only on CUDA and broke non-CUDA devices.
    # Every CUDA entry point the copy or fence path could reach now raises: a CPU pool must never reach one.
    def cuda_only(*args, **kwargs):
        raise AssertionError("a CPU pool must never reach a CUDA-only API")

    for name in ("Event", "Stream", "current_stream", "synchronize", "stream"):
        monkeypatch.setattr(torch.cuda, name, cuda_only)
    cluster = make_cluster(2, 1)
    sides = _run_room(cluster, 1, 37)  # scatters run
    decode = cluster.decode[0]
    pages = decode.pool.allocator.allocate(4, 2)
    decode.expect_room(2, cluster.prefill_peers, 16, 0, tuple(pages), timeout_s=20)
    for agent in cluster.prefill:
        agent.attach_room(2, 16, cluster.decode_tp, timeout_s=20)  # never computed: only an abort can end it
    outcome = wait_outcomes(decode, 1)[1]
    assert outcome.ok, outcome
    decode.abort(2)  # fences the room's scatters, then releases
    aborted = wait_outcomes(decode, 1)[2]
    assert (aborted.ok, aborted.reason) == (False, "aborted by decode")
    assert tuple(aborted.pages) == tuple(pages), "a failed room hands its pages back to the engine"
    _assert_landed(cluster, sides, 0)
    assert decode.wait_quiescent(5)
    assert decode.snapshot().ring_live_bytes == 0


def test_a_prefill_rank_whose_import_of_a_decode_peer_blocks_past_dead_after_keeps_answering_and_hands_off(
    make_cluster,
):
    """NIXL connects inside an import and was seen blocking 11 s on the agent thread, long enough for decode to
    declare a live prefill rank dead. Imports run on the importer thread: with every import held for 1.5 x
    dead_after_s, the agents go on answering each other and the room lands once the imports do."""
    cluster = make_cluster(2, 1)
    for agent in cluster.prefill:
        real = agent.transport.import_remote

        def slow_import(descriptor, real=real):
            time.sleep(1.5 * TIMING.dead_after_s)
            return real(descriptor)

        agent.transport.import_remote = slow_import
    sides = _run_room(cluster, 9, 24)
    for agent in cluster.decode + cluster.prefill:
        assert wait_outcomes(agent, 1, timeout=30.0)[9].ok
    _assert_landed(cluster, sides, 0)
