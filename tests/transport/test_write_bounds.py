"""Every data backend bounds a write's lifetime: a write whose `not_after` has passed moves no byte, and with
`max_write_s` a write is cut between pieces. Checked between two real processes for local, mooncake and nixl
(the reader is a spawned `ReaderPeer`; bytes are compared by digests taken in the reader's process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.base import LEASE_EXPIRED, PIECE_BYTES, WRITE_CUT, DataTransport, WriteBound
from kvstage.transport.data.loopback import ReaderPeer, digest, wait_for
from kvstage.transport.data.nixl import _RC_RETRIES, _ucx_timeouts

BACKENDS = ["local", "mooncake", "nixl"]
#: Transfer threads of each backend that has them (local copies inside the write call, on the caller's thread, so
#: its check at the call is the last moment): a test that stalls them all must stall this many.
WORKERS = {"mooncake": 2, "nixl": 4}
REGION = 2 * PIECE_BYTES + 4096  # three pieces when bounded


@pytest.fixture(autouse=True)
def ucx_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NIXL transport with `max_write_s` sets UCX's timeouts in this process's environment: undo it after."""
    for name in _ucx_timeouts(1.0, infiniband=True):
        monkeypatch.delenv(name, raising=False)


def config(backend: str, max_write_s: float | None = None) -> TransportConfig:
    return TransportConfig(backend=backend, write_timeout_s=20.0, max_write_s=max_write_s)


@pytest.fixture(scope="module", params=BACKENDS)
def peer(request: pytest.FixtureRequest) -> Iterator[ReaderPeer]:
    if request.param != "local":
        pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[request.param])
    with ReaderPeer(config(request.param), REGION) as reader:
        yield reader


class StalledWorkers:
    """Holds every transfer thread of a transport after its next completion (the way a long GC pause or a busy
    link would), until `release`: writes submitted meanwhile wait in the backend's queue, not yet started."""

    def __init__(self, transport: DataTransport, threads: int) -> None:
        self._threads = threads
        self._held: set[int] = set()
        self._lock = threading.Condition()
        self._go = threading.Event()
        transport.on_completion(self._hold)

    def _hold(self) -> None:
        with self._lock:
            self._held.add(threading.get_ident())
            self._lock.notify_all()
        self._go.wait(60)

    def wait_all_held(self) -> None:
        with self._lock:
            assert self._lock.wait_for(lambda: len(self._held) >= self._threads, 30), f"held {len(self._held)}"

    def release(self) -> None:
        self._go.set()


def test_a_write_past_its_not_after_at_the_call_moves_no_byte_and_completes_as_lease_expired(peer: ReaderPeer) -> None:
    with create_transport(config(peer.descriptor.backend)) as writer:
        source = writer.register(torch.full((REGION,), 0x5A, dtype=torch.uint8))
        remote = writer.import_remote(peer.descriptor)
        before = peer.digest(0, REGION)

        late = writer.write(source, 0, remote, 0, REGION, not_after=time.monotonic())
        [done] = wait_for(writer, [late], timeout_s=30).values()

        assert (done.ok, done.reason, done.peer_gone) == (False, LEASE_EXPIRED, False)
        assert writer.ops_issued == 0, "never handed to the backend"
        assert peer.digest(0, REGION) == before


def test_a_queued_write_whose_not_after_passes_before_a_worker_takes_it_up_moves_no_byte(peer: ReaderPeer) -> None:
    """The check that matters: at the last moment, on the thread that would move the bytes, not at the call."""
    backend = peer.descriptor.backend
    if backend not in WORKERS:
        pytest.skip(f"{backend} moves the bytes inside the write call: nothing is queued")
    with create_transport(config(backend)) as writer:
        remote = writer.import_remote(peer.descriptor)
        zeros = writer.register(torch.zeros(4096, dtype=torch.uint8))
        source = writer.register(torch.full((REGION,), 0xC3, dtype=torch.uint8))
        stall = StalledWorkers(writer, WORKERS[backend])
        stalls = [writer.write(zeros, 0, remote, 0, 4096) for _ in range(2 * WORKERS[backend])]
        stall.wait_all_held()
        before = peer.digest(0, REGION)

        not_after = time.monotonic() + 0.2
        queued = writer.write(source, 0, remote, 0, REGION, not_after=not_after)
        handed_over = writer.ops_issued  # it passed the check at the call: the backend has it queued
        time.sleep(max(0.0, not_after - time.monotonic()) + 0.05)
        stall.release()
        done = wait_for(writer, [*stalls, queued], timeout_s=30)

        assert handed_over == len(stalls) + 1
        assert all(done[t].ok for t in stalls), [done[t].reason for t in stalls]
        assert (done[queued].ok, done[queued].reason) == (False, LEASE_EXPIRED)
        assert peer.digest(0, REGION) == before, "not one byte of the expired write landed"


