"""KV layout, head mapping across tensor-parallel ranks, staging-region plans and the chunk grid.

Owns the pure arithmetic that both sides of a handoff must agree on, byte for byte:

- `KVLayout`: the shape of one model's KV cache and its sizes per token, head and page; `latent_layout`, an MLA
  model's latent cache as a KVLayout (one head, the latent row halved into K and V).
- `heads_of_rank`: which global KV heads a TP rank holds.
- `plan_head_transfers`: which prefill rank writes which heads to which decode rank; `replica_turn`, where a
  room's decode ranks start among a replicated head's prefill replicas.
- `plan_staging`: where each writer's block lives inside one chunk's staging region.
- `ChunkGrid`: how a prompt's uncached suffix is cut into chunks aligned to the cached prefix, and which of a
  room's pages hold a token range (`ceil_div`, `pages_for`, `page_slice`). The one home of this arithmetic: both
  endpoints, the runtime, the dataplane and the simulator use it, staged, direct and MLA rooms alike.
- `validate_staging_config`: the startup check that rejects configurations staging cannot serve.

Invariants: every decode head is written exactly once, by a prefill rank that holds it; replicated heads are
spread over their replicas; a plan's blocks tile its region with no gap or overlap. Pure: no torch, no I/O,
no clock, no randomness. Called by protocol/ (sizes, chunk grid), dataplane/ (offsets, pages), runtime/ and sim/.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from kvstage.errors import ConfigError, InvalidRequest

#: Bytes per element of each KV dtype kvstage moves. Copies are bit-preserving, so only the size matters.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

Attention = Literal["mha", "gqa", "mla"]
ATTENTION_KINDS: tuple[str, ...] = ("mha", "gqa", "mla")


def ceil_div(numerator: int, denominator: int) -> int:
    """`numerator / denominator` rounded up, for a positive `denominator` (integers only, no float)."""
    return -(-numerator // denominator)


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages hold `num_tokens` tokens counted from a page boundary."""
    return ceil_div(num_tokens, page_size)


