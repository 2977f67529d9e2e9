"""The instance listing a router discovers instances from: `kvstage bootstrap`'s or etcd's, through
`open_instance_directory`."""

from __future__ import annotations

import threading
import time

import pytest

from kvstage.errors import ConfigError
from kvstage.layout import KVLayout
from kvstage.transport.bootstrap import BootstrapClient, BootstrapServer, LayoutRecord, PeerRecord
from kvstage.transport.directory import Directory, open_directory
from kvstage.transport.discovery import open_instance_directory

LAYOUT = LayoutRecord.of(KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_size=16))


def record(instance: str, role: str, tp: int, rank: int, url: str = "") -> PeerRecord:
    return PeerRecord(
        peer_id=f"{instance}-{rank}",
        role=role,  # type: ignore[arg-type]
        instance=instance,
        tp_size=tp,
        rank=rank,
        layout=LAYOUT,
        control_address="tcp://127.0.0.1:1",
        backend="local",
        session=1,
        url=url,
    )


def test_the_listing_sums_up_each_instance_and_is_complete_once_every_rank_registered() -> None:
    with BootstrapServer() as server:
        client = BootstrapClient(server.address)
        client.register(record("P", "prefill", 2, 1, "http://10.0.0.2:8100"))
        client.register(record("D", "decode", 1, 0, "http://10.0.0.3:8200"))
        client.register(record("Q", "prefill", 1, 0))
        (d, p, q) = client.list_instances()
        assert (d.instance, d.role, d.tp_size, d.url, d.complete) == ("D", "decode", 1, "http://10.0.0.3:8200", True)
        assert (p.instance, p.complete, p.layout) == ("P", False, LAYOUT)  # rank 0 of 2 is missing
        assert (q.instance, q.url, q.complete) == ("Q", "", True)  # no URL published
        client.register(record("P", "prefill", 2, 0, "http://10.0.0.2:8100"))
        assert [e.complete for e in client.list_instances()] == [True, True, True]
        client.unregister("D-0", 1)
        assert [e.instance for e in client.list_instances()] == ["P", "Q"]
        client.close()


def _wait_changed_follows_a_registration(address: str, client: Directory) -> None:
    directory = open_instance_directory(address, poll_s=0.05)
    known = directory.list_instances()
    started = time.monotonic()
    assert directory.wait_changed(known, 0.3) == known
    assert time.monotonic() - started >= 0.3
    timer = threading.Timer(0.2, client.register, [record("D", "decode", 1, 0, "http://h:1")])
    timer.start()
    changed = directory.wait_changed(known, 10.0)
    timer.join()
    assert [(e.instance, e.url, e.complete) for e in changed] == [("D", "http://h:1", True)]
    assert time.monotonic() - started < 5.0
    directory.close()


def test_wait_changed_returns_when_an_instance_registers_and_after_the_timeout_when_none_does() -> None:
    with BootstrapServer() as server:
        client = BootstrapClient(server.address)
        _wait_changed_follows_a_registration(server.address, client)
        client.close()


def test_the_router_follows_instances_registered_in_etcd_as_in_the_bootstrap(shared_etcd) -> None:  # type: ignore[no-untyped-def]
    address = shared_etcd.address("discovery")
    client = open_directory(address)
    _wait_changed_follows_a_registration(address, client)
    client.close()


def test_a_malformed_directory_address_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="etcd"):
        open_instance_directory("etcd://h:notaport")
