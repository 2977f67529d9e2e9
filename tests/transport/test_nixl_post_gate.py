"""A NIXL write whose deadline passes while a peer's import holds NIXL's metadata lock is refused unposted, not posted
late (R13). In NIXL's RW mode a post waits inside `initialize_xfer` for any `add_remote_agent` under way, and
loading a peer that drops its SYNs takes until a SYN gets through; a write checked before that wait went out after
its lease. Real NIXL agents: readers in their own processes, the writer in this one; the unreachable peer's
listening ports are dropped with an nftables rule (root)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvstage.errors import TransportError
from kvstage.protocol.reasons import LEASE_EXPIRED
from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.loopback import ReaderPeer, digest, wait_for

pytest.importorskip("nixl_cu12")
pytestmark = pytest.mark.skipif(
    shutil.which("nft") is None or shutil.which("ss") is None or os.geteuid() != 0,
    reason="dropping a peer's SYNs needs root, nft and ss",
)

REGION = 1 << 16
#: How long the unreachable peer's SYNs are dropped: its import ends at the next SYN retry after that (Linux
#: retries after 1 s, then 2 s more).
DROP_S = 2.0
TABLE = f"kvstage-post-gate-{os.getpid()}"


def config() -> TransportConfig:
    return TransportConfig(backend="nixl", write_timeout_s=30.0)


def listening_ports(pid: int) -> set[int]:
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return {int(m.group(1)) for line in lines if f"pid={pid}," in line and (m := re.search(r":(\d+)\s", line))}


@contextmanager
def syns_dropped(ports: set[int]) -> Iterator[None]:
    rules = "".join(f"add rule inet {TABLE} in tcp dport {port} drop\n" for port in sorted(ports))
    script = f"add table inet {TABLE}\nadd chain inet {TABLE} in {{ type filter hook input priority 0; }}\n{rules}"
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "inet", TABLE], check=True)


def test_a_write_whose_deadline_passes_while_an_import_holds_nixl_is_refused_unposted() -> None:
    with (
        ReaderPeer(config(), REGION) as reader,
        ReaderPeer(config(), REGION) as unreachable,
        create_transport(config()) as writer,
    ):
        source = writer.register(torch.full((REGION,), 7, dtype=torch.uint8))
        remote = writer.import_remote(reader.descriptor)
        untouched = reader.digest(0, REGION)
        imported: list[str] = []

        def import_unreachable() -> None:
            try:
                writer.import_remote(unreachable.descriptor)
                imported.append("imported")
            except TransportError as err:
                imported.append(str(err))

        ports = listening_ports(unreachable.process.pid)
        assert ports, "the unreachable peer listens on no TCP port"
        with syns_dropped(ports):
            importer = threading.Thread(target=import_unreachable)
            importer.start()
            time.sleep(0.5)  # the import is connecting, holding NIXL's metadata lock
            started = time.monotonic()
            late = writer.write(source, 0, remote, 0, REGION, not_after=started + 0.5)
            time.sleep(DROP_S)
        importer.join(60)
        outcome = wait_for(writer, [late], timeout_s=60)[late]

        assert imported, "the import did not end once the SYNs got through"
        assert not outcome.ok and outcome.reason == LEASE_EXPIRED, outcome
        assert reader.digest(0, REGION) == untouched, "bytes of the refused write landed"
        on_time = writer.write(source, 0, remote, 0, REGION, not_after=time.monotonic() + 10)
        assert wait_for(writer, [on_time], timeout_s=30)[on_time].ok
        assert reader.digest(0, REGION) == digest(source.tensor)
