"""Real-socket tests of the ZeroMQ control channel: round trips, bounded outbox, hostile frames, many peers."""

from __future__ import annotations

import queue
import threading
import time

import msgspec
import pytest
import zmq

from kvstage.errors import ProtocolError
from kvstage.transport.control import (
    REJECT_MULTIPART,
    REJECT_OVERSIZE,
    REJECT_UNDECODABLE,
    SEND_PEER_BUSY,
    ChannelClosed,
    ChannelConfig,
    ControlChannel,
    OutboxFull,
)


class Ping(msgspec.Struct, frozen=True):
    sender: str
    seq: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Ping)


def _decode(frame: bytes) -> Ping:
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(str(exc)) from exc


class Harness:
    """A channel whose callbacks land in queues the test can wait on."""

    def __init__(self, bind: str, config: ChannelConfig | None = None, name: str = "test") -> None:
        self.inbox: queue.Queue[Ping] = queue.Queue()
        self.failures: queue.Queue[tuple[str, Ping, str]] = queue.Queue()
        self.channel: ControlChannel[Ping, Ping] = ControlChannel(
            bind,
            encode=_encoder.encode,
            decode=_decode,
            deliver=self.inbox.put,
            on_send_failure=lambda peer, msg, reason: self.failures.put((peer, msg, reason)),
            config=config,
            name=name,
        ).start()

    def receive(self, count: int, timeout: float = 10.0) -> list[Ping]:
        return [self.inbox.get(timeout=timeout) for _ in range(count)]


@pytest.fixture
def harnesses():
    made: list[Harness] = []

    def make(bind: str = "tcp://127.0.0.1:*", config: ChannelConfig | None = None) -> Harness:
        harness = Harness(bind, config, name=f"h{len(made)}")
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.channel.close()


def test_frames_round_trip_between_two_channels_over_tcp(harnesses):
    a, b = harnesses(), harnesses()
    for seq in range(100):
        a.channel.send(b.channel.address, Ping("a", seq))
    assert [m.seq for m in b.receive(100)] == list(range(100))
    b.channel.send(a.channel.address, Ping("b", 7))
    assert a.receive(1) == [Ping("b", 7)]


def test_frames_round_trip_over_ipc(harnesses, tmp_path):
    a = harnesses(f"ipc://{tmp_path}/a.sock")
    b = harnesses(f"ipc://{tmp_path}/b.sock")
    a.channel.send(b.channel.address, Ping("a", 1))
    b.channel.send(a.channel.address, Ping("b", 2))
    assert b.receive(1) == [Ping("a", 1)]
    assert a.receive(1) == [Ping("b", 2)]


def test_full_outbox_is_an_explicit_failure_not_a_hang(harnesses):
    """While the I/O thread is busy (here: stuck in a callback), sends past the capacity raise at once."""
    release = threading.Event()
    entered = threading.Event()
    a = harnesses(config=ChannelConfig(outbox_capacity=4))
    b = harnesses()

    def stuck_deliver(message: Ping) -> None:
        entered.set()
        release.wait(10)
        a.inbox.put(message)

    a.channel._deliver = stuck_deliver
    b.channel.send(a.channel.address, Ping("b", 0))
    assert entered.wait(10)
    for seq in range(4):
        a.channel.send(b.channel.address, Ping("a", seq))
    started = time.monotonic()
    with pytest.raises(OutboxFull):
        a.channel.send(b.channel.address, Ping("a", 4))
    assert time.monotonic() - started < 1.0
    release.set()
    assert [m.seq for m in b.receive(4)] == [0, 1, 2, 3]


def test_outbox_fills_when_sends_outpace_the_io_thread_and_reports_it(harnesses):
    """Through the public API only: a tiny outbox and a burst of sends must raise, never block."""
    a = harnesses(config=ChannelConfig(outbox_capacity=1))
    b = harnesses()
    outcomes = {"queued": 0, "full": 0}
    for seq in range(20_000):
        try:
            a.channel.send(b.channel.address, Ping("a", seq))
            outcomes["queued"] += 1
        except OutboxFull:
            outcomes["full"] += 1
    assert outcomes["full"] > 0
    assert outcomes["queued"] > 0
    assert len(b.receive(outcomes["queued"])) == outcomes["queued"]


