"""R9 with a lossless network: a chunk parked for ring space hears its watermark from a frame, never from a timer.

Decode sends a moved watermark at once only to writers that may hold a parked chunk (decode_rooms.LiveGrants);
every other writer learns it from its next frame. These tests drive rooms of random sizes through rings of one to
three chunks, with every write and scatter held and released one at a time in a random order, and never advance
the clock: no heartbeat, retry or deadline fires, so a parked chunk that nobody told would leave its room open.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_harness import Pump, all_quiescent, attach, compute, expect, make_pump

from kvstage.protocol import Scatter, WriteRegion

CHUNK_TOKENS = 8
CHUNK_BYTES = 4096  # the harness's layout: 8 heads, 2 layers, head_dim 8, bf16, 8 tokens, all heads on d0


def _release_one(pump: Pump, rng: random.Random) -> None:
    src, action = pump.held.pop(rng.randrange(len(pump.held)))
    pump.complete(src, action)
    pump.run()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    prefill_tp=st.sampled_from([1, 2]),
    ring_halves=st.integers(2, 6),
    rooms=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_every_room_ends_without_a_timer_when_no_frame_is_lost(
    prefill_tp: int, ring_halves: int, rooms: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    pump = make_pump(prefill_tp=prefill_tp, ring_bytes=ring_halves * CHUNK_BYTES // 2)
    pump.hold = lambda src, action: isinstance(action, WriteRegion | Scatter)
    for room, chunks in enumerate(rooms, start=1):
        tokens = chunks * CHUNK_TOKENS
        expect(pump, room, tokens)
        attach(pump, room, tokens)
        for end in range(CHUNK_TOKENS, tokens + 1, CHUNK_TOKENS):  # the engine computes chunk by chunk
            compute(pump, room, end)
            pump.run()
            while pump.held and rng.random() < 0.5:
                _release_one(pump, rng)
    while pump.held:
        _release_one(pump, rng)
    assert pump.now == 0.0
    assert [pump.outcome("d0", room) for room in range(1, len(rooms) + 1)] == ["ok"] * len(rooms)
    assert all_quiescent(pump)
