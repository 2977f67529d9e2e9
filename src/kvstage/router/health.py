"""Which upstream instances may take a request: a circuit breaker per instance, an active `/health` probe, each
instance's load, and the choice among the instances that pass both.

Owns:
- `Breaker`: one instance's circuit breaker. Closed, it lets every request through and counts failures in a row;
  `failures_to_open` of them open it; open, it lets nothing through until `cooldown_s` has passed, then one trial
  request (half-open); the trial's success closes it, its failure opens it for another cooldown, and a trial that
  brings no verdict within a cooldown (cancelled, say) lets the next one through;
- `Pool`: the instances of one role (they may join and leave: `update`), their breakers, probe results and loads
  (`busy`: this router's requests open at each; `scraped`: vLLM's waiting queue); `pick` hands the candidates that
  are not excluded, not down by their probe, allowed by their breaker and usable (the caller's check: its TP size
  lookup has not just failed), in turn from the one after the last pick, to a policy (`router.select`), round
  robin by default; an instance that joins takes nothing until its first probe succeeds; `succeeded` / `failed`
  are the passive verdicts of the requests (only failures that blame the instance count: connect errors,
  timeouts, broken connections, 5xx; a refused request is the request's fault, and proves the instance answers);
- `Prober`: the active check, every instance's `GET /health` every `interval_s` in the background, then its
  `/metrics` (bounded); a failed probe takes the instance out of selection until a probe succeeds.

Why not a library (aiobreaker, purgatory): both guard a call (a decorator or a context manager whose block's
exception is the failure). The router needs another shape: selection asks each instance "may you take a request
now?" without calling anything, and the verdict on a request comes later and from several places (prefill's
answer, decode's headers or first byte), beside a probe that has its own say. A small synchronous state machine
fits that, and needs no lock: every call comes from the event loop's thread.

Invariants: a breaker's state only changes through `take`, `succeeded` and `failed`, and each change is reflected
in the `breaker_state` metric; `pick` never returns an excluded instance. Called by `router.proxy`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum

import anyio
import httpx
from anyio.abc import TaskStatus

from kvstage.router.instances import Instance, Role
from kvstage.router.metrics import RouterMetrics
from kvstage.router.select import Candidate, HashRing, first_in_turn
from kvstage.router.upstream import UpstreamFailure, failure_from_exception, failure_from_response, read_bounded
from kvstage.router.vllm_metrics import METRICS_BYTES, VLLMLoad, parse_vllm_metrics

log = logging.getLogger("kvstage.router")


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class Breaker:
    failures_to_open: int
    cooldown_s: float
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # in a row
    trial_at: float = 0.0  # when not closed: when the next trial request may pass

    def allows(self, now: float) -> bool:
        return self.state is BreakerState.CLOSED or now >= self.trial_at

    def take(self, now: float) -> None:
        """A request goes to the instance (it `allows` it): unless closed, that request is the trial."""
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.HALF_OPEN
            self.trial_at = now + self.cooldown_s

    def succeeded(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.state is not BreakerState.CLOSED or self.failures >= self.failures_to_open:
            self.state = BreakerState.OPEN
            self.trial_at = now + self.cooldown_s


@dataclass
class _State:
    instance: Instance
    breaker: Breaker
    probe: UpstreamFailure | None = None  # why the last probe failed; None: it succeeded (or none ran yet)
    last_failure: UpstreamFailure | None = None  # the last failure that blamed the instance
    outstanding: int = 0  # requests of this router open at the instance now
    waiting: float = 0.0  # vLLM's num_requests_waiting at the last scrape of its /metrics
    waiting_at: float = -math.inf  # when that scrape was (monotonic)


def _describe(state: BreakerState) -> str:
    return state.name.lower()


NOT_PROBED = "not probed yet"


class Pool:
    """The instances of one role, handed out among those that may take a request (in turn by default)."""

    def __init__(
        self,
        role: Role,
        instances: Iterable[Instance],
        *,
        failures_to_open: int,
        cooldown_s: float,
        metrics: RouterMetrics,
        load_fresh_s: float = 4.0,
    ) -> None:
        self.role = role
        self._failures_to_open = failures_to_open
        self._cooldown_s = cooldown_s
        self._load_fresh_s = load_fresh_s
        self._states: dict[Instance, _State] = {}
        self._next = 0
        self._metrics = metrics
        self.ring = HashRing(())
        self.update(instances, probed_first=False)

    @property
    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._states)

    def update(
        self, instances: Iterable[Instance], *, probed_first: bool = True
    ) -> tuple[list[Instance], list[Instance]]:
        """The pool holds exactly `instances` from now on: (joined, left). With `probed_first`, an instance that
        joins takes no request until its first `/health` probe succeeds."""
        wanted = tuple(dict.fromkeys(instances))
        left = [i for i in self._states if i not in wanted]
        for instance in left:
            del self._states[instance]
            self._metrics.forget(instance.role, instance.name)
        joined = [i for i in wanted if i not in self._states]
        for instance in joined:
            state = _State(instance, Breaker(self._failures_to_open, self._cooldown_s))
            if probed_first:
                state.probe = UpstreamFailure(instance, "unavailable", 503, NOT_PROBED)
            self._states[instance] = state
            self._show(state)
        if joined or left:
            self.ring = HashRing(i.name for i in self._states)
        return joined, left

    def load(self, instance: Instance, now: float) -> float:
        """The router's requests open at the instance, plus vLLM's waiting queue when read within `load_fresh_s`."""
        state = self._states[instance]
        fresh = now - state.waiting_at <= self._load_fresh_s
        return state.outstanding + (state.waiting if fresh else 0.0)

    def pick(
        self,
        exclude: Collection[Instance] = (),
        usable: Callable[[Instance], bool] = lambda _i: True,
        choose: Callable[[Sequence[Candidate]], Candidate] = first_in_turn,
        held: Callable[[Instance], int] = lambda _i: 0,
    ) -> Instance | None:
        """The instance `choose` takes among those that may take a request now (in turn from the one after the
        last pick), or None; it is counted as the breaker's trial."""
        now = time.monotonic()
        order = list(self._states.values())
        count = len(order)
        candidates = []
        for step in range(count):
            state = order[(self._next + step) % count]
            if state.instance in exclude or not self._admits(state, now) or not usable(state.instance):
                continue
            candidates.append(Candidate(state.instance, self.load(state.instance, now), held(state.instance)))
        if not candidates:
            return None
        chosen = self._states[choose(candidates).instance]
        self._next = order.index(chosen) + 1
        before = chosen.breaker.state
        chosen.breaker.take(now)
        self._changed(chosen, before)
        return chosen.instance

    @contextmanager
    def busy(self, instance: Instance) -> Iterator[None]:
        """One request of this router is open at the instance for the block (its load, `instance_in_flight`)."""
        self._add_outstanding(instance, 1)
        try:
            yield
        finally:
            self._add_outstanding(instance, -1)

    def _add_outstanding(self, instance: Instance, delta: int) -> None:
        state = self._states.get(instance)
        if state is not None:  # an instance that left keeps no state
            state.outstanding += delta
            self._metrics.instance_in_flight.labels(instance.role, instance.name).set(state.outstanding)

    def outstanding(self, instance: Instance) -> int:
        return self._states[instance].outstanding

    def scraped(self, instance: Instance, waiting: float) -> None:
        """vLLM's `num_requests_waiting`, as its `/metrics` said just now."""
        state = self._states.get(instance)
        if state is not None:
            state.waiting, state.waiting_at = waiting, time.monotonic()
            self._metrics.waiting.labels(instance.role, instance.name).set(waiting)

    def scrape_failed(self, instance: Instance, why: str) -> None:
        """The instance's `/metrics` could not be read: its load is the router's own count until it can."""
        log.debug("%s: /metrics not read: %s", instance.describe(), why)
        self._metrics.scrape_failures.labels(instance.role, instance.name).inc()

    def succeeded(self, instance: Instance) -> None:
        state = self._states.get(instance)
        if state is None:
            return
        before = state.breaker.state
        state.breaker.succeeded()
        self._changed(state, before)

    def failed(self, failure: UpstreamFailure) -> None:
        """A request the instance was sent failed. Only a failure that blames the instance counts against it; a
        refused request proves that the instance answers, and counts as a success."""
        if not failure.blames_instance:
            self.succeeded(failure.instance)
            return
        state = self._states.get(failure.instance)
        if state is None:
            return
        state.last_failure = failure
        before = state.breaker.state
        state.breaker.failed(time.monotonic())
        self._changed(state, before)

    def probed(self, instance: Instance, failure: UpstreamFailure | None) -> None:
        """The result of a `/health` probe: None when it succeeded."""
        state = self._states.get(instance)
        if state is None:
            return
        if (failure is None) != (state.probe is None):
            if failure is None:
                log.info("%s: /health answers, taking requests", instance.describe())
            else:
                log.warning("%s: /health failed, skipped until it answers: %s", instance.describe(), failure)
        state.probe = failure
        if failure is not None:
            state.last_failure = failure
        self._metrics.probed(instance.role, instance.name, failure is None)

    def why_skipped(self, instance: Instance) -> UpstreamFailure | None:
        """Why `pick` skips the instance now (its probe failed, or its breaker is open), else None."""
        state = self._states[instance]
        if state.probe is not None and state.probe.detail == NOT_PROBED:
            return state.probe
        if state.probe is not None:
            return UpstreamFailure(instance, state.probe.reason, 503, f"/health failed: {state.probe.detail}")
        if self._admits(state, time.monotonic()):
            return None
        last = state.last_failure
        detail = f"circuit {_describe(state.breaker.state)} after {state.breaker.failures} failures in a row"
        if last is None:
            return UpstreamFailure(instance, "connect", 503, detail)
        return UpstreamFailure(instance, last.reason, 503, f"{detail}, the last: {last.detail}")

    def breaker_state(self, instance: Instance) -> str:
        return _describe(self._states[instance].breaker.state)

    @staticmethod
    def _admits(state: _State, now: float) -> bool:
        return state.probe is None and state.breaker.allows(now)

    def _changed(self, state: _State, before: BreakerState) -> None:
        after = state.breaker.state
        if after is before:
            return
        self._show(state)
        what = state.instance.describe()
        if after is BreakerState.OPEN:
            log.warning("%s: circuit open for %.1fs: %s", what, state.breaker.cooldown_s, state.last_failure)
        elif after is BreakerState.CLOSED:
            log.info("%s: circuit closed again", what)
        else:
            log.info("%s: circuit half-open, one trial request", what)

    def _show(self, state: _State) -> None:
        self._metrics.breaker_state.labels(state.instance.role, state.instance.name).set(state.breaker.state)