def test_peer_that_never_reads_makes_sends_fail_with_a_reason(harnesses):
    ctx = zmq.Context.instance()
    dead = ctx.socket(zmq.ROUTER)  # bound but never read: its receive queue and our send queue fill up
    dead.setsockopt(zmq.RCVHWM, 1)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    try:
        a = harnesses(config=ChannelConfig(peer_send_hwm=1, outbox_capacity=100_000))
        for seq in range(5000):
            a.channel.send(f"tcp://127.0.0.1:{port}", Ping("a", seq))
        peer, message, reason = a.failures.get(timeout=10)
        assert reason == SEND_PEER_BUSY
        assert peer == f"tcp://127.0.0.1:{port}"
        assert isinstance(message, Ping)
    finally:
        dead.close(linger=0)


def test_garbage_frames_are_counted_and_the_channel_keeps_serving(harnesses):
    config = ChannelConfig(max_frame_bytes=1024)
    b = harnesses(config=config)
    a = harnesses()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(b.channel.address)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send(_encoder.encode({"unexpected": "shape"}))
        raw.send(b"x" * 2048)
        raw.send_multipart([b"one", b"two"])
        a.channel.send(b.channel.address, Ping("a", 1))
        assert b.receive(1) == [Ping("a", 1)]
        deadline = time.monotonic() + 10
        while sum(b.channel.rejected.values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.channel.rejected == {REJECT_UNDECODABLE: 2, REJECT_OVERSIZE: 1, REJECT_MULTIPART: 1}
    finally:
        raw.close(linger=0)


def test_many_peers_each_reach_a_hub_and_get_replies(harnesses):
    hub = harnesses()
    peers = [harnesses() for _ in range(12)]
    for i, peer in enumerate(peers):
        for seq in range(10):
            peer.channel.send(hub.channel.address, Ping(peer.channel.address, i * 100 + seq))
    got = hub.receive(120)
    assert sorted(m.seq for m in got) == sorted(i * 100 + s for i in range(12) for s in range(10))
    for message in got:
        hub.channel.send(message.sender, Ping("hub", message.seq))
    for i, peer in enumerate(peers):
        assert sorted(m.seq for m in peer.receive(10)) == [i * 100 + s for s in range(10)]


def test_29984_sends_from_many_threads_never_corrupt_frames_on_a_shared_socket(harnesses):
    # Upstream #29984: concurrent sends on one shared socket corrupted frames; one I/O thread owns each socket.
    a, b = harnesses(), harnesses()

    def burst(tag: int) -> None:
        for seq in range(200):
            a.channel.send(b.channel.address, Ping(str(tag), seq))

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = b.receive(800)
    for tag in range(4):
        assert [m.seq for m in got if m.sender == str(tag)] == list(range(200))
    assert not b.channel.rejected


def test_send_after_close_raises_channel_closed(harnesses):
    a = harnesses()
    a.channel.close()
    with pytest.raises(ChannelClosed):
        a.channel.send("tcp://127.0.0.1:1", Ping("a", 1))


def test_forgotten_peer_is_reconnected_on_next_send(harnesses):
    a, b = harnesses(), harnesses()
    a.channel.send(b.channel.address, Ping("a", 1))
    assert b.receive(1) == [Ping("a", 1)]
    a.channel.forget_peer(b.channel.address)
    a.channel.send(b.channel.address, Ping("a", 2))
    assert b.receive(1) == [Ping("a", 2)]


def test_inbound_frames_waiting_for_the_owner_are_bounded_in_bytes_and_the_rest_counted(harnesses):
    """An owner that bounds its inbox in bytes (`admit`) gets at most that many bytes of frames while it is not
    reading; the others are dropped as "inbox full" before delivery (issue #15, defect 4)."""
    waiting: list[int] = []
    b = harnesses()
    b.channel._admit = lambda nbytes: sum(waiting) + nbytes <= 4096 and not waiting.append(nbytes)
    a = harnesses()
    big = "x" * 1000  # each frame about 1 KB
    for seq in range(50):
        a.channel.send(b.channel.address, Ping(big, seq))
    deadline = time.monotonic() + 10
    while b.channel.received + b.channel.rejected["inbox full"] < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.channel.received == len(waiting) == 4 and sum(waiting) <= 4096
    assert b.channel.rejected["inbox full"] == 46


def test_a_flood_of_bad_frames_is_counted_in_full_but_logged_at_most_once_a_second(harnesses, caplog):
    b = harnesses(config=ChannelConfig(reject_log_interval_s=60.0))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(b.channel.address)
    try:
        with caplog.at_level("WARNING", logger="kvstage.transport.control"):
            for _ in range(500):
                raw.send(b"\xc1 not msgpack")
            deadline = time.monotonic() + 10
            while b.channel.rejected[REJECT_UNDECODABLE] < 500 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        raw.close(linger=0)
    assert b.channel.rejected[REJECT_UNDECODABLE] == 500
    assert len([r for r in caplog.records if "rejected an inbound frame" in r.getMessage()]) == 1
