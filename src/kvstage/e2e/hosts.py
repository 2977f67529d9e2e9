"""Several hosts on one machine: each host a network namespace of its own, joined by point-to-point veth links.

Owns `Host` (a namespace, its one address, and how to run a command inside it) and `HostNet`, which builds and
tears down the namespaces and links and cuts them: `link_down` / `link_up` take one host pair's link down and up
again (both directions, as a pulled cable or a dead switch port), `block` / `unblock` drop only one direction's
packets with an nftables rule inside the sending host's namespace.

Topology. Every pair of hosts has a veth link of its own, and so has every host with the operator (the namespace
the caller runs in: the test or demo process, which plays the client and reads the servers' health). A host has
one address, on each of its links (a /32 with a route per peer over that peer's link), so a host is reached at
the same address from everywhere and taking the A-B link down cuts A from B only: A still reaches C, and C
still reaches both. Inside a host, only its own processes use its loopback interface (a vLLM server's TP workers
talk over it); nothing crosses hosts through a loopback address.

Invariants: names (namespaces, the operator's interfaces) and the subnet are unique to this `HostNet`, so two runs
on one machine do not meet; `close` removes every namespace and link it made, also after a partial `create`.
Needs root (CAP_NET_ADMIN) and `ip`; `block` needs `nft`. `namespaces_refused` says why where that is missing.
Called by the vLLM demo (`kvstage demo --hosts 3`) and the multi-host end-to-end tests.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from kvstage.e2e.servers import Placement
from kvstage.errors import KVStageError

#: The first two octets of every subnet a `HostNet` takes (one /24 each: 10.77.N.0/24).
_PREFIX = "10.77"
#: The operator's address in every subnet.
_OPERATOR_OCTET = 254
#: The nftables table kvstage's cuts live in, inside a host's namespace.
_TABLE = "kvstage_cut"
#: Hosts of a `HostNet` share this machine's memory and host name, so UCX would take its shared-memory transports
#: between them and NIXL's writes would never cross a link: processes on them use UCX's TCP transport only.
NETWORK_ONLY_ENV = (("UCX_TLS", "tcp"),)


class HostsUnavailable(KVStageError):
    """This machine cannot make network namespaces (not root, no `ip`, or the kernel refuses)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One host: its name ("A"), network namespace and address."""

    name: str
    netns: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _run(argv: Sequence[str], stdin: str | None = None) -> None:
    done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, check=False)
    if done.returncode:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")


def _ip(netns: str | None, *args: str) -> None:
    _run(["ip", *(("-n", netns) if netns else ()), *args])


def namespaces_refused() -> str | None:
    """Why this machine cannot host a `HostNet`, or None when it can (checked by making one namespace)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"kvs-probe-{os.getpid()}"
    try:
        _ip(None, "netns", "add", probe)
    except HostsUnavailable as err:
        return f"network namespaces are refused here (root and CAP_NET_ADMIN needed): {err}"
    try:
        _ip(None, "netns", "del", probe)
    except HostsUnavailable as err:
        return str(err)
    return None


