"""kvstage's classes as sglang 0.5.23 asks for them through `get_kv_class`: manager, sender, receiver and
bootstrap server of the `kvstage` transfer backend.

Owns `KVStageKVManager`, `KVStageKVSender`, `KVStageKVReceiver` (thin subclasses of sglang's base classes that
delegate to manager.py's `RankBackend` and rooms.py's `SenderRoom` / `ReceiverRoom`), `KVStageBootstrapServer`
(bootstrap.py) and `kv_class`, which plugin.py's hook calls. Importing this module imports sglang and refuses any
but the pinned version. sglang's queues call these from the scheduler thread (prefill: `PrefillBootstrapQueue`
builds the manager and a sender per request, `pop_bootstrapped` / the inflight queue poll it; decode:
`DecodePreallocQueue` builds the manager and a receiver per request, the transfer queue polls it).

Invariants: the constructors of a manager raise `ConfigError` at start for what kvstage cannot serve; no method of
a sender or receiver raises, except `failure_exception`, whose job it is (sglang's `KVTransferError`, carrying the
reason).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstage.integrations.sglang.version import check_sglang_version

check_sglang_version()

import numpy as np  # noqa: E402
from sglang.srt.disaggregation.base.conn import (  # noqa: E402
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402

from kvstage.integrations.sglang.bootstrap import KVStageBootstrapServer  # noqa: E402
from kvstage.integrations.sglang.manager import RankBackend, RankPlace, Role  # noqa: E402
from kvstage.integrations.sglang.rooms import ReceiverRoom, SenderRoom  # noqa: E402
from kvstage.integrations.sglang.settings import settings_from_env  # noqa: E402


def _place(args: Any, mode: Any, server_args: Any) -> RankPlace:
    role: Role = "prefill" if str(getattr(mode, "value", mode)) == "prefill" else "decode"
    host, port = server_args.host, server_args.disaggregation_bootstrap_port
    settings = settings_from_env()
    instance = settings.instance or f"sglang-{role}-{settings.host}-{port}"
    tp = int(getattr(server_args, "tp_size", 1)) // max(1, int(getattr(server_args, "dp_size", 1) or 1))
    device = "cpu" if str(getattr(server_args, "device", "cpu")) == "cpu" else f"cuda:{args.gpu_id}"
    return RankPlace(role, instance, max(tp, 1), int(args.engine_rank) % max(tp, 1), f"{host}:{port}", device)


def _fill_kv_heads(args: Any, tp_size: int, is_mla: bool) -> None:
    """Set `kv_head_num` / `total_kv_head_num` where sglang left them unset. sglang 0.5.23's prefill bootstrap queue
    sets both; its decode prealloc queue sets neither (only its staging-buffer path does, after the manager is
    built), so decode takes them from the process's model config, as sglang sizes its KV pool
    (`get_num_kv_heads(attention TP)`)."""
    if is_mla or (getattr(args, "kv_head_num", None) and getattr(args, "total_kv_head_num", None)):
        return
    from sglang.srt.runtime_context import process_model_config

    model_config = process_model_config()
    args.total_kv_head_num = int(model_config.get_total_num_kv_heads())
    args.kv_head_num = int(model_config.get_num_kv_heads(tp_size))


class KVStageKVManager(BaseKVManager):  # type: ignore[misc]
    """One rank's kvstage backend (`RankBackend`), built by sglang's bootstrap / prealloc queue at start."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        self.kv_args = args
        place = _place(args, disaggregation_mode, server_args)
        _fill_kv_heads(args, place.tp_size, bool(is_mla_backend))
        self.backend = RankBackend(place, settings_from_env(), args, bool(is_mla_backend))
        self.prefill_info_table = self.backend.prefill_info_table

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the agent registered with kvstage's directory when it started."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return self.backend.try_ensure_parallel_info(bootstrap_addr)

    def close(self) -> None:
        self.backend.close()


class KVStageKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill's side of one request (rooms.py, `SenderRoom`)."""

    def __init__(self, mgr: KVStageKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:  # fmt: skip
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.room = SenderRoom(mgr.backend, bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.room.init(int(num_kv_indices), aux_index)

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None) -> None:
        has_state = state_indices is not None and any(s is not None for s in state_indices)
        self.room.send(np.asarray(kv_indices, dtype=np.int64).tolist(), has_state)

    def poll(self) -> int:
        return self.room.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()

    def failure_exception(self) -> None:
        raise _failure(self.room, self.bootstrap_room)

    def abort(self) -> None:
        self.room.abort()

    def clear(self) -> None:
        self.room.clear()


class KVStageKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """Decode's side of one request (rooms.py, `ReceiverRoom`)."""

    def __init__(self, mgr: KVStageKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.room = ReceiverRoom(mgr.backend, bootstrap_addr, bootstrap_room)

    @property
    def conclude_state(self) -> int | None:
        """What sglang's `_init_receiver` reads: Failed once the room failed, else None."""
        return 0 if self.room.state == 0 else None

    def init(self, prefill_dp_rank: int) -> None:
        self.room.init()

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None, **_: Any) -> None:  # fmt: skip
        if state_indices is not None and any(s is not None for s in state_indices):
            self.room.fail("invalid request: state payloads are not moved by kvstage", refused=True)
            return
        pages = np.asarray(kv_indices, dtype=np.int64).tolist()
        self.room.send_metadata(pages, aux_index, int(decode_prefix_len or 0))

    def poll(self) -> int:
        return self.room.poll()

    def failure_exception(self) -> None:
        raise _failure(self.room, self.bootstrap_room or 0)

    def abort(self) -> None:
        self.room.abort()

    def clear(self) -> None:
        self.room.clear()


def _failure(room: SenderRoom | ReceiverRoom, bootstrap_room: int) -> KVTransferError:
    """Why sglang failed the request. sglang MIN-reduces poll states over the instance's TP ranks, so it may call
    this on a rank whose own room did not fail: then the room gives its pages back here (sglang frees them next;
    no scatter or gather of kvstage's uses them after `give_back`) and the error says it came from another rank, as
    sglang's own backends mark it."""
    if room.failure_reason:
        return KVTransferError(bootstrap_room, room.failure_reason)
    reason = f"failed on another TP rank of this instance (this rank's room was in poll state {room.state})"
    room.give_back()  # sglang frees the pages next: no kvstage copy may use them after this
    room.state, room.failure_reason = 0, reason  # KVPoll.Failed, even where this rank's room succeeded
    return KVTransferError(bootstrap_room, reason, is_from_another_rank=True)


_CLASSES: dict[str, type] = {
    "manager": KVStageKVManager,
    "sender": KVStageKVSender,
    "receiver": KVStageKVReceiver,
    "bootstrap_server": KVStageBootstrapServer,
}


def kv_class(class_type: str, original: Callable[..., Any]) -> type | None:
    """kvstage's class for sglang's `KVClassType` value `class_type` (KVArgs is sglang's own, through
    `original`, sglang's `get_kv_class`)."""
    if class_type == "kvargs":
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

        result: type | None = original(TransferBackend.FAKE, KVClassType.KVARGS)
        return result
    return _CLASSES.get(class_type)
