"""The vLLM connector's settings and start-up checks: a bad deployment file fails at start, naming what is wrong.

These run without starting vLLM; the connector's behaviour with real vLLM servers is in tests/e2e.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.dataplane.engine_kv import KVCacheFormat
from kvstage.errors import ConfigError
from kvstage.integrations.vllm.settings import ConnectorSettings
from kvstage.integrations.vllm.worker import cpu_format, staging_note


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
        "url",
        "canary",
    ],
)
def test_a_bad_extra_config_is_refused_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ConnectorSettings.from_extra_config(extra)


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
