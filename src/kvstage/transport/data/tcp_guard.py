"""Bounds on TCP connections that a library opened in this process: the write bounds Mooncake's TCP lacks.

Owns: `ConnectionGuard`, which finds this process's TCP connections to a set of watched endpoints (peer address
and port), sets the kernel's TCP_USER_TIMEOUT on each (`bound`), and aborts them on demand (`sever`);
`tcp_table`, this network namespace's TCP sockets with their state and peer; and `listening_ports`, the ports this
process listens on.

Why a timeout. Data a TCP connection has sent and the peer has not acknowledged is sent again by the kernel for 13
to 30 minutes (`net.ipv4.tcp_retries2` = 15); if the path heals within that time, the bytes land, however late. A
write posted into a one-way link cut did exactly that over Mooncake (tests/e2e/test_hosts_agents.py), and
Mooncake's TCP transport offers no setting against it (UCX has `UCX_TCP_USER_TIMEOUT`). With TCP_USER_TIMEOUT the
kernel aborts a connection whose data has stayed unacknowledged that long, and drops what it had not delivered, so
nothing sent on it lands afterwards. The kernel measures that time from the first retransmission, so the option
bounds a connection even when it is set while the connection is already retransmitting; it bounds a connection
that is still being made (SYN sent) too.

Why severing. The timeout covers bytes already handed to the kernel, not work a library still keeps to itself:
Mooncake queues a peer's slices behind its few connections to it (4 by default), and once the kernel aborted them
it connects again and sends the queue whenever a connection succeeds, after a heal too. `sever` aborts every
connection to an endpoint, those being made included: the library sees each fail, and Mooncake then fails the work
it queued. The abort is `connect()` with an AF_UNSPEC address on a duplicate descriptor, the kernel's disconnect of
the socket itself: it drops the data not yet acknowledged, resets the peer, and wakes the owner with an error; the
owner's descriptor stays open for it to close.

How. The sockets belong to the library (C++), so they are found through procfs: /proc/self/fd names each socket
descriptor's inode, and /proc/self/net/tcp and tcp6 (this process's network namespace) each TCP socket's state and
peer, connecting ones included (which `getpeername` does not answer). A socket to act on is duplicated (`os.dup`:
options and connection belong to the socket, not to the descriptor), checked to still be the socket procfs named
(its inode), changed, and the duplicate closed at once; the owner's descriptor is never touched.

Invariants: only TCP sockets to a watched endpoint (for `bound`) or a named one (for `sever`) are changed; what is
remembered is pruned to the sockets still open at each `bound` (bounded by the process's descriptors). No I/O
beyond procfs and the socket calls above. Called by `kvstage.transport.data.mooncake` (its watcher thread, while
writes are in flight or stranded, and at start for its own listening ports).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"
_SOCKET_LINK = "socket:["
_TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
#: Linux's option number, for Pythons built without the constant.
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
#: TCP states as /proc/net/tcp writes them (include/net/tcp_states.h).
ESTABLISHED = 0x01
SYN_SENT = 0x02
TIME_WAIT = 0x06
CLOSE = 0x07
LISTEN = 0x0A
#: States in which a connection may still send: all but these.
_NOT_SENDING = frozenset({TIME_WAIT, CLOSE, LISTEN})
_LIBC = ctypes.CDLL(None, use_errno=True)
_UNSPEC = bytes(16)  # a sockaddr whose family is AF_UNSPEC (0): connect() with it disconnects the socket

Endpoint = tuple[str, int]


def endpoint(address: str, port: int) -> Endpoint:
    """(`address`, `port`) in the form this module compares: an IPv4-mapped IPv6 address as its IPv4 form, no
    zone; ValueError if `address` is not an IP address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), port


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One row of /proc/self/net/tcp(6): the socket's peer and state."""

    peer: Endpoint
    state: int


def tcp_table() -> dict[int, TcpSocket]:
    """This network namespace's TCP sockets that have an inode: inode -> peer and state. Raises OSError where
    procfs cannot be read or reads unlike Linux's (a kernel without IPv6 has no tcp6 table, which is skipped)."""
    table: dict[int, TcpSocket] = {}
    for path in _TCP_TABLES:
        try:
            with open(path) as rows:
                next(rows)  # the header
                for row in rows:
                    _add_row(table, row, path)
        except FileNotFoundError:
            if path == _TCP_TABLES[0]:
                raise
    return table


