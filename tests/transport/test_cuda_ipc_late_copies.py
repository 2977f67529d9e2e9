"""The cuda_ipc backend's hard bound on late copies: a copy the GPU reaches after `max_write_s` stores nothing, so
it never lands in ring space decode has granted again, and a write queued behind a gather the GPU finishes only
after the writer's lease stores nothing (the lease is the copy's device deadline), reported as "lease expired"
since no byte moved. GPU only: a `StreamGate` holds the writer's stream (or the gather's) until the host
clock has passed the bound, so the copy reaches the device late on any machine."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_gate import StreamGate
from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.base import LEASE_EXPIRED
from kvstage.transport.data.cuda_ipc import LATE_ON_DEVICE
from kvstage.transport.data.loopback import wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NBYTES = 4 << 20
MAX_WRITE_S = 0.3
BOUNDED = TransportConfig(backend="cuda_ipc", max_write_s=MAX_WRITE_S)


def test_a_copy_the_gpu_reaches_after_max_write_s_never_lands_in_regranted_ring_space() -> None:
    with create_transport(TransportConfig(backend="cuda_ipc")) as reader, create_transport(BOUNDED) as writer:
        ring = reader.allocate(NBYTES, device="cuda")
        remote = writer.import_remote(reader.export(ring))
        src = writer.register(torch.full((NBYTES,), 7, dtype=torch.uint8, device="cuda"))
        with StreamGate() as gate:
            gate.hold(writer._stream(torch.device("cuda")))  # the writer's copy stream, held past max_write_s
            # a lease longer than max_write_s: the bound that cuts the copy is max_write_s after its post
            write = writer.write_batch(src, remote, [(0, 0, NBYTES)], not_after=time.monotonic() + 10 * MAX_WRITE_S)
            time.sleep(MAX_WRITE_S + 0.1)  # decode's bound has passed: it grants the space to another write
            regranted = torch.cuda.Stream()
            with torch.cuda.stream(regranted):
                ring.tensor.fill_(5)
            regranted.synchronize()
        [completion] = wait_for(writer, [write], timeout_s=30).values()  # the gate is open: the copy runs, late
        assert bool((ring.tensor == 5).all()), "a late copy landed in re-granted ring space"
        assert not completion.ok and completion.reason.startswith(LATE_ON_DEVICE), completion


def test_a_write_queued_behind_a_gather_that_lands_after_the_lease_stores_nothing_and_reports_the_lease() -> None:
    """The write is queued at once behind the gather, on the device (no host wait between them), under the lease as
    its device deadline: the device reaches it only once the gather has landed, past the lease, and stores
    nothing."""
    with create_transport(TransportConfig(backend="cuda_ipc")) as reader, create_transport(BOUNDED) as writer:
        ring = reader.allocate(NBYTES, device="cuda")
        remote = writer.import_remote(reader.export(ring))
        source = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        src = writer.register(source)
        side = torch.cuda.Stream()
        with StreamGate() as gate:
            gate.hold(side)  # a gather the GPU finishes only after the lease has ended
            with torch.cuda.stream(side):
                source.fill_(9)
                gathered = torch.cuda.Event()
                gathered.record(side)
            write = writer.write_batch(src, remote, [(0, 0, NBYTES)], gathered, not_after=time.monotonic() + 0.1)
            assert writer.ops_issued == 1, "queued at the call, behind the gather"
            time.sleep(0.2)
        [completion] = wait_for(writer, [write], timeout_s=30).values()
        assert gathered.query()
        assert int(ring.tensor.count_nonzero()) == 0, "a write past its lease moved bytes"
        assert not completion.ok and completion.reason == LEASE_EXPIRED, completion


def test_a_write_the_device_reaches_in_time_lands_although_its_lease_ends_before_its_completion_is_polled() -> None:
    with create_transport(TransportConfig(backend="cuda_ipc")) as reader, create_transport(BOUNDED) as writer:
        ring = reader.allocate(NBYTES, device="cuda")
        remote = writer.import_remote(reader.export(ring))
        src = writer.register(torch.full((NBYTES,), 3, dtype=torch.uint8, device="cuda"))
        write = writer.write_batch(src, remote, [(0, 0, NBYTES)], not_after=time.monotonic() + 0.05)
        time.sleep(0.1)
        [completion] = wait_for(writer, [write], timeout_s=30).values()
        assert completion.ok, completion
        assert bool((ring.tensor == 3).all())


@pytest.mark.parametrize("shift", [0, 1, 2, 4, 8], ids=lambda s: f"offset-{s}")
def test_bounded_copies_land_bit_exact_at_every_alignment(shift: int) -> None:
    generator = torch.Generator().manual_seed(shift)
    data = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=generator)
    slices = [(shift, 4096 + shift, 100_003), (200_000, shift, 64), (300_000 + shift, 600_000, 1 << 20)]
    with create_transport(TransportConfig(backend="cuda_ipc")) as reader, create_transport(BOUNDED) as writer:
        ring = reader.allocate(NBYTES, device="cuda")
        remote = writer.import_remote(reader.export(ring))
        src = writer.register(data.cuda())
        write = writer.write_batch(src, remote, slices, not_after=time.monotonic() + 10)
        assert wait_for(writer, [write], timeout_s=30)[write].ok
        expected = torch.zeros(NBYTES, dtype=torch.uint8)
        for s_off, d_off, n in slices:
            expected[d_off : d_off + n] = data[s_off : s_off + n]
        assert torch.equal(ring.tensor.cpu(), expected)


def test_a_recalibration_whose_readings_all_run_long_keeps_a_young_mapping_and_refuses_an_old_one(monkeypatch) -> None:
    """A busy engine process can keep the launcher thread off the GIL for milliseconds after each clock reading:
    the mapping measured before stays in use (writes go on) while it is young, and a clock with no young mapping
    fails the write rather than guess a deadline."""
    from kvstage.errors import TransportError
    from kvstage.transport.data import bounded_copy

    clock = bounded_copy.DeviceClock(torch.device("cuda"))
    offset = clock._offset_ns
    monkeypatch.setattr(bounded_copy, "MAX_ROUND_TRIP_NS", -1)  # every reading now counts as too slow
    clock.calibrate()
    assert clock._offset_ns == offset and clock._next_try <= time.monotonic() + bounded_copy.RETRY_S
    clock._calibrated -= bounded_copy.MAX_MAPPING_AGE_S
    with pytest.raises(TransportError, match="every reading took over 2 ms"):
        clock.calibrate()
