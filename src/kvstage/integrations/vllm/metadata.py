"""What the connector's scheduler side tells its worker side each step (vLLM pickles it to every rank).

Owns the per-step records: `ExpectRoom` (decode: register a request's room before prefill hears of it),
`ComputeStep` (prefill: this step computes tokens [.., end_tokens) of a room, in these blocks), `AbortRoom`, and
`StepRecords`, their container, which also lists the requests whose blocks vLLM took back (preempted: reclaimed
before the forward), the requests whose blocks vLLM holds for kvstage until they are reported sent (prefill), and
the requests promised remote KV that got no room (decode: reported failed, so vLLM recomputes them). Frozen values
with no behaviour; built by `scheduler.py`, read by `worker.py`. No vLLM import here: the worker half runs where
vLLM is not installed too (the GPU connector tests); vLLM's own type, `connector.StepMetadata`, adds the base class.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ExpectRoom:
    """Decode: `req_id`'s KV for tokens [prefix_tokens, num_tokens) comes from `peer` (TP `peer_tp`) in `room`."""

    req_id: str
    room: int
    peer: str
    peer_tp: int
    num_tokens: int
    prefix_tokens: int
    blocks: tuple[int, ...]
    prompt: bytes = b""  # digest of the prompt's tokens, checked by prefill


@dataclass(frozen=True, slots=True)
class ComputeStep:
    """Prefill: this step computes tokens [.., end_tokens) of `req_id`'s `num_tokens`-token prompt in `blocks`.

    `first` is set on the room's first step: the worker attaches the room (for decode TP `peer_tp`) then."""

    req_id: str
    room: int
    peer_tp: int
    num_tokens: int
    end_tokens: int
    blocks: tuple[int, ...]
    first: bool
    prompt: bytes = b""  # digest of the prompt's tokens, checked against decode's Metadata


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """vLLM gave up on `req_id` (an abort or a client that went away): end its room."""

    req_id: str
    room: int


@dataclass
class StepRecords:
    """Everything the workers do for kvstage in one scheduler step."""

    expect: list[ExpectRoom] = field(default_factory=list)
    compute: list[ComputeStep] = field(default_factory=list)
    abort: list[AbortRoom] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # prefill: vLLM freed their blocks; reclaim before forward
    sending: list[str] = field(default_factory=list)  # prefill: blocks held until get_finished reports them
    unserved: list[str] = field(default_factory=list)  # decode: promised remote KV, no room: report failed
