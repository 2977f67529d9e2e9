"""The state tables drive every move: an edge not in a table is refused, docs/protocol.md shows exactly the code's
tables, every state can still end, and no code in protocol/ sets or compares a state outside states.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from protocol_harness import make_pump

from kvstage.errors import ProtocolError
from kvstage.protocol import AbortRoom, DecodeEndpoint, ExpectRoom
from kvstage.protocol.states import (
    DECODE_ROOM,
    PREFILL_CHUNK,
    PREFILL_ROOM,
    ChunkState,
    ChunkTrigger,
    DecodeRoomState,
    DecodeTrigger,
    Table,
)

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"DECODE_ROOM": DECODE_ROOM, "PREFILL_ROOM": PREFILL_ROOM, "PREFILL_CHUNK": PREFILL_CHUNK}


@dataclass
class Holder:
    state: ChunkState


def test_an_edge_missing_from_the_table_is_refused_and_the_state_is_kept() -> None:
    chunk = Holder(ChunkState.REQUESTED)
    with pytest.raises(ProtocolError, match="prefill chunk \\(1, 0\\): no edge from REQUESTED on WRITE"):
        PREFILL_CHUNK.move(chunk, ChunkTrigger.WRITE, (1, 0))  # a write before its grant
    assert chunk.state is ChunkState.REQUESTED
    PREFILL_CHUNK.move(chunk, ChunkTrigger.GRANT, (1, 0))
    assert chunk.state is ChunkState.GRANTED


def test_an_endpoint_refuses_a_move_its_table_lacks() -> None:
    pump = make_pump()
    pump.call("d0", ExpectRoom(1, ("p0", "p1"), 16, 0, (1, 2, 3, 4), 30.0))
    pump.call("d0", AbortRoom(1))
    d0 = pump.endpoints["d0"]
    assert isinstance(d0, DecodeEndpoint)
    assert d0.room_state(1) is DecodeRoomState.QUARANTINED  # waiting for the writers' AbortAck
    room = d0._rooms[1]
    assert not DECODE_ROOM.can(room, DecodeTrigger.GRANT)
    with pytest.raises(ProtocolError, match="decode room 1: no edge from QUARANTINED on SUCCEED"):
        DECODE_ROOM.move(room, DecodeTrigger.SUCCEED, 1)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_docs_show_exactly_the_code_tables(name: str) -> None:
    docs = (ROOT / "docs" / "protocol.md").read_text()
    found = re.search(rf"<!-- states\.{name} -->\n(.*?)\n<!-- end -->", docs, re.DOTALL)
    assert found is not None, f"docs/protocol.md has no <!-- states.{name} --> block"
    assert found.group(1) == TABLES[name].markdown(), f"paste this into docs/protocol.md:\n{TABLES[name].markdown()}"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_state_is_reached_and_can_end_in_forgotten(name: str) -> None:
    table: Table = TABLES[name]  # type: ignore[type-arg]
    states = {edge.state for edge in table.edges} | {edge.next for edge in table.edges}
    kind = type(next(iter(states)))
    assert states == set(kind), "a state of the enum has no edge"
    assert not [e for e in table.edges if e.state is kind.FORGOTTEN], "forgotten is final"
    ends = {kind.FORGOTTEN}
    while True:  # states from which some path leads to FORGOTTEN
        more = {e.state for e in table.edges if e.next in ends} - ends
        if not more:
            break
        ends |= more
    assert ends == states


def test_no_state_is_set_or_compared_outside_the_tables() -> None:
    protocol = ROOT / "src" / "kvstage" / "protocol"
    pattern = re.compile(r"\.state\s*(=[^=]|is\b|==|!=|in\b)")
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(protocol.glob("*.py"))
        if path.name != "states.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
