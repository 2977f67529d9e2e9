"""The connector's scheduler side: which requests move KV through kvstage, and when their blocks may go.

Owns `SchedulerSide`, which runs in vLLM's scheduler process and never touches KV or sockets. It turns vLLM's
scheduler hooks into per-step records for the workers (`metadata.StepRecords`):

    both    on_new_request: the request's kvstage params are checked once (`params.parse_params`); malformed ones
                           are logged and counted, and the request runs without kvstage. Each request that names a
                           room gets a room of its own (`params.child_room`: n > 1 and list prompts share params).
    decode  (kv_consumer)  get_num_new_matched_tokens: a request with a room loads its prompt's KV
                           asynchronously, all of it but decode's own prefix-cache hit (block aligned);
                           update_state_after_alloc: the blocks are known -> ExpectRoom for every worker, in
                           this very step, so decode registers the room before prefill can announce it;
                           request_finished: a request still waiting for its KV is aborted -> AbortRoom.
    prefill (kv_producer)  build_connector_meta: each step that computes part of a room's prompt -> ComputeStep
                           (the worker attaches the room on the first); a preempted request -> AbortRoom and
                           `preempted` (the workers reclaim its blocks before the forward, and it runs on without
                           kvstage); request_finished: an attached room's blocks stay until every worker has
                           seen its outcome (`sending`; vLLM frees them when get_finished reports the request
                           sent); a request given up before it attached -> AbortRoom (decode hears it at once).
                           vLLM's sequential flow (`do_remote_decode`): the room is drawn here, attached without a
                           decode TP, and request_finished answers `params.handoff_params` for the client to hand
                           to decode; the blocks stay until decode's ranks took the KV or the room's deadline.

Invariants: no hook raises (a failure is logged, counted, and the request runs without kvstage; a decode request
already promised remote KV is reported failed so that vLLM recomputes it); a room id is given to one request only
(siblings are numbered in arrival order, and a group's count outlives its last live request: vLLM adds an n > 1
request's children one at a time, and prefill may finish one before the next arrives); every record is emitted
once; the tables here shrink as requests finish, so they are bounded by the requests vLLM holds, but for the
counts of the last `SIBLING_MEMORY` finished sibling groups.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvstage.integrations.vllm.metadata import AbortRoom, ComputeStep, ExpectRoom, StepRecords
from kvstage.integrations.vllm.params import (
    MAX_ROOM,
    RemoteDecode,
    RoomParams,
    child_room,
    handoff_params,
    parse_params,
    prompt_digest,
)
from kvstage.layout import pages_for

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstage.vllm")

_R = TypeVar("_R")
_NO_PARAMS: dict[str, Any] | None = None

#: Finished sibling groups (router room, prompt digest) whose count is remembered: a child that arrives after all of
#: its earlier siblings finished goes on numbering from there. vLLM adds the children of one request back to back,
#: so only the groups that finish in between have to fit.
SIBLING_MEMORY = 4096


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request's admission to kvstage: its params, its own room and the digest of its prompt."""

    params: RoomParams
    room: int
    prompt: bytes

    @property
    def siblings(self) -> tuple[int, bytes]:
        return self.params.room, self.prompt


@dataclass(frozen=True, slots=True)
class Instance:
    """The instance a scheduler side serves: its name and TP size (prefill names them in its sequential-flow
    answer)."""

    name: str
    tp_size: int


@dataclass(slots=True)
class _PrefillRequest:
    ticket: Ticket
    num_tokens: int
    attached: bool = False


