"""Validation of the `Metadata` a decode rank sends a prefill rank: what makes it unusable, in one place.

Owns `metadata_problem` (whatever the room: this rank's TP and heads, the room's token and chunk bounds on
decode's page grid, which may differ from this rank's page size, and the page count of the direct path) and
`attached_metadata_problem` (also against the room the prefill engine attached). Each returns the problem as a
short phrase, counted by the endpoint under `messages_rejected`, or None. A problem is never raised: the sender is
answered `Abort("bad metadata")` (R10).

Pure. Called by prefill.py.
"""

from __future__ import annotations

from collections.abc import Container

from kvstage.errors import ConfigError
from kvstage.layout import ceil_div, pages_for, replica_turn
from kvstage.protocol.config import PrefillConfig
from kvstage.protocol.messages import DIRECT, MAX_CHUNKS, Metadata
from kvstage.protocol.plans import transfers_of_writer


def metadata_problem(config: PrefillConfig, m: Metadata) -> str | None:
    """Why `m` cannot be served by this prefill rank whatever the room, or None."""
    page_size = m.page_size  # decode's: the grid and the page list are decode's; this rank's may differ
    if m.prefill_tp != config.tp_size:
        return "metadata for another prefill TP size"
    if page_size < 1:
        return "page size not positive"
    if not m.decode_rank < m.decode_tp:
        return "decode rank outside its TP group"
    try:
        turn = replica_turn(m.room, config.tp_size)
        targets = transfers_of_writer(config.layout.num_kv_heads, config.tp_size, m.decode_tp, config.rank, turn)
    except ConfigError:
        return "decode TP size incompatible with the KV heads"
    if m.bystander and targets:
        return "a writes-nothing notice to a rank that writes in this room"
    if not m.bystander and m.decode_rank not in targets:
        return "metadata from a decode rank this rank does not write to"
    if not 0 <= m.prefix_tokens < m.num_tokens or m.prefix_tokens % page_size:
        return "prefix not page-aligned or not below num_tokens"
    if m.chunk_tokens <= 0 or m.chunk_tokens % page_size:
        return "chunk_tokens not a positive multiple of the page size"
    if ceil_div(m.num_tokens - m.prefix_tokens, m.chunk_tokens) > MAX_CHUNKS:
        return "too many chunks"
    expected_pages = pages_for(m.num_tokens, page_size) if m.path == DIRECT else 0
    if len(m.pages) != expected_pages:
        return "page count does not match num_tokens"
    return None


def attached_metadata_problem(
    config: PrefillConfig,
    m: Metadata,
    num_tokens: int,
    decode_tp: int,
    linked_ranks: Container[int],
    prompt: bytes = b"",
) -> str | None:
    """`metadata_problem`, and whether `m` fits the attached room (`num_tokens`, `decode_tp`, and the digest of
    its `prompt` when both sides give one) whose decode ranks `linked_ranks` already sent theirs."""
    problem = metadata_problem(config, m)
    if problem is None and (m.num_tokens != num_tokens or m.decode_tp != decode_tp):
        problem = "metadata disagrees with the attached room"
    if problem is None and m.prompt and prompt and m.prompt != prompt:
        problem = "metadata for another prompt (a misrouted room)"
    if problem is None and m.decode_rank in linked_ranks:
        problem = "two peers claim the same decode rank"
    return problem
