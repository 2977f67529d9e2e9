"""A real decode agent in its own process takes 100,000 hostile frames at its control socket while legitimate
rooms are in flight (issue #15, item 4): it stays up, its RSS grows by less than 16 MiB, every legitimate room
succeeds, and the rejected frames show in its metrics.

The deployment runs with a shared secret, as docs/security.md says it should; the attacker does not hold it. Its
frames are random bytes, valid envelopes unsealed, valid envelopes sealed with a wrong key (forged senders and
rooms, huge chunk indices), and truncated or oversized ones.
"""

from __future__ import annotations

import json
import random
import time

from deployment import DecodeProcess, prefill_instance, start_room, wait_outcomes

from kvstage.e2e.stranger import Stranger
from kvstage.protocol.messages import PROTOCOL_VERSION, Abort, Body, ChunkReady, Envelope, Heartbeat, StagingRequest
from kvstage.transport.auth import FrameAuth
from kvstage.transport.bootstrap import BootstrapServer

SECRET = b"live fuzz shared secret, 32 byte"
HOSTILE_FRAMES = 100_000
ROOMS = 40


def _hostile(rng: random.Random, attacker: Stranger, forger: FrameAuth, address: str) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    room = rng.randrange(1, ROOMS + 1)
    body = rng.choice([Heartbeat(), Abort(room=room, reason="aborted by prefill"),
                       StagingRequest(room=room, chunk=rng.randrange(2**16)),
                       ChunkReady(room=room, chunk=rng.randrange(2**16), epoch=rng.getrandbits(32))])  # fmt: skip
    sender = rng.choice(["P/0", "P/1", f"evil-{rng.randrange(10**6)}/0"])
    frame = attacker.codec.encode(attacker_envelope(sender, body, rng))
    if kind == 1:
        return frame  # unsealed
    sealed = forger.seal(frame, address.encode())
    if kind == 2:
        return sealed[: rng.randrange(1, len(sealed))]
    if kind == 3:
        return sealed + rng.randbytes(rng.randrange(1, 64))
    return sealed  # sealed, with the wrong key


def attacker_envelope(sender: str, body: Body, rng: random.Random) -> Envelope:
    return Envelope(PROTOCOL_VERSION, sender, rng.getrandbits(62), 0, rng.getrandbits(32), None, body)


def test_a_decode_process_under_100000_hostile_frames_serves_every_room_within_16_mib() -> None:
    with BootstrapServer(secret=SECRET) as bootstrap:
        decode = DecodeProcess(bootstrap.address, SECRET)
        prefill = prefill_instance("P", bootstrap.address, secret=SECRET, pages=8 * ROOMS)
        attacker = Stranger(decode.address)
        forger = FrameAuth(b"not the deployment's secret!!!!!")
        rng = random.Random(15)
        outcomes: dict[str, list] = {}
        try:
            decode.ask("expect 1 P")
            for agent in prefill:
                start_room(agent, 1)
            while "1" not in outcomes:
                outcomes.update(json.loads(decode.ask("outcomes")))
                time.sleep(0.01)
            before = decode.state()
            sent, room = 0, 1
            while sent < HOSTILE_FRAMES:
                for _ in range(1000):
                    attacker.send_raw(_hostile(rng, attacker, forger, decode.address))
                sent += 1000
                if sent % (HOSTILE_FRAMES // (ROOMS - 1)) < 1000 and room < ROOMS:  # a room in flight meanwhile
                    room += 1
                    decode.ask(f"expect {room} P")
                    for agent in prefill:
                        start_room(agent, room)
                outcomes.update(json.loads(decode.ask("outcomes")))
            deadline = time.monotonic() + 60
            while len(outcomes) < room and time.monotonic() < deadline:
                outcomes.update(json.loads(decode.ask("outcomes")))
                time.sleep(0.05)
            for agent in prefill:
                assert all(o.ok for o in wait_outcomes(agent, range(1, room + 1)).values())
            deadline = time.monotonic() + 60
            while sum(decode.state()["rejected"].values()) < sent:  # (legitimate frames count as received)
                assert time.monotonic() < deadline, "decode never got through the hostile frames"
                time.sleep(0.1)
            after = decode.state()
        finally:
            attacker.close()
            for agent in prefill:
                agent.close()
            decode.close()
    assert room == ROOMS and len(outcomes) == ROOMS
    assert all(ok for ok, _ in outcomes.values()), outcomes
    assert after["rejected"] == {"auth": sent} and after["metric_auth"] == sent, after  # dropped before decoding
    assert after["rss"] - before["rss"] < 16 * 2**20, (before, after)
    print(f"\nhostile frames {sent}, rejected {after['rejected']}, RSS {before['rss']} -> {after['rss']}")
