"""The event trace of one simulated run: the last N events, one compact line each, for failure reports.

Owns: `Trace`, a bounded ring of (time, node, text) records, and an optional running digest of every event so
tests can prove that a seed replays exactly. Formatting is lazy: a record is a tuple until someone prints it,
so tracing costs little when nothing fails.

Called by the world's parts (record) and sim/runner.py / cli.py (render on a violation or with `--trace`).
"""

from __future__ import annotations

import hashlib
from collections import deque

import msgspec

from kvstage.errors import ProtocolError
from kvstage.protocol import Codec, ReceivedFrame, Send
from kvstage.protocol.messages import Envelope

#: Marks an entry whose `what` is the type name of its detail (an event) or "-> " and the name (an action).
EVENT, ACTION = "\x00event", "\x00action"

_CODEC = Codec()


class Trace:
    """Bounded event log; with `keep_all` every line is also kept (for `--trace` replays and digests)."""

    def __init__(self, tail: int = 50, keep_all: bool = False) -> None:
        self._tail: deque[tuple[float, str, str, object]] = deque(maxlen=tail)
        self._all: list[str] | None = [] if keep_all else None
        self.count = 0

    def record(self, time: float, node: str, what: str, detail: object = "") -> None:
        """One entry; `detail` is text, or an event/action/envelope formatted only when the line is shown."""
        self.count += 1
        entry = (time, node, what, detail)
        self._tail.append(entry)
        if self._all is not None:
            self._all.append(_line(entry))

    @property
    def keep_all(self) -> bool:
        return self._all is not None

    def tail(self) -> list[str]:
        return [_line(entry) for entry in self._tail]

    def lines(self) -> list[str]:
        """Every line, when recorded with `keep_all`; otherwise the tail."""
        return list(self._all) if self._all is not None else self.tail()

    def digest(self) -> str:
        """SHA-256 over every line (needs `keep_all`)."""
        assert self._all is not None, "digest needs Trace(keep_all=True)"
        h = hashlib.sha256()
        for line in self._all:
            h.update(line.encode())
            h.update(b"\n")
        return h.hexdigest()


def _line(entry: tuple[float, str, str, object]) -> str:
    time, node, what, detail = entry
    if what == EVENT:
        what = type(detail).__name__
    elif what == ACTION:
        what = "-> " + type(detail).__name__
    text = detail if isinstance(detail, str) else describe(detail)
    return f"{time * 1000:10.3f}ms {node:<10} {what:<14} {text}"


def describe_envelope(envelope: Envelope) -> str:
    body = envelope.body
    fields = " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(body).items() if k != "pages")
    wm = envelope.watermark
    mark = f" wm={wm.round}:{wm.tail}" if wm is not None else ""
    return f"{envelope.sender}#{envelope.session}.{envelope.epoch} {type(body).__name__} {fields}{mark}"


def describe(value: object) -> str:
    """One compact line for an event, action or envelope (nested plans and blocks are summarised)."""
    if isinstance(value, ReceivedFrame):
        try:
            return describe_envelope(_CODEC.decode(value.frame))
        except ProtocolError as exc:
            return f"<rejected frame of {len(value.frame)}B: {str(exc)[:60]}>"
    if isinstance(value, Send):
        return f"to {value.peer}: {describe_envelope(value.envelope)}"
    if isinstance(value, Envelope):
        return describe_envelope(value)
    parts = []
    for name in getattr(value, "__slots__", ()):
        item = getattr(value, name)
        if name in ("plan", "block", "transfer", "envelope"):
            continue
        if name == "region":
            item = f"e{item.epoch}@r{item.round}[{item.offset},{item.end})"
        elif isinstance(item, tuple) and len(item) > 6:
            item = f"({item[0]}..{item[-1]}; {len(item)})"
        elif isinstance(item, bytes):
            item = f"<{len(item)}B>"
        parts.append(f"{name}={item}")
    return " ".join(parts)
