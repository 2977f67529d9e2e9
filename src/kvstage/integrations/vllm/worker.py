"""The connector's worker side: one kvstage agent per vLLM worker (TP rank), over vLLM's own KV tensors.

Owns `WorkerSide` and `EngineFacts` (what it needs to know of the engine; no vLLM import here, so tests build a
worker side directly). At `register_kv_caches` it describes vLLM's cache as a `KVLayout` plus an `EngineKV` over
the very tensors vLLM attends from (no pool of kvstage's, no copy), then starts a `DecodeAgent` (kv_consumer) or a
`PrefillAgent` (kv_producer) that registers with the bootstrap as rank `facts.rank` of instance
`settings.instance`. An MLA model's latent cache is one head every rank holds whole (`layout.latent_layout`,
format `vllm_mla`), so each decode rank takes it from one prefill rank. A cache layout kvstage has not been
checked against (`cache_format`) stops vLLM at start, naming the setting that avoids it. Each step it turns the
scheduler side's records into agent calls and the agent's outcomes into vLLM's:

    reclaim_preempted           prefill: preempted requests' rooms are aborted and their blocks reclaimed
      (handle_preemptions)      (no gather reads them after this, before the forward can overwrite them)
    bind (before the forward)   decode: expect_room for new rooms      prefill: attach_room (first step) and
                                both: abort                                      compute_scheduled
    wait_for_save (after it)                                            prefill: kv_ready (tokens now in blocks;
                                                                        on a GPU behind an event, no host wait)
    transfer_results            decode: room ok -> finished_recving; room failed (or never started) -> also
                                failed_recving, so vLLM recomputes the prompt (never garbage, never a hang)
                                prefill: finished_sending for a request vLLM holds for kvstage (`sending`),
                                once its room has ended here (only then may it free the blocks kvstage read)

Invariants: nothing here raises into vLLM for one request (a failed record is logged and counted, and fails that
request's room only); every agent call only queues an event (nothing blocks on the network); every room a worker
starts ends in exactly one report to vLLM, and only requests vLLM still holds are reported; the tables here are
bounded by the requests in flight.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvstage.dataplane.engine_kv import EngineKV, KVCacheFormat
from kvstage.dataplane.pool import TORCH_DTYPES
from kvstage.errors import ConfigError
from kvstage.integrations.vllm.metadata import ComputeStep, ExpectRoom, StepRecords
from kvstage.integrations.vllm.report import RankReport, span_digests
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.layout import KVLayout, heads_of_rank, latent_layout
from kvstage.runtime import AgentConfig, DecodeAgent, PrefillAgent, peer_id
from kvstage.transport.auth import load_secret
from kvstage.transport.data import TransportConfig

log = logging.getLogger("kvstage.vllm")

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_CUDA_FORMATS = {"LBNHC": KVCacheFormat.VLLM_NHD, "LBHNC": KVCacheFormat.VLLM_HND}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a worker needs to know of its engine, read from vLLM's config by the connector (`engine_facts`) or
    given directly (tests): its role, its TP size and rank, the model's KV shape, and the cache's format."""

    producer: bool
    tp_size: int
    rank: int
    num_kv_heads: int  # the model's, over all ranks
    head_dim: int
    block_size: int
    cache_dtype: str = "auto"  # vLLM's cache_config.cache_dtype
    gpu_layout: str = ""  # vLLM's KV cache layout on a GPU ("LBNHC" or "LBHNC")
    cpu_attention_isa: Callable[[torch.dtype], str] = lambda _dtype: "vec"  # the CPU kernel for a cache dtype
    mla: bool = False  # an MLA model: its cache holds one latent row (kv_lora_rank + rope_dim) per token
    #: vLLM's attention backend of the named layers ("CPU_ATTN", "CPU_MLA", ...; several, comma-separated)
    attention_backend: Callable[[Sequence[str]], str] = lambda _layers: "CPU_ATTN"


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
    """See the module docstring. One per vLLM worker process; constructible without vLLM (`EngineFacts`)."""

    def __init__(self, settings: ConnectorSettings, facts: EngineFacts) -> None:
        self._settings = settings
        self._facts = facts
        self._producer = facts.producer
        self._agent: DecodeAgent | PrefillAgent | None = None
        self._kv: EngineKV | None = None
        self._report: RankReport | None = None
        self._rooms: dict[int, _Room] = {}  # open room -> what vLLM knows it by
        self._by_req: dict[str, int] = {}  # request -> its open room
        self._ready: list[ComputeStep] = []  # prefill: this step's kv_ready calls, made after the forward
        self._sending: set[str] = set()  # prefill: requests whose blocks vLLM holds until reported sent
        self._unserved: set[str] = set()  # decode: requests to report failed at the next get_finished
        #: engine calls and hooks that failed here, by name (each also logged with its traceback)
        self.errors: Counter[str] = Counter()

    @property
    def agent(self) -> DecodeAgent | PrefillAgent | None:
        """This rank's agent, from `register_kv_caches` on (tests reach its copy stream through it)."""
        return self._agent

    # ---- start-up -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        facts = self._facts
        names = sorted(kv_caches, key=_layer_index)
        layers = [kv_caches[name] for name in names]
        fmt = cache_format(facts, layers[0], facts.attention_backend(names))
        self._kv_format = fmt
        layout = self._layout(layers[0], len(layers))
        heads = heads_of_rank(layout.num_kv_heads, facts.tp_size, facts.rank)
        self._kv = EngineKV.from_layers(layout, fmt, layers, len(heads))
        self._global_heads = tuple(heads)
        s = self._settings
        config = AgentConfig(
            instance=s.instance,
            rank=facts.rank,
            tp_size=facts.tp_size,
            layout=layout,
            bootstrap=s.bootstrap,
            attention="mla" if facts.mla else "gqa",
            transport=TransportConfig(backend=s.backend, host=s.host),
            control_bind=f"tcp://{s.host}:*",
            chunk_tokens=s.chunk_tokens_for(layout.page_size),
            ring_bytes=s.ring_mib << 20,
            ring_canary=bool(s.ring_canary),
            staging_bytes=s.staging_mib << 20,
            timing=s.timing(),
            secret=load_secret(s.secret_file or None),
            url=s.url.rstrip("/"),
        )
        agent = PrefillAgent(config, self._kv) if self._producer else DecodeAgent(config, self._kv)
        agent.start()
        self._agent = agent
        if s.report_dir:
            role = "prefill" if self._producer else "decode"
            self._report = RankReport(s.report_dir, role, s.instance, facts.rank)
        log.info(
            "kvstage %s agent %s up: %s, %s layout, %d-token chunks, backend %s, %s",
            "prefill" if self._producer else "decode",
            config.peer_id,
            layout,
            self._kv_format,
            config.chunk_tokens,
            s.backend,
            staging_note(agent.transport.staging_device(self._kv.device), self._kv.device, s.backend),
        )

    def _layout(self, sample: torch.Tensor, num_layers: int) -> KVLayout:
        facts = self._facts
        dtype = _FP8.get(facts.cache_dtype) or _dtype_name(sample.dtype)
        if facts.mla:
            return latent_layout(num_layers, sample.shape[-1], dtype, facts.block_size)
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=facts.num_kv_heads,
            head_dim=facts.head_dim,
            dtype=dtype,
            page_size=facts.block_size,
        )

    # ---- each step ----------------------------------------------------------------------------------------

    def reclaim_preempted(self, meta: StepRecords) -> None:
        """Before the forward (vLLM's `handle_preemptions`, and again at bind: idempotent): vLLM freed these
        requests' blocks, and this step's forward may write another request's KV into them. Each room is aborted
        and forgotten here (vLLM never hears of it again), and no gather reads its blocks once this returns; on a
        GPU the engine's stream waits for the gathers already queued, the host does not."""
        agent = self._agent
        if not isinstance(agent, PrefillAgent):
            return
        for req_id in meta.preempted:
            room = self._by_req.pop(req_id, None)
            if room is None:
                continue
            del self._rooms[room]
            log.info("kvstage: request %s preempted: room %d aborted (decode recomputes), its blocks reclaimed", req_id,
                     room)  # fmt: skip
            self._guarded("reclaim", partial(self._reclaim, agent, room))

    def _reclaim(self, agent: PrefillAgent, room: int) -> None:
        event = agent.reclaim(room)
        if event is not None and self._kv is not None:
            torch.cuda.current_stream(self._kv.device).wait_event(event)

    def bind(self, meta: StepRecords) -> None:
        agent = self._require_agent()
        self.reclaim_preempted(meta)
        for expect in meta.expect:
            self._guarded("expect", partial(self._expect, agent, expect), failed=expect.req_id)
        for step in meta.compute:
            self._guarded("compute", partial(self._compute, agent, step))
        for abort in meta.abort:
            if abort.room in self._rooms or self._producer:  # prefill also closes a room it never attached
                self._guarded("abort", partial(agent.abort, abort.room))
        self._sending.update(meta.sending)
        self._unserved.update(meta.unserved)

    def _guarded(self, what: str, call: Callable[[], object], failed: str = "") -> None:
        """One engine record: a failure is logged and counted, and fails that request's room only (a decode
        request named by `failed` is reported failed, so vLLM recomputes it)."""
        try:
            call()
        except Exception:
            log.exception("kvstage: %s failed on rank %d", what, self._facts.rank)
            self.errors[what] += 1
            if failed:
                self._unserved.add(failed)

    def _expect(self, agent: DecodeAgent | PrefillAgent, expect: ExpectRoom) -> None:
        assert isinstance(agent, DecodeAgent)
        peers = tuple(peer_id(expect.peer, r) for r in range(expect.peer_tp))
        log.debug(
            "expect room %d from %s: tokens [%d, %d)", expect.room, peers, expect.prefix_tokens, expect.num_tokens
        )
        agent.expect_room(
            expect.room,
            peers,
            expect.num_tokens,
            expect.prefix_tokens,
            expect.blocks,
            self._settings.room_timeout_s,
            expect.prompt,
        )
        self._open(expect.room, _Room(expect.req_id, expect.num_tokens, expect.prefix_tokens, expect.blocks))

    def _compute(self, agent: DecodeAgent | PrefillAgent, step: ComputeStep) -> None:
        assert isinstance(agent, PrefillAgent)
        log.debug("room %d: computing tokens up to %d of %d", step.room, step.end_tokens, step.num_tokens)
        if step.first:
            claim_s = 0.0 if step.peer_tp else self._settings.claim_timeout_s  # sequential flow: decode not known
            agent.attach_room(step.room, step.num_tokens, step.peer_tp, self._settings.room_timeout_s, step.prompt,
                              claim_s)  # fmt: skip
            self._open(step.room, _Room(step.req_id, step.num_tokens, 0, step.blocks))
        if step.room in self._rooms:
            agent.compute_scheduled(step.room, step.end_tokens)
            self._ready.append(step)

    def _open(self, room: int, record: _Room) -> None:
        self._rooms[room] = record
        self._by_req[record.req_id] = room

    def wait_for_save(self) -> None:
        """After the forward: the tokens this step computed are in vLLM's blocks; kvstage may read them. On a GPU
        an event recorded on vLLM's current stream orders the gathers after this step's writes; the host never
        waits for the device here."""
        if not self._ready:
            return
        agent = self._require_agent()
        assert isinstance(agent, PrefillAgent)
        ready = None
        if self._kv is not None and self._kv.device.type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(self._kv.device))
        for step in self._ready:
            if step.room not in self._rooms:
                continue  # reclaimed or ended in this step
            if self._report is not None and step.end_tokens == step.num_tokens:
                # before the last chunk is handed over, so prefill's digests are on file before decode's can be
                self._record_digests(step.room, _Room(step.req_id, step.num_tokens, 0, step.blocks))
            self._guarded("kv_ready", partial(agent.kv_ready, step.room, step.end_tokens, step.blocks, ready))
        self._ready.clear()

    def transfer_results(self) -> Results:
        """What vLLM hears this step: decode's rooms that ended (failed ones also as failed, so vLLM recomputes),
        and prefill's requests whose blocks kvstage no longer reads (only those vLLM holds for it)."""
        results = Results(set(), set(), set())
        if self._agent is None:
            return results
        outcomes = self._agent.poll()
        for outcome in outcomes:
            room = self._rooms.pop(outcome.room, None)
            if room is None:
                continue
            self._by_req.pop(room.req_id, None)
            if not outcome.ok:
                log.warning("kvstage room %d (request %s) failed: %s", outcome.room, room.req_id, outcome.reason)
            if not self._producer:
                self._received(outcome.room, room, outcome.ok, results)
        if outcomes and self._report is not None:
            self._report.counters(self._agent.metrics.registry)
        if self._producer:
            done = {req_id for req_id in self._sending if req_id not in self._by_req}
            self._sending -= done
            results.finished_sending.update(done)
        else:
            results.finished_recving.update(self._unserved)
            results.failed_recving.update(self._unserved)
            self._unserved.clear()
        return results

    def _received(self, room_id: int, room: _Room, ok: bool, results: Results) -> None:
        """Decode: the room ended. vLLM runs the request on (ok) or recomputes its prompt (failed)."""
        results.finished_recving.add(room.req_id)
        if not ok:
            results.failed_recving.add(room.req_id)
        elif self._report is not None:
            self._record_digests(room_id, room)

    def _record_digests(self, room_id: int, room: _Room) -> None:
        assert self._report is not None and self._kv is not None
        digests = span_digests(self._kv, self._global_heads, room.blocks, room.num_tokens, room.prefix_tokens)
        self._report.room(room_id, room.num_tokens, room.prefix_tokens, digests)

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    def _require_agent(self) -> DecodeAgent | PrefillAgent:
        if self._agent is None:
            raise ConfigError("kvstage: the connector was used before vLLM registered its KV caches")
        return self._agent


