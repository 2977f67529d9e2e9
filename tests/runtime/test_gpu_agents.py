"""Agents with their KV and their staging on a GPU, over the cuda_ipc backend (and nixl, VRAM through UCX): rooms
hand off bit-exact, and ring space and a failed room's pages go back only once the scatters that read or wrote them
have landed (their CUDA events), with no stream or device synchronize on the way."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from agent_outcomes import wait_outcomes

from gpu_gate import StreamGate
from kvstage.dataplane import KVPool
from kvstage.errors import KVStageError, TransportUnavailable
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.runtime.reclaim import PageClaims
from kvstage.transport.bootstrap import BootstrapServer
from kvstage.transport.data import TransportConfig
from kvstage.transport.data.nixl import load_nixl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", page_size=16)
TIMING = Timing(heartbeat_s=0.2, dead_after_s=10.0, retry_initial_s=0.02, retry_max_s=0.2)
CHUNK, RING = 64, 1 << 22


@pytest.fixture
def cluster():
    made: list[tuple[BootstrapServer, list]] = []

    def make(
        prefill_tp: int, decode_tp: int, backend: str = "cuda_ipc"
    ) -> tuple[list[PrefillAgent], list[DecodeAgent]]:
        bootstrap = BootstrapServer().start()

        def config(instance: str, tp: int, rank: int) -> AgentConfig:
            return AgentConfig(
                instance=instance, rank=rank, tp_size=tp, layout=LAYOUT, bootstrap=bootstrap.address,
                transport=TransportConfig(backend=backend), timing=TIMING, chunk_tokens=CHUNK,
                ring_bytes=RING, staging_bytes=RING,
            )  # fmt: skip

        def pool(tp: int, rank: int) -> KVPool:
            return KVPool.for_rank(LAYOUT, tp, rank, num_pages=64, device="cuda")

        decode = [DecodeAgent(config("D", decode_tp, r), pool(decode_tp, r)).start() for r in range(decode_tp)]
        prefill = [PrefillAgent(config("P", prefill_tp, r), pool(prefill_tp, r)).start() for r in range(prefill_tp)]
        made.append((bootstrap, decode + prefill))
        return prefill, decode

    yield make
    for bootstrap, agents in made:
        for agent in agents:
            agent.close()
        bootstrap.close()


def _byte_view(pool: KVPool) -> torch.Tensor:
    return pool.flat.view(2, LAYOUT.num_layers, pool.geometry.num_slots, pool.num_heads, LAYOUT.head_bytes)


def _start_room(prefill: list[PrefillAgent], decode: list[DecodeAgent], room: int, num_tokens: int) -> dict:
    """Random KV in the prefill pools, the room handed off; returns the KV and each side's pages."""
    kv = torch.randint(0, 256, (2, LAYOUT.num_layers, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_bytes))
    kv = kv.to(torch.uint8)
    npages = -(-num_tokens // LAYOUT.page_size)
    sides: dict = {"kv": kv, "decode": []}
    peers = tuple(peer_id("P", r) for r in range(len(prefill)))
    for agent in decode:
        pages = agent.pool.allocator.allocate(npages, room)
        sides["decode"].append(pages)
        agent.expect_room(room, peers, num_tokens, 0, tuple(pages), timeout_s=30)
    for rank, agent in enumerate(prefill):
        pages = agent.pool.allocator.allocate(npages, room)
        heads = heads_of_rank(LAYOUT.num_kv_heads, len(prefill), rank)
        slots = agent.pool.slot_indices(pages, 0, num_tokens)
        _byte_view(agent.pool).index_copy_(2, slots, kv[:, :, :, heads.start : heads.stop].cuda())
        agent.attach_room(room, num_tokens, len(decode), timeout_s=30)
        agent.compute_scheduled(room, num_tokens)
        agent.kv_ready(room, num_tokens, tuple(pages))
    return sides


def _landed(decode: list[DecodeAgent], sides: dict) -> bool:
    kv = sides["kv"]
    for rank, agent in enumerate(decode):
        heads = heads_of_rank(LAYOUT.num_kv_heads, len(decode), rank)
        slots = agent.pool.slot_indices(sides["decode"][rank], 0, kv.shape[2])
        if not torch.equal(_byte_view(agent.pool).index_select(2, slots).cpu(), kv[:, :, :, heads.start : heads.stop]):
            return False
    return True


def _warm_up(prefill: list[PrefillAgent], decode: list[DecodeAgent]) -> None:
    """One room end to end, so that peers are resolved and kernels compiled before a test holds a stream."""
    _start_room(prefill, decode, 100, 64)
    for agent in decode + prefill:
        assert wait_outcomes(agent, 1, timeout=60)[100].ok


def _until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "backend"), [(2, 1, "cuda_ipc"), (1, 2, "cuda_ipc"), (2, 1, "nixl")]
)
def test_kv_and_staging_on_the_gpu_hand_off_bit_exact(cluster, prefill_tp, decode_tp, backend):
    if backend == "nixl":
        try:
            load_nixl()
        except TransportUnavailable as err:
            pytest.skip(str(err))
    prefill, decode = cluster(prefill_tp, decode_tp, backend)
    assert all(a.ring_region.tensor.is_cuda for a in decode) and all(a.staging_region.tensor.is_cuda for a in prefill)
    sides = {room: _start_room(prefill, decode, room, n) for room, n in ((1, 300), (2, 64), (3, 17))}
    for agent in decode + prefill:
        outcomes = wait_outcomes(agent, len(sides), timeout=60)
        assert all(o.ok for o in outcomes.values()), outcomes
    assert all(_landed(decode, side) for side in sides.values())
    for agent in decode:
        assert agent.wait_quiescent(10) and agent.snapshot().ring_live_bytes == 0


