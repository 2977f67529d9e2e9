"""The connector's worker side: one kvstage agent per vLLM worker (TP rank), over vLLM's own KV tensors.

Owns `WorkerSide`. At `register_kv_caches` it describes vLLM's cache as a `KVLayout` plus an `EngineKV` over the
very tensors vLLM attends from (no pool of kvstage's, no copy), then starts a `DecodeAgent` (kv_consumer) or a
`PrefillAgent` (kv_producer) that registers with the bootstrap as rank `tp_rank` of instance `settings.instance`.
Each step it turns the scheduler side's records into agent calls and the agent's outcomes into vLLM's:

    bind (before the forward)   decode: expect_room for new rooms      prefill: attach_room (first step) and
                                both: abort                                      compute_scheduled
    wait_for_save (after it)                                            prefill: kv_ready (tokens now in blocks)
    transfer_results            decode: room ok -> finished_recving; room failed -> also failed_recving, so
                                vLLM recomputes the prompt (never garbage, never a hang)
                                prefill: room ended -> finished_sending, once vLLM has finished the request
                                (only then may it free the blocks kvstage was reading)

Invariants: every agent call only queues an event (nothing here blocks on the network); every room a worker
starts ends in exactly one report to vLLM; the tables here are bounded by the rooms in flight.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat
from kvstage.dataplane.pool import TORCH_DTYPES
from kvstage.errors import ConfigError
from kvstage.integrations.vllm.metadata import ComputeStep, ExpectRoom, StepMetadata
from kvstage.integrations.vllm.report import RankReport, page_digests
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.layout import KVLayout, heads_of_rank
from kvstage.protocol import Timing
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.auth import load_secret
from kvstage.transport.data import TransportConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvstage.vllm")

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_CUDA_FORMATS = {"LBNHC": KVCacheFormat.VLLM_NHD, "LBHNC": KVCacheFormat.VLLM_HND}


@dataclass(frozen=True, slots=True)
class Results:
    """One step's report to vLLM (`KVConnectorTransferResults`' three sets)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


@dataclass(frozen=True, slots=True)
class _Room:
    req_id: str
    num_tokens: int
    prefix_tokens: int
    blocks: tuple[int, ...]


