"""What one sglang request's sender (prefill) or receiver (decode) does, as kvstage room calls; no sglang import.

Owns `SenderRoom` and `ReceiverRoom`, which conn.py's `KVStageKVSender` / `KVStageKVReceiver` wrap one to one.
sglang's `bootstrap_room` is the kvstage room. Tokens are counted in whole pages on both sides, as sglang's own
backends move them: prefill is told the pages to send (`init`), decode the pages to fill (`send_metadata`), and a
request of N prompt tokens is a room of ceil(N / page) * page tokens (the last page's tail carries prefill's bytes
into decode's own last page, which decode writes before it reads).

Prefill (sglang's bootstrap queue, then its inflight queue):
    __init__   the room is checked (`check_room`); a malformed one fails here, logged and counted, with its reason
    poll       WaitingForInput at once: kvstage needs no handshake (decode registers the room through its own
               protocol), so sglang may prefill before decode has allocated; then Transferring, Success once the
               room succeeded, or Failed
    init       `attach_room(room, pages * page, decode_tp=0)`: decode's first Metadata tells its TP size
    send       one call per chunk of chunked prefill: its pages are appended; `compute_scheduled` and `kv_ready`
               up to their end, so kvstage writes every chunk of decode's grid the sent pages complete; decode's
               prefix (which kvstage's protocol tells prefill) is never written. The last send (all pages given)
               gives its `kv_ready` the aux row sglang wrote just before it (first token, logprobs, room id): it
               rides the room's last chunk to every decode rank this rank writes to (every prefill TP rank has it)
    abort      `abort(room)`; Failed at once with "aborted by prefill"
Decode (sglang's prealloc queue, then its transfer queue):
    init       the prefill address's instance must be known (`try_ensure_parallel_info`); else Failed
    send_metadata  `expect_room(room, prefill ranks, tokens, prefix, pages)`; decode's prefix pages are not given
               by sglang (only the pages past its prefix hit) and kvstage never touches them: they are named by
               page 0, sglang's reserved padding page
    poll       Bootstrapping, WaitingForInput, Transferring; Success once the KV is in and the aux row that came with
               kvstage's outcome (`RoomOutcome.aux`) is written into decode's metadata row; Failed with kvstage's
               reason, or "aux row not received" (the room succeeded without one) / "aux row unusable", on
               `failure_reason`
    abort      `abort(room)`; Failed at once with "aborted by decode"

Invariants: no method raises on a request's account; every failure has a reason; a room's outcome is taken once.
"""

from __future__ import annotations

import logging
from typing import Final

import torch

from kvstage.integrations.sglang.manager import RankBackend, check_room
from kvstage.protocol.reasons import ABORTED_BY_DECODE, ABORTED_BY_PREFILL

log = logging.getLogger(__name__)

FAILED: Final = 0  # sglang's KVPoll values
BOOTSTRAPPING: Final = 1
WAITING: Final = 2
TRANSFERRING: Final = 3
SUCCESS: Final = 4
PADDING_PAGE: Final = 0


