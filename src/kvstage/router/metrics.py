"""Prometheus metrics of one router, on the router's own `CollectorRegistry` (served at `/metrics`).

Metrics (all prefixed `kvstage_router_`):
- `requests_total{endpoint, outcome}`: client requests by how they ended (`OUTCOMES`);
- `in_flight_requests`: requests holding a concurrency slot (a slot is held until both upstream requests end);
- `upstream_errors_total{role, instance, reason}`: failed upstream requests (reasons: see `router.upstream`);
- `retries_total{reason}`: requests sent again to another decode instance (a new room) after decode failed
  before its first byte, by the reason of that failure;
- `fallbacks_total{reason}`: requests served by decode alone (`FALLBACKS`);
- `breaker_state{role, instance}`: each instance's circuit breaker, 0 closed, 1 half-open, 2 open;
- `instance_up{role, instance}`: 1 while the instance's last `/health` probe succeeded, else 0;
- `probes_total{role, instance, result}`: `/health` probes, result `up` or `down`;
- `unauthorized_total`: requests refused for a missing or wrong API key (401);
- `request_seconds{endpoint}`: arrival to the last byte sent (histogram);
- `first_byte_seconds{endpoint}`: arrival to the first body byte sent to the client, i.e. time to first token
  for a streamed request (histogram);
- `prefill_seconds`: duration of the prefill requests that succeeded (histogram).

Per instance (each instance's series go when it leaves the router's pools, so churn never grows them):
- `instance_in_flight{role, instance}`: requests of this router open at the instance (its load);
- `instance_waiting{role, instance}`: vLLM's `num_requests_waiting` at the last read of its `/metrics`;
- `routed_total{role, instance}`: requests sent to the instance (each attempt);
- `ttft_seconds{instance}`: per decode instance, arrival to the first body byte sent (histogram);
- `kv_bytes_total{instance}`: per decode instance, KV bytes its connector loaded since the router started
  (vLLM's `prompt_tokens_by_source{source="external_kv_transfer"}` times the KV bytes of a token);
- `scrape_failures_total{role, instance}`: `/metrics` reads that failed;
- errors by kind: `upstream_errors_total{role, instance, reason}` above.

Invariants: nothing is registered on prometheus-client's global registry, so several routers (and tests) can live
in one process. Called by `router.proxy`, `router.health` and `router.app`.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES: Final = (
    "ok",
    "bad_request",  # the router refused the body (400, 413)
    "busy",  # 429: the concurrency cap was reached
    "client_error",  # decode refused the request (4xx)
    "decode_unavailable",  # 503
    "decode_error",  # 502: decode answered 5xx or broke the connection
    "decode_timeout",  # 504
    "client_disconnected",
)

FALLBACKS: Final = (
    "prefill_failed",  # prefill failed before decode's first byte: decode was asked again, without a room
    "no_prefill",  # no prefill instance could take the request (down, breaker open, TP size unknown)
    "beam_search",  # vLLM's beam search makes up its own engine requests: decode serves it alone
    "prefix_cached",  # the decode chosen likely holds all of the prompt but less than a block: no prefill hop
)

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "kvstage_router_requests", "Client requests by outcome", ("endpoint", "outcome"), registry=reg
        )
        self.in_flight = Gauge("kvstage_router_in_flight_requests", "Requests holding a slot", registry=reg)
        self.upstream_errors = Counter(
            "kvstage_router_upstream_errors",
            "Failed upstream requests by instance and reason",
            ("role", "instance", "reason"),
            registry=reg,
        )
        self.retries = Counter(
            "kvstage_router_retries", "Requests sent again to another decode instance", ("reason",), registry=reg
        )
        self.fallbacks = Counter(
            "kvstage_router_fallbacks", "Requests served by decode alone", ("reason",), registry=reg
        )
        self.breaker_state = Gauge(
            "kvstage_router_breaker_state",
            "Circuit breaker per instance: 0 closed, 1 half-open, 2 open",
            ("role", "instance"),
            registry=reg,
        )
        self.instance_up = Gauge(
            "kvstage_router_instance_up", "1 while the last /health probe succeeded", ("role", "instance"), registry=reg
        )
        self.probes = Counter(
            "kvstage_router_probes", "/health probes by result", ("role", "instance", "result"), registry=reg
        )
        self.unauthorized = Counter(
            "kvstage_router_unauthorized", "Requests refused for a missing or wrong API key", registry=reg
        )
        self.request_seconds = Histogram(
            "kvstage_router_request_seconds",
            "Arrival to last byte sent",
            ("endpoint",),
            buckets=_SECONDS_BUCKETS,
            registry=reg,
        )
        self.first_byte_seconds = Histogram(
            "kvstage_router_first_byte_seconds",
            "Arrival to first body byte sent",
            ("endpoint",),
            buckets=_SECONDS_BUCKETS,
            registry=reg,
        )
        self.prefill_seconds = Histogram(
            "kvstage_router_prefill_seconds",
            "Duration of successful prefill requests",
            buckets=_SECONDS_BUCKETS,
            registry=reg,
        )

        self.instance_in_flight = Gauge(
            "kvstage_router_instance_in_flight",
            "Requests of this router open at the instance",
            ("role", "instance"),
            registry=reg,
        )
        self.waiting = Gauge(
            "kvstage_router_instance_waiting",
            "vLLM's num_requests_waiting at the last read of its /metrics",
            ("role", "instance"),
            registry=reg,
        )
        self.routed = Counter(
            "kvstage_router_routed", "Requests sent to the instance", ("role", "instance"), registry=reg
        )
        self.ttft_seconds = Histogram(
            "kvstage_router_ttft_seconds",
            "Per decode instance: arrival to first body byte sent",
            ("instance",),
            buckets=_SECONDS_BUCKETS,
            registry=reg,
        )
        self.kv_bytes = Counter(
            "kvstage_router_kv_bytes", "KV bytes the decode instance's connector loaded", ("instance",), registry=reg
        )
        self.scrape_failures = Counter(
            "kvstage_router_scrape_failures", "/metrics reads that failed", ("role", "instance"), registry=reg
        )
        self._per_instance = (
            self.upstream_errors,
            self.breaker_state,
            self.instance_up,
            self.probes,
            self.instance_in_flight,
            self.waiting,
            self.routed,
            self.scrape_failures,
        )
        self._per_decode = (self.ttft_seconds, self.kv_bytes)

    def forget(self, role: str, instance: str) -> None:
        """Drop every series of an instance that left."""
        for metric in self._per_instance:
            metric.remove_by_labels({"role": role, "instance": instance})
        if role == "decode":
            for per_decode in self._per_decode:
                per_decode.remove_by_labels({"instance": instance})

    def request_done(self, endpoint: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.requests.labels(endpoint, outcome).inc()

    def upstream_error(self, role: str, instance: str, reason: str) -> None:
        self.upstream_errors.labels(role, instance, reason).inc()

    def fallback(self, reason: str) -> None:
        if reason not in FALLBACKS:
            raise ValueError(f"unknown fallback {reason!r}")
        self.fallbacks.labels(reason).inc()

    def probed(self, role: str, instance: str, up: bool) -> None:
        self.probes.labels(role, instance, "up" if up else "down").inc()
        self.instance_up.labels(role, instance).set(1 if up else 0)

    def value(self, name: str, **labels: str) -> float:
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