def staging_note(staging: torch.device, kv: torch.device, backend: str) -> str:
    """Where this rank stages, for the start-up log: on the KV's GPU, or host memory (named as the fallback when the
    KV is on a GPU and the backend moves host memory only)."""
    if staging.type == "cuda":
        return f"staging in device memory on {staging} (no byte through the host)"
    if kv.type == "cuda":
        return f"host staging (fallback: backend {backend} moves host memory only; cuda_ipc or nixl stage on the GPU)"
    return "host staging"


#: vLLM's CPU attention kernels whose cache layout kvstage reads (checked against vLLM's own write kernel).
CPU_KERNELS_READ = ("vec", "vec16")
#: vLLM's MLA backends whose latent cache kvstage reads: CPU_MLA's write is checked against vLLM's own
#: (tests/dataplane/test_engine_kv_vllm.py); the GPU backends named write through vLLM's common latent write
#: (`concat_and_cache_mla`, rows of kv_c then k_pe) and were read, not run, here. AMX_MLA packs with a kernel of
#: its own, not checked.
MLA_BACKENDS_READ = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA")
#: MLA cache dtypes whose rows are plain elements (fp8: one byte each, one scale per tensor).
MLA_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def cache_format(facts: EngineFacts, sample: torch.Tensor, backend: str) -> KVCacheFormat:
    """The format of vLLM's KV cache (`sample`: one layer's tensor), written by attention backend `backend`;
    `ConfigError` naming the setting that avoids a layout kvstage has not been checked against."""
    if facts.mla:
        return mla_format(backend, facts.cache_dtype, sample.shape[-1], facts.head_dim)
    if sample.device.type == "cpu":
        if backend != "CPU_ATTN":
            raise ConfigError(
                f"kvstage: vLLM's CPU attention backend here is {backend!r}; kvstage reads CPU_ATTN's KV cache only "
                "(set --attention-backend CPU_ATTN)"
            )
        return cpu_format(facts.cpu_attention_isa(sample.dtype))
    if facts.gpu_layout not in _CUDA_FORMATS:
        raise ConfigError(
            f"kvstage: vLLM's KV cache layout {facts.gpu_layout!r} is not supported; set VLLM_KV_CACHE_LAYOUT to "
            f"one of {sorted(_CUDA_FORMATS)}"
        )
    return _CUDA_FORMATS[facts.gpu_layout]