class WorkerSide:
    """See the module docstring. One per vLLM worker process."""

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig, is_producer: bool) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._settings = settings
        self._config = vllm_config
        self._producer = is_producer
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._rank = get_tensor_model_parallel_rank()
        self._agent: DecodeAgent | PrefillAgent | None = None
        self._kv: EngineKV | None = None
        self._report: RankReport | None = None
        self._rooms: dict[int, _Room] = {}  # room -> what vLLM knows it by
        self._ready: list[ComputeStep] = []  # prefill: this step's kv_ready calls, made after the forward
        self._ended: dict[str, bool] = {}  # prefill: rooms ended, by request, until vLLM has finished them
        self._finished: set[str] = set()  # prefill: requests vLLM finished whose room has not ended yet

    # ---- start-up -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        layout = self._layout(layers[0], len(layers))
        heads = heads_of_rank(layout.num_kv_heads, self._tp_size, self._rank)
        self._kv = EngineKV.from_layers(layout, self._format(layers[0]), layers, len(heads))
        self._global_heads = tuple(heads)
        s = self._settings
        config = AgentConfig(
            instance=s.instance,
            rank=self._rank,
            tp_size=self._tp_size,
            layout=layout,
            bootstrap=s.bootstrap,
            transport=TransportConfig(backend=s.backend, host=s.host),
            control_bind=f"tcp://{s.host}:*",
            chunk_tokens=s.chunk_tokens_for(layout.page_size),
            ring_bytes=s.ring_mib << 20,
            staging_bytes=s.staging_mib << 20,
            timing=Timing(heartbeat_s=s.dead_after_s / 10, dead_after_s=s.dead_after_s),
            secret=load_secret(s.secret_file or None),
        )
        agent = PrefillAgent(config, self._kv) if self._producer else DecodeAgent(config, self._kv)
        agent.start()
        self._agent = agent
        if s.report_dir:
            role = "prefill" if self._producer else "decode"
            self._report = RankReport(s.report_dir, role, s.instance, self._rank)
        log.info(
            "kvstage %s agent %s up: %s, %s layout, %d-token chunks, backend %s",
            "prefill" if self._producer else "decode",
            config.peer_id,
            layout,
            self._kv_format,
            config.chunk_tokens,
            s.backend,
        )

    def _layout(self, sample: torch.Tensor, num_layers: int) -> KVLayout:
        model = self._config.model_config
        cache = self._config.cache_config
        dtype = _FP8.get(str(cache.cache_dtype)) or _dtype_name(sample.dtype)
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=model.get_total_num_kv_heads(),
            head_dim=model.get_head_size(),
            dtype=dtype,
            page_size=cache.block_size,
        )

    def _format(self, sample: torch.Tensor) -> KVCacheFormat:
        if sample.device.type == "cpu":
            fmt = cpu_format(self._cpu_attention_isa(sample))
        else:
            name = str(getattr(self._config.cache_config, "kv_cache_layout", ""))
            if name not in _CUDA_FORMATS:
                raise ConfigError(
                    f"kvstage: vLLM's KV cache layout {name!r} is not supported; set VLLM_KV_CACHE_LAYOUT to "
                    f"one of {sorted(_CUDA_FORMATS)}"
                )
            fmt = _CUDA_FORMATS[name]
        self._kv_format = fmt
        return fmt

    def _cpu_attention_isa(self, sample: torch.Tensor) -> str:
        """The kernel vLLM's CPU attention writes its cache with (it decides the layout of a block)."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache = self._config.cache_config
        head_size = self._config.model_config.get_head_size()
        return str(_get_attn_isa(sample.dtype, cache.block_size, head_size, str(cache.cache_dtype)))

    # ---- each step ----------------------------------------------------------------------------------------

    def bind(self, meta: StepMetadata) -> None:
        agent = self._require_agent()
        timeout = self._settings.room_timeout_s
        for expect in meta.expect:
            assert isinstance(agent, DecodeAgent)
            self._expect(agent, expect, timeout)
        for step in meta.compute:
            assert isinstance(agent, PrefillAgent)
            log.debug("room %d: computing tokens up to %d of %d", step.room, step.end_tokens, step.num_tokens)
            if step.first:
                self._rooms[step.room] = _Room(step.req_id, step.num_tokens, 0, step.blocks)
                agent.attach_room(step.room, step.num_tokens, step.peer_tp, timeout)
            agent.compute_scheduled(step.room, step.end_tokens)
            self._ready.append(step)
        for abort in meta.abort:
            if abort.room in self._rooms:
                agent.abort(abort.room)

    def _expect(self, agent: DecodeAgent, expect: ExpectRoom, timeout: float) -> None:
        peers = tuple(peer_id(expect.peer, r) for r in range(expect.peer_tp))
        log.debug(
            "expect room %d from %s: tokens [%d, %d)", expect.room, peers, expect.prefix_tokens, expect.num_tokens
        )
        self._rooms[expect.room] = _Room(expect.req_id, expect.num_tokens, expect.prefix_tokens, expect.blocks)
        agent.expect_room(expect.room, peers, expect.num_tokens, expect.prefix_tokens, expect.blocks, timeout)

    def wait_for_save(self) -> None:
        """After the forward: the tokens this step computed are in vLLM's blocks; kvstage may read them."""
        if not self._ready:
            return
        agent = self._require_agent()
        assert isinstance(agent, PrefillAgent)
        if self._kv is not None and self._kv.device.type == "cuda":
            torch.cuda.current_stream(self._kv.device).synchronize()  # gather runs on kvstage's own stream
        for step in self._ready:
            agent.kv_ready(step.room, step.end_tokens, step.blocks)
            if self._report is not None and step.end_tokens == step.num_tokens:
                self._record_digests(step.room, _Room(step.req_id, step.num_tokens, 0, step.blocks))
        self._ready.clear()

    def transfer_results(self, finished_req_ids: set[str]) -> Results:
        results = Results(set(), set(), set())
        if self._agent is None:
            return results
        outcomes = self._agent.poll()
        for outcome in outcomes:
            room = self._rooms.pop(outcome.room, None)
            if room is None:
                continue
            if not outcome.ok:
                log.warning("kvstage room %d (request %s) failed: %s", outcome.room, room.req_id, outcome.reason)
            if self._producer:
                self._ended[room.req_id] = outcome.ok
            else:
                self._received(outcome.room, room, outcome.ok, results)
        if outcomes and self._report is not None:
            self._report.counters(self._agent.metrics.registry)
        if self._producer:
            self._report_sent(finished_req_ids, results.finished_sending)
        return results

    def _received(self, room_id: int, room: _Room, ok: bool, results: Results) -> None:
        """Decode: the room ended. vLLM runs the request on (ok) or recomputes its prompt (failed)."""
        results.finished_recving.add(room.req_id)
        if not ok:
            results.failed_recving.add(room.req_id)
        elif self._report is not None:
            self._record_digests(room_id, room)

    def _report_sent(self, finished_req_ids: set[str], sent: set[str]) -> None:
        """A prefill request is reported sent once its room has ended and vLLM has finished it (vLLM only
        accepts ids it has announced as finished)."""
        open_requests = {room.req_id for room in self._rooms.values()}
        self._finished |= {r for r in finished_req_ids if r in open_requests or r in self._ended}
        for req_id in [r for r in self._finished if r in self._ended]:
            self._finished.discard(req_id)
            del self._ended[req_id]
            sent.add(req_id)

    def _record_digests(self, room_id: int, room: _Room) -> None:
        assert self._report is not None and self._kv is not None
        first_page = room.prefix_tokens // self._kv.layout.page_size
        digests = page_digests(self._kv, self._global_heads, room.blocks, room.num_tokens, first_page)
        self._report.room(room_id, room.num_tokens, self._kv.layout.page_size, first_page, digests)

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    def _require_agent(self) -> DecodeAgent | PrefillAgent:
        if self._agent is None:
            raise ConfigError("kvstage: the connector was used before vLLM registered its KV caches")
        return self._agent


#: vLLM's CPU attention kernels whose cache layout kvstage reads (checked against vLLM's own write kernel).
CPU_KERNELS_READ = ("vec", "vec16")


def cpu_format(isa: str) -> KVCacheFormat:
    """The format of a CPU cache written by vLLM's `isa` kernel; `ConfigError` for a layout kvstage cannot read
    (AMX packs K and V in tiles, and the ARM, RISC-V, s390x and POWER kernels were not checked)."""
    if isa not in CPU_KERNELS_READ:
        raise ConfigError(
            f"kvstage: vLLM's CPU attention kernel here is {isa!r}; kvstage reads the KV cache layout of the "
            f"{' and '.join(CPU_KERNELS_READ)} kernels only (with AMX, a float32 or float16 cache, or a block size "
            "that is not a multiple of 32, avoids the AMX kernel)"
        )
    return KVCacheFormat.VLLM_CPU


def _layer_index(name: str) -> tuple[int, str]:
    """Layers in model order: by the first number in the layer's name ("model.layers.12.self_attn.attn")."""
    match = re.search(r"\d+", name)
    return (int(match.group()) if match else -1, name)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ConfigError(f"kvstage: vLLM's KV cache dtype {dtype} is not one kvstage moves ({sorted(TORCH_DTYPES)})")
