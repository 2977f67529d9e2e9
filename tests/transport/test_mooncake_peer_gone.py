"""How the mooncake backend tells a gone peer, between real processes and a real Mooncake engine.

Mooncake gives every failed write the same code, so the backend finds the cause itself: a peer in this kernel and
pid namespace is gone when its pid no longer runs, whatever listens on its old handshake port (Mooncake picks those
ports at random, so another engine on the host may take a freed one)."""

from __future__ import annotations

import socket
import threading

import msgspec
import pytest
import torch

from kvstage.errors import TransportError
from kvstage.transport.data import RegionDescriptor, TransportConfig, create_transport
from kvstage.transport.data.loopback import ReaderPeer, wait_for

pytest.importorskip("mooncake.engine")

REGION = 1 << 20


def config() -> TransportConfig:
    return TransportConfig(backend="mooncake", write_timeout_s=20.0)


def refuse_handshakes(listener: socket.socket) -> None:
    """Accept each connection and close it at once, as an engine that does not know the caller's segment would."""
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:  # the test closed the listener
            return
        connection.close()


def test_writes_to_a_killed_peer_whose_handshake_port_another_listener_took_fail_with_peer_gone() -> None:
    """The kernel keeps the killed reader's own port in TIME_WAIT for a minute (Mooncake's listener does not set
    SO_REUSEADDR), so the squatter takes a fresh port and the writer meets the reader's descriptor naming that
    port: to the writer, that is a dead peer whose handshake port another process now listens on."""
    reader = ReaderPeer(config(), REGION)
    with create_transport(config()) as writer, socket.socket() as squatter:
        source = writer.register(torch.ones(REGION, dtype=torch.uint8))
        warm = writer.write(source, 0, writer.import_remote(reader.descriptor), 0, REGION)
        assert wait_for(writer, [warm], timeout_s=30)[warm].ok
        reader.kill()
        squatter.bind(("127.0.0.1", 0))  # stands in for another engine that picked the freed port
        squatter.listen()
        threading.Thread(target=refuse_handshakes, args=(squatter,), daemon=True).start()
        payload = msgspec.msgpack.decode(reader.descriptor.payload)
        payload["session"] = f"127.0.0.1:{squatter.getsockname()[1]}"
        reused = msgspec.structs.replace(reader.descriptor, payload=msgspec.msgpack.encode(payload))
        remote = writer.import_remote(reused)

        transfers = [writer.write(source, 0, remote, 0, REGION) for _ in range(3)]
        done = wait_for(writer, transfers, timeout_s=60)

    assert all(not c.ok for c in done.values()), "writes into a SIGKILLed peer's memory reported success"
    assert all(c.peer_gone for c in done.values()), [c.reason for c in done.values()]
    assert all("peer dead" in c.reason for c in done.values()), [c.reason for c in done.values()]
    reader.stop()


@pytest.mark.parametrize(
    "payload",
    [
        {"session": "127.0.0.1:15000", "address": 4096},  # no pid, no process space
        {"session": "127.0.0.1:15000", "address": 4096, "pid": 0, "space": "x"},
        {"session": "127.0.0.1:15000", "address": 4096, "pid": 1 << 40, "space": "x"},
        {"session": "127.0.0.1:15000", "address": 4096, "pid": 7, "space": "x" * 10_000},
        {"session": "127.0.0.1:15000", "address": 4096, "pid": 7, "space": "x", "extra": 1},
    ],
    ids=["missing-owner", "pid-zero", "pid-huge", "space-long", "unknown-field"],
)
def test_descriptor_with_a_missing_or_out_of_range_owner_identity_is_refused_on_import(
    payload: dict[str, object],
) -> None:
    with create_transport(config()) as writer:
        descriptor = RegionDescriptor("mooncake", "evil", 1, 4096, msgspec.msgpack.encode(payload))
        with pytest.raises(TransportError, match="malformed mooncake descriptor"):
            writer.import_remote(descriptor)