@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_queued_write_refused_after_its_peer_died_says_the_peer_is_gone_where_the_backend_can_tell(
    backend: str,
) -> None:
    """Its room then fails as "peer dead", like any write to a dead peer. (NIXL has no way to ask without posting.)"""
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine")
    reader = ReaderPeer(config(backend), 4096)
    with create_transport(config(backend)) as writer:
        remote = writer.import_remote(reader.descriptor)
        source = writer.register(torch.zeros(4096, dtype=torch.uint8))
        stall = StalledWorkers(writer, WORKERS[backend])
        stalls = [writer.write(source, 0, remote, 0, 4096) for _ in range(2 * WORKERS[backend])]
        stall.wait_all_held()
        queued = writer.write(source, 0, remote, 0, 4096, not_after=time.monotonic() + 0.2)
        reader.kill()
        time.sleep(0.3)
        stall.release()
        done = wait_for(writer, [*stalls, queued], timeout_s=30)[queued]

    assert not done.ok and done.peer_gone, done
    reader.stop()


def test_a_write_within_its_not_after_lands_bit_exact(peer: ReaderPeer) -> None:
    with create_transport(config(peer.descriptor.backend, max_write_s=30.0)) as writer:
        source = writer.register(torch.randint(0, 256, (REGION,), dtype=torch.uint8))
        remote = writer.import_remote(peer.descriptor)

        transfer = writer.write(source, 0, remote, 0, REGION, not_after=time.monotonic() + 30)
        [done] = wait_for(writer, [transfer], timeout_s=30).values()

        assert done.ok, done.reason
        assert writer.ops_issued == 1, "pieces are the backend's business: still one operation"
        assert peer.digest(0, REGION) == digest(source.tensor)


def test_a_write_running_past_half_of_max_write_s_is_cut_between_pieces_and_no_later_piece_lands(
    peer: ReaderPeer,
) -> None:
    with create_transport(config(peer.descriptor.backend, max_write_s=1e-6)) as writer:
        source = writer.register(torch.full((REGION,), 0x77, dtype=torch.uint8))
        remote = writer.import_remote(peer.descriptor)
        untouched = peer.digest(PIECE_BYTES, REGION - PIECE_BYTES)

        transfer = writer.write(source, 0, remote, 0, REGION)
        [done] = wait_for(writer, [transfer], timeout_s=30).values()

        if writer.backend == "mooncake":  # it stops waiting for a piece at 0.75 x max_write_s, and cuts it off
            assert not done.ok and "still moving" in done.reason, done.reason
        else:
            assert (done.ok, done.reason) == (False, WRITE_CUT)
            assert peer.digest(0, PIECE_BYTES) == digest(source.tensor[:PIECE_BYTES]), "the first piece moved"
        assert peer.digest(PIECE_BYTES, REGION - PIECE_BYTES) == untouched, "no piece started after the bound"


def test_bounded_pieces_cover_the_slices_in_order_and_none_is_larger_than_a_piece() -> None:
    slices = [(0, 100, 3 * PIECE_BYTES + 5), (7, 0, 10), (PIECE_BYTES, 1, PIECE_BYTES - 3)]
    bounded = list(WriteBound(max_write_s=1.0).pieces(slices))
    flat = [s for piece in bounded for s in piece]

    assert all(sum(n for _, _, n in piece) <= PIECE_BYTES for piece in bounded)
    assert len(bounded) == 5
    rebuilt: list[tuple[int, int, int]] = []
    for s_off, d_off, n in flat:  # merge the split parts back: the same slices, in the same order
        last = rebuilt[-1] if rebuilt else None
        if last is not None and last[0] + last[2] == s_off and last[1] + last[2] == d_off:
            rebuilt[-1] = (last[0], last[1], last[2] + n)
        else:
            rebuilt.append((s_off, d_off, n))
    assert rebuilt == slices
    assert list(WriteBound().pieces(slices)) == [tuple(slices)], "unbounded: one piece, nothing split"
    assert [len(p) for p in WriteBound().pieces(slices, max_slices=2)] == [2, 1]


def test_nixl_sets_ucx_timeouts_that_fail_an_unacknowledged_request_within_half_of_max_write_s() -> None:
    settings = _ucx_timeouts(0.8, infiniband=True)
    rc_timeout_s = int(settings["UCX_RC_TIMEOUT"].removesuffix("us")) / 1e6

    assert settings["UCX_TCP_USER_TIMEOUT"] == "400ms"  # the other half of max_write_s is when pieces are posted
    assert settings["UCX_RC_RETRY_COUNT"] == str(_RC_RETRIES)
    assert 2 * rc_timeout_s * (_RC_RETRIES + 1) <= 0.4  # InfiniBand may round the timeout up to twice the value
    assert set(_ucx_timeouts(0.8, infiniband=False)) == {"UCX_TCP_USER_TIMEOUT"}, "no RC settings UCX would not use"
