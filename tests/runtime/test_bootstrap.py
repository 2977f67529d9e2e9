"""Bootstrap service over real ZeroMQ sockets: registration, lookup, sessions, compatibility, hostile requests."""

from __future__ import annotations

import time

import pytest
import zmq

from kvstage.errors import CompatibilityError, TransportError
from kvstage.layout import KVLayout
from kvstage.transport.bootstrap import (
    BootstrapClient,
    BootstrapServer,
    LayoutRecord,
    PeerRecord,
    check_compatible,
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=4)


def record(peer_id: str, rank: int = 0, *, session: int = 1, layout: KVLayout = LAYOUT, **kw) -> PeerRecord:
    fields = dict(
        peer_id=peer_id,
        role="prefill",
        instance="P",
        tp_size=2,
        rank=rank,
        layout=LayoutRecord.of(layout),
        control_address=f"tcp://127.0.0.1:{5000 + rank}",
        backend="local",
        session=session,
    )
    fields.update(kw)
    return PeerRecord(**fields)


@pytest.fixture
def server():
    with BootstrapServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    cli = BootstrapClient(server.address, timeout_s=5)
    yield cli
    cli.close()


def test_registered_ranks_are_found_by_peer_id_and_by_instance(client):
    client.register(record("p1", 1))
    client.register(record("p0", 0, descriptors={"ring": b"\x01\x02"}))
    client.register(record("d0", role="decode", instance="D", tp_size=1))
    assert client.lookup(["p0", "nobody"]) == {"p0": record("p0", 0, descriptors={"ring": b"\x01\x02"})}
    assert [r.peer_id for r in client.lookup_instance("P", "prefill")] == ["p0", "p1"]
    assert [r.peer_id for r in client.lookup_instance("D", "decode")] == ["d0"]
    assert client.wait_for_instance("P", "prefill", 2, timeout_s=1)[1].rank == 1


def test_restarted_rank_with_newer_session_replaces_its_record_and_older_cannot(client):
    client.register(record("p0", session=5, control_address="tcp://127.0.0.1:1"))
    client.register(record("p0", session=9, control_address="tcp://127.0.0.1:2"))
    with pytest.raises(TransportError, match="newer session"):
        client.register(record("p0", session=7))
    assert client.lookup(["p0"])["p0"].control_address == "tcp://127.0.0.1:2"
    client.unregister("p0", session=5)  # stale unregister of an old incarnation is ignored
    assert "p0" in client.lookup(["p0"])
    client.unregister("p0", session=9)
    assert client.lookup(["p0"]) == {}


def test_waiting_for_an_incomplete_instance_times_out_with_the_ranks_seen(client):
    client.register(record("p0", 0))
    with pytest.raises(TransportError, match=r"ranks \[0\].*expected 2"):
        client.wait_for_instance("P", "prefill", 2, timeout_s=0.2)


def test_layout_mismatch_names_the_field_and_both_values_and_page_sizes_may_differ():
    other = KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, dtype="float16", page_size=4)
    with pytest.raises(CompatibilityError, match=r"dtype=.bfloat16.*dtype=.float16."):
        check_compatible(LAYOUT, record("p0", layout=other), me="decode rank d0")
    check_compatible(LAYOUT, record("p0", layout=KVLayout(4, 4, 16, "bfloat16", page_size=16)))
    for field, value in (("num_layers", 8), ("head_dim", 32), ("num_kv_heads", 8)):
        fields = dict(num_layers=4, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=4)
        fields[field] = value
        with pytest.raises(CompatibilityError, match=rf"{field}=.*{field}={value}"):
            check_compatible(LAYOUT, record("p0", layout=KVLayout(**fields)))
    check_compatible(LAYOUT, record("p0"))


def test_garbage_requests_get_an_error_and_the_service_keeps_answering(server, client):
    raw = zmq.Context.instance().socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        raw.send(b"\xc1garbage")
        assert raw.poll(5000)
        assert b"bad request" in raw.recv()
    finally:
        raw.close(linger=0)
    assert server.rejected.total() == 1
    client.register(record("p0"))
    assert "p0" in client.lookup(["p0"])


def test_record_count_is_bounded():
    with BootstrapServer(max_records=2) as srv:
        cli = BootstrapClient(srv.address)
        cli.register(record("a"))
        cli.register(record("b"))
        with pytest.raises(TransportError, match="full"):
            cli.register(record("c"))
        cli.close()


def test_unreachable_bootstrap_is_a_timeout_error_not_a_hang():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        cli = BootstrapClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
        with pytest.raises(TransportError, match="did not answer"):
            cli.lookup(["x"])
        cli.close()
    finally:
        silent.close(linger=0)


def test_a_record_not_registered_again_within_its_ttl_expires_and_a_refreshed_one_stays():
    """A rank killed without unregistering leaves no record for good (issue #15, defect 5)."""
    with BootstrapServer(record_ttl_s=0.5) as srv:
        cli = BootstrapClient(srv.address)
        try:
            cli.register(record("dead/0"))
            cli.register(record("live/0"))
            for _ in range(5):
                time.sleep(0.2)
                cli.register(record("live/0"))  # what a live agent's resolver does every REREGISTER_S
            assert set(cli.lookup(["dead/0", "live/0"])) == {"live/0"}
            assert [r.peer_id for r in srv.records()] == ["live/0"]
        finally:
            cli.close()