class _Room:
    def __init__(self, backend: RankBackend, room: object) -> None:
        self.backend = backend
        self.room = room if isinstance(room, int) and not isinstance(room, bool) else 0
        self.state = WAITING
        self.failure_reason = ""
        self.kv_done = False
        self.aux = b""  # decode: the room's aux row, from kvstage's outcome
        self.registered = False  # the agent holds the room (attached or expected): its outcome will come (False
        # again once given back: that outcome is dropped when it comes)
        self.outcome_seen = False
        if why := check_room(room):
            self.fail(why, refused=True)

    def fail(self, reason: str, refused: bool = False) -> None:
        if self.state in (FAILED, SUCCESS):
            return
        if refused:
            self.backend.refused[reason.split(":")[0]] += 1
            log.error("kvstage: request refused: %s", reason)
        else:
            log.warning("kvstage: room %d failed: %s", self.room, reason)
        self.state, self.failure_reason = FAILED, reason

    def _take(self) -> None:
        """Take the room's kvstage outcome, if it came."""
        outcome = self.backend.take_outcome(self.room)
        if outcome is None:
            return
        self.outcome_seen = True
        if outcome.ok:
            self.kv_done, self.aux = True, outcome.aux
        else:
            self.fail(outcome.reason)

    def clear(self) -> None:
        self.backend.forget(self.room, awaiting=self.registered and not self.outcome_seen)

    def give_back(self) -> None:
        """sglang takes the room's pages back now: once this returns no copy of kvstage's uses them (on the CPU a
        running one has finished; on a GPU sglang's current stream waits for those queued), and the room is aborted.
        The outcome the agent still owes is dropped when it comes: sglang 0.5.23 clears a prefill sender only after
        success, so no `clear` would (a later one drops nothing more)."""
        if not self.registered or self.outcome_seen:
            return
        event = self.backend.agent.reclaim(self.room)
        self.backend.forget(self.room, awaiting=True)
        self.registered = False
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class SenderRoom(_Room):
    """Prefill's side of one request (see the module docstring)."""

    def __init__(self, backend: RankBackend, room: object) -> None:
        super().__init__(backend, room)
        self.num_pages = 0
        self.aux_index = -1
        self.pages: list[int] = []

    def init(self, num_pages: int, aux_index: int | None) -> None:
        if self.state == FAILED:
            return
        if num_pages <= 0 or aux_index is None or not self.backend.aux.holds(aux_index):
            self.fail(f"invalid request: {num_pages} pages to send, aux index {aux_index}", refused=True)
            return
        self.num_pages, self.aux_index = num_pages, aux_index
        tokens, timeout = num_pages * self.backend.page_size, self.backend.settings.room_timeout_s
        self.backend.agent.attach_room(self.room, tokens, 0, timeout)  # type: ignore[union-attr]
        self.registered = True

    def send(self, pages: list[int], has_state: bool) -> None:
        if self.state == FAILED:
            return
        if self.num_pages == 0 or has_state or len(self.pages) + len(pages) > self.num_pages:
            why = "state payloads" if has_state else f"{len(self.pages) + len(pages)} pages of {self.num_pages}"
            self.fail(f"invalid request: send of {why} (not initialised, or more than announced)", refused=True)
            self.give_back()
            return
        self.pages.extend(pages)
        end = len(self.pages) * self.backend.page_size
        agent = self.backend.agent
        agent.compute_scheduled(self.room, end)  # type: ignore[union-attr]
        agent.kv_ready(self.room, end, tuple(self.pages), aux=self.aux_row())  # type: ignore[union-attr]
        self.state = TRANSFERRING

    def aux_row(self) -> bytes:
        """The aux row to give with this send: sglang's metadata row on the last send (all pages given), else none.

        sglang 0.5.23 fills the row on every prefill TP rank: the scheduler's `_send_kv_chunk(last_chunk=True)` calls
        `MetadataBuffers.set_buf(req)` with no rank guard, from the batch result every TP rank holds (the same
        sampled first token). So every rank gives it and every decode rank gets it from any of its writers (a rank
        that writes to no decode rank in the room sends nothing, and every decode rank has a writer)."""
        return self.backend.aux.read(self.aux_index) if len(self.pages) == self.num_pages else b""

    def poll(self) -> int:
        if self.state in (FAILED, SUCCESS) or self.num_pages == 0:
            return self.state
        if not self.kv_done:
            self._take()
        if self.kv_done and self.state != FAILED:
            self.state = SUCCESS
        return self.state

    def abort(self) -> None:
        """The room is aborted and its pages are sglang's again when this returns (`give_back`)."""
        if self.state not in (FAILED, SUCCESS):
            self.give_back()
        self.fail(ABORTED_BY_PREFILL)


class ReceiverRoom(_Room):
    """Decode's side of one request (see the module docstring); `mailbox` is its prefill's bootstrap address."""

    def __init__(self, backend: RankBackend, mailbox: str, room: object) -> None:
        super().__init__(backend, room)
        self.mailbox = mailbox
        if self.state != FAILED:
            self.state = BOOTSTRAPPING
        self.aux_index = -1
        self.aborting = False

    def init(self) -> None:
        if self.state == FAILED:
            return
        if self.mailbox not in self.backend.prefill_info_table:
            self.fail(f"prefill {self.mailbox} unknown: its instance was never found")
            return
        self.state = WAITING

    def send_metadata(self, pages: list[int], aux_index: int | None, prefix_tokens: int) -> None:
        if self.state != WAITING:
            if self.state != FAILED:
                self.fail("invalid request: send_metadata before init", refused=True)
            return
        size = self.backend.page_size
        bad = not pages or prefix_tokens < 0 or prefix_tokens % size
        if bad or aux_index is None or not self.backend.aux.holds(aux_index):
            why = f"{len(pages)} pages, aux index {aux_index}, prefix {prefix_tokens} (page {size})"
            self.fail(f"invalid request: {why}", refused=True)
            return
        self.aux_index = aux_index
        prefix_pages = prefix_tokens // size
        tokens = (prefix_pages + len(pages)) * size
        all_pages = (PADDING_PAGE,) * prefix_pages + tuple(pages)
        peers = self.backend.prefill_info_table[self.mailbox].peers()
        timeout = self.backend.settings.room_timeout_s
        self.backend.agent.expect_room(self.room, peers, tokens, prefix_tokens, all_pages, timeout)  # type: ignore[union-attr]
        self.registered = True
        self.state = TRANSFERRING

    def poll(self) -> int:
        if self.state != TRANSFERRING:
            return self.state
        if not self.kv_done:
            self._take()
            if self.kv_done and self.aborting:  # the KV landed before the abort did: give it up all the same
                self.fail(ABORTED_BY_DECODE)
            elif self.kv_done:
                self._write_aux()
        return self.state

    def _write_aux(self) -> None:
        """The KV is in: write the aux row that came with it into decode's metadata row, then report Success."""
        if not self.aux:
            self.fail("aux row not received: the room's last chunk brought none from prefill")
            return
        try:
            self.backend.aux.write(self.aux_index, self.aux)
        except ValueError as exc:
            self.fail(f"aux row unusable: {exc}")
            return
        self.state = SUCCESS

    def abort(self) -> None:
        """Give the room up. Once `expect_room` was called, Failed comes only with kvstage's outcome, i.e. once no
        scatter can touch decode's pages any more (sglang frees them when it sees Failed)."""
        if self.state == TRANSFERRING and not self.kv_done:
            self.backend.agent.abort(self.room)
            self.aborting = True
            return
        self.fail(ABORTED_BY_DECODE)
