"""The vLLM connector's settings and start-up checks: a bad deployment file, or a cache layout kvstage has not been
checked against, fails at start, naming what is wrong and the setting that avoids it.

These run without starting vLLM; the connector's behaviour with real vLLM servers is in tests/e2e.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane.engine_kv import KVCacheFormat
from kvstage.errors import ConfigError
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.integrations.vllm.worker import EngineFacts, WorkerSide, cache_format, cpu_format, mla_format, staging_note
from kvstage.layout import latent_layout
from kvstage.transport.bootstrap import BootstrapServer


def test_settings_take_their_types_from_the_extra_config_strings_included() -> None:
    s = ConnectorSettings.from_extra_config({"instance": "P", "ring_mib": "8", "dead_after_s": "2.5"})
    assert (s.instance, s.ring_mib, s.dead_after_s, s.backend) == ("P", 8, 2.5, "local")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({}, "'instance'"),
        ({"instance": "P", "ring_mb": 8}, "ring_mb"),
        ({"instance": "P", "ring_mib": "lots"}, "'ring_mib'"),
        ({"instance": "P", "backend": "rdma"}, "'backend'"),
        ({"instance": "P/0"}, "'instance'"),
        ({"instance": "P", "dead_after_s": 0}, "'dead_after_s'"),
        ({"instance": "P", "decode_dead_after_s": -1}, "'decode_dead_after_s'"),
        ({"instance": "P", "url": "10.0.0.2:8100"}, "'url'"),
        ({"instance": "D", "ring_canary": 2}, "'ring_canary'"),
    ],
    ids=[
        "no instance",
        "unknown key",
        "not a number",
        "unknown backend",
        "slash in name",
        "zero liveness",
        "negative decode liveness",
        "url",
        "canary",
    ],
)
def test_a_bad_extra_config_is_refused_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_prefill_waits_4_s_for_a_silent_decode_rank_and_heartbeats_often_enough_for_it() -> None:
    timing = ConnectorSettings(instance="P").timing()
    assert (timing.dead_after_s, timing.decode_dead_after_s, timing.heartbeat_s) == (20.0, 4.0, 0.5)
    timing = ConnectorSettings(instance="P", dead_after_s=5.0, decode_dead_after_s=30.0).timing()
    assert (timing.decode_dead_after_s, timing.heartbeat_s) == (30.0, 0.5)


def test_the_chunk_grid_defaults_to_the_smallest_block_multiple_of_at_least_256_tokens() -> None:
    s = ConnectorSettings(instance="P")
    assert [s.chunk_tokens_for(b) for b in (16, 128, 100, 512)] == [256, 256, 300, 512]
    with pytest.raises(ConfigError, match="multiple of vLLM's block size 128"):
        ConnectorSettings(instance="P", chunk_tokens=200).chunk_tokens_for(128)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_the_cpu_kernels_whose_layout_kvstage_reads_map_to_the_vllm_cpu_format(isa: str) -> None:
    assert cpu_format(isa) is KVCacheFormat.VLLM_CPU


@pytest.mark.parametrize("isa", ["amx", "neon", "vsx"])
def test_a_cpu_kernel_with_another_cache_layout_is_refused_at_start(isa: str) -> None:
    with pytest.raises(ConfigError, match=f"'{isa}'"):
        cpu_format(isa)


def test_cuda_ipc_is_a_connector_backend_and_host_staging_is_named_as_the_fallback() -> None:
    assert ConnectorSettings.from_extra_config({"instance": "P", "backend": "cuda_ipc"}).backend == "cuda_ipc"
    gpu, host = torch.device("cuda", 0), torch.device("cpu")
    assert "device memory on cuda:0" in staging_note(gpu, gpu, "cuda_ipc")
    assert "fallback: backend mooncake" in staging_note(host, gpu, "mooncake")
    assert staging_note(host, host, "local") == "host staging"


def _facts(**fields: object) -> EngineFacts:
    return EngineFacts(producer=True, tp_size=1, rank=0, num_kv_heads=1, head_dim=576, block_size=16, **fields)  # type: ignore[arg-type]


def test_the_amx_kernel_is_refused_naming_the_settings_that_avoid_it() -> None:
    facts = _facts(cpu_attention_isa=lambda _dtype: "amx")
    with pytest.raises(ConfigError, match=r"'amx'.*--dtype float32 or float16.*--block-size"):
        cache_format(facts, torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16), "CPU_ATTN")


def test_a_cpu_attention_backend_other_than_cpu_attn_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"'FLEX_ATTENTION'.*--attention-backend CPU_ATTN"):
        cache_format(_facts(), torch.zeros(2, 1, 16, 128), "FLEX_ATTENTION")


def test_vllms_cpu_mla_latent_cache_is_the_vllm_mla_format() -> None:
    latent = torch.zeros(2, 1, 16, 576)
    assert cache_format(_facts(mla=True), latent, "CPU_MLA") is KVCacheFormat.VLLM_MLA
    assert cache_format(_facts(mla=True, cache_dtype="fp8"), latent.to(torch.uint8), "TRITON_MLA") is (
        KVCacheFormat.VLLM_MLA
    )


@pytest.mark.parametrize(
    ("backend", "cache_dtype", "row", "named"),
    [
        ("AMX_MLA", "auto", 576, "'AMX_MLA'.*--attention-backend.*CPU_MLA"),
        ("ROCM_AITER_MLA", "auto", 576, "'ROCM_AITER_MLA'.*--attention-backend"),
        ("FLASHMLA", "fp8_ds_mla", 656, "'fp8_ds_mla'.*--kv-cache-dtype"),
        ("TRITON_MLA", "fp8", 584, "584 elements.*--kv-cache-dtype"),
    ],
    ids=["amx tiles", "unchecked backend", "scales in the row", "padded row"],
)
def test_an_mla_cache_layout_kvstage_has_not_been_checked_against_is_refused_naming_the_setting(
    backend: str, cache_dtype: str, row: int, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        mla_format(backend, cache_dtype, row, 576)


@pytest.mark.parametrize("producer", [True, False], ids=["prefill", "decode"])
def test_an_mla_engines_worker_serves_its_latent_cache_as_one_replicated_head(producer: bool) -> None:
    bootstrap = BootstrapServer().start()
    settings = ConnectorSettings(instance="M", bootstrap=bootstrap.address)
    facts = EngineFacts(producer, tp_size=2, rank=1, num_kv_heads=1, head_dim=576, block_size=16, mla=True,
                        attention_backend=lambda _layers: "CPU_MLA")  # fmt: skip
    worker = WorkerSide(settings, facts)
    try:
        worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 16, 576) for i in range(3)})
        agent = worker._require_agent()
        assert agent.config.layout == latent_layout(3, 576, "float32", 16)
        assert agent.config.attention == "mla"
    finally:
        worker.shutdown()
        bootstrap.close()
