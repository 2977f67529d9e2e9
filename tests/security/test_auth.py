"""Authenticated control plane (issue #15, items 1-2): HMAC-SHA256 on every control frame and bootstrap request
under a shared secret, a replay guard, refused open binds, and where the secret comes from."""

from __future__ import annotations

import time

import pytest
import zmq
from deployment import Deployment, prefill_instance

from kvstage.e2e.stranger import Stranger
from kvstage.errors import ConfigError, TransportError
from kvstage.protocol.messages import Heartbeat
from kvstage.transport.auth import SECRET_ENV, FrameAuth, ReplayWindow, load_secret
from kvstage.transport.bootstrap import REQUEST_CONTEXT, BootstrapClient, BootstrapServer
from kvstage.transport.control import ControlChannel

SECRET = b"correct horse battery staple 42"
WRONG = b"incorrect horse battery staple!!"


def _rejected(deployment: Deployment, reason: str) -> float:
    return deployment.decode.metrics.value("kvstage_rejected_frames_total", reason=reason)


def _wait(done, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not seen after {timeout_s}s"
        time.sleep(0.02)


@pytest.fixture
def deployment():
    made = Deployment(secret=SECRET)
    yield made
    made.close()


def test_rooms_hand_off_when_every_side_holds_the_secret(deployment: Deployment) -> None:
    prefill = prefill_instance("P", deployment.bootstrap.address, secret=SECRET)
    try:
        for room in (1, 2, 3):
            assert all(o.ok for o in deployment.run_room(room, "P", prefill))
    finally:
        for agent in prefill:
            agent.close()
    assert _rejected(deployment, "auth") == 0 and _rejected(deployment, "replay") == 0


@pytest.mark.parametrize("key", [WRONG, None], ids=["wrong key", "no key"])
def test_frames_without_the_secret_are_dropped_before_decoding_and_counted_as_auth(
    deployment: Deployment, key: bytes | None
) -> None:
    stranger = Stranger(deployment.decode.channel.address, key)
    try:
        for i in range(50):
            stranger.send(f"forger-{i}/0", Heartbeat())
        _wait(lambda: _rejected(deployment, "auth") == 50, "50 frames rejected as auth")
    finally:
        stranger.close()
    assert deployment.decode.channel.received == 0, "no forged frame reached the decoder"
    assert not deployment.decode.endpoint.peers()


def test_a_replayed_frame_is_rejected_and_counted(deployment: Deployment) -> None:
    insider = Stranger(deployment.decode.channel.address, SECRET)
    try:
        frame = insider.send("P/0", Heartbeat())
        _wait(lambda: deployment.decode.channel.received == 1, "the first copy accepted")
        insider.send_raw(frame)
        insider.send_raw(frame)
        _wait(lambda: _rejected(deployment, "replay") == 2, "both copies rejected as replays")
    finally:
        insider.close()
    assert deployment.decode.channel.received == 1


def test_a_frame_sealed_for_another_agent_is_refused_here(deployment: Deployment) -> None:
    other = "tcp://127.0.0.1:1"  # the frame's tag binds it to the address it was sent to
    frame = FrameAuth(SECRET).seal(b"\x00" * 16, other.encode())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(deployment.decode.channel.address)
    try:
        sock.send(frame)
        _wait(lambda: _rejected(deployment, "auth") == 1, "the misdirected frame rejected as auth")
    finally:
        sock.close(linger=0)


def test_bootstrap_answers_only_authentic_requests_and_refuses_replays() -> None:
    with BootstrapServer(secret=SECRET) as server:
        insider = BootstrapClient(server.address, secret=SECRET)
        try:
            assert insider.lookup(["D/0"]) == {}
            for secret in (None, WRONG):
                stranger = BootstrapClient(server.address, secret=secret, timeout_s=2.0)
                with pytest.raises(TransportError, match=r"unauthenticated|authentication"):
                    stranger.lookup(["D/0"])
                stranger.close()
            assert server.rejected["auth"] == 2
            raw = zmq.Context.instance().socket(zmq.REQ)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            request = FrameAuth(SECRET).seal(b"\x81\xa1x\x01", REQUEST_CONTEXT)
            for _ in range(2):
                raw.send(request)
                assert raw.poll(5000)
                raw.recv()
            raw.close(linger=0)
            assert server.rejected["replay"] == 1
        finally:
            insider.close()


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://10.1.2.3:*"])
def test_a_bind_beyond_loopback_without_a_secret_is_refused_naming_the_secret(bind: str) -> None:
    channel = ControlChannel(bind, encode=bytes, decode=bytes, deliver=print)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        channel.start()
    with pytest.raises(ConfigError, match="--insecure"):
        BootstrapServer(bind).start()


def test_an_open_bind_starts_with_a_secret_or_when_insecure_is_explicit() -> None:
    with BootstrapServer("tcp://0.0.0.0:*", secret=SECRET):
        pass
    with BootstrapServer("tcp://0.0.0.0:*", insecure=True):
        pass
    with ControlChannel("tcp://0.0.0.0:*", encode=bytes, decode=bytes, deliver=print,
                        auth=FrameAuth(SECRET)):  # fmt: skip
        pass


def test_the_secret_comes_from_a_file_or_the_environment_and_must_not_be_short(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert load_secret(None) == SECRET
    path = tmp_path / "secret"
    path.write_bytes(WRONG + b"\n")
    assert load_secret(str(path)) == WRONG, "the file wins over the environment; trailing newline stripped"
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


def test_the_replay_window_takes_late_frames_once_and_forgets_the_oldest_sessions() -> None:
    window = ReplayWindow(window=8, max_sessions=2)
    assert [window.accept(1, seq) for seq in (1, 3, 2, 3, 10)] == [True, True, True, False, True]
    assert not window.accept(1, 2), "older than the window"
    assert window.accept(1, 9) and not window.accept(1, 9)
    window.accept(2, 1)
    window.accept(3, 1)
    assert len(window) == 2
