"""Where ranks find each other: the directory interface and the client for a directory address.

Owns `Directory`, the methods every directory client offers (`BootstrapClient` for `kvstage bootstrap`'s
`tcp://HOST:PORT`, `EtcdDirectory` for `etcd://HOST:PORT`), and `open_directory`, which picks the client by the
address's scheme. `follow` asks for a client that is looked up again and again (an agent's resolver): on etcd it keeps
a mirror fed by a watch and calls `on_change` when a record changes; the bootstrap client has no push and ignores
both (its callers poll).

Invariants: a client is for one thread; every call is bounded by `timeout_s`; etcd's client is imported only for an
etcd address, so a deployment without etcd needs no etcd3gw. Called by runtime/ (agents and their
resolver) and router/.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstage.transport.bootstrap import BootstrapClient, InstanceEntry, PeerRecord, Role

#: The scheme of a directory on etcd; its client (and the etcd3gw package) is imported only for such an address.
ETCD_SCHEME = "etcd"


class Directory(Protocol):
    """A client of the directory of peer records."""

    address: str

    def register(self, record: PeerRecord) -> None: ...

    def renew(self) -> None:
        """Keep the records registered through this client alive (call it often: it renews only when due)."""

    def unregister(self, peer_id: str, session: int) -> None: ...

    def lookup(self, peer_ids: list[str]) -> dict[str, PeerRecord]: ...

    def lookup_instance(self, instance: str, role: Role) -> list[PeerRecord]: ...

    def wait_for_instance(self, instance: str, role: Role, tp_size: int, timeout_s: float) -> list[PeerRecord]: ...

    def list_instances(self) -> list[InstanceEntry]:
        """Every instance with a registered rank, summed up, sorted by (role, name)."""

    def close(self) -> None: ...


def open_directory(
    address: str,
    *,
    timeout_s: float = 5.0,
    secret: bytes | None = None,
    follow: bool = False,
    on_change: Callable[[], None] | None = None,
) -> Directory:
    """The client for `address`: `etcd://HOST:PORT[/NAMESPACE][?lease_s=N]` or `kvstage bootstrap`'s
    `tcp://HOST:PORT` (`ConfigError` for a malformed etcd address)."""
    if address.startswith(f"{ETCD_SCHEME}://"):
        from kvstage.transport.etcd import EtcdDirectory

        return EtcdDirectory(address, timeout_s=timeout_s, secret=secret, follow=follow, on_change=on_change)
    return BootstrapClient(address, timeout_s=timeout_s, secret=secret)
