"""Prometheus metrics of one agent, on the agent's own `CollectorRegistry`.

Owns `AgentMetrics` (every metric an agent exports) and `BusyClock` (wall time during which at least one
transfer was in flight: the union of the transfers' busy intervals, so overlapping transfers are not counted
twice and idle gaps are not counted at all; throughput = bytes / busy seconds).

Metrics (all prefixed `kvstage_`, all labelled with the agent's `role` and `peer`):
- `ring_live_bytes`, `ring_high_water_bytes` (decode): bytes of the staging ring held by live or quarantined
  allocations, and the most ever held;
- `watermark_lag_bytes` (decode): bytes between the ring's watermark and its head, i.e. how far the oldest live
  allocation holds writers back; `parked_chunks` (prefill): chunks waiting for ring space;
- `rooms{state}`: open rooms by state (open / succeeded / failed, the last two as totals);
- `copy_seconds{kind}` (histogram): run time of each chunk's gather (prefill) or scatter (decode);
- `transfer_bytes_total`, `transfer_seconds` (histogram), `transfer_busy_seconds_total`,
  `transfer_throughput_bytes_per_second` (bytes over busy time), `transfer_ops_total`;
- `room_failures_total{reason}`: failures by reason (reasons.py vocabulary);
- `rejected_frames_total{reason}`: inbound frames dropped by the control channel or the protocol codec;
- `parked_sends_failed_total{reason}`: sends parked for an unresolved peer that were never sent (a cap, their
  time, or the peer's session ended; runtime/outbox.py);
- `protocol_rejected{why}`: messages the endpoint refused, by why (a bound hit: "too many peers", "room cap of the
  peer reached", "chunk index out of range", "unknown room", ...; protocol/stats.py);
- `peer_state{table}`: entries per per-peer table of the agent (records, sockets, resolver, parked, endpoint), so
  an operator sees that they follow the peers alive now;
- `internal_errors_total`: agent steps that raised unexpectedly (a bug; logged with its traceback);
- `peer_reconnects_total` (prefill): decode peers whose imports were dropped to be made again, after a write to
  them failed as disconnected while they still answered (runtime/prefill.py, `_reconnect`).

Invariants: nothing is registered on prometheus-client's global registry, so several agents (and tests) can live
in one process. All methods are thread-safe (prometheus-client's are; `BusyClock` has a lock). Called by the
runtime agents; read by `kvstage bench`, tests and an optional HTTP exporter (`serve_http`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.metrics import MetricWrapperBase

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BusyClock:
    """Union of busy intervals: `begin()` when a transfer starts, `end()` when it completes, in any order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    def begin(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1

    def end(self, now: float | None = None) -> float:
        """Close one interval; returns the busy seconds added (non-zero only when the last one closes)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._active <= 0:
                raise ValueError("BusyClock.end() without a matching begin()")
            self._active -= 1
            if self._active:
                return 0.0
            added = max(0.0, now - self._since)
            self._busy += added
            return added

    def busy_seconds(self, now: float | None = None) -> float:
        """Busy time so far, including the open interval if a transfer is in flight."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._busy + (max(0.0, now - self._since) if self._active else 0.0)


class AgentMetrics:
    """Every metric of one agent, registered on `self.registry` (never the global registry)."""

    def __init__(self, role: str, peer: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("role", "peer")
        self._labels = (role, peer)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvstage_{name}", doc, labels, registry=reg)

        self.ring_live_bytes = gauge("ring_live_bytes", "Staging-ring bytes held by live or quarantined allocations")
        self.ring_high_water = gauge("ring_high_water_bytes", "Most staging-ring bytes ever held at once")
        self.watermark_lag = gauge("watermark_lag_bytes", "Bytes between the ring watermark and the ring head")
        self.parked_chunks = gauge("parked_chunks", "Chunks waiting for ring space on their decode peer")
        self.throughput = gauge(
            "transfer_throughput_bytes_per_second", "Transfer bytes over busy wall time (union of intervals)"
        )
        self.rooms = Gauge("kvstage_rooms", "Rooms by state", (*labels, "state"), registry=reg)
        self.transfer_bytes = Counter("kvstage_transfer_bytes", "Bytes moved by data transfers", labels, registry=reg)
        self.transfer_ops = Counter("kvstage_transfer_ops", "Transfer operations issued", labels, registry=reg)
        self.busy_seconds = Counter(
            "kvstage_transfer_busy_seconds", "Wall time with at least one transfer in flight", labels, registry=reg
        )
        self.transfer_seconds = Histogram(
            "kvstage_transfer_seconds", "Latency of one transfer", labels, buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.copy_seconds = Histogram(
            "kvstage_copy_seconds", "Run time of one chunk's gather (prefill) or scatter (decode) on the reactor",
            (*labels, "kind"), buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.failures = Counter("kvstage_room_failures", "Room failures by reason", (*labels, "reason"), registry=reg)
        self.rejected = Counter(
            "kvstage_rejected_frames", "Inbound frames dropped, by reason", (*labels, "reason"), registry=reg
        )
        self.parked_failed = Counter(
            "kvstage_parked_sends_failed", "Parked sends never sent, by reason", (*labels, "reason"), registry=reg
        )
        self.protocol_rejected = Gauge(
            "kvstage_protocol_rejected", "Messages the endpoint refused, by why", (*labels, "why"), registry=reg
        )
        self.peer_state = Gauge("kvstage_peer_state", "Entries per per-peer table", (*labels, "table"), registry=reg)
        self.canary_violations = Counter(
            "kvstage_ring_canary_violations", "Free ring bytes found written (ring_canary on): late writes", labels,
            registry=reg,
        )  # fmt: skip
        self.internal_errors = Counter(
            "kvstage_internal_errors", "Agent steps that raised unexpectedly (logged with a traceback)", labels,
            registry=reg,
        )  # fmt: skip
        self.reconnects = Counter(
            "kvstage_peer_reconnects", "Peers whose imports were dropped to reconnect after a disconnected write",
            labels, registry=reg,
        )  # fmt: skip
        self.clock = BusyClock()
        self._bytes_moved = 0
        self._lock = threading.Lock()
        # each metric's child for this agent's labels (and an extra label's value), looked up once: `labels()` takes
        # a lock and checks its arguments on every call, and the reactor updates gauges several times a chunk
        self._children: dict[tuple[int, str | None], Any] = {}

    def _of(self, metric: MetricWrapperBase, extra: str | None = None) -> Any:
        """`metric`'s child for this agent (and `extra`, the value of its third label if it has one)."""
        key = (id(metric), extra)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*self._labels) if extra is None else metric.labels(*self._labels, extra)
            self._children[key] = child
        return child

    # ---- updates -----------------------------------------------------------------------------------------
    def transfer_started(self, now: float | None = None) -> None:
        self.clock.begin(now)

    def transfer_finished(self, nbytes: int, seconds: float, ops: int, ok: bool, now: float | None = None) -> None:
        """Account one finished transfer; failed ones count latency and busy time but no bytes."""
        added = self.clock.end(now)
        self._of(self.busy_seconds).inc(added)
        self._of(self.transfer_seconds).observe(seconds)
        self._of(self.transfer_ops).inc(ops)
        if ok:
            self._of(self.transfer_bytes).inc(nbytes)
            with self._lock:
                self._bytes_moved += nbytes
        busy = self.clock.busy_seconds(now)
        if busy > 0:
            with self._lock:
                self._of(self.throughput).set(self._bytes_moved / busy)

    def copy_done(self, kind: str, seconds: float) -> None:
        """One chunk's gather or scatter (`kind`) ran for `seconds` on the reactor."""
        self._of(self.copy_seconds, kind).observe(seconds)

    def room_failed(self, reason: str) -> None:
        self._of(self.failures, reason).inc()

    def canary_violated(self, nbytes: int) -> None:
        self._of(self.canary_violations).inc(nbytes)

    def internal_error(self) -> None:
        self._of(self.internal_errors).inc()

    def peer_reconnected(self) -> None:
        self._of(self.reconnects).inc()

    def frame_rejected(self, reason: str) -> None:
        self._of(self.rejected, reason).inc()

    def parked_send_failed(self, reason: str) -> None:
        self._of(self.parked_failed, reason).inc()

    def set_protocol_rejected(self, why: str, count: int) -> None:
        self._of(self.protocol_rejected, why).set(count)

    def set_peer_state(self, table: str, count: int) -> None:
        self._of(self.peer_state, table).set(count)

    def set_rooms(self, state: str, count: int) -> None:
        self._of(self.rooms, state).set(count)

    def set_ring(self, live_bytes: int, high_water: int, lag_bytes: int) -> None:
        self._of(self.ring_live_bytes).set(live_bytes)
        self._of(self.ring_high_water).set(high_water)
        self._of(self.watermark_lag).set(lag_bytes)

    def set_parked(self, count: int) -> None:
        self._of(self.parked_chunks).set(count)

    # ---- reading -----------------------------------------------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """Current value of sample `name` (e.g. "kvstage_room_failures_total") with these extra labels; 0 if absent."""
        found = self.registry.get_sample_value(name, {"role": self._labels[0], "peer": self._labels[1], **labels})
        return 0.0 if found is None else found

    def bytes_moved(self) -> int:
        with self._lock:
            return self._bytes_moved

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose this agent's registry over HTTP (`/metrics`) on a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)
