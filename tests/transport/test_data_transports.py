"""Behaviour every data backend shares, checked between two real processes for local, mooncake and nixl.

The reader is a spawned child process (`ReaderPeer`) that owns the target region; this test process is the
writer. Bytes are compared by SHA-256 digests taken on each side.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from kvstage.errors import ConfigError, ProtocolError, TransportError, TransportUnavailable
from kvstage.transport.data import (
    RegionDescriptor,
    TransportConfig,
    create_transport,
    decode_descriptor,
    encode_descriptor,
)
from kvstage.transport.data.base import MAX_DESCRIPTOR_PAYLOAD, DataTransport
from kvstage.transport.data.loopback import ReaderPeer, digest, scattered_slices, wait_for

REGION = 1 << 20
BACKENDS = ["local", "mooncake", "nixl"]


def config(backend: str) -> TransportConfig:
    return TransportConfig(backend=backend, write_timeout_s=20.0)


@pytest.fixture(scope="module", params=BACKENDS)
def peer(request: pytest.FixtureRequest) -> Iterator[ReaderPeer]:
    with ReaderPeer(config(request.param), REGION) as reader:
        yield reader


@pytest.fixture
def writer(peer: ReaderPeer) -> Iterator[DataTransport]:
    with create_transport(config(peer.descriptor.backend)) as transport:
        yield transport


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_bulk_and_batched_slices_land_bit_exact_in_the_reader_process(peer: ReaderPeer, writer: DataTransport) -> None:
    source = writer.register(random_bytes(REGION, seed=7))
    remote = writer.import_remote(decode_descriptor(encode_descriptor(peer.descriptor)))
    slices = [(s + 300_000, d, n) for s, d, n in scattered_slices(64 * 1024, 1024)]
    expected = torch.frombuffer(bytearray(peer.read(0, REGION)), dtype=torch.uint8)

    bulk = writer.write(source, 0, remote, REGION // 2, REGION // 4)
    batch = writer.write_batch(source, remote, slices)
    done = wait_for(writer, [bulk, batch], timeout_s=30)

    assert [(c.ok, c.reason, c.ops) for c in (done[bulk], done[batch])] == [(True, "", 1), (True, "", 64)]
    assert writer.ops_issued == 65
    assert writer.in_flight == 0
    expected[REGION // 2 : REGION // 2 + REGION // 4] = source.tensor[: REGION // 4]
    for s_off, d_off, length in slices:
        expected[d_off : d_off + length] = source.tensor[s_off : s_off + length]
    assert peer.digest(0, REGION) == digest(expected)


def test_every_completion_wakes_the_owner_so_it_need_not_poll(peer: ReaderPeer, writer: DataTransport) -> None:
    woken = threading.Semaphore(0)
    writer.on_completion(woken.release)
    source = writer.register(random_bytes(REGION, seed=3))
    remote = writer.import_remote(decode_descriptor(encode_descriptor(peer.descriptor)))
    landed = writer.write(source, 0, remote, 0, REGION)
    refused = writer.write(source, 0, remote, REGION, 1)  # outside the region: fails at once, and wakes too
    assert woken.acquire(timeout=30) and woken.acquire(timeout=30)
    done = {c.transfer_id: c for c in writer.poll()}  # no waiting: both are ready once both wake-ups came
    assert done[landed].ok and not done[refused].ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_allocation_is_a_hint_that_still_gives_zeroed_memory(backend: str) -> None:
    with create_transport(config(backend)) as transport:
        region = transport.allocate(4096, pinned=True)
        assert region.nbytes == 4096 and not region.tensor.any()
        assert region.tensor.is_pinned() == (torch.cuda.is_available() and backend == "mooncake")


def test_write_outside_the_remote_region_fails_with_a_reason_and_moves_no_byte(
    peer: ReaderPeer, writer: DataTransport
) -> None:
    source = writer.allocate(4096)
    source.tensor.fill_(0xAB)
    remote = writer.import_remote(peer.descriptor)
    before = peer.digest(REGION - 4096, 4096)

    transfer = writer.write(source, 0, remote, REGION - 100, 4096)
    [completion] = wait_for(writer, [transfer], timeout_s=10).values()

    assert not completion.ok
    assert "outside remote region" in completion.reason
    assert peer.digest(REGION - 4096, 4096) == before
    assert writer.ops_issued == 0


def test_write_through_a_forgotten_remote_or_unregistered_source_fails_with_a_reason(
    peer: ReaderPeer, writer: DataTransport
) -> None:
    source = writer.allocate(4096)
    remote = writer.import_remote(peer.descriptor)
    writer.forget_remote(remote)
    forgotten = writer.write(source, 0, remote, 0, 16)
    writer.unregister(source)
    unregistered = writer.write(source, 0, writer.import_remote(peer.descriptor), 0, 16)

    done = wait_for(writer, [forgotten, unregistered], timeout_s=10)

    assert "not imported" in done[forgotten].reason
    assert "not registered" in done[unregistered].reason
    assert not done[forgotten].ok and not done[unregistered].ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_to_a_killed_peer_fails_naming_the_peer_gone_instead_of_raising_or_hanging(backend: str) -> None:
    reader = ReaderPeer(config(backend), REGION)
    with create_transport(config(backend)) as writer:
        source = writer.register(random_bytes(REGION, seed=3))
        remote = writer.import_remote(reader.descriptor)
        warm = writer.write(source, 0, remote, 0, REGION)
        assert wait_for(writer, [warm], timeout_s=30)[warm].ok
        reader.kill()

        transfers = [writer.write(source, 0, remote, 0, REGION) for _ in range(3)]
        done = wait_for(writer, transfers, timeout_s=40)

    failed = [c for c in done.values() if not c.ok]
    assert failed, "writes into a SIGKILLed peer's memory all reported success"
    assert all(c.reason for c in failed)
    assert all(c.peer_gone for c in failed), "the transport's cause (peer gone) reaches the writer"
    reader.stop()


@pytest.mark.parametrize(
    ("backend", "module", "extra"),
    [("mooncake", "mooncake.engine", "kvstage[mooncake]"), ("nixl", "nixl_cu12._api", "kvstage[nixl]")],
)
def test_missing_backend_package_error_names_the_pip_extra(
    monkeypatch: pytest.MonkeyPatch, backend: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TransportUnavailable, match=rf"pip install '{extra}'".replace("[", r"\[").replace("]", r"\]")):
        create_transport(TransportConfig(backend=backend))


def test_descriptor_from_the_wire_is_bounded_and_checked() -> None:
    good = RegionDescriptor("local", "owner", 1, 4096, b"x")
    assert decode_descriptor(encode_descriptor(good)) == good
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_descriptor(encode_descriptor(RegionDescriptor("local", "o", 1, 1, b"x" * (MAX_DESCRIPTOR_PAYLOAD + 1))))
    with pytest.raises(ProtocolError, match="unknown backend"):
        decode_descriptor(encode_descriptor(RegionDescriptor("carrier-pigeon", "o", 1, 1, b"")))
    with pytest.raises(ProtocolError, match="nbytes"):
        decode_descriptor(encode_descriptor(RegionDescriptor("local", "o", 1, 0, b"")))
    with pytest.raises(ProtocolError, match="malformed"):
        decode_descriptor(b"\x93\x01\x02")


def test_descriptor_of_another_backend_is_refused_on_import() -> None:
    with create_transport(TransportConfig()) as transport, pytest.raises(TransportError, match="backend 'nixl'"):
        transport.import_remote(RegionDescriptor("nixl", "o", 1, 16, b""))


def test_a_descriptor_that_overstates_the_region_is_caught_before_bytes_land_outside_it(
    peer: ReaderPeer, writer: DataTransport
) -> None:
    real = peer.descriptor
    forged = RegionDescriptor(real.backend, real.owner, real.region_id, 4 * REGION, real.payload)
    if real.backend == "local":
        with pytest.raises(TransportError, match=f"has {REGION} bytes"):
            writer.import_remote(forged)
        return
    remote = writer.import_remote(forged)  # mooncake and nixl cannot check the size here: their engines must
    source = writer.register(random_bytes(REGION, seed=11))

    beyond = writer.write(source, 0, remote, 2 * REGION, 4096)
    [refused] = wait_for(writer, [beyond], timeout_s=30).values()
    inside = writer.write(source, 0, remote, 0, REGION)
    [accepted] = wait_for(writer, [inside], timeout_s=30).values()

    assert not refused.ok and refused.reason
    assert accepted.ok, accepted.reason
    assert peer.digest(0, REGION) == digest(source.tensor)


def test_memory_registered_by_address_is_a_write_source(peer: ReaderPeer, writer: DataTransport) -> None:
    foreign = bytearray(random_bytes(8192, seed=5).numpy().tobytes())
    address = ctypes.addressof(ctypes.c_char.from_buffer(foreign))
    source = writer.register_address(address, len(foreign))
    remote = writer.import_remote(peer.descriptor)

    transfer = writer.write(source, 0, remote, 4096, 8192)

    assert wait_for(writer, [transfer], timeout_s=30)[transfer].ok
    assert peer.read(4096, 8192) == bytes(foreign)
    writer.unregister(source)


@pytest.mark.parametrize("workers", [1, 4])
def test_nixl_writes_in_flight_from_several_threads_land_bit_exact_with_one_or_several_ucx_workers(
    workers: int,
) -> None:
    """One UCX worker runs NIXL in STRICT mode (every call serialised); several run it in RW mode, where writes
    posted from the transport's worker threads copy at the same time. Both must land every byte."""
    pytest.importorskip("nixl_cu12")

    def cfg() -> TransportConfig:  # a fresh agent name for each side
        return TransportConfig(backend="nixl", write_timeout_s=20.0, nixl_workers=workers)

    with ReaderPeer(cfg(), REGION) as reader, create_transport(cfg()) as transport:
        source = transport.register(random_bytes(REGION, seed=workers))
        remote = transport.import_remote(reader.descriptor)
        piece = REGION // 32
        ids = [transport.write(source, i * piece, remote, REGION - (i + 1) * piece, piece) for i in range(32)]
        done = wait_for(transport, ids, timeout_s=30)
        assert all(c.ok for c in done.values()), [c.reason for c in done.values() if not c.ok]
        expected = torch.cat([source.tensor[i * piece : (i + 1) * piece] for i in reversed(range(32))])
        assert reader.digest(0, REGION) == digest(expected)


