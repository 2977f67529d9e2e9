"""The multi-host harness itself (kvstage.e2e.hosts): each host reaches the others at their addresses over links of
its own, taking the A-B link down cuts A from B only, an nftables block cuts one direction, and both heal.
Real namespaces, veth links and TCP connections between processes inside them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstage.e2e.hosts import Host, HostNet, namespaces_refused

REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"no multi-host harness here: {REFUSED}")

PORT = 7999
LISTEN = (
    "import socket, sys\ns = socket.create_server((sys.argv[1], int(sys.argv[2])))\nwhile True: s.accept()[0].close()"
)
CONNECT = "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()"


@pytest.fixture(scope="module")
def net() -> Iterator[HostNet]:
    with HostNet() as made:
        listeners = [
            subprocess.Popen(host.command([sys.executable, "-c", LISTEN, host.address, str(PORT)]))
            for host in made.hosts.values()
        ]
        try:
            deadline = time.monotonic() + 30
            while not all(reaches(None, h) for h in made.hosts.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            yield made
        finally:
            for listener in listeners:
                listener.kill()
                listener.wait()


def reaches(source: Host | None, target: Host) -> bool:
    """Whether a process on `source` (None: the operator) opens a TCP connection to `target`'s address."""
    argv = [sys.executable, "-c", CONNECT, target.address, str(PORT)]
    return subprocess.run(source.command(argv) if source else argv, capture_output=True).returncode == 0


def test_every_host_reaches_every_other_at_its_own_address(net: HostNet) -> None:
    hosts = list(net.hosts.values())
    assert len({h.address for h in hosts}) == 3
    assert all(reaches(a, b) for a in hosts for b in hosts if a is not b)


def test_taking_the_a_b_link_down_cuts_a_from_b_only_until_it_is_up_again(net: HostNet) -> None:
    a, b, c = (net.hosts[n] for n in "ABC")
    net.link_down("A", "B")
    try:
        assert not reaches(a, b) and not reaches(b, a)
        assert reaches(a, c) and reaches(b, c) and reaches(None, a)
    finally:
        net.link_up("A", "B")
    assert reaches(a, b) and reaches(b, a)


def test_a_one_way_block_drops_what_a_sends_to_b_and_nothing_else(net: HostNet) -> None:
    a, b, c = (net.hosts[n] for n in "ABC")
    net.block("A", "B")
    try:
        assert not reaches(a, b)
        assert not reaches(b, a)  # B's SYN arrives, A's answer is dropped: TCP needs both directions
        assert reaches(a, c) and reaches(c, b)
    finally:
        net.unblock("A")
    assert reaches(a, b) and reaches(b, a)
