"""What the router reads from a vLLM server's Prometheus `/metrics`: its waiting queue and the prompt tokens its KV
connector loaded.

Owns `VLLMLoad` and `parse_vllm_metrics(text)`: `vllm:num_requests_waiting` (summed over engines) and
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}` (prompt tokens whose KV came through the
connector, i.e. through kvstage on a decode instance; summed over engines). Either is None when the text does
not carry it (another vLLM version, another server); a text that is not Prometheus' format gives both None.

Invariants: pure; the caller bounds the text's size (`METRICS_BYTES`). Called by `router.health` (the prober).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

#: The most of a `/metrics` answer the router reads (vLLM's is about 30-100 KiB).
METRICS_BYTES: Final = 2**20
WAITING: Final = "vllm:num_requests_waiting"
PROMPT_TOKENS_BY_SOURCE: Final = "vllm:prompt_tokens_by_source_total"
EXTERNAL: Final = "external_kv_transfer"


@dataclass(frozen=True, slots=True)
class VLLMLoad:
    waiting: float | None = None
    external_tokens: float | None = None  # a counter: tokens loaded through the connector since vLLM started


def parse_vllm_metrics(text: str) -> VLLMLoad:
    waiting: float | None = None
    external: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == WAITING:
                    waiting = (waiting or 0.0) + sample.value
                elif sample.name == PROMPT_TOKENS_BY_SOURCE and sample.labels.get("source") == EXTERNAL:
                    external = (external or 0.0) + sample.value
    except ValueError:  # not Prometheus' text format
        return VLLMLoad()
    return VLLMLoad(waiting, external)