def _free_subnet() -> int:
    """A third octet N whose 10.77.N.0/24 no route of the operator's namespace uses."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
    for octet in range(1 + os.getpid() % 200, 254):
        if f"{_PREFIX}.{octet}." not in routes:
            return octet
    raise HostsUnavailable(f"every {_PREFIX}.N.0/24 subnet is in use")


class HostNet:
    """Hosts named `names` (each in its own namespace), a link between every pair and from each to the operator.
    Use as a context manager, or call `create` and `close`."""

    def __init__(self, names: Sequence[str] = ("A", "B", "C")) -> None:
        self._tag = f"kvs{os.getpid() % 100000}"
        self._octet = _free_subnet()
        self.hosts = {
            name: Host(name, f"{self._tag}-{name.lower()}", f"{_PREFIX}.{self._octet}.{i + 1}")
            for i, name in enumerate(names)
        }
        self.operator_address = f"{_PREFIX}.{self._octet}.{_OPERATOR_OCTET}"
        self._made: list[str] = []

    def __enter__(self) -> HostNet:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        try:
            for host in self.hosts.values():
                _ip(None, "netns", "add", host.netns)
                self._made.append(host.netns)
                _ip(host.netns, "link", "set", "lo", "up")
                self._link_operator(host)
            for a, b in itertools.combinations(self.hosts.values(), 2):
                self._link(a, b)
        except HostsUnavailable:
            self.close()
            raise

    def _link_operator(self, host: Host) -> None:
        """A veth from the operator's namespace (named after the host) to the host (named `op` there)."""
        mine = f"{self._tag}{host.name.lower()}"
        _ip(None, "link", "add", "name", mine, "type", "veth", "peer", "name", "op", "netns", host.netns)
        self._made.append(f"link:{mine}")
        self._address(None, mine, self.operator_address, host.address)
        self._address(host.netns, "op", host.address, self.operator_address)

    def _link(self, a: Host, b: Host) -> None:
        """A veth between hosts a and b: each end is named after the host at its other end."""
        ends = (b.name.lower(), a.name.lower())
        _ip(a.netns, "link", "add", "name", ends[0], "type", "veth", "peer", "name", ends[1], "netns", b.netns)
        self._address(a.netns, ends[0], a.address, b.address)
        self._address(b.netns, ends[1], b.address, a.address)

    @staticmethod
    def _address(netns: str | None, device: str, mine: str, peer: str) -> None:
        _ip(netns, "addr", "add", f"{mine}/32", "dev", device)
        _ip(netns, "link", "set", "dev", device, "up")
        _ip(netns, "route", "add", f"{peer}/32", "dev", device, "src", mine)

    def placement(self, name: str, secret: str) -> Placement:
        """Where a process on host `name` runs: its address, inside its namespace, under the deployment's secret."""
        host = self.hosts[name]
        return Placement(host.address, tuple(host.command([])), secret, NETWORK_ONLY_ENV)

    def close(self) -> None:
        """Remove every namespace and operator link this made (a namespace's links go with it)."""
        for made in reversed(self._made):
            with contextlib.suppress(HostsUnavailable):  # gone already: nothing left to remove
                if made.startswith("link:"):
                    _ip(None, "link", "del", made.removeprefix("link:"))
                else:
                    _ip(None, "netns", "del", made)
        self._made.clear()

    def link_down(self, a: str, b: str) -> None:
        """Take the link between hosts a and b down (both ends): neither reaches the other until `link_up`."""
        self._set_link(a, b, "down")

    def link_up(self, a: str, b: str) -> None:
        self._set_link(a, b, "up")

    def _set_link(self, a: str, b: str, state: str) -> None:
        for near, far in ((a, b), (b, a)):
            _ip(self.hosts[near].netns, "link", "set", "dev", far.lower(), state)
        for near, far in ((a, b), (b, a)):  # a device taken down loses its routes
            if state == "up":
                host = self.hosts[near]
                _ip(
                    host.netns,
                    "route",
                    "replace",
                    f"{self.hosts[far].address}/32",
                    "dev",
                    far.lower(),
                    "src",
                    host.address,
                )

    def block(self, source: str, target: str) -> None:
        """Drop every packet host `source` sends to host `target` (an nftables rule in source's namespace); the
        other direction still flows."""
        if shutil.which("nft") is None:
            raise HostsUnavailable("no `nft` command: install nftables (make system-deps)")
        host = self.hosts[source]
        script = (
            f"table inet {_TABLE} {{\n chain out {{\n  type filter hook output priority 0;\n"
            f"  ip daddr {self.hosts[target].address} drop\n }}\n}}\n"
        )
        _run(host.command(["nft", "-f", "-"]), stdin=script)

    def unblock(self, source: str) -> None:
        """Remove every cut `block` put into host `source`'s namespace."""
        _run(self.hosts[source].command(["nft", "delete", "table", "inet", _TABLE]))