def test_a_chunks_ring_space_is_freed_only_once_its_scatter_has_landed(cluster):
    prefill, decode = cluster(2, 1)
    [reader] = decode
    assert reader.device_work.stream is not None
    _warm_up(prefill, decode)
    with StreamGate() as gate:
        gate.hold(reader.device_work.stream)  # every scatter queues behind the shut gate
        sides = _start_room(prefill, decode, 1, 128)
        _until(lambda: reader._landing, "a scatter is queued behind the gate")
        _until(lambda: reader.snapshot().ring_live_bytes > 0, "the snapshot (refreshed on a timer) shows it")
        for _ in range(20):
            assert reader.snapshot().ring_live_bytes > 0 and not reader.poll(), "ring freed before the scatter landed"
            time.sleep(0.01)
    assert wait_outcomes(reader, 1, timeout=30)[1].ok and _landed(decode, sides)
    assert reader.wait_quiescent(10) and reader.snapshot().ring_live_bytes == 0


def test_an_abort_during_a_scatter_gives_the_pages_back_only_after_that_scatter_landed(cluster):
    prefill, decode = cluster(2, 1)
    [reader] = decode
    assert reader.device_work.stream is not None
    _warm_up(prefill, decode)
    with StreamGate() as gate:
        gate.hold(reader.device_work.stream)
        sides = _start_room(prefill, decode, 7, 128)
        _until(lambda: reader._landing, "a scatter is queued behind the gate")
        reader.abort(7)
        for _ in range(20):
            assert not reader.poll(), "the failed room's pages went back while its scatter was still queued"
            time.sleep(0.01)
    [outcome] = wait_outcomes(reader, 1, timeout=30).values()
    assert not outcome.ok and "abort" in outcome.reason
    assert sorted(outcome.pages) == sorted(sides["decode"][0])
    assert reader.wait_quiescent(15) and reader.snapshot().ring_live_bytes == 0


def test_a_gather_waits_on_the_engines_ready_event_and_the_host_never_does(cluster):
    """vLLM's forward may run on a stream of its own: `kv_ready(ready=event)` orders the gathers after it on the
    device (the copy stream waits only on the default stream by itself), with no host wait on the step path."""
    prefill, decode = cluster(2, 1)
    _warm_up(prefill, decode)
    [reader] = decode
    with StreamGate() as gate:
        # the control ends before room 5 starts: the copy stream runs gathers in order, and one of the control's
        # behind room 5's first gather would wait for the engine's stream too (until the gate's own time limit)
        sides = {6: _room_written_on_a_held_stream(prefill, reader, 6, False, gate)}
        control = wait_outcomes(reader, 1, timeout=30)  # room 6's gathers did not wait for the engine's stream
        sides[5] = _room_written_on_a_held_stream(prefill, reader, 5, True, gate)
        # each rank's first write is posted, so its gather is queued on the copy stream, before the engine's KV is
        _until(lambda: all(writer._in_flight for writer in prefill), "room 5's writes are posted")
    outcomes = control | wait_outcomes(reader, 1, timeout=30)
    assert outcomes[5].ok and outcomes[6].ok, outcomes
    assert _landed(decode, sides[5]), "a gather read pages the engine had not written yet"
    assert not _landed(decode, sides[6]), "control: without the event the gather should read the pages too early"


