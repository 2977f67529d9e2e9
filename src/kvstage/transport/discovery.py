"""Instance discovery: which prefill and decode instances exist now, for whoever routes requests to them.

Owns the one small interface a router needs from a directory, and its implementation over either directory client
(transport/directory.py: `kvstage bootstrap` or etcd):
- `InstanceDirectory`: `list_instances()` (every instance with a registered rank: name, role, TP size, OpenAI
  URL, KV layout, whether all its ranks are registered) and `wait_changed(known, timeout_s)` (the listing once it
  differs from `known`, or as it is after `timeout_s`), both blocking and bounded; `close()`;
- `PolledDirectory`: the interface over a directory client; it follows changes by asking every `poll_s` (on etcd
  the client answers from its watch-fed mirror, so asking is local);
- `open_instance_directory`: the directory an address names (`tcp://HOST:PORT` or `etcd://HOST:PORT/NAMESPACE`).

Invariants: every call is bounded by the client's timeout (`wait_changed` by `timeout_s` plus one request); a
failed request raises `TransportError`, never returns a partial listing. For one thread, like `BootstrapClient`.
Called by the router's discovery (`kvstage.router.discovery`).
"""

from __future__ import annotations

import time
from typing import Protocol

from kvstage.transport.bootstrap import InstanceEntry
from kvstage.transport.directory import Directory, open_directory

Listing = tuple[InstanceEntry, ...]


class InstanceDirectory(Protocol):
    def list_instances(self) -> Listing:
        """Every instance with a registered rank, sorted by (role, name); `TransportError` when it cannot tell."""
        ...

    def wait_changed(self, known: Listing, timeout_s: float) -> Listing:
        """The listing as soon as it differs from `known`, else as it is after about `timeout_s`."""
        ...

    def close(self) -> None: ...


class PolledDirectory:
    """`InstanceDirectory` over a directory client, asked every `poll_s` while waiting for a change."""

    def __init__(self, client: Directory, *, poll_s: float = 1.0) -> None:
        self._client = client
        self._poll_s = poll_s

    def list_instances(self) -> Listing:
        return tuple(self._client.list_instances())

    def wait_changed(self, known: Listing, timeout_s: float) -> Listing:
        deadline = time.monotonic() + timeout_s
        while True:
            listing = self.list_instances()
            left = deadline - time.monotonic()
            if listing != known or left <= 0:
                return listing
            time.sleep(min(self._poll_s, left))

    def close(self) -> None:
        self._client.close()


def open_instance_directory(
    address: str, *, timeout_s: float = 2.0, poll_s: float = 1.0, secret: bytes | None = None
) -> InstanceDirectory:
    """The directory `address` names (`ConfigError` for a malformed etcd address)."""
    return PolledDirectory(open_directory(address, timeout_s=timeout_s, secret=secret, follow=True), poll_s=poll_s)