def _add_row(table: dict[int, TcpSocket], row: str, path: str) -> None:
    fields = row.split()
    try:
        inode = int(fields[9])
        if inode:  # 0: a socket no process holds (TIME_WAIT)
            table[inode] = TcpSocket(_proc_endpoint(fields[2]), int(fields[3], 16))
    except (IndexError, ValueError) as err:
        raise OSError(f"unexpected line in {path}: {row.strip()!r}") from err


def _proc_endpoint(text: str) -> Endpoint:
    """An endpoint as procfs writes it: the address as hex 32-bit words, each in this machine's byte order."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return endpoint(str(ipaddress.ip_address(raw)), int(port, 16))


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


def _connections() -> list[tuple[int, int, TcpSocket | None]]:
    """(inode, descriptor, its row of the TCP table) for each socket descriptor of this process; the row is None
    for a socket that is not TCP, or not connecting yet."""
    table = tcp_table()
    return [(inode, fd, table.get(inode)) for inode, fd in _socket_fds().items()]


def tcp_sockets() -> Iterator[tuple[int, socket.socket]]:
    """(inode, borrowed duplicate) for each internet TCP socket of this process; each duplicate is closed after
    its turn."""
    for inode, fd in _socket_fds().items():
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


def _disconnect(sock: socket.socket) -> None:
    """Abort `sock`'s connection (made or being made): unsent and unacknowledged data are dropped, the peer gets a
    reset, and whoever waits on the socket gets an error. OSError if the kernel refuses."""
    if _LIBC.connect(sock.fileno(), _UNSPEC, len(_UNSPEC)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class ConnectionGuard:
    """Sets TCP_USER_TIMEOUT (`timeout_s`) on this process's TCP connections to the endpoints `watch` names, and
    aborts connections to given endpoints (`sever`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._endpoints: set[Endpoint] = set()
        self._settled: set[int] = set()  # inodes bounded, listening, or connected elsewhere
        self._lock = threading.Lock()

    def watch(self, endpoints: Collection[Endpoint]) -> None:
        """Bound connections to `endpoints` (made by `endpoint`) from now on."""
        with self._lock:
            if not self._endpoints.issuperset(endpoints):
                self._endpoints.update(endpoints)
                self._settled.clear()  # a socket settled as "elsewhere" may be connected to one of them

    def bound(self) -> int:
        """Bound every connection to a watched endpoint not bounded yet, connecting ones too; how many were bounded
        now. Raises OSError where procfs cannot be read."""
        with self._lock:
            if not self._endpoints:
                return 0
            connections = _connections()
            self._settled &= {inode for inode, _, _ in connections}
            bounded = 0
            for inode, fd, row in connections:
                if inode in self._settled or row is None or row.state == CLOSE:  # not TCP, or not connecting yet
                    continue
                if row.peer in self._endpoints and row.state not in _NOT_SENDING:
                    bounded += self._bound(fd, inode)
                self._settled.add(inode)
            return bounded

    def _bound(self, fd: int, inode: int) -> int:
        sock = _borrow(fd, inode)
        if sock is None:
            return 0
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, self.timeout_ms)
        return 1

    def sever(self, endpoints: Collection[Endpoint]) -> int:
        """Abort every connection of this process to `endpoints` that may still send (connecting ones too); how
        many were aborted. A socket the kernel would not abort is logged and skipped. Raises OSError where procfs
        cannot be read."""
        if not endpoints:
            return 0
        severed = 0
        for inode, fd, row in _connections():
            if row is None or row.peer not in endpoints or row.state in _NOT_SENDING:
                continue
            sock = _borrow(fd, inode)
            if sock is None:
                continue
            with sock:
                try:
                    _disconnect(sock)
                except OSError as err:
                    log.warning("cannot abort this process's connection to %s:%d: %s", *row.peer, err)
                    continue
            severed += 1
        return severed
