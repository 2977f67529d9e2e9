"""TCP_USER_TIMEOUT on connections that a library opened in this process: the write bound Mooncake's TCP lacks.

Owns: `ConnectionTimeouts`, which finds this process's TCP connections to a set of watched endpoints (peer address
and port) and sets the kernel's TCP_USER_TIMEOUT on each, and `listening_ports`, the ports this process listens on.

Why. Data a TCP connection has sent and the peer has not acknowledged is sent again by the kernel for 13 to 30
minutes (`net.ipv4.tcp_retries2` = 15); if the path heals within that time, the bytes land, however late. A write
posted into a one-way link cut did exactly that over Mooncake (tests/e2e/test_hosts.py), and Mooncake's TCP
transport offers no setting against it (UCX has `UCX_TCP_USER_TIMEOUT`). With TCP_USER_TIMEOUT the kernel aborts a
connection whose data has stayed unacknowledged that long, and drops what it had not delivered, so nothing sent on
it lands afterwards. The kernel measures that time from the first retransmission, so the option bounds a
connection even when it is set while the connection is already retransmitting.

How. The sockets belong to Mooncake's engine (C++), so they are found through procfs: each socket among
/proc/self/fd that has not been settled yet is duplicated (`os.dup`: options belong to the socket, not to the
descriptor), checked to still be the socket procfs named (its inode), and asked for its peer; one connected to a
watched endpoint gets the option. The duplicate is closed at once; the owner's descriptor is never touched. A
socket that is not connected yet is looked at again at the next `apply`.

Invariants: only TCP sockets connected to a watched endpoint are changed, and only this one option; what is
remembered is pruned to the sockets still open at each `apply` (bounded by the process's descriptors). No I/O
beyond procfs and the socket calls above. Called by `kvstage.transport.data.mooncake` (its watcher thread, while
writes are in flight, and at start for its own listening ports).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Container, Iterator

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"
_SOCKET_LINK = "socket:["
#: Linux's option number, for Pythons built without the constant.
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def _normal(address: str) -> str:
    """`address` as one canonical text: an IPv4-mapped IPv6 address as its IPv4 form, no zone."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _socket_fds() -> dict[int, int]:
    """This process's socket descriptors: socket inode -> descriptor (OSError where procfs is missing)."""
    found: dict[int, int] = {}
    for name in os.listdir(_FD_DIR):
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed since the listing
            continue
        if target.startswith(_SOCKET_LINK):
            found[int(target[len(_SOCKET_LINK) : -1])] = int(name)
    return found


def _borrow(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of descriptor `fd` as a socket object (the caller closes it), or None if `fd` no longer names
    the socket `inode` (closed, or reused since procfs was read) or is not an internet TCP socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    if os.fstat(dup).st_ino != inode:
        os.close(dup)
        return None
    sock = socket.socket(fileno=dup)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def tcp_sockets(fds: dict[int, int] | None = None, skip: Container[int] = ()) -> Iterator[tuple[int, socket.socket]]:
    """(inode, borrowed duplicate) for each internet TCP socket among `fds` (inode -> descriptor; default: all of
    this process's) whose inode is not in `skip`; each duplicate is closed after its turn."""
    for inode, fd in (_socket_fds() if fds is None else fds).items():
        if inode in skip:
            continue
        sock = _borrow(fd, inode)
        if sock is not None:
            with sock:
                yield inode, sock


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (empty where procfs is missing)."""
    try:
        return {
            sock.getsockname()[1]
            for _, sock in tcp_sockets()
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        }
    except OSError as err:
        log.debug("cannot list this process's sockets: %s", err)
        return set()


class ConnectionTimeouts:
    """Sets TCP_USER_TIMEOUT (`timeout_s`) on this process's TCP connections to the endpoints `watch` names."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._endpoints: set[tuple[str, int]] = set()
        self._settled: set[int] = set()  # inodes bounded, or connected elsewhere
        self._lock = threading.Lock()

    def watch(self, address: str, port: int) -> None:
        """Bound connections to (`address`, `port`) from now on; `address` is an IP address (ValueError if not)."""
        endpoint = (_normal(address), port)
        with self._lock:
            if endpoint not in self._endpoints:
                self._endpoints.add(endpoint)
                self._settled.clear()  # a socket settled as "elsewhere" may be connected to this one

    def apply(self) -> int:
        """Bound every connection to a watched endpoint not bounded yet; how many were bounded now. Raises OSError
        where procfs cannot be read."""
        with self._lock:
            if not self._endpoints:
                return 0
            fds = _socket_fds()
            self._settled &= fds.keys()
            bounded = 0
            for inode, sock in tcp_sockets(fds, skip=self._settled):
                settled, hit = self._settle(sock)
                if settled:
                    self._settled.add(inode)
                bounded += hit
            return bounded

    def _settle(self, sock: socket.socket) -> tuple[bool, bool]:
        """(whether `sock` needs no further look, whether it was bounded now)."""
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return True, False  # a listener never connects
        try:
            peer = sock.getpeername()
        except OSError:
            return False, False  # not connected yet
        if (_normal(peer[0]), peer[1]) not in self._endpoints:
            return True, False
        sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, self.timeout_ms)
        return True, True
