"""Real-socket tests of the ZeroMQ control channel: round trips, sends that cannot go, hostile frames, many peers.

Each channel is driven the way an agent's reactor drives it: one thread owns it, waits on its descriptor and reads
what came (`Harness`); the test hands that thread the sends to make.
"""

from __future__ import annotations

import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from kvstage.errors import ProtocolError, TransportError
from kvstage.transport.control import (
    REJECT_MULTIPART,
    REJECT_OVERSIZE,
    REJECT_UNDECODABLE,
    SEND_OVERSIZE,
    SEND_PEER_BUSY,
    SEND_TOO_MANY_PEERS,
    ChannelClosed,
    ChannelConfig,
    ControlChannel,
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
    """A channel owned by a thread of its own, as by an agent's reactor: it binds, waits on the channel's descriptor,
    reads what came into `inbox`, and runs the calls the test hands it (`call`)."""

    def __init__(self, bind: str, config: ChannelConfig | None = None, name: str = "test") -> None:
        self.inbox: queue.Queue[Ping] = queue.Queue()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]] | None] = queue.SimpleQueue()
        self.channel: ControlChannel[Ping, Ping] = ControlChannel(
            bind, encode=_encoder.encode, decode=_decode, deliver=self.inbox.put, config=config, name=name
        )
        self.deliver_gate = threading.Event()  # cleared: the owner holds in its next delivery until set
        self.deliver_gate.set()
        self._thread = threading.Thread(target=self._own, daemon=True)
        self._started = queue.SimpleQueue[BaseException | None]()
        self._thread.start()
        failed = self._started.get(timeout=10)
        if failed is not None:
            raise failed

    def _own(self) -> None:
        try:
            self.channel.start()
        except Exception as exc:  # noqa: BLE001 - handed to the test, which raises it
            self._started.put(exc)
            return
        self._started.put(None)
        while True:
            while True:
                try:
                    job = self._calls.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.channel.close()
                    return
                fn, answer = job
                try:
                    answer.put(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the test, which raises it
                    answer.put(exc)
            try:
                if not self.channel.readable():
                    select.select([self.channel.fileno()], [], [], 0.005)
                self.deliver_gate.wait(30)
                self.channel.receive()
            except ChannelClosed:  # the test closed it: go on running its calls
                time.sleep(0.005)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the owner's thread; its result, or its exception raised here."""
        answer: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._calls.put((fn, answer))
        result = answer.get(timeout=30)
        if isinstance(result, BaseException):
            raise result
        return result

    def send(self, peer: str, message: Ping) -> None:
        self.call(lambda: self.channel.send(peer, message))

    def receive(self, count: int, timeout: float = 10.0) -> list[Ping]:
        return [self.inbox.get(timeout=timeout) for _ in range(count)]

    def close(self) -> None:
        self.deliver_gate.set()
        self._calls.put(None)
        self._thread.join(10)


@pytest.fixture
def harnesses():
    made: list[Harness] = []

    def make(bind: str = "tcp://127.0.0.1:*", config: ChannelConfig | None = None) -> Harness:
        harness = Harness(bind, config, name=f"h{len(made)}")
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def test_frames_round_trip_between_two_channels_over_tcp(harnesses):
    a, b = harnesses(), harnesses()
    for seq in range(100):
        a.send(b.channel.address, Ping("a", seq))
    assert [m.seq for m in b.receive(100)] == list(range(100))
    b.send(a.channel.address, Ping("b", 7))
    assert a.receive(1) == [Ping("b", 7)]


def test_frames_round_trip_over_ipc(harnesses, tmp_path):
    a = harnesses(f"ipc://{tmp_path}/a.sock")
    b = harnesses(f"ipc://{tmp_path}/b.sock")
    a.send(b.channel.address, Ping("a", 1))
    b.send(a.channel.address, Ping("b", 2))
    assert b.receive(1) == [Ping("a", 1)]
    assert a.receive(1) == [Ping("b", 2)]


def test_peer_that_never_reads_makes_sends_fail_at_once_with_a_reason_not_a_hang(harnesses):
    ctx = zmq.Context.instance()
    dead = ctx.socket(zmq.ROUTER)  # bound but never read: its receive queue and our send queue fill up
    dead.setsockopt(zmq.RCVHWM, 1)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    peer = f"tcp://127.0.0.1:{port}"
    try:
        a = harnesses(config=ChannelConfig(peer_send_hwm=1))

        def burst() -> tuple[int, str, float]:
            started = time.monotonic()
            for seq in range(5000):
                try:
                    a.channel.send(peer, Ping("a", seq))
                except TransportError as exc:
                    return seq, str(exc), time.monotonic() - started
            return 5000, "", time.monotonic() - started

        sent, reason, seconds = a.call(burst)
        assert sent < 5000 and reason.startswith(SEND_PEER_BUSY), (sent, reason)
        assert seconds < 5.0
    finally:
        dead.close(linger=0)


def test_a_frame_over_the_bound_and_a_peer_past_the_cap_are_refused_with_their_reason(harnesses):
    a = harnesses(config=ChannelConfig(max_frame_bytes=256, max_peers=1))
    b, c = harnesses(), harnesses()
    with pytest.raises(TransportError, match=SEND_OVERSIZE):
        a.send(b.channel.address, Ping("x" * 1000, 0))
    a.send(b.channel.address, Ping("a", 1))
    with pytest.raises(TransportError, match=SEND_TOO_MANY_PEERS):
        a.send(c.channel.address, Ping("a", 2))
    assert b.receive(1) == [Ping("a", 1)]


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
        a.send(b.channel.address, Ping("a", 1))
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
            peer.send(hub.channel.address, Ping(peer.channel.address, i * 100 + seq))
    got = hub.receive(120)
    assert sorted(m.seq for m in got) == sorted(i * 100 + s for i in range(12) for s in range(10))
    for message in got:
        hub.send(message.sender, Ping("hub", message.seq))
    for i, peer in enumerate(peers):
        assert sorted(m.seq for m in peer.receive(10)) == [i * 100 + s for s in range(10)]


def test_29984_no_thread_but_the_owner_can_touch_a_socket_so_frames_are_never_corrupted(harnesses):
    # Upstream #29984: concurrent sends on one shared socket corrupted frames. Here one thread owns every socket of
    # a channel: a send from any other thread is refused before it reaches ZeroMQ, and the owner's frames arrive
    # whole and in order.
    a, b = harnesses(), harnesses()
    refused: list[BaseException] = []

    def intruder() -> None:
        try:
            a.channel.send(b.channel.address, Ping("intruder", 0))
        except TransportError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=intruder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for seq in range(200):
        a.send(b.channel.address, Ping("a", seq))
    for thread in threads:
        thread.join()
    assert len(refused) == 4 and all("other than its owner" in str(e) for e in refused), refused
    assert [m.seq for m in b.receive(200)] == list(range(200))
    assert b.inbox.empty() and not b.channel.rejected


def test_send_after_close_raises_channel_closed(harnesses):
    a = harnesses()
    a.call(a.channel.close)
    with pytest.raises(ChannelClosed):
        a.send("tcp://127.0.0.1:1", Ping("a", 1))


def test_forgotten_peer_is_reconnected_on_next_send(harnesses):
    a, b = harnesses(), harnesses()
    a.send(b.channel.address, Ping("a", 1))
    assert b.receive(1) == [Ping("a", 1)]
    a.call(lambda: a.channel.forget_peer(b.channel.address))
    assert a.channel.open_peers == 0
    a.send(b.channel.address, Ping("a", 2))
    assert b.receive(1) == [Ping("a", 2)]


def test_frames_wait_for_a_busy_owner_in_zeromqs_bounded_queue_and_all_arrive_once_it_reads(harnesses):
    """Nothing waits between the socket and the owner: while the owner is busy, frames stay in ZeroMQ's receive
    queue (bounded by its high-water mark); reads of at most `recv_batch` frames each then hand over all of them."""
    b = harnesses(config=ChannelConfig(recv_batch=8))
    a = harnesses()
    b.deliver_gate.clear()  # the owner is busy elsewhere
    for seq in range(20):
        a.send(b.channel.address, Ping("a", seq))
    time.sleep(0.2)
    assert b.channel.received == 0 and b.inbox.empty()
    b.deliver_gate.set()
    assert [m.seq for m in b.receive(20)] == list(range(20))


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
