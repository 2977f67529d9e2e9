"""One sglang rank's kvstage state: its agent, the room outcomes it reports, and the background work that must not
run on sglang's scheduler thread.

Owns `RankBackend`, built once per rank by conn.py's manager (sglang builds that from its prefill bootstrap queue
or its decode prealloc queue, at scheduler start). It:

- builds the rank's `EngineKV` over sglang's own KV buffers (kvargs.py) and starts a `PrefillAgent` or a
  `DecodeAgent` on it, registered in kvstage's directory (`KVSTAGE_BOOTSTRAP`) under this instance's name;
- hands each room's outcome to the sender or receiver that asks for it (`take_outcome`: the agent's `poll`,
  drained into a table the asking object empties);
- holds the rank's view of sglang's aux (metadata) rows (`aux`, kvargs.py): prefill reads a request's row into its
  last `kv_ready`, and it reaches decode in the room's `RoomOutcome.aux` (kvstage's protocol carries it on the
  room's last chunk), where decode writes it into its own row (rooms.py);
- runs blocking mailbox requests (bootstrap.py) on one worker thread: prefill's rank 0 posts its instance info
  at start; decode ranks ask a prefill address for its instance (`try_ensure_parallel_info`, as sglang's decode
  queue asks).

Invariants: engine-facing methods never block and never raise on a request's account (a bad request is logged,
counted in `refused`, and failed with a reason by its sender or receiver); only the scheduler thread calls
`take_outcome` and `forget`; the worker thread touches only `_infos`, under `_lock`; the outcome tables are
emptied as their rooms end, so they are bounded by the requests sglang holds, and `_infos` by the prefill
addresses decode is given.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvstage.integrations.sglang.bootstrap import MailboxClient, Request
from kvstage.integrations.sglang.kvargs import AuxRows, RankKV, rank_kv
from kvstage.integrations.sglang.settings import BackendSettings
from kvstage.protocol.messages import MAX_ID
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, RoomOutcome, peer_id
from kvstage.transport.data.base import TransportConfig

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    """What decode's queue reads of a prefill address (`prefill_info_table`): kvstage's instance and TP size, and
    the fields sglang's `_resolve_prefill_dp_rank` reads (one DP rank per instance)."""

    instance: str
    tp_size: int
    dp_size: int = 1
    follow_bootstrap_room: bool = True

    def peers(self) -> tuple[str, ...]:
        return tuple(peer_id(self.instance, r) for r in range(self.tp_size))


def check_room(room: object) -> str:
    """Why `room` cannot be a kvstage room ("" when it can): an int in [1, 2**63 - 1]. Room 0 is sglang's "no
    metadata yet" marker in its aux rows, so it is refused too."""
    if not isinstance(room, int) or isinstance(room, bool):
        return f"malformed room: bootstrap_room {room!r} is not an integer"
    if not 0 < room <= MAX_ID:
        return f"malformed room: bootstrap_room {room} is not in [1, {MAX_ID}]"
    return ""


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank stands: its role, instance, TP size and rank, its prefill mailbox address, its KV device."""

    role: Role
    instance: str
    tp_size: int
    rank: int
    mailbox: str
    device: str = "cpu"


class RankBackend:
    """See the module docstring."""

    def __init__(self, place: RankPlace, settings: BackendSettings, kv_args: Any, is_mla: bool) -> None:
        self.place, self.settings = place, settings
        self.rank_kv: RankKV = rank_kv(kv_args, is_mla, place.device)
        self.is_mla = is_mla
        config = self._agent_config()
        self.aux = AuxRows.of(kv_args, config.limits.max_aux_bytes)  # refused before any agent starts
        self.page_size = self.rank_kv.layout.page_size
        self.refused: Counter[str] = Counter()
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._outcomes: dict[int, RoomOutcome] = {}
        self._dropped: set[int] = set()  # rooms cleared before their outcome: it is discarded when it comes
        self._infos: dict[str, PrefillInfo | None] = {}  # address -> its info once answered (None: asked)
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.agent = self._start_agent(config)
        self._worker = threading.Thread(target=self._work, name=f"kvstage-sglang-{place.role}", daemon=True)
        self._worker.start()
        if place.role == "prefill" and place.rank == 0:
            self._jobs.put(self._post_info)

    def _agent_config(self) -> AgentConfig:
        s, p, kv = self.settings, self.place, self.rank_kv
        return AgentConfig(
            instance=p.instance, rank=p.rank, tp_size=p.tp_size, layout=kv.layout, bootstrap=s.bootstrap,
            attention="mla" if self.is_mla else "gqa",
            transport=TransportConfig(backend=s.backend, host=s.host), control_bind=f"tcp://{s.host}:*",
            chunk_tokens=s.grid(kv.layout.page_size), ring_bytes=s.ring_mib << 20, staging_bytes=s.staging_mib << 20,
        )  # fmt: skip

    def _start_agent(self, config: AgentConfig) -> PrefillAgent | DecodeAgent:
        kv = self.rank_kv.kv
        agent = PrefillAgent(config, kv) if self.place.role == "prefill" else DecodeAgent(config, kv)
        agent.start()
        return agent

    # ---- the worker thread ---------------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _post_info(self) -> None:
        client, deadline = MailboxClient(self.place.mailbox), time.monotonic() + self.settings.room_timeout_s
        while time.monotonic() < deadline:
            reply = client.ask(Request("put_info", instance=self.place.instance, tp_size=self.place.tp_size))
            if reply.ok:
                return
            time.sleep(0.2)
        log.error("kvstage: could not post this instance's info to %s: decode cannot find it", self.place.mailbox)

    def _ask_info(self, addr: str) -> None:
        reply = MailboxClient(addr).ask(Request("get_info"))
        info = PrefillInfo(reply.instance, reply.tp_size) if reply.ok and reply.tp_size > 0 else None
        with self._lock:
            if info is None:
                self._infos.pop(addr, None)  # asked again on the next try
            else:
                self._infos[addr] = info

    # ---- engine-facing (sglang's scheduler thread) ---------------------------------------------------------

    def try_ensure_parallel_info(self, addr: str) -> bool:
        """Whether prefill `addr`'s instance is known; if not, ask for it in the background (never blocks)."""
        if addr in self.prefill_info_table:
            return True
        with self._lock:
            info = self._infos.get(addr)
            if addr not in self._infos:
                self._infos[addr] = None
                self._jobs.put(lambda: self._ask_info(addr))
        if info is not None:
            self.prefill_info_table[addr] = info
        return info is not None

    def take_outcome(self, room: int) -> RoomOutcome | None:
        """`room`'s outcome, once (the agent's outcomes of every room are drained into a table first)."""
        for outcome in self.agent.poll():
            if outcome.room in self._dropped:
                self._dropped.discard(outcome.room)
            else:
                self._outcomes[outcome.room] = outcome
        return self._outcomes.pop(room, None)

    def kept_outcomes(self) -> int:
        """Outcomes taken from the agent and not yet asked for, plus rooms whose outcome will be discarded."""
        return len(self._outcomes) + len(self._dropped)

    def forget(self, room: int, awaiting: bool = False) -> None:
        """Drop what is kept of `room` (its sender or receiver is done with it); `awaiting`: the agent still owes
        its outcome, which is then discarded when it comes (every room the agent holds ends with one)."""
        if self._outcomes.pop(room, None) is None and awaiting:
            self._dropped.add(room)

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=5)
        self.agent.close()
