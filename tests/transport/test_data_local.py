"""The local (shared-memory) backend's ownership of its segments, across real processes."""

from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvstage.errors import TransportError
from kvstage.transport.data import RegionDescriptor, TransportConfig, create_transport
from kvstage.transport.data.local import ProcessWatch
from kvstage.transport.data.loopback import ReaderPeer, digest, measure_raw_bulk, scattered_slices, wait_for


def segment_path(descriptor: RegionDescriptor, shm_dir: Path) -> Path:
    [path] = [p for p in shm_dir.glob("kvstage-*") if descriptor.payload.find(p.name.encode()) >= 0]
    return path


def test_only_the_owner_unlinks_its_segment_and_a_closed_owner_fails_later_writes(tmp_path: Path) -> None:
    config = TransportConfig(shm_dir=str(tmp_path))
    reader = ReaderPeer(config, 1 << 16)
    path = segment_path(reader.descriptor, tmp_path)
    with create_transport(TransportConfig(shm_dir=str(tmp_path))) as writer:
        remote = writer.import_remote(reader.descriptor)
        source = writer.register(torch.full((1 << 16,), 5, dtype=torch.uint8))
        first = writer.write(source, 0, remote, 0, 1 << 16)
        assert wait_for(writer, [first])[first].ok
        writer.forget_remote(remote)
    assert path.exists(), "a writer closing its transport must not unlink the reader's segment"
    assert reader.digest(0, 1 << 16) == digest(torch.full((1 << 16,), 5, dtype=torch.uint8))

    with create_transport(TransportConfig(shm_dir=str(tmp_path))) as writer:
        remote = writer.import_remote(reader.descriptor)
        source = writer.allocate(16)
        reader.close_transport()
        assert not path.exists()
        late = writer.write(source, 0, remote, 0, 16)
        assert wait_for(writer, [late])[late].reason.startswith("peer closed")
    reader.stop()


def test_segment_of_a_killed_owner_is_swept_by_the_next_transport(tmp_path: Path) -> None:
    reader = ReaderPeer(TransportConfig(shm_dir=str(tmp_path)), 4096)
    path = segment_path(reader.descriptor, tmp_path)
    reader.kill()
    assert path.exists()

    with create_transport(TransportConfig(shm_dir=str(tmp_path))) as survivor:
        live = survivor.allocate(4096)
        assert not path.exists()
        assert segment_path(survivor.export(live), tmp_path).exists()
    assert list(tmp_path.glob("kvstage-*")) == []


def test_caller_memory_is_exported_by_process_and_address_not_as_a_segment() -> None:
    with create_transport(TransportConfig()) as transport:
        tensor = torch.zeros(64, dtype=torch.float32)
        region = transport.register(tensor)
        assert region.nbytes == 256
        ref = msgspec.msgpack.decode(transport.export(region).payload)
        assert (ref["type"], ref["pid"], ref["address"]) == ("process", os.getpid(), tensor.data_ptr())


def test_import_refuses_a_descriptor_naming_a_path_outside_the_segment_namespace(tmp_path: Path) -> None:
    with create_transport(TransportConfig(shm_dir=str(tmp_path))) as transport:
        for name in ("../etc/passwd", "kvstage-1-zz-1", "kvstage-99999999-0123456789ab-1"):
            payload = msgspec.msgpack.encode({"segment": name, "pid": 1})
            with pytest.raises(TransportError):
                transport.import_remote(RegionDescriptor("local", "evil", 1, 16, payload))


def test_closing_with_writes_in_flight_reports_each_of_them_failed_exactly_once() -> None:
    with ReaderPeer(TransportConfig(), 1 << 22) as reader:
        writer = create_transport(TransportConfig())
        source = writer.allocate(1 << 22)
        remote = writer.import_remote(reader.descriptor)
        transfers = [writer.write(source, 0, remote, 0, 1 << 22) for _ in range(4)]
        writer.close()
        completions = writer.poll() + writer.poll()
    assert sorted(c.transfer_id for c in completions) == transfers
    assert all(not c.ok and "closed" in c.reason for c in completions)
    with pytest.raises(TransportError, match="closed"):
        writer.write(source, 0, remote, 0, 16)


def test_raw_bulk_harness_counts_one_operation_for_bulk_and_one_per_slice() -> None:
    result = measure_raw_bulk(TransportConfig(), 1 << 20, 4096, repeats=1)
    assert (result.bulk_ops, result.slice_ops) == (1, 256)
    assert result.bulk_gbps > 0 and result.slice_gbps > 0


def test_scattered_slices_cover_both_regions_exactly_once_without_adjacent_neighbours() -> None:
    slices = scattered_slices(1 << 20, 4096)
    for column in (0, 1):
        starts = sorted(s[column] for s in slices)
        assert starts == list(range(0, 1 << 20, 4096))
    for a, b in itertools.pairwise(slices):
        assert b[0] != a[0] + 4096 and b[1] != a[1] + 4096


def test_a_watched_owner_reads_dead_once_it_exits_even_before_it_is_reaped() -> None:
    """The pidfd watch that replaced a /proc read per write: alive while the process runs, dead from its exit on
    (a zombie its parent has not waited for included), and its descriptor goes with the last region of the pid."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ProcessWatch()
    try:
        watch.watch(child.pid)
        watch.watch(child.pid)
        assert watch.alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while watch.alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.alive(child.pid)
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert stat[stat.rfind(")") + 2] == "Z"  # not reaped yet: a zombie, and already dead to the watch
        fds = len(os.listdir("/proc/self/fd"))
        watch.release(child.pid)
        assert len(os.listdir("/proc/self/fd")) == fds  # one region of the pid is still imported
        watch.release(child.pid)
        assert len(os.listdir("/proc/self/fd")) == fds - 1
    finally:
        child.kill()
        child.wait()
        watch.close()


def test_a_pid_that_never_ran_reads_dead() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        unused = int(f.read()) + 1  # above the largest pid the kernel hands out
    assert not ProcessWatch().alive(unused)


def test_a_watch_works_with_descriptors_past_1024_as_a_busy_engine_process_holds() -> None:
    """`select` refuses descriptors of 1024 and above; the pidfd a watch opens may be one in an engine's process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ProcessWatch()
    try:
        while not held or held[-1] < 1100:
            held.append(os.dup(0))
        watch.watch(child.pid)
        assert watch.alive(child.pid)
        child.kill()
        child.wait()
        assert not watch.alive(child.pid)
    finally:
        child.kill()
        child.wait()
        watch.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