def mla_format(backend: str, cache_dtype: str, row: int, head_size: int) -> KVCacheFormat:
    """`vllm_mla` for a latent cache kvstage reads: a checked backend (`MLA_BACKENDS_READ`), a cache dtype of plain
    elements, and rows of exactly vLLM's MLA head size (no inline scales, no padding); else `ConfigError`."""
    if backend not in MLA_BACKENDS_READ:
        raise ConfigError(
            f"kvstage: vLLM's MLA backend here is {backend!r}, whose latent cache layout kvstage has not been "
            f"checked against; set --attention-backend to one of {', '.join(MLA_BACKENDS_READ)} (on a CPU host "
            "with AMX, CPU_MLA)"
        )
    if cache_dtype not in MLA_CACHE_DTYPES:
        raise ConfigError(
            f"kvstage: an MLA cache of kv_cache_dtype {cache_dtype!r} packs scales into its rows, a layout kvstage "
            f"has not been checked against; set --kv-cache-dtype to one of {', '.join(MLA_CACHE_DTYPES)}"
        )
    if row != head_size:
        raise ConfigError(
            f"kvstage: vLLM's MLA cache rows hold {row} elements, not the latent's {head_size} "
            "(kv_lora_rank + rope_dim): a padded or scaled row layout kvstage has not been checked against; set "
            f"--kv-cache-dtype to one of {', '.join(MLA_CACHE_DTYPES)}"
        )
    return KVCacheFormat.VLLM_MLA


def cpu_format(isa: str) -> KVCacheFormat:
    """The format of a CPU cache written by vLLM's `isa` kernel; `ConfigError` for a layout kvstage cannot read
    (AMX packs K and V in tiles, and the ARM, RISC-V, s390x and POWER kernels were not checked)."""
    if isa not in CPU_KERNELS_READ:
        raise ConfigError(
            f"kvstage: vLLM's CPU attention kernel here is {isa!r}; kvstage reads the KV cache layout of the "
            f"{' and '.join(CPU_KERNELS_READ)} kernels only (with AMX, --dtype float32 or float16, or a "
            "--block-size that is not a multiple of 32, avoids the AMX kernel)"
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
