"""A new peer on a departed peer's control address keeps its socket and its mapping when the departed one is
released (found in review: the agent's address -> peer map is keyed by address, and releasing the departed peer,
`dead_after_s` after it went, closed the socket of the peer that had taken its port and forgot that peer's entry,
so frames queued to it were lost and its failed sends no longer reached the endpoint)."""

from __future__ import annotations

import socket
import time

from deployment import Deployment, prefill_instance


def _free_ports(count: int) -> tuple[int, ...]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = tuple(sock.getsockname()[1] for sock in sockets)
    for sock in sockets:
        sock.close()
    return ports


def test_releasing_a_departed_peer_keeps_the_socket_of_the_new_peer_on_its_address() -> None:
    deployment = Deployment()
    binds = tuple(f"tcp://127.0.0.1:{port}" for port in _free_ports(2))
    decode = deployment.decode
    first = prefill_instance("A", deployment.bootstrap.address, binds=binds)
    try:
        assert all(o.ok for o in deployment.run_room(1, "A", first))
    finally:
        for agent in first:
            agent.close()
    second = prefill_instance("B", deployment.bootstrap.address, binds=binds)  # a new instance on the same ports
    try:
        assert all(o.ok for o in deployment.run_room(2, "B", second))
        deadline = time.monotonic() + 20
        while {"A/0", "A/1"} & decode._records.keys():  # A is released dead_after_s after it went silent
            assert time.monotonic() < deadline, "the departed instance was never released"
            time.sleep(0.05)
        time.sleep(0.2)  # the channel's I/O thread has handled any socket close by now
        assert decode._peer_of_address == {binds[0]: "B/0", binds[1]: "B/1"}
        assert decode.channel.open_peers == 2, "releasing A closed B's sockets"
        assert all(o.ok for o in deployment.run_room(3, "B", second))
    finally:
        for agent in second:
            agent.close()
        deployment.close()
