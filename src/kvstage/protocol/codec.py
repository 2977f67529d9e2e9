"""Frame encoding and bounded, validating decoding of `Envelope`s (msgpack via msgspec).

Owns: the byte format of a frame and the first line of defence against hostile or broken input. `decode`
rejects, with `ProtocolError`, a frame larger than `max_frame_bytes`, bytes that are not msgpack, a value of
the wrong type, a field outside its `Meta` bounds (see messages.py), an unknown body tag, extra fields, and a
protocol version other than `PROTOCOL_VERSION` (named in the error, even when that version's envelope has
another shape). It never raises anything else and never allocates more than
the frame's own size allows. `peek` reads only a frame's sender, session and body tag (`FrameHead`), creating no
object for the body, so a receiver can check who sent a frame, and whether it takes that body at all, before it
decodes (and pays for) the whole frame: a body's decoded objects take several times its bytes.

Called by: the endpoints (`ReceivedFrame` events, counted as rejected frames), runtime/ (encode before a
socket send) and sim/ (optionally round-trips every message through bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, cast

import msgspec

from kvstage.errors import ProtocolError
from kvstage.protocol.messages import PROTOCOL_VERSION, Count, Envelope, PeerId

#: Default bound on one frame. The largest legitimate frame is a direct-path Metadata with one page id per
#: page of a very long prompt (MAX_PAGES ids of up to 6 bytes each, about 12 MiB).
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 2**20


class Codec:
    """Encodes envelopes to msgpack frames and decodes frames back, enforcing every bound."""

    __slots__ = ("_decoder", "_encoder", "_head_decoder", "_peek_decoder", "_tag_decoder", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._head_decoder = msgspec.msgpack.Decoder(_Head)
        self._peek_decoder = msgspec.msgpack.Decoder(_Peek)
        self._tag_decoder = msgspec.msgpack.Decoder(_Tag)

    def encode(self, envelope: Envelope) -> bytes:
        """The frame of `envelope`; `ProtocolError` if it would exceed `max_frame_bytes`."""
        frame = self._encoder.encode(envelope)
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        return frame

    def decode(self, frame: bytes | bytearray | memoryview) -> Envelope:
        """The envelope in `frame`; `ProtocolError` for anything malformed, out of bounds or of another version."""
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        try:
            envelope = self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            self._refuse_other_version(frame)
            raise ProtocolError(f"invalid frame: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from exc
        if envelope.version != PROTOCOL_VERSION:
            raise _version_error(envelope.version)
        return envelope

    def peek(self, frame: bytes | bytearray | memoryview) -> FrameHead:
        """The sender, session and body tag of `frame`, without decoding its body; `ProtocolError` when those
        cannot be read or the frame is of another protocol version (`decode` checks the rest)."""
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        try:
            head = self._peek_decoder.decode(frame)
            tag = self._tag_decoder.decode(head.body).tag
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._refuse_other_version(frame)
            raise ProtocolError(f"invalid frame: {exc}") from exc
        if head.version != PROTOCOL_VERSION:
            raise _version_error(head.version)
        return FrameHead(head.sender, head.session, tag)

    def _refuse_other_version(self, frame: bytes | bytearray | memoryview) -> None:
        """A frame that fails validation may be well formed for another protocol version: say so, if it is."""
        try:
            head = self._head_decoder.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if head.version != PROTOCOL_VERSION:
            raise _version_error(head.version)


def body_tags(bodies: Iterable[type]) -> frozenset[str]:
    """The wire tags of body types (what `FrameHead.tag` reads), e.g. of `EndpointCore.accepted_bodies()`."""
    return frozenset(str(cast("type[msgspec.Struct]", body).__struct_config__.tag) for body in bodies)


class FrameHead(msgspec.Struct, frozen=True):
    """Who sent a frame (peer id and session) and the tag of its body (`Metadata`'s is "meta"), read by `peek`."""

    sender: str
    session: int
    tag: str


class _Peek(msgspec.Struct, frozen=True, array_like=True):
    """An envelope's leading fields, its body left undecoded (later fields are ignored)."""

    version: int
    sender: PeerId
    session: Count
    epoch: Count
    seq: Count
    watermark: msgspec.Raw
    body: msgspec.Raw


class _Tag(msgspec.Struct, frozen=True, array_like=True):
    """The tag that leads every encoded body."""

    tag: str


class _Head(msgspec.Struct, frozen=True, array_like=True):
    """The first field of an envelope of any protocol version (later fields are ignored)."""

    version: int


def _version_error(version: int) -> ProtocolError:
    return ProtocolError(
        f"frame has protocol version {version}, this endpoint speaks {PROTOCOL_VERSION}; "
        "upgrade both sides to the same kvstage version"
    )
