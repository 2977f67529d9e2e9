"""Bounds on connections another library opened in this process (kvstage.transport.data.tcp_guard), with real
sockets and a real Mooncake engine: only connections to a watched endpoint get TCP_USER_TIMEOUT, whenever they were
made and whether or not they are connected yet; severing aborts connections to an endpoint, those being made too, and
nothing they had not delivered arrives; and the mooncake backend watches each imported peer's data port."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from kvstage.transport.data import TransportConfig, create_transport
from kvstage.transport.data.loopback import ReaderPeer, wait_for
from kvstage.transport.data.tcp_guard import (
    CLOSE,
    ESTABLISHED,
    LISTEN,
    SYN_SENT,
    TCP_USER_TIMEOUT,
    ConnectionGuard,
    endpoint,
    listening_ports,
    tcp_sockets,
    tcp_table,
)


def user_timeout(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT)


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    made = []
    for _ in range(2):
        listener = socket.create_server(("127.0.0.1", 0))
        made.append(listener)
    yield made
    for listener in made:
        listener.close()


@pytest.fixture
def full_listener() -> Iterator[socket.socket]:
    """A listener (backlog 0, never accepting) whose accept queue one connection fills: it drops later SYNs."""
    with (
        socket.create_server(("127.0.0.1", 0), backlog=0) as listener,
        socket.create_connection(listener.getsockname(), timeout=5.0),
    ):
        yield listener


def test_only_connections_to_a_watched_endpoint_get_the_timeout_including_ones_made_before_the_watch(
    listeners: list[socket.socket],
) -> None:
    watched, other = listeners
    early = socket.create_connection(watched.getsockname())
    elsewhere = socket.create_connection(other.getsockname())
    guard = ConnectionGuard(2.25)
    guard.watch({endpoint("127.0.0.1", watched.getsockname()[1])})
    late = socket.create_connection(watched.getsockname())
    accepted, _ = watched.accept()
    with early, elsewhere, late, accepted:
        assert guard.bound() == 2
        assert user_timeout(early) == user_timeout(late) == 2250
        assert user_timeout(elsewhere) == user_timeout(accepted) == user_timeout(watched) == 0
        assert guard.bound() == 0, "a connection is bounded once"


def test_an_ipv4_mapped_peer_address_matches_its_ipv4_endpoint() -> None:
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("::ffff:127.0.0.1", port)) as mapped:
            guard = ConnectionGuard(1.0)
            guard.watch({endpoint("127.0.0.1", port)})
            assert guard.bound() == 1
            assert user_timeout(mapped) == 1000


def test_a_watched_address_must_be_an_ip_address() -> None:
    with pytest.raises(ValueError):
        endpoint("not-an-address", 80)


def test_the_tcp_table_names_each_socket_s_peer_and_state(listeners: list[socket.socket]) -> None:
    listener = listeners[0]
    with socket.create_connection(listener.getsockname()) as client:
        table = tcp_table()
        row = table[os.fstat(client.fileno()).st_ino]
        assert row.peer == endpoint(*listener.getsockname()) and row.state == ESTABLISHED
        assert table[os.fstat(listener.fileno()).st_ino].state == LISTEN


def test_a_connection_still_being_made_is_bounded_and_severing_fails_it(full_listener: socket.socket) -> None:
    """A listener whose accept queue is full drops new SYNs, so a connect to it stays in SYN_SENT: `getpeername`
    does not answer for it, the TCP table does."""
    with socket.socket() as connecting:
        connecting.setblocking(False)
        assert connecting.connect_ex(full_listener.getsockname()) == errno.EINPROGRESS
        inode = os.fstat(connecting.fileno()).st_ino
        assert tcp_table()[inode].state == SYN_SENT
        guard = ConnectionGuard(3.0)
        guard.watch({endpoint(*full_listener.getsockname())})
        assert guard.bound() == 2  # and the connection that filled the queue
        assert user_timeout(connecting) == 3000
        assert guard.sever({endpoint(*full_listener.getsockname())}) == 2
        assert connecting.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET
        row = tcp_table().get(inode)
        assert row is None or row.state == CLOSE, "no longer connecting"


def test_severing_drops_what_a_connection_had_not_delivered_and_leaves_other_connections_alone(
    listeners: list[socket.socket],
) -> None:
    """The reader does not read, so the writer's bytes pile up in both kernels' buffers; once severed, the reader
    gets what had reached its buffer and then a reset, never the rest."""
    target, other = listeners
    with (
        socket.create_connection(target.getsockname()) as writer,
        socket.create_connection(other.getsockname()) as bystander,
    ):
        reader, _ = target.accept()
        with reader:
            writer.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent += writer.send(b"x" * 65536)
            guard = ConnectionGuard(1.0)
            assert guard.sever({endpoint(*target.getsockname())}) == 1
            received = 0
            with pytest.raises(ConnectionResetError):
                while chunk := reader.recv(1 << 20):
                    received += len(chunk)
            assert 0 < received < sent
        bystander.sendall(b"still here")
        assert tcp_table()[os.fstat(bystander.fileno()).st_ino].state == ESTABLISHED


def test_listening_ports_names_this_process_s_listeners(listeners: list[socket.socket]) -> None:
    assert {listener.getsockname()[1] for listener in listeners} <= listening_ports()


def test_a_mooncake_writer_bounds_its_connections_to_the_reader_s_data_port() -> None:
    """The reader's descriptor names its engine's data port; once the writer has written to it, the writer's
    connections to that port time out after half of max_write_s unacknowledged, and no other connection does."""
    pytest.importorskip("mooncake.engine")
    config = TransportConfig(backend="mooncake", max_write_s=4.0, write_timeout_s=30.0)
    with ReaderPeer(config, 1 << 20) as reader, create_transport(config) as writer:
        remote = writer.import_remote(reader.descriptor)
        source = writer.register(torch.ones(1 << 20, dtype=torch.uint8))
        transfer = writer.write(source, 0, remote, 0, 1 << 20)
        assert wait_for(writer, [transfer], timeout_s=30)[transfer].ok
        advertised = msgspec.msgpack.decode(reader.descriptor.payload)
        data_port = advertised["data_port"]
        assert data_port and data_port != int(advertised["session"].rsplit(":", 1)[1])
        bounded = user_timeouts_to(data_port)
    assert bounded and all(ms == 2000 for ms in bounded), bounded


def user_timeouts_to(port: int, timeout_s: float = 5.0) -> list[int]:
    """TCP_USER_TIMEOUT of each of this process's connections to `port`, once all of them have one (the writer's
    watcher looks every 0.2 s after writes) or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [user_timeout(sock) for _, sock in tcp_sockets() if _peer_port(sock) == port]
        if (found and all(found)) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _peer_port(sock: socket.socket) -> int:
    try:
        return int(sock.getpeername()[1])
    except OSError:
        return 0