def _never_raises(default: Callable[[], _R]) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """A scheduler hook that fails is logged with its traceback and counted, and answers `default()`: an exception
    inside vLLM's `schedule()` would kill the engine."""

    def wrap(hook: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(hook)
        def guarded(self: SchedulerSide, *args: Any) -> _R:
            try:
                return hook(self, *args)
            except Exception:
                log.exception("kvstage: scheduler hook %s failed; the request goes on without kvstage", hook.__name__)
                self.errors["hook failed"] += 1
                return default()

        return guarded

    return wrap


class SchedulerSide:
    """See the module docstring. One per vLLM engine (scheduler process)."""

    def __init__(self, is_producer: bool, block_size: int, instance: Instance) -> None:
        self._producer = is_producer
        self._block_size = block_size
        self._instance = instance
        self._kv_cache_manager: KVCacheManager | None = None
        self._next = StepRecords()
        self._tickets: dict[str, Ticket | None] = {}  # every live request: its ticket, or None (no kvstage)
        self._sibling_seen: Counter[tuple[int, bytes]] = Counter()  # (router room, prompt) -> requests seen
        self._sibling_live: Counter[tuple[int, bytes]] = Counter()  # ... and still live
        self._sibling_done: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # finished groups: requests seen
        self._waiting: dict[str, Ticket] = {}  # decode: requests whose KV is on its way
        self._tried: set[str] = set()  # decode: requests that had their room (at most one each, until they finish)
        self._prefilling: dict[str, _PrefillRequest] = {}  # prefill: requests being computed
        self._sending: set[str] = set()  # prefill: finished requests whose blocks kvstage still reads
        self._preempted: set[str] = set()  # prefill: requests whose room was aborted by a preemption
        #: requests refused by reason ("bad params: ...", "hook failed"); also logged
        self.errors: Counter[str] = Counter()

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # ---- admission ----------------------------------------------------------------------------------------

    @_never_raises(lambda: None)
    def on_new_request(self, request: Request) -> None:
        self._ticket(request)

    def _ticket(self, request: Request) -> Ticket | None:
        """The request's ticket, made on first sight (normally at on_new_request)."""
        req_id = request.request_id
        if req_id in self._tickets:
            return self._tickets[req_id]
        parsed = parse_params(request.kv_transfer_params, self._producer)
        if isinstance(parsed, RemoteDecode):
            parsed = self._sequential_room(parsed.room)
        ticket = None
        if isinstance(parsed, str):
            self.errors["bad params"] += 1
            log.warning("kvstage: request %s runs without kvstage: bad kv_transfer_params: %s", req_id, parsed)
        elif parsed is not None:
            digest = prompt_digest(request.prompt_token_ids or ())
            key = (parsed.room, digest)
            if key in self._sibling_done:  # its earlier siblings all finished before it arrived
                self._sibling_seen[key] = self._sibling_done.pop(key)
            ticket = Ticket(parsed, child_room(parsed.room, digest, self._sibling_seen[key]), digest)
            self._sibling_seen[key] += 1
            self._sibling_live[key] += 1
            log.debug("kvstage: request %s has room %d (router room %d)", req_id, ticket.room, parsed.room)
        self._tickets[req_id] = ticket
        return ticket

    @staticmethod
    def _sequential_room(room: int) -> RoomParams:
        """A prefill request of vLLM's sequential flow: room `room` (0: one drawn here), for a decode not known yet."""
        return RoomParams(room or secrets.randbelow(MAX_ROOM) + 1, "", 0)

    def _release_ticket(self, req_id: str) -> Ticket | None:
        """The finished request's ticket, forgotten (its siblings' count moves to the finished groups once the last
        of them is gone)."""
        ticket = self._tickets.pop(req_id, None)
        if ticket is not None:
            key = ticket.siblings
            self._sibling_live[key] -= 1
            if self._sibling_live[key] <= 0:
                self._sibling_done[key] = self._sibling_seen.pop(key)
                del self._sibling_live[key]
                if len(self._sibling_done) > SIBLING_MEMORY:
                    self._sibling_done.popitem(last=False)
        return ticket

    # ---- decode -------------------------------------------------------------------------------------------

    @_never_raises(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._producer or request.request_id in self._tried or self._ticket(request) is None:
            return 0, False  # a request whose room failed is recomputed by vLLM: it never gets a second room
        remaining = request.num_prompt_tokens - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception:
            log.exception("kvstage: request %s: update_state_after_alloc failed", request.request_id)
            self.errors["hook failed"] += 1
            if not self._producer and num_external_tokens > 0:
                self._tried.add(request.request_id)
                self._next.unserved.append(request.request_id)  # vLLM waits for its KV: report it failed

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        ticket = self._ticket(request)
        if ticket is None:
            return
        req_id = request.request_id
        if self._producer:
            if req_id not in self._prefilling and req_id not in self._preempted:
                self._prefilling[req_id] = _PrefillRequest(ticket, request.num_prompt_tokens)
            return
        if num_external_tokens <= 0 or req_id in self._tried:
            return  # vLLM calls again once the KV has landed, for the blocks of the tokens that follow
        self._tried.add(req_id)
        num_tokens = request.num_prompt_tokens
        block_ids = tuple(blocks.get_block_ids()[0])
        self._waiting[req_id] = ticket
        self._next.expect.append(
            ExpectRoom(
                req_id,
                ticket.room,
                ticket.params.peer,
                ticket.params.peer_tp,
                num_tokens,
                num_tokens - num_external_tokens,
                block_ids[: pages_for(num_tokens, self._block_size)],
                ticket.prompt,
            )
        )

    # ---- both ---------------------------------------------------------------------------------------------

    @_never_raises(StepRecords)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepRecords:
        if self._producer:
            self._add_preemptions(scheduler_output)
            self._add_compute_steps(scheduler_output)
        meta, self._next = self._next, StepRecords()
        return meta

    @_never_raises(lambda: (False, _NO_PARAMS))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        ticket = self._release_ticket(req_id)
        self._tried.discard(req_id)
        if waiting := self._waiting.pop(req_id, None):  # decode, still waiting: vLLM holds the blocks for us
            self._next.abort.append(AbortRoom(req_id, waiting.room))
            return False, None
        prefill = self._prefilling.pop(req_id, None)
        preempted = req_id in self._preempted
        self._preempted.discard(req_id)
        if prefill is None or not prefill.attached:
            if self._producer and ticket is not None and not preempted:
                # given up before any of it was computed (aborted while queued, or refused): nothing reads its
                # blocks, and decode's ranks learn it now instead of at the room's deadline
                self._next.abort.append(AbortRoom(req_id, ticket.room))
            return False, None
        self._sending.add(req_id)
        self._next.sending.append(req_id)
        if request.status.name == "FINISHED_ABORTED" or request.num_computed_tokens < prefill.num_tokens:
            self._next.abort.append(AbortRoom(req_id, prefill.ticket.room))
            return True, None
        params = prefill.ticket.params
        if not params.sequential:
            return True, None
        log.debug("kvstage: request %s holds its blocks for decode, room %d", req_id, prefill.ticket.room)
        return True, handoff_params(params.room, self._instance.name, self._instance.tp_size)

    @_never_raises(lambda: None)
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self._waiting.pop(req_id, None)
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)

    def has_pending_push_work(self) -> bool:
        """Prefill keeps stepping while kvstage still reads a finished request's blocks, so that the workers
        report the outcome and vLLM frees them."""
        return bool(self._sending)

    # ---- prefill ------------------------------------------------------------------------------------------

    def _add_preemptions(self, out: SchedulerOutput) -> None:
        """vLLM freed a preempted request's blocks: an attached room ends now (decode recomputes), the workers
        reclaim the blocks before this step's forward writes into them, and the request, when it runs again, is
        computed without kvstage. A room not attached yet waits for its request to run again."""
        for req_id in out.preempted_req_ids or ():
            prefill = self._prefilling.get(req_id)
            if prefill is None or not prefill.attached:
                continue  # nothing of it was read yet: it attaches its room when it runs again
            del self._prefilling[req_id]
            self._preempted.add(req_id)
            self._next.preempted.append(req_id)
            self._next.abort.append(AbortRoom(req_id, prefill.ticket.room))

    def _add_compute_steps(self, out: SchedulerOutput) -> None:
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, before in computed.items():
            prefill = self._prefilling.get(req_id)
            if prefill is None or before >= prefill.num_tokens:
                continue
            end = min(prefill.num_tokens, before + out.num_scheduled_tokens[req_id])
            ticket = prefill.ticket
            self._next.compute.append(
                ComputeStep(
                    req_id,
                    ticket.room,
                    ticket.params.peer_tp,
                    prefill.num_tokens,
                    end,
                    self._blocks_of(req_id, end),
                    first=not prefill.attached,
                    prompt=ticket.prompt,
                )
            )
            prefill.attached = True

    def _blocks_of(self, req_id: str, end_tokens: int) -> tuple[int, ...]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before the first step"
        blocks = self._kv_cache_manager.get_block_ids(req_id)[0]
        return tuple(blocks[: pages_for(end_tokens, self._block_size)])
