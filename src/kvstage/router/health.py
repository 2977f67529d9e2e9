"""Which upstream instances may take a request: a circuit breaker per instance, an active `/health` probe, and
round-robin selection among the instances that pass both.

Owns:
- `Breaker`: one instance's circuit breaker. Closed, it lets every request through and counts failures in a row;
  `failures_to_open` of them open it; open, it lets nothing through until `cooldown_s` has passed, then one trial
  request (half-open); the trial's success closes it, its failure opens it for another cooldown, and a trial that
  brings no verdict within a cooldown (cancelled, say) lets the next one through;
- `Pool`: the instances of one role, their breakers and probe results; `pick` hands out the next instance in turn
  that is not excluded, not down by its probe, allowed by its breaker and usable (the caller's check: its TP size
  lookup has not just failed); `succeeded` / `failed` are the passive verdicts of the requests (only failures
  that blame the instance count: connect errors, timeouts, broken connections, 5xx; a refused request is the
  request's fault, and proves the instance answers);
- `Prober`: the active check, every instance's `GET /health` every `interval_s` in the background; a failed probe
  takes the instance out of selection until a probe succeeds.

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
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import IntEnum

import anyio
import httpx
from anyio.abc import TaskStatus

from kvstage.router.instances import Instance
from kvstage.router.metrics import RouterMetrics
from kvstage.router.upstream import UpstreamFailure, failure_from_exception, failure_from_response, read_bounded

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


def _describe(state: BreakerState) -> str:
    return state.name.lower()


class Pool:
    """The instances of one role, handed out in turn among those that may take a request."""

    def __init__(
        self, instances: Iterable[Instance], *, failures_to_open: int, cooldown_s: float, metrics: RouterMetrics
    ) -> None:
        self.instances = tuple(instances)
        if not self.instances:
            raise ValueError("at least one instance is needed")
        self._states = {i: _State(i, Breaker(failures_to_open, cooldown_s)) for i in self.instances}
        self._next = 0
        self._metrics = metrics
        for state in self._states.values():
            self._show(state)

    def pick(
        self, exclude: Collection[Instance] = (), usable: Callable[[Instance], bool] = lambda _i: True
    ) -> Instance | None:
        """The next instance in turn that may take a request now, or None; it is counted as the breaker's trial."""
        now = time.monotonic()
        count = len(self.instances)
        for step in range(count):
            index = (self._next + step) % count
            state = self._states[self.instances[index]]
            if state.instance in exclude or not self._admits(state, now) or not usable(state.instance):
                continue
            self._next = index + 1
            before = state.breaker.state
            state.breaker.take(now)
            self._changed(state, before)
            return state.instance
        return None

    def succeeded(self, instance: Instance) -> None:
        state = self._states[instance]
        before = state.breaker.state
        state.breaker.succeeded()
        self._changed(state, before)

    def failed(self, failure: UpstreamFailure) -> None:
        """A request the instance was sent failed. Only a failure that blames the instance counts against it; a
        refused request proves that the instance answers, and counts as a success."""
        if not failure.blames_instance:
            self.succeeded(failure.instance)
            return
        state = self._states[failure.instance]
        state.last_failure = failure
        before = state.breaker.state
        state.breaker.failed(time.monotonic())
        self._changed(state, before)

    def probed(self, instance: Instance, failure: UpstreamFailure | None) -> None:
        """The result of a `/health` probe: None when it succeeded."""
        state = self._states[instance]
        if (failure is None) != (state.probe is None):
            if failure is None:
                log.info("%s: /health answers again", instance.describe())
            else:
                log.warning("%s: /health failed, skipped until it answers: %s", instance.describe(), failure)
        state.probe = failure
        if failure is not None:
            state.last_failure = failure
        self._metrics.probed(instance.role, instance.name, failure is None)

    def why_skipped(self, instance: Instance) -> UpstreamFailure | None:
        """Why `pick` skips the instance now (its probe failed, or its breaker is open), else None."""
        state = self._states[instance]
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
    """Each pool's instances' `GET /health`, every `interval_s`, each probe bounded by `timeout_s`."""

    def __init__(self, client: httpx.AsyncClient, pools: Iterable[Pool], *, interval_s: float, timeout_s: float):
        self._client = client
        self._pools = tuple(pools)
        self._interval_s = interval_s
        self._timeout_s = timeout_s

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
                    probes.start_soon(self._probe, pool, instance)

    async def _probe(self, pool: Pool, instance: Instance) -> None:
        try:
            async with self._client.stream("GET", instance.url + "/health", timeout=self._timeout_s) as response:
                raw = await read_bounded(response)
        except httpx.HTTPError as exc:
            pool.probed(instance, failure_from_exception(instance, exc))
            return
        ok = response.status_code == 200
        pool.probed(instance, None if ok else failure_from_response(instance, response.status_code, raw))
