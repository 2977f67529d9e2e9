"""What one `kvstage bench` run measures: the model's KV shape, the TP pair, the request and the repeats.

Owns `MODEL_PRESETS`, `parse_model` (a preset name or an explicit `L32xH8xD128:bfloat16` shape) and `BenchConfig`,
the validated, frozen description of a run, plus the sizes every process derives from it (pages per request,
ring and staging capacities). Pure: no I/O, no clock, no randomness.

Invariants: a `BenchConfig` that constructs is one the runtime accepts (layout, TP pair, chunk grid, backend);
every bad value is a `ConfigError` that names the flag. Called by the CLI, `kvstage.bench.runner` and the workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstage.errors import ConfigError
from kvstage.layout import (
    KVLayout,
    ceil_div,
    heads_of_rank,
    pages_for,
    plan_head_transfers,
    plan_staging,
    validate_staging_config,
)
from kvstage.transport.data import BACKENDS


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-relevant shape of a model: layers, KV heads, head size and dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"


MODEL_PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(32, 8, 128),
    "llama3-70b": ModelShape(80, 8, 128),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "tiny": ModelShape(4, 4, 64),
}

_SHAPE_RE = re.compile(r"L(?P<layers>\d+)xH(?P<heads>\d+)xD(?P<dim>\d+)(?::(?P<dtype>\w+))?")

#: Where the ranks' KV pools live. With "cuda" the rings and staging live where the backend's `staging_device` says:
#: on each rank's GPU with cuda_ipc and nixl, else in host memory (what the other transports move), so the staged path's
#: gather/scatter cross between the GPU pool and host staging.
DEVICES = ("cpu", "cuda")
#: Slack per region for the ring's alignment padding.
ALIGN_SLACK = 64


def parse_model(spec: str) -> ModelShape:
    """A preset name, or `L<layers>xH<kv heads>xD<head dim>[:dtype]` (dtype defaults to bfloat16)."""
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    match = _SHAPE_RE.fullmatch(spec)
    if match is None:
        raise ConfigError(
            f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a shape like L32xH8xD128:bfloat16"
        )
    return ModelShape(int(match["layers"]), int(match["heads"]), int(match["dim"]), match["dtype"] or "bfloat16")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One bench run. `concurrency` requests move at once; each path runs `repeats` times, interleaved. KV pools
    live on `device`."""

    backend: str
    model: str
    prefill_tp: int
    decode_tp: int
    page_size: int
    tokens: int
    chunk_tokens: int
    concurrency: int = 1
    repeats: int = 3
    device: str = "cpu"
    ring_chunks: int = 4
    writes_per_peer: int = 2
    #: rounds that also time the per-slice path (None: every round); it is verified in the first, so at least 1
    slice_rounds: int | None = None
    batch_slices: int = 4096
    timeout_s: float = 300.0
    seed: int = 20261129

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
        for name in (
            "prefill_tp", "decode_tp", "tokens", "concurrency", "repeats", "batch_slices", "ring_chunks",
            "writes_per_peer",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.slice_rounds is not None and (not isinstance(self.slice_rounds, int) or self.slice_rounds <= 0):
            raise ConfigError(f"--slice-rounds must be a positive integer, got {self.slice_rounds!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device {self.device!r} is unknown; choose one of {', '.join(DEVICES)}")
        validate_staging_config(chunk_tokens=self.chunk_tokens, page_size=self.page_size)
        shape = self.shape  # validates --model
        self.layout  # noqa: B018 - validates the layout (dtype, sizes)
        for tp in (self.prefill_tp, self.decode_tp):
            heads_of_rank(shape.num_kv_heads, tp, 0)  # validates each TP size against the KV heads

    def times_slice(self, round_index: int) -> bool:
        """Whether timed round `round_index` (from 1) runs the per-slice path too."""
        return self.slice_rounds is None or round_index <= self.slice_rounds

    @property
    def shape(self) -> ModelShape:
        return parse_model(self.model)

    @property
    def layout(self) -> KVLayout:
        s = self.shape
        return KVLayout(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, self.page_size)

    @property
    def pages_per_request(self) -> int:
        return pages_for(self.tokens, self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages of every rank's KV pool: one request's worth per concurrent request."""
        return self.pages_per_request * self.concurrency

    @property
    def request_bytes(self) -> int:
        """KV bytes of one request over all heads: what every path moves per request."""
        return self.tokens * self.layout.bytes_per_token()

    @property
    def chunks_per_request(self) -> int:
        return ceil_div(self.tokens, self.chunk_tokens)

    def decode_bytes(self, decode_rank: int) -> int:
        """KV bytes of one request that `decode_rank` receives (its heads, every writer)."""
        return plan_staging(self.layout, self.prefill_tp, self.decode_tp, decode_rank, self.tokens).total_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes every path moves per request: what all decode ranks receive (replicated heads count per copy)."""
        return sum(self.decode_bytes(rank) for rank in range(self.decode_tp))

    @property
    def raw_writes_per_pair(self) -> int:
        """Raw path: writes per (prefill rank, decode rank) pair. cuda_ipc: one, since a writer's copies run one
        after another on its stream whatever the number in flight; otherwise `writes_per_peer`, the staged path's
        window, so both keep as many writes in flight per pair (several NIXL UCX workers copy at once)."""
        return 1 if self.backend == "cuda_ipc" else self.writes_per_peer

    def ring_bytes(self, decode_rank: int) -> int:
        """A decode rank's staging ring: `ring_chunks` regions of one full chunk."""
        chunk = plan_staging(self.layout, self.prefill_tp, self.decode_tp, decode_rank, self.chunk_tokens)
        return self.ring_chunks * (chunk.total_bytes + ALIGN_SLACK)

    def staging_bytes(self, prefill_rank: int) -> int:
        """A prefill rank's local staging slab: `ring_chunks` chunks of every block it writes.

        Replicated heads are written by a replica that changes from room to room (`replica_turn`): the slab holds
        the most any turn gives this rank; a replica that every turn leaves idle still gets a minimal slab."""
        per_chunk = max(
            sum(
                2 * self.layout.num_layers * self.chunk_tokens * t.num_heads * self.layout.head_bytes + ALIGN_SLACK
                for t in plan_head_transfers(self.shape.num_kv_heads, self.prefill_tp, self.decode_tp, turn)
                if t.prefill_rank == prefill_rank
            )
            for turn in range(self.prefill_tp)
        )
        return self.ring_chunks * max(per_chunk, ALIGN_SLACK)
