"""The connector's scheduler side: which requests move KV through kvstage, and when their blocks may go.

Owns `SchedulerSide`, which runs in vLLM's scheduler process and never touches KV or sockets. It turns vLLM's
scheduler hooks into per-step records for the workers (`metadata.StepMetadata`):

    decode  (kv_consumer)  get_num_new_matched_tokens: a request with kvstage params loads its prompt's KV
                           asynchronously, all of it but decode's own prefix-cache hit (block aligned);
                           update_state_after_alloc: the blocks are known -> ExpectRoom for every worker, in
                           this very step, so decode registers the room before prefill can announce it;
                           request_finished: a request still waiting for its KV is aborted -> AbortRoom.
    prefill (kv_producer)  build_connector_meta: each step that computes part of a kvstage request's prompt ->
                           ComputeStep (the worker attaches the room on the first, then says which tokens are
                           computed in which blocks); request_finished: the blocks stay until every worker has
                           seen the room's outcome (vLLM frees them when get_finished reports the request sent);
                           an aborted request -> AbortRoom.

Invariants: a request's room id comes from its `kv_transfer_params` (`kvstage_room`, set by the router) and is
never reused by this side; every record is emitted once; the tables here shrink as requests finish, so they are
bounded by the requests vLLM holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstage.errors import ConfigError
from kvstage.integrations.vllm.metadata import AbortRoom, ComputeStep, ExpectRoom, StepMetadata
from kvstage.layout import pages_for

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstage.vllm")

#: The keys the router puts into a request's `kv_transfer_params`.
ROOM_KEY = "kvstage_room"
PEER_KEY = "kvstage_peer"
PEER_TP_KEY = "kvstage_peer_tp"


@dataclass(frozen=True, slots=True)
class RoomParams:
    """A request's kvstage parameters, checked: its room and the peer instance (name and TP size)."""

    room: int
    peer: str
    peer_tp: int

    @classmethod
    def of(cls, request: Request) -> RoomParams | None:
        """The request's params, or None for a request that does not go through kvstage."""
        params = request.kv_transfer_params or {}
        if ROOM_KEY not in params:
            return None
        try:
            room, peer, peer_tp = int(params[ROOM_KEY]), str(params[PEER_KEY]), int(params[PEER_TP_KEY])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"request {request.request_id}: kv_transfer_params needs {ROOM_KEY} (int), {PEER_KEY} (str) and "
                f"{PEER_TP_KEY} (int); got {params!r}"
            ) from exc
        if not 0 < room < 2**63 or not peer or peer_tp < 1:
            raise ConfigError(f"request {request.request_id}: bad kvstage params {params!r}")
        return cls(room, peer, peer_tp)


@dataclass(slots=True)
class _PrefillRequest:
    params: RoomParams
    num_tokens: int
    attached: bool = False


class SchedulerSide:
    """See the module docstring. One per vLLM engine (scheduler process)."""

    def __init__(self, is_producer: bool, block_size: int) -> None:
        self._producer = is_producer
        self._block_size = block_size
        self._kv_cache_manager: KVCacheManager | None = None
        self._next = StepMetadata()
        self._waiting: dict[str, RoomParams] = {}  # decode: requests whose KV is on its way
        self._tried: set[str] = set()  # decode: requests that had their room (at most one each, until they finish)
        self._prefilling: dict[str, _PrefillRequest] = {}  # prefill: requests being computed
        self._sending: dict[str, int] = {}  # prefill: finished requests whose blocks kvstage still reads
        self._preempted: set[str] = set()  # prefill: requests whose room was aborted by a preemption

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # ---- decode -------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._producer or request.request_id in self._tried or RoomParams.of(request) is None:
            return 0, False  # a request whose room failed is recomputed by vLLM: it never gets a second room
        remaining = request.num_prompt_tokens - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = RoomParams.of(request)
        if params is None:
            return
        if self._producer:
            if request.request_id not in self._prefilling and request.request_id not in self._preempted:
                self._prefilling[request.request_id] = _PrefillRequest(params, request.num_prompt_tokens)
            return
        if num_external_tokens <= 0 or request.request_id in self._tried:
            return  # vLLM calls again once the KV has landed, for the blocks of the tokens that follow
        self._tried.add(request.request_id)
        num_tokens = request.num_prompt_tokens
        block_ids = tuple(blocks.get_block_ids()[0])
        self._waiting[request.request_id] = params
        self._next.expect.append(
            ExpectRoom(
                request.request_id,
                params.room,
                params.peer,
                params.peer_tp,
                num_tokens,
                num_tokens - num_external_tokens,
                block_ids[: pages_for(num_tokens, self._block_size)],
            )
        )

    # ---- both ---------------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        if self._producer:
            self._add_compute_steps(scheduler_output)
        meta, self._next = self._next, StepMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        aborted = request.status.name == "FINISHED_ABORTED"
        self._tried.discard(req_id)
        self._preempted.discard(req_id)
        if params := self._waiting.pop(req_id, None):  # decode, still waiting: vLLM holds the blocks for us
            self._next.abort.append(AbortRoom(req_id, params.room))
            return False, None
        prefill = self._prefilling.pop(req_id, None)
        if prefill is None or not prefill.attached:
            return False, None  # not ours, or never reached a worker: nothing reads its blocks
        if aborted or request.num_computed_tokens < prefill.num_tokens:
            self._next.abort.append(AbortRoom(req_id, prefill.params.room))
        self._sending[req_id] = prefill.params.room
        return True, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self._waiting.pop(req_id, None)
        for req_id in output.finished_sending or ():
            self._sending.pop(req_id, None)

    def has_pending_push_work(self) -> bool:
        """Prefill keeps stepping while kvstage still reads a finished request's blocks, so that the workers
        report the outcome and vLLM frees them."""
        return bool(self._sending)

    # ---- prefill ------------------------------------------------------------------------------------------

    def _add_compute_steps(self, out: SchedulerOutput) -> None:
        for req_id in out.preempted_req_ids or ():
            # vLLM frees a preempted request's blocks: its room ends now (decode recomputes), and the request,
            # when it runs again, is computed without kvstage.
            prefill = self._prefilling.pop(req_id, None)
            if prefill is not None and prefill.attached:
                self._next.abort.append(AbortRoom(req_id, prefill.params.room))
                self._preempted.add(req_id)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, before in computed.items():
            prefill = self._prefilling.get(req_id)
            if prefill is None or before >= prefill.num_tokens:
                continue
            end = min(prefill.num_tokens, before + out.num_scheduled_tokens[req_id])
            self._next.compute.append(
                ComputeStep(
                    req_id,
                    prefill.params.room,
                    prefill.params.peer_tp,
                    prefill.num_tokens,
                    end,
                    self._blocks_of(req_id, end),
                    first=not prefill.attached,
                )
            )
            prefill.attached = True

    def _blocks_of(self, req_id: str, end_tokens: int) -> tuple[int, ...]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before the first step"
        blocks = self._kv_cache_manager.get_block_ids(req_id)[0]
        return tuple(blocks[: pages_for(end_tokens, self._block_size)])
