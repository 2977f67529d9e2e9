"""The local backend on a shared-memory filesystem too small for a region (Docker's default /dev/shm is 64 MiB).

Each test runs a real process in its own user and mount namespace (`unshare -rm`, no privilege needed where the
kernel allows unprivileged user namespaces) over a private 1 MiB tmpfs; where `unshare` is refused it is skipped."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MOUNT = 'mount -t tmpfs -o size=1m none "$0"'

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from kvstage.errors import TransportError
    from kvstage.transport.data import TransportConfig, create_transport
    from kvstage.transport.data.loopback import wait_for

    shm_dir = sys.argv[1]
    config = TransportConfig(backend="local", shm_dir=shm_dir)
    with create_transport(config) as reader, create_transport(config) as writer:
        try:
            region = reader.allocate(8 << 20)
        except TransportError as err:
            print("REFUSED", err, flush=True)
        else:  # the old behaviour: allocate succeeded; writing it all dies of SIGBUS
            print("ALLOCATED", flush=True)
            source = writer.register(torch.ones(8 << 20, dtype=torch.uint8))
            done = writer.write(source, 0, writer.import_remote(reader.export(region)), 0, 8 << 20)
            print("WRITE", wait_for(writer, [done], 30)[done], flush=True)
        print("LEFT", sorted(os.listdir(shm_dir)), flush=True)
        small = reader.allocate(256 << 10)
        source = writer.register(torch.full((256 << 10,), 7, dtype=torch.uint8))
        done = writer.write(source, 0, writer.import_remote(reader.export(small)), 0, 256 << 10)
        ok = wait_for(writer, [done], 30)[done].ok
        print("SMALL", ok, bool((small.tensor == 7).all()), flush=True)
    """
)


def run_in_tiny_tmpfs(shm_dir: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` under `python -c` with `shm_dir` replaced, in a private mount namespace, by a 1 MiB tmpfs."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux and util-linux unshare to give the process a private tmpfs")
    probe = subprocess.run(
        [unshare, "-rm", "sh", "-c", MOUNT, str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm with a tmpfs mount is refused here: {probe.stderr.strip()}")
    return subprocess.run(
        [unshare, "-rm", "sh", "-c", f'{MOUNT} && exec "$1" -c "$2" "$0"', str(shm_dir), sys.executable, script],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_allocate_larger_than_the_shared_memory_filesystem_fails_at_once_naming_directory_size_and_free_space(
    tmp_path: Path,
) -> None:
    done = run_in_tiny_tmpfs(tmp_path, CHILD)
    out = done.stdout
    assert done.returncode == 0, f"the process died (rc {done.returncode}):\n{out}\n{done.stderr[-3000:]}"
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert refused, f"allocate of 8 MiB in a 1 MiB tmpfs did not fail:\n{out}"
    assert str(tmp_path) in refused[0] and str(8 << 20) in refused[0] and "bytes free" in refused[0]
    assert "LEFT []" in out, f"the refused segment file was left behind:\n{out}"
    assert "SMALL True True" in out, f"a region that fits must still work after the refusal:\n{out}"