def _room_written_on_a_held_stream(
    prefill: list[PrefillAgent], reader: DecodeAgent, room: int, event: bool, gate: StreamGate
) -> dict:
    """A room whose KV the engine writes on a stream of its own, behind the shut `gate`; kv_ready is called at
    once, with the stream's event or (the control) without one."""
    num_tokens, npages, tp = 128, 128 // LAYOUT.page_size, len(prefill)
    kv = torch.randint(0, 256, (2, LAYOUT.num_layers, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_bytes))
    kv = kv.to(torch.uint8)
    on_gpu = kv.cuda()  # before the hold: a copy from pageable host memory would make the host wait for it
    torch.cuda.synchronize()
    dst_pages = reader.pool.allocator.allocate(npages, room)
    reader.expect_room(room, tuple(peer_id("P", r) for r in range(tp)), num_tokens, 0, tuple(dst_pages), timeout_s=30)
    src_pages = [writer.pool.allocator.allocate(npages, room) for writer in prefill]
    slots = [writer.pool.slot_indices(pages, 0, num_tokens) for writer, pages in zip(prefill, src_pages, strict=True)]
    torch.cuda.synchronize()  # the slot indices are uploaded on the default stream
    engine = torch.cuda.Stream()
    gate.hold(engine)  # the engine's forward is still running on its own stream...
    for rank, writer in enumerate(prefill):
        heads = heads_of_rank(LAYOUT.num_kv_heads, tp, rank)
        with torch.cuda.stream(engine):  # ...and writes the room's KV at its end
            _byte_view(writer.pool).index_copy_(2, slots[rank], on_gpu[:, :, :, heads.start : heads.stop])
            slots[rank].record_stream(engine)  # the allocator must not reuse them before that write ran
            on_gpu.record_stream(engine)
            ready = torch.cuda.Event()
            ready.record(engine)
        writer.attach_room(room, num_tokens, 1, timeout_s=30)
        writer.compute_scheduled(room, num_tokens)
        writer.kv_ready(room, num_tokens, tuple(src_pages[rank]), ready if event else None)
    return {"kv": kv, "decode": [dst_pages]}


def test_after_reclaim_the_engines_next_writes_wait_for_the_gathers_already_queued():
    """A preemption: the engine reuses a room's pages in its next forward. The event `reclaim` returns follows the
    gathers already queued; the engine's stream waits on it, so the gather reads the room's KV, never the next
    request's. The control shows the hazard: the same write without the wait lands before the queued gather."""
    claims = PageClaims()
    copy, engine = torch.cuda.Stream(), torch.cuda.Stream()
    pages = {room: torch.full((1 << 20,), 1.0, device="cuda") for room in (1, 2)}
    gathered = {room: torch.zeros(1 << 20, device="cuda") for room in (1, 2)}
    gate = StreamGate()
    with gate:
        for room in (1, 2):
            claims.set_ready(room, gate.hold(engine))  # this step's forward has not finished writing the KV yet
            with torch.cuda.stream(copy), claims.reading(room, copy):
                gathered[room].copy_(pages[room])  # the gather, queued behind the ready event
        event = claims.reclaim(1)
        assert event is not None and not event.query()
        claims.reclaim(2)  # the control: its event is not waited on
        nxt = torch.cuda.Stream()
        nxt.wait_event(event)
        with torch.cuda.stream(nxt):
            pages[1].fill_(2.0)  # the next forward writes another request's KV into the reclaimed pages
        control = torch.cuda.Stream()
        with torch.cuda.stream(control):
            pages[2].fill_(2.0)
        control.synchronize()  # the control's reuse has landed while the gather still waits
    torch.cuda.synchronize()
    assert torch.all(gathered[1] == 1.0), "the gather read pages the engine had reused"
    assert torch.all(gathered[2] == 2.0), "control: without the wait the reuse should overtake the queued gather"
    with pytest.raises(KVStageError), claims.reading(1, copy):
        pytest.fail("a gather of a reclaimed room started")
