"""The router's choices, as pure functions: prompt blocks, the hash ring, the prefix index, bounded loads."""

from __future__ import annotations

from kvstage.router.instances import Instance
from kvstage.router.select import (
    BYTES_PER_TOKEN,
    Candidate,
    HashRing,
    LoadBound,
    PrefixIndex,
    by_prefix,
    least_loaded,
    prompt_blocks,
)

D0, D1, D2 = (Instance(f"D{i}", "decode", f"http://127.0.0.1:{9000 + i}") for i in range(3))


def blocks_of(prompt: object, block: int = 4, chat: bool = False):
    body = {"messages": prompt} if chat else {"prompt": prompt}
    return prompt_blocks(body, chat=chat, block_tokens=block)


def test_token_prompts_that_share_leading_blocks_share_those_hashes_and_only_those() -> None:
    a = blocks_of(list(range(10)))
    b = blocks_of([*range(8), 77, 78, 79, 80])
    assert len(a.hashes) == 2 and len(b.hashes) == 3  # full blocks only
    assert a.hashes == b.hashes[:2] and a.units == 10 and a.uncached_units(2) == 2
    assert blocks_of(list(range(3))).key is None  # shorter than a block: no place on the ring
    assert blocks_of([list(range(8)), [5]]).hashes == blocks_of(list(range(8))).hashes  # a list: its first prompt


def test_text_and_chat_prompts_are_hashed_by_bytes_and_a_shared_leading_message_is_a_shared_prefix() -> None:
    step = 4 * BYTES_PER_TOKEN
    text = blocks_of("x" * (3 * step + 1))
    assert len(text.hashes) == 3 and text.block_units == step
    system = {"role": "system", "content": "s" * 200}
    one = blocks_of([system, {"role": "user", "content": "first question"}], chat=True)
    two = blocks_of([system, {"role": "user", "content": "another one"}], chat=True)
    shared = sum(1 for x, y in zip(one.hashes, two.hashes, strict=False) if x == y)
    assert shared >= 200 // step - 1 and one.hashes != two.hashes
    assert blocks_of({"not": "a prompt"}).hashes == ()


def test_the_ring_maps_a_key_to_the_same_instance_and_a_new_instance_takes_over_about_a_third() -> None:
    two, three = HashRing(["D0", "D1"]), HashRing(["D0", "D1", "D2"])
    keys = [i.to_bytes(4, "big") for i in range(3000)]
    assert sorted(two.order(keys[0])) == ["D0", "D1"] and two.order(keys[0]) == two.order(keys[0])
    moved = sum(1 for k in keys if two.order(k)[0] != three.order(k)[0])
    assert all(three.order(k)[0] == "D2" for k in keys if two.order(k)[0] != three.order(k)[0])
    assert 0.2 < moved / len(keys) < 0.5


def test_the_index_finds_the_longest_prefix_an_instance_served_within_its_bound_and_forgets_it() -> None:
    index = PrefixIndex(per_instance=4)
    first = blocks_of(list(range(12)))  # 3 blocks
    index.record(D0, first)
    assert index.held(D0, blocks_of([*range(8), 9, 9, 9, 9])) == 2 and index.held(D1, first) == 0
    index.record(D0, blocks_of(list(range(100, 112))))  # 3 more: over the bound of 4
    assert index.held(D0, first) == 1  # its last blocks went first, its first block stayed
    index.forget(D0)
    assert index.held(D0, first) == 0


def test_bounded_loads_prefer_the_holder_until_it_is_over_its_share_then_the_ring_decides() -> None:
    ring = HashRing(["D0", "D1"])
    key = b"k"
    holder = Candidate(D1, load=1, held=3)
    other = Candidate(D0, load=1, held=0)
    strict = LoadBound(1.25, slack=0)
    assert by_prefix([other, holder], key, ring, strict).instance == D1
    busy = Candidate(D1, load=4, held=3)  # cap: ceil(1.25 * 6 / 2) = 4, and 4 + 1 > 4
    assert by_prefix([other, busy], key, ring, strict).instance == D0
    assert by_prefix([other, busy], key, ring, LoadBound(1.25, slack=1)).instance == D1  # 4 + 1 <= 4 + 1
    cold = [Candidate(D0, 0), Candidate(D1, 0)]
    assert by_prefix(cold, key, ring, strict).instance.name == ring.order(key)[0]
    assert by_prefix([Candidate(D0, 2), Candidate(D1, 1)], None, ring, strict).instance == D1  # no key: least load
    assert least_loaded([Candidate(D0, 1), Candidate(D1, 1), Candidate(D2, 0.5)]).instance == D2
    assert least_loaded([Candidate(D1, 1), Candidate(D0, 1)]).instance == D1  # equals: the first in turn
