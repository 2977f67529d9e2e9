"""The router's circuit breaker and instance selection, without HTTP (time is the breaker's `now` argument)."""

from __future__ import annotations

from kvstage.router.health import Breaker, BreakerState, Pool
from kvstage.router.instances import Instance
from kvstage.router.metrics import RouterMetrics
from kvstage.router.upstream import UpstreamFailure

D0 = Instance("D0", "decode", "http://h:1")
D1 = Instance("D1", "decode", "http://h:2")


def test_a_breaker_opens_after_failures_in_a_row_and_closes_after_a_successful_trial() -> None:
    breaker = Breaker(failures_to_open=3, cooldown_s=10.0)
    breaker.failed(0.0)
    breaker.failed(0.0)
    breaker.succeeded()  # not in a row
    for _ in range(3):
        assert breaker.allows(1.0)
        breaker.failed(1.0)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(10.9)
    assert breaker.allows(11.0)
    breaker.take(11.0)  # the one trial
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows(11.0)
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and breaker.allows(11.0)


def test_a_failed_trial_opens_the_breaker_again_and_a_trial_without_verdict_lets_the_next_one_through() -> None:
    breaker = Breaker(failures_to_open=1, cooldown_s=5.0)
    breaker.failed(0.0)
    breaker.take(5.0)
    breaker.failed(5.0)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(9.9) and breaker.allows(10.0)
    breaker.take(10.0)  # this trial never reports back (its request was cancelled)
    assert not breaker.allows(14.9) and breaker.allows(15.0)


def _failure(instance: Instance, reason: str = "connect") -> UpstreamFailure:
    return UpstreamFailure(instance, reason, 503, "refused")


def test_the_pool_hands_out_in_turn_and_skips_instances_down_by_probe_or_breaker() -> None:
    metrics = RouterMetrics()
    pool = Pool("decode", [D0, D1], failures_to_open=1, cooldown_s=60.0, metrics=metrics)
    assert [pool.pick() for _ in range(3)] == [D0, D1, D0]
    assert pool.pick(exclude={D1}) == D0 and pool.pick(usable=lambda i: i != D1) == D0
    pool.probed(D0, _failure(D0))
    assert [pool.pick() for _ in range(2)] == [D1, D1]
    reason = pool.why_skipped(D0)
    assert reason is not None and reason.status == 503 and reason.reason == "connect"
    assert metrics.value("kvstage_router_instance_up", role="decode", instance="D0") == 0
    pool.probed(D0, None)
    pool.failed(_failure(D1, "http_5xx"))
    assert pool.breaker_state(D1) == "open" and pool.pick() == D0 and pool.pick() == D0
    assert metrics.value("kvstage_router_breaker_state", role="decode", instance="D1") == BreakerState.OPEN
    pool.failed(_failure(D0, "http_4xx"))  # a refused request: the instance answers
    assert pool.breaker_state(D0) == "closed"
    pool.probed(D0, _failure(D0))
    assert pool.pick() is None


def test_an_instance_that_joins_waits_for_its_first_probe_and_one_that_leaves_takes_its_series_along() -> None:
    metrics = RouterMetrics()
    pool = Pool("decode", [], failures_to_open=1, cooldown_s=60.0, metrics=metrics)
    assert pool.pick() is None
    assert pool.update([D0, D1]) == ([D0, D1], [])
    assert pool.pick() is None  # neither probed yet
    skipped = pool.why_skipped(D0)
    assert skipped is not None and skipped.detail == "not probed yet"
    pool.probed(D1, None)
    assert [pool.pick() for _ in range(2)] == [D1, D1]
    with pool.busy(D1):
        assert metrics.value("kvstage_router_instance_in_flight", role="decode", instance="D1") == 1
    assert pool.update([D0]) == ([], [D1])
    assert pool.pick() is None and pool.instances == (D0,)
    assert metrics.registry.get_sample_value("kvstage_router_instance_up", {"role": "decode", "instance": "D1"}) is None
    pool.succeeded(D1)  # a request that was open when D1 left ends: nothing to update, nothing raised
