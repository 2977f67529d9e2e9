"""`Stranger`: a raw ZeroMQ DEALER at an agent's control socket that sends kvstage frames under any sender id, as
an attacker who can reach the port would (sealed with a secret if given: the deployment's makes it an insider, any
other a forger).

Owns nothing but its socket. Frames are encoded and sealed the way an agent's control channel does it (`frame`), so
whatever the agent does with them is what it would do with a peer's. Called by the security tests
(tests/security/) and benchmarks/hostile_memory.py.
"""

from __future__ import annotations

import zmq

from kvstage.protocol import Codec
from kvstage.protocol.messages import PROTOCOL_VERSION, Body, Envelope
from kvstage.transport.auth import FrameAuth


class Stranger:
    """A raw DEALER connected to `address`, sealing with `secret` if given."""

    def __init__(self, address: str, secret: bytes | None = None) -> None:
        self.address = address
        self.auth = None if secret is None else FrameAuth(secret)
        self.codec = Codec()
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(address)
        self.seq = 0

    def frame(self, sender: str, body: Body, session: int = 1, epoch: int = 0) -> bytes:
        """One envelope from `sender`, encoded and sealed, not sent."""
        self.seq += 1
        return self.seal(self.codec.encode(Envelope(PROTOCOL_VERSION, sender, session, epoch, self.seq, None, body)))

    def seal(self, payload: bytes) -> bytes:
        """`payload` as sent: sealed anew each time (a frame sent twice is dropped as a replay)."""
        return payload if self.auth is None else self.auth.seal(payload, self.address.encode())

    def send(self, sender: str, body: Body, session: int = 1, epoch: int = 0) -> bytes:
        """Send one envelope; returns the frame as sent (to replay it)."""
        frame = self.frame(sender, body, session, epoch)
        self.sock.send(frame)
        return frame

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
