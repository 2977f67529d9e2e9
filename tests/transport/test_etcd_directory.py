"""The directory on etcd against a real etcd server: records under leases, sessions, the watch, sealed records,
and etcd going away and coming back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvstage.errors import ConfigError, TransportError
from kvstage.layout import KVLayout
from kvstage.transport.bootstrap import LayoutRecord, PeerRecord
from kvstage.transport.directory import open_directory
from kvstage.transport.etcd import REJECT_AUTH, REJECT_BAD_RECORD, EtcdAddress, EtcdDirectory

SECRET = b"s" * 32
LAYOUT = LayoutRecord.of(KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=4))


def record(peer_id: str, rank: int = 0, *, session: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="prefill", instance=peer_id.split("/")[0], tp_size=2, rank=rank,
                      layout=LAYOUT, control_address=f"tcp://127.0.0.1:{5000 + rank}", backend="local",
                      session=session)  # fmt: skip


def wait_until(done, what: str, timeout_s: float = 10.0) -> float:
    """Seconds until `done()` held; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, f"{what}: not seen after {timeout_s}s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_registered_ranks_are_found_by_peer_id_and_instance_and_a_newer_session_replaces_an_older_one(shared_etcd):
    address = shared_etcd.address("sessions")
    writer = open_directory(address, secret=SECRET)
    reader = open_directory(address, secret=SECRET)
    try:
        writer.register(record("P/1", 1, session=5))
        writer.register(record("P/0", 0, session=5))
        assert sorted(reader.lookup(["P/0", "P/1", "X/0"])) == ["P/0", "P/1"]
        assert [r.rank for r in reader.wait_for_instance("P", "prefill", 2, timeout_s=5)] == [0, 1]
        with pytest.raises(TransportError, match="newer session"):
            writer.register(record("P/0", session=4))
        writer.register(record("P/0", session=6))
        assert reader.lookup(["P/0"])["P/0"].session == 6
        writer.unregister("P/0", 5)  # an older session's withdrawal leaves the newer record alone
        assert "P/0" in reader.lookup(["P/0"])
        writer.unregister("P/0", 6)
        assert reader.lookup(["P/0"]) == {}
    finally:
        writer.close()
        reader.close()


def test_a_follower_sees_registrations_and_withdrawals_through_its_watch_and_is_told_of_each(shared_etcd):
    address = shared_etcd.address("watch")
    changed = threading.Event()
    follower = EtcdDirectory(address, secret=SECRET, follow=True, on_change=changed.set)
    writer = open_directory(address, secret=SECRET)
    try:
        assert follower.lookup(["D/0"]) == {}  # reads the prefix and starts the watch
        writer.register(record("D/0"))
        assert changed.wait(5), "the watch reported the registration"
        wait_until(lambda: "D/0" in follower.lookup(["D/0"]), "the registration in the mirror")
        changed.clear()
        writer.unregister("D/0", 1)
        assert changed.wait(5), "the watch reported the withdrawal"
        wait_until(lambda: follower.lookup(["D/0"]) == {}, "the withdrawal in the mirror")
    finally:
        writer.close()
        follower.close()


def test_records_sealed_under_another_secret_or_unsealed_are_refused_and_counted(shared_etcd):
    address = shared_etcd.address("sealing")
    stranger = open_directory(address, secret=b"o" * 32)
    plain = open_directory(address)
    reader = EtcdDirectory(address, secret=SECRET, follow=True)
    try:
        stranger.register(record("S/0"))
        plain.register(record("U/0"))
        assert reader.lookup(["S/0", "U/0"]) == {}
        assert reader.rejected[REJECT_AUTH] == 2
        plain.register(record("U/1", 1))  # arriving through the watch: refused the same way
        wait_until(lambda: reader.rejected[REJECT_AUTH] == 3, "the unsealed record refused by the follower")
        assert reader.records() == []
        unsealed_reader = EtcdDirectory(address)  # without the secret a sealed value does not even decode
        assert "S/0" not in unsealed_reader.lookup(["S/0"]) and unsealed_reader.rejected[REJECT_BAD_RECORD] == 1
        unsealed_reader.close()
    finally:
        stranger.close()
        plain.close()
        reader.close()


OWNER = textwrap.dedent(
    """
    import sys, time
    from test_etcd_directory import record
    from kvstage.transport.directory import open_directory
    directory = open_directory(sys.argv[1])
    directory.register(record("K/0"))
    print("registered", flush=True)
    while True:
        directory.renew()
        time.sleep(0.1)
    """
)


def test_a_killed_owners_record_stays_while_it_renews_and_vanishes_once_its_lease_runs_out(shared_etcd):
    lease_s = 2
    address = shared_etcd.address("leases", lease_s=lease_s)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, address], stdout=subprocess.PIPE, text=True, env=env)
    follower = EtcdDirectory(address, follow=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "registered"
        time.sleep(1.5 * lease_s)  # longer than its lease: renewed, so still there
        assert "K/0" in follower.lookup(["K/0"])
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        gone_after = wait_until(lambda: follower.lookup(["K/0"]) == {}, "the killed owner's record gone", 3 * lease_s)
        assert gone_after <= lease_s + 1.0, f"gone {gone_after:.1f}s after the kill, lease {lease_s}s"
    finally:
        if owner.poll() is None:
            owner.kill()
        follower.close()


def test_while_etcd_is_stopped_lookups_fail_naming_it_and_after_it_returns_records_are_followed_again(etcd):
    writer = open_directory(etcd.address(), timeout_s=1.0)
    follower = EtcdDirectory(etcd.address(), timeout_s=1.0, follow=True)
    try:
        writer.register(record("A/0"))
        assert "A/0" in follower.lookup(["A/0"])
        etcd.stop()
        wait_until(lambda: _fails(follower), "lookups failing while etcd is stopped")
        with pytest.raises(TransportError, match=f"etcd 127.0.0.1:{etcd.client_port} did not answer"):
            follower.lookup(["A/0"])
        etcd.start()
        assert "A/0" in follower.lookup(["A/0"]), "the record (and its lease) outlived the restart"
        writer.register(record("B/0"))
        wait_until(lambda: "B/0" in follower.lookup(["B/0"]), "a registration after the restart, followed")
    finally:
        writer.close()
        follower.close()


def _fails(directory: EtcdDirectory) -> bool:
    try:
        directory.lookup(["A/0"])
    except TransportError:
        return True
    return False


@pytest.mark.parametrize(
    "address", ["etcd://:2379", "etcd://host", "etcd://host:2379?lease_s=0", "etcd://host:2379?ttl=3", "etcd://h:x"]
)
def test_a_malformed_etcd_address_is_a_config_error(address):
    with pytest.raises(ConfigError):
        EtcdAddress.parse(address)


def test_an_etcd_address_names_its_namespace_and_lease():
    where = EtcdAddress.parse("etcd://10.0.0.1:2379/fleet-a?lease_s=30")
    assert (where.host, where.port, where.namespace, where.lease_s) == ("10.0.0.1", 2379, "fleet-a", 30)
    assert where.key("P/0") == b"/fleet-a/peers/P/0"


def test_open_directory_sends_exactly_the_addresses_the_etcd_client_parses_to_it() -> None:
    from kvstage.transport import directory, etcd

    assert directory.ETCD_SCHEME == etcd.SCHEME