class Prober:
    """Each pool's instances' `GET /health`, every `interval_s`, each probe bounded by `timeout_s`; after a probe
    that succeeds, the instance's `/metrics` (vLLM's waiting queue, and on decode the prompt tokens its connector
    loaded), passed to `on_metrics`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pools: Iterable[Pool],
        *,
        interval_s: float,
        timeout_s: float,
        on_metrics: Callable[[Instance, VLLMLoad], None] = lambda _i, _m: None,
    ):
        self._client = client
        self._pools = tuple(pools)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_metrics = on_metrics

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe every instance once, report started, then probe again every `interval_s` until cancelled."""
        await self._round()
        task_status.started()
        while True:
            await anyio.sleep(self._interval_s)
            await self._round()

    async def _round(self) -> None:
        async with anyio.create_task_group() as probes:
            for pool in self._pools:
                for instance in pool.instances:
                    probes.start_soon(self.probe, pool, instance)

    async def probe(self, pool: Pool, instance: Instance) -> None:
        """One probe of one instance (and its metrics when it is up)."""
        try:
            async with self._client.stream("GET", instance.url + "/health", timeout=self._timeout_s) as response:
                raw = await read_bounded(response)
        except httpx.HTTPError as exc:
            pool.probed(instance, failure_from_exception(instance, exc))
            return
        ok = response.status_code == 200
        pool.probed(instance, None if ok else failure_from_response(instance, response.status_code, raw))
        if ok:
            await self._scrape(pool, instance)

    async def _scrape(self, pool: Pool, instance: Instance) -> None:
        try:
            async with self._client.stream("GET", instance.url + "/metrics", timeout=self._timeout_s) as response:
                raw = await read_bounded(response, METRICS_BYTES + 1)
        except httpx.HTTPError as exc:
            pool.scrape_failed(instance, repr(exc))
            return
        if response.status_code != 200 or len(raw) > METRICS_BYTES:
            pool.scrape_failed(instance, f"HTTP {response.status_code}, {len(raw)} bytes (at most {METRICS_BYTES})")
            return
        load = parse_vllm_metrics(raw.decode(errors="replace"))
        if load.waiting is not None:
            pool.scraped(instance, load.waiting)
        self._on_metrics(instance, load)