def test_nixl_workers_below_one_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="nixl_workers must be at least 1, got 0"):
        TransportConfig(backend="nixl", nixl_workers=0)


_MOONCAKE_ROUND_TRIP = """
from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.loopback import wait_for
a = create_transport(TransportConfig(backend="mooncake"))
b = create_transport(TransportConfig(backend="mooncake"))
src, dst = a.allocate(4096), b.allocate(4096)
done = wait_for(a, [a.write(src, 0, a.import_remote(b.export(dst)), 0, 4096)], 30)
assert all(c.ok for c in done.values())
a.close()
b.close()
"""


@pytest.mark.parametrize("level", [None, "INFO"])
def test_mooncake_keeps_its_info_lines_off_stderr_unless_mc_log_level_asks(level: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"} | ({"MC_LOG_LEVEL": level} if level else {})
    proc = subprocess.run(
        [sys.executable, "-c", _MOONCAKE_ROUND_TRIP], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    info_lines = [line for line in proc.stderr.splitlines() if line.startswith("I")]
    assert bool(info_lines) == (level == "INFO"), proc.stderr[-2000:]


def test_local_writes_land_bit_exact_in_memory_the_reader_allocated_itself_and_registered() -> None:
    with ReaderPeer(config("local"), REGION, caller_memory=True) as reader, create_transport(config("local")) as writer:
        source = writer.register(random_bytes(REGION, seed=11))
        remote = writer.import_remote(decode_descriptor(encode_descriptor(reader.descriptor)))
        slices = [(s + 300_000, d, n) for s, d, n in scattered_slices(REGION // 2, 256)]  # 2048: two system calls
        runs = writer.write_batch(source, remote, slices)
        bulk = writer.write(source, 0, remote, REGION // 2, REGION // 4)
        outside = writer.write(source, 0, remote, REGION - 8, 16)
        done = wait_for(writer, [runs, bulk, outside], timeout_s=30)
        assert done[runs].ok and done[bulk].ok, (done[runs].reason, done[bulk].reason)
        assert not done[outside].ok and "outside" in done[outside].reason
        expected = torch.zeros(REGION // 2, dtype=torch.uint8)
        for s_off, d_off, length in slices:
            expected[d_off : d_off + length] = source.tensor[s_off : s_off + length]
        assert reader.digest(0, REGION // 2) == digest(expected)
        assert reader.digest(REGION // 2, REGION // 4) == digest(source.tensor[: REGION // 4])
        reader.kill()
        gone = writer.write(source, 0, remote, 0, 4096)
        assert wait_for(writer, [gone], timeout_s=30)[gone].peer_gone
