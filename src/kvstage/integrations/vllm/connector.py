"""`KVStageConnector`: kvstage as a vLLM v1 KV connector (`KVConnectorBase_V1`).

Owns the class vLLM instantiates, once in the scheduler process (role SCHEDULER) and once in every worker (role
WORKER). It holds the checked settings and delegates: scheduler hooks to `scheduler.SchedulerSide`, worker hooks
to `worker.WorkerSide`. Each primitive, with the side that calls it:

    scheduler  on_new_request (params checked, a room per request)  get_num_new_matched_tokens
               update_state_after_alloc  build_connector_meta  request_finished (prefill, vLLM's sequential flow:
               the kv_transfer_params decode needs)  update_connector_output  has_pending_push_work
               bind_kv_cache_manager
    worker     register_kv_caches  handle_preemptions (preempted requests' blocks reclaimed, before the forward)
               bind_connector_metadata (rooms start here, before the forward)
               start_load_kv / wait_for_layer_load / save_kv_layer (no-ops: kvstage moves KV off the forward path)
               wait_for_save (prefill: the step's KV is ready)  get_transfer_results  shutdown

No per-step hook raises into vLLM: an exception in vLLM's `schedule()` or in a worker's step kills the engine.
What a client sends is checked on the scheduler side (a bad request runs without kvstage); a failure of kvstage's
own is logged with its traceback, counted, and ends one request's room (decode recomputes it).

Select it with `--kv-transfer-config '{"kv_connector": "KVStageConnector", "kv_connector_module_path":
"kvstage.integrations.vllm", "kv_role": "kv_producer" | "kv_consumer", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"instance": ..., "bootstrap": ...}}'` (docs/vllm.md).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvstage.errors import ConfigError
from kvstage.integrations.vllm.metadata import StepRecords
from kvstage.integrations.vllm.scheduler import Instance, SchedulerSide
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.integrations.vllm.worker import EngineFacts, Results, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstage.vllm")

_R = TypeVar("_R")


def _log_to_stderr() -> None:
    """kvstage's loggers write to stderr inside vLLM's processes (vLLM configures only its own logger), at
    `$KVSTAGE_LOG_LEVEL` (INFO by default), unless the application configured them already."""
    root = logging.getLogger("kvstage")
    if root.handlers or root.level != logging.NOTSET:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("kvstage %(levelname)s %(asctime)s [%(name)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("KVSTAGE_LOG_LEVEL", "INFO").upper())
    root.propagate = False


@dataclass
class StepMetadata(StepRecords, KVConnectorMetadata):
    """A step's `StepRecords` as vLLM's connector metadata: what vLLM pickles from the scheduler to every worker."""

    @classmethod
    def of(cls, records: StepRecords) -> StepMetadata:
        return cls(**{f.name: getattr(records, f.name) for f in fields(StepRecords)})


class KVStageConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        transfer = self._kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(
                f"kvstage: kv_role must be 'kv_producer' (prefill) or 'kv_consumer' (decode), got {transfer.kv_role!r}"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("kvstage: pipeline parallelism > 1 is not supported (staging needs pp_size == 1)")
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        producer = transfer.kv_role == "kv_producer"
        if not producer and transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kvstage: kv_load_failure_policy=%r: a request whose KV handoff fails will fail; set 'recompute' "
                "to have vLLM compute its prompt instead",
                transfer.kv_load_failure_policy,
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            instance = scheduler_instance(vllm_config, settings.instance)
            self._scheduler = SchedulerSide(producer, vllm_config.cache_config.block_size, instance)
        else:
            self._worker = WorkerSide(settings, engine_facts(vllm_config, producer))

    # ---- worker side --------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StepRecords):
            self._step_hook("handle_preemptions", self._worker_side().reclaim_preempted, kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, StepRecords):
            self._step_hook("bind_connector_metadata", self._worker_side().bind, connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: rooms began at bind_connector_metadata and land asynchronously."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole KV has landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: kvstage reads the step's KV once the forward is done (wait_for_save)."""

    def wait_for_save(self) -> None:
        self._step_hook("wait_for_save", self._worker_side().wait_for_save)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._step_hook("get_transfer_results", self._worker_side().transfer_results)
        if results is None:
            results = Results(set(), set(), set())
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side -----------------------------------------------------------------------------------

    @property
    def refused(self) -> Counter[str]:
        """Scheduler side: requests that run without kvstage, by why (bad params, a hook that failed)."""
        return self._scheduler_side().errors

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StepMetadata.of(self._scheduler_side().build_connector_meta(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- plumbing -----------------------------------------------------------------------------------------

    def _step_hook(self, name: str, call: Callable[..., _R], *args: Any) -> _R | None:
        """A worker's per-step hook: a failure of kvstage's (a bug) is logged with its traceback and counted in
        `WorkerSide.errors`, and the step goes on; a raise here would kill vLLM's worker. The rooms it concerned
        end by their deadline."""
        try:
            return call(*args)
        except Exception:
            log.exception("kvstage: worker hook %s failed; the engine goes on", name)
            self._worker_side().errors[name] += 1
            return None

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("kvstage: a worker hook was called on the scheduler's connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("kvstage: a scheduler hook was called on a worker's connector")
        return self._scheduler


def scheduler_instance(vllm_config: VllmConfig, name: str) -> Instance:
    """The instance the scheduler side serves. In vLLM's sequential flow a prefill rank that writes to no decode
    rank (replicated heads) hears decode's TP from decode rank 0's writes-nothing notice, so every TP is served."""
    return Instance(name, vllm_config.parallel_config.tensor_parallel_size)


def engine_facts(vllm_config: VllmConfig, producer: bool) -> EngineFacts:
    """What a worker needs to know of vLLM's engine, read from its config (in a worker process: TP rank too)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    model, cache = vllm_config.model_config, vllm_config.cache_config

    def cpu_attention_isa(dtype: torch.dtype) -> str:
        """The kernel vLLM's CPU attention writes its cache with (it decides the layout of a block)."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, cache.block_size, model.get_head_size(), str(cache.cache_dtype)))

    def attention_backend(layer_names: Sequence[str]) -> str:
        """The attention backend vLLM built those layers with (it decides the cache's layout too)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
        return ",".join(sorted({layer.get_attn_backend().get_name() for layer in layers.values()}))

    return EngineFacts(
        producer=producer,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        rank=get_tensor_model_parallel_rank(),
        num_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),  # MLA: one latent head, replicated
        head_dim=model.get_head_size(),  # MLA: kv_lora_rank + rope_dim
        block_size=cache.block_size,
        cache_dtype=str(cache.cache_dtype),
        gpu_layout=str(getattr(cache, "kv_cache_layout", "")),
        cpu_attention_isa=cpu_attention_isa,
        mla=model.use_mla,
        attention_backend=attention_backend,
    )