def page_slice(token_start: int, token_end: int, page_size: int) -> slice:
    """Which entries of a room's page list (page `i` holds tokens `[i * page_size, (i + 1) * page_size)`) hold
    tokens `[token_start, token_end)`: `pages[page_slice(...)]`."""
    return slice(token_start // page_size, ceil_div(token_end, page_size))


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one model's paged KV cache, identical on both sides of a handoff.

    `num_kv_heads` is the model's total KV heads; a TP rank holds a slice of them (see `heads_of_rank`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            _require_positive(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token in one layer, for K or for V."""
        return self.head_dim * self.itemsize

    def bytes_per_token(self, num_heads: int | None = None) -> int:
        """Bytes of one token's K and V over all layers, for `num_heads` heads (default: all KV heads)."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        return 2 * self.num_layers * heads * self.head_bytes

    def bytes_per_head(self, num_tokens: int = 1) -> int:
        """Bytes of one head's K and V over all layers, for `num_tokens` tokens."""
        return 2 * self.num_layers * num_tokens * self.head_bytes

    def bytes_per_page(self, num_heads: int | None = None) -> int:
        """Bytes of one page (page_size tokens) of K and V over all layers, for `num_heads` heads."""
        return self.page_size * self.bytes_per_token(num_heads)


def latent_layout(num_layers: int, latent_dim: int, dtype: str, page_size: int) -> KVLayout:
    """An MLA model's latent KV cache (`latent_dim = kv_lora_rank + rope_dim` elements per token and layer, the
    same on every TP rank) as a `KVLayout`: one KV head, so the head plan replicates it (each decode rank takes it
    whole from one prefill rank), whose K is the row's first half and V its second. Every size, staging plan and
    copy then covers each latent row exactly once, in order."""
    if not isinstance(latent_dim, int) or latent_dim <= 0 or latent_dim % 2:
        raise ConfigError(
            f"latent_dim={latent_dim!r}: an MLA latent row is moved as two halves, so it must be a positive even "
            "number of elements (kv_lora_rank + rope_dim)"
        )
    return KVLayout(num_layers=num_layers, num_kv_heads=1, head_dim=latent_dim // 2, dtype=dtype, page_size=page_size)


def _check_tp(num_kv_heads: int, tp_size: int) -> None:
    _require_positive("num_kv_heads", num_kv_heads)
    _require_positive("tp_size", tp_size)
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise ConfigError(
            f"num_kv_heads={num_kv_heads} is not divisible by tp_size={tp_size}; "
            "choose a TP size that divides the KV heads"
        )
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ConfigError(
            f"tp_size={tp_size} exceeds num_kv_heads={num_kv_heads} but is not a multiple of it; "
            "heads can only be replicated a whole number of times"
        )


def heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """Global KV heads held by `rank` of a TP group of `tp_size` ranks.

    With tp <= H each rank holds H/tp consecutive heads. With tp > H, tp/H consecutive ranks share one head:
    rank r holds head r // (tp // H) (integer division, not modulo).
    """
    _check_tp(num_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} is outside a TP group of size {tp_size}")
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def replicas_of_head(num_kv_heads: int, tp_size: int, head: int) -> range:
    """TP ranks that hold global `head` (one rank unless tp > H)."""
    _check_tp(num_kv_heads, tp_size)
    if not 0 <= head < num_kv_heads:
        raise ConfigError(f"head {head} is outside 0..{num_kv_heads - 1}")
    if tp_size <= num_kv_heads:
        rank = head // (num_kv_heads // tp_size)
        return range(rank, rank + 1)
    replication = tp_size // num_kv_heads
    return range(head * replication, (head + 1) * replication)


@dataclass(frozen=True, slots=True)
class HeadTransfer:
    """One prefill rank writes `num_heads` consecutive heads to one decode rank.

    Head starts are local indices within each rank's own heads.
    """

    prefill_rank: int
    decode_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


def replica_turn(room: int, prefill_tp: int) -> int:
    """The turn of `room` among replicated heads' prefill replicas: consecutive rooms start one replica further,
    so that rooms spread over every replica (an MLA latent over every prefill rank) even when fewer decode ranks
    need it. Both sides compute it from the room id; it is below `prefill_tp`, so plans keyed by it stay few."""
    return room % prefill_tp


def plan_head_transfers(num_kv_heads: int, prefill_tp: int, decode_tp: int, turn: int = 0) -> tuple[HeadTransfer, ...]:
    """Every (prefill rank -> decode rank) head run of a handoff, ordered by decode rank then head.

    Each global head of each decode rank is written exactly once, by a prefill rank that holds it. When a head
    has several prefill replicas, the decode ranks needing it take the replicas round robin, starting `turn`
    replicas along (`replica_turn`). Contiguous runs from the same writer are merged.
    """
    transfers: list[HeadTransfer] = []
    for decode_rank in range(decode_tp):
        dst_heads = heads_of_rank(num_kv_heads, decode_tp, decode_rank)
        run: HeadTransfer | None = None
        for dst_local, head in enumerate(dst_heads):
            needing = replicas_of_head(num_kv_heads, decode_tp, head)
            writers = replicas_of_head(num_kv_heads, prefill_tp, head)
            writer = writers[(decode_rank - needing.start + turn) % len(writers)]
            src_local = head - heads_of_rank(num_kv_heads, prefill_tp, writer).start
            if (
                run is not None
                and run.prefill_rank == writer
                and run.src_head_start + run.num_heads == src_local
                and run.dst_head_start + run.num_heads == dst_local
            ):
                run = HeadTransfer(writer, decode_rank, run.src_head_start, run.dst_head_start, run.num_heads + 1)
                continue
            if run is not None:
                transfers.append(run)
            run = HeadTransfer(writer, decode_rank, src_local, dst_local, 1)
        assert run is not None  # every rank holds at least one head
        transfers.append(run)
    return tuple(transfers)


@dataclass(frozen=True, slots=True)
class WriterBlock:
    """One writer's block inside a chunk's staging region: `[K layer 0..L-1 | V layer 0..L-1]`.

    Each layer is token-major: `num_tokens x num_heads x head_dim` elements.
    """

    transfer: HeadTransfer
    offset: int
    nbytes: int
    layer_bytes: int

    @property
    def prefill_rank(self) -> int:
        return self.transfer.prefill_rank

    def layer_offset(self, kv: int, layer: int, num_layers: int) -> int:
        """Byte offset, within the region, of K (kv=0) or V (kv=1) of `layer`."""
        return self.offset + (kv * num_layers + layer) * self.layer_bytes


@dataclass(frozen=True, slots=True)
class StagingPlan:
    """Where each writer's data lives inside one chunk's region on one decode rank."""

    layout: KVLayout
    decode_rank: int
    num_tokens: int
    blocks: tuple[WriterBlock, ...]
    total_bytes: int

    @property
    def writers(self) -> tuple[int, ...]:
        """Prefill ranks that write into this region, in block order."""
        return tuple(block.prefill_rank for block in self.blocks)

    def block_of(self, prefill_rank: int) -> WriterBlock:
        """The block that `prefill_rank` writes; `InvalidRequest` if it writes none."""
        for block in self.blocks:
            if block.prefill_rank == prefill_rank:
                return block
        raise InvalidRequest(f"prefill rank {prefill_rank} writes nothing to decode rank {self.decode_rank}")


def plan_staging(
    layout: KVLayout, prefill_tp: int, decode_tp: int, decode_rank: int, num_tokens: int, turn: int = 0
) -> StagingPlan:
    """Ordered writer blocks of one chunk of `num_tokens` tokens destined for `decode_rank`, in a room of `turn`."""
    if not isinstance(num_tokens, int) or num_tokens <= 0:
        raise InvalidRequest(f"num_tokens must be a positive integer, got {num_tokens!r}")
    heads_of_rank(layout.num_kv_heads, decode_tp, decode_rank)  # validates decode_rank
    transfers = [
        t for t in plan_head_transfers(layout.num_kv_heads, prefill_tp, decode_tp, turn) if t.decode_rank == decode_rank
    ]
    transfers.sort(key=lambda t: t.prefill_rank)
    blocks: list[WriterBlock] = []
    offset = 0
    for transfer in transfers:
        layer_bytes = num_tokens * transfer.num_heads * layout.head_bytes
        nbytes = 2 * layout.num_layers * layer_bytes
        blocks.append(WriterBlock(transfer, offset, nbytes, layer_bytes))
        offset += nbytes
    return StagingPlan(layout, decode_rank, num_tokens, tuple(blocks), offset)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens `[start, end)` of a prompt; `index` counts grid slots from the cached prefix."""

    index: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    """Cuts `[prefix_tokens, num_tokens)` into chunks of `chunk_tokens`, the grid starting at the prefix.

    The grid of every path (staged, direct, MLA): it needs only `chunk_tokens`, a positive multiple of
    `page_size`, so every chunk starts on a page boundary."""

    chunk_tokens: int
    page_size: int

    def __post_init__(self) -> None:
        _check_chunk_tokens(self.chunk_tokens, self.page_size)

    def num_chunks(self, num_tokens: int, prefix_tokens: int = 0) -> int:
        """How many chunks cover the uncached suffix."""
        self._check(num_tokens, prefix_tokens)
        return ceil_div(num_tokens - prefix_tokens, self.chunk_tokens)

    def pages_of(self, chunk: Chunk) -> slice:
        """The entries of the room's page list that hold `chunk`'s tokens: `pages[grid.pages_of(chunk)]`."""
        return page_slice(chunk.start, chunk.end, self.page_size)

    def chunk(self, index: int, num_tokens: int, prefix_tokens: int = 0) -> Chunk:
        """Chunk `index` of the grid; `InvalidRequest` if out of range."""
        count = self.num_chunks(num_tokens, prefix_tokens)
        if not 0 <= index < count:
            raise InvalidRequest(f"chunk index {index} is outside 0..{count - 1}")
        return self.at(index, num_tokens, prefix_tokens)

    def at(self, index: int, num_tokens: int, prefix_tokens: int = 0) -> Chunk:
        """`chunk` without the checks, for a caller that has checked the room's tokens and the index (an
        endpoint's hot path: the room was checked when it was registered)."""
        start = prefix_tokens + index * self.chunk_tokens
        return Chunk(index, start, min(start + self.chunk_tokens, num_tokens))

    def chunks(self, num_tokens: int, prefix_tokens: int = 0) -> tuple[Chunk, ...]:
        """Every chunk of the uncached suffix, in order; the last one may be short."""
        return tuple(self.iter_chunks(num_tokens, prefix_tokens))

    def iter_chunks(self, num_tokens: int, prefix_tokens: int = 0) -> Iterator[Chunk]:
        for index in range(self.num_chunks(num_tokens, prefix_tokens)):
            yield self.at(index, num_tokens, prefix_tokens)

    def _check(self, num_tokens: int, prefix_tokens: int) -> None:
        if prefix_tokens < 0 or prefix_tokens % self.page_size:
            raise InvalidRequest(
                f"prefix_tokens={prefix_tokens} is not a non-negative multiple of page_size={self.page_size}; "
                "a cached prefix must end on a page boundary"
            )
        if num_tokens <= prefix_tokens:
            raise InvalidRequest(
                f"num_tokens={num_tokens} must exceed prefix_tokens={prefix_tokens}: nothing is left to transfer"
            )


def validate_staging_config(
    *,
    chunk_tokens: int | None,
    page_size: int,
    pp_size: int = 1,
    context_parallel: bool = False,
    attention: str = "gqa",
) -> None:
    """Reject, at startup, every configuration that staging cannot serve; each message names the fix."""
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention={attention!r} is unknown; use one of {', '.join(ATTENTION_KINDS)}")
    _check_chunk_tokens(chunk_tokens, page_size)
    if pp_size != 1:
        raise ConfigError(
            f"pp_size={pp_size}: staging does not support pipeline parallelism; set pp_size=1 or disable staging"
        )
    if context_parallel:
        raise ConfigError(
            "context_parallel=True: staging does not support prefill context parallelism; "
            "disable context parallelism or disable staging"
        )


def _check_chunk_tokens(chunk_tokens: int | None, page_size: int) -> None:
    """The chunk grid's own requirement: `chunk_tokens` is a positive multiple of a positive `page_size`."""
    _require_positive("page_size", page_size)
    if chunk_tokens is None or isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise ConfigError(
            f"chunk_tokens={chunk_tokens!r}: staging needs chunk_tokens set to a positive multiple of "
            f"page_size={page_size}"
        )
    if chunk_tokens <= 0 or chunk_tokens % page_size:
        raise ConfigError(
            f"chunk_tokens={chunk_tokens} must be a positive multiple of page_size={page_size}; "
            f"set chunk_tokens to a multiple of page_size, for example {page_size * max(1, chunk_tokens // page_size)}"
        )
