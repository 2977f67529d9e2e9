"""The router's shared state: its instances, how it chooses among them, and what it shows about them.

Owns `Router`: the upstream HTTP client, a `Pool` per role, the `TPDirectory`, the `Prober`, the prefix index,
the discovery of instances (`--discover`), the concurrency slots and the metrics; `run` keeps the background
tasks going for the app's life. Also the responses every part of the router answers with (`error_response`, the
OpenAI error shape; `failure_response`), and `Route`, the choice of decode for one request.

Choosing (`policy`, docs/vllm.md "Routing policies"): `round_robin` takes each role's instances in turn; `load`
the least loaded (`Pool.load`: this router's requests open at the instance, plus vLLM's waiting queue where
fresh); `prefix` chooses decode by prefix affinity under a load bound (`select.by_prefix`) and prefill by load,
and when the decode chosen likely holds all of the prompt but less than a block, the request skips prefill.

Invariants: every instance it chooses is in its pool and may take a request now (probe, breaker, TP size); the
prefix index and the per-instance metrics hold only instances in the pools. Called by `router.proxy` and
`router.app`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import httpx
from anyio.abc import TaskStatus
from fastapi.responses import JSONResponse, Response

from kvstage.router.config import RouterConfig
from kvstage.router.discovery import Discovery
from kvstage.router.health import Pool, Prober
from kvstage.router.instances import Instance, Role, TPDirectory
from kvstage.router.metrics import RouterMetrics
from kvstage.router.select import LoadBound, PrefixIndex, PromptBlocks, by_prefix, first_in_turn, least_loaded
from kvstage.router.upstream import (
    JSONBody,
    UpstreamFailure,
    failure_from_exception,
    failure_from_response,
    read_bounded,
    upstream_headers,
)
from kvstage.router.vllm_metrics import VLLMLoad
from kvstage.transport.bootstrap import InstanceEntry

log = logging.getLogger("kvstage.router")

MODELS_BYTES = 2**20  # the most of an upstream /v1/models answer the router relays


def error_response(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The OpenAI error shape, `{"error": {"message", "type", "code"}}`, for an error of the router's own."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def failure_response(failure: UpstreamFailure) -> JSONResponse:
    return JSONResponse(failure.error_body(), status_code=failure.status)


def outcome_of(failure: UpstreamFailure) -> str:
    return {503: "decode_unavailable", 504: "decode_timeout", 502: "decode_error"}.get(failure.status, "client_error")


@dataclass(frozen=True, slots=True)
class Route:
    """The decode chosen for one attempt, and whether prefill is skipped (decode likely holds the prompt)."""

    decode: Instance
    skip_prefill: bool = False


class Router:
    """The request path's shared state and background tasks (`run`)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.prefill = self._pool("prefill", config.prefill)
        self.decode = self._pool("decode", config.decode)
        self.tp = TPDirectory(
            config.bootstrap,
            (*config.prefill, *config.decode),
            timeout_s=config.bootstrap_timeout_s,
            retry_s=config.tp_retry_s,
            refresh_s=config.tp_refresh_s,
            secret=config.secret,
        )
        self.prefixes = PrefixIndex()
        self._external_tokens: dict[Instance, float] = {}  # decode: the connector's loaded tokens, last read
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                config.read_timeout_s, connect=config.connect_timeout_s, pool=config.connect_timeout_s
            ),
            limits=httpx.Limits(max_connections=2 * config.max_concurrent, max_keepalive_connections=64),
        )
        # Probes have a client of their own: a router at its concurrency cap still probes every instance.
        self._probe_client = httpx.AsyncClient(timeout=config.health_timeout_s)
        self.prober = Prober(
            self._probe_client,
            (self.prefill, self.decode),
            interval_s=config.probe_interval_s,
            timeout_s=config.health_timeout_s,
            on_metrics=self._scraped,
        )
        self._discovery = Discovery(config, self.track) if config.discover else None
        self._slots = 0

    def _pool(self, role: Role, instances: Sequence[Instance]) -> Pool:
        config = self.config
        return Pool(
            role,
            instances,
            failures_to_open=config.breaker_failures,
            cooldown_s=config.breaker_cooldown_s,
            metrics=self.metrics,
            load_fresh_s=2 * config.probe_interval_s,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """TP lookups, discovery and probes until cancelled; started once each has had its first round (bounded by
        the bootstrap and probe timeouts)."""
        async with anyio.create_task_group() as background:
            if self._discovery is not None:
                await background.start(self._discovery.run)
            async with anyio.create_task_group() as first_rounds:
                first_rounds.start_soon(background.start, self.tp.run)
                first_rounds.start_soon(background.start, self.prober.run)
            task_status.started()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self._probe_client.aclose()

    # ---- membership -------------------------------------------------------------------------------------------

    async def track(self, listing: Sequence[InstanceEntry]) -> None:
        """Discovery's latest listing: the pools hold the configured instances plus every complete instance that
        published its URL; one that joins is probed at once and takes requests once its probe succeeds."""
        found: dict[str, list[Instance]] = {role: list(self.config.instances(role)) for role in ("prefill", "decode")}
        for entry in listing:
            if entry.complete and entry.url:
                instance = Instance(entry.instance, entry.role, entry.url.rstrip("/"))
                self.tp.learn(instance, entry.tp_size, entry.layout)
                found[entry.role].append(instance)
        async with anyio.create_task_group() as probes:
            for pool in (self.prefill, self.decode):
                joined, left = pool.update(found[pool.role])
                for instance in left:
                    log.info("%s left: no new requests", instance.describe())
                    self.tp.forget(instance)
                    self.prefixes.forget(instance)
                    self._external_tokens.pop(instance, None)
                for instance in joined:
                    log.info("%s joined (TP=%s): probing it", instance.describe(), self.tp.known(instance))
                    probes.start_soon(self.prober.probe, pool, instance)

    def _scraped(self, instance: Instance, load: VLLMLoad) -> None:
        """A decode's loaded-token counter, read again: the tokens since the last read, as KV bytes."""
        tokens, token_bytes = load.external_tokens, self.tp.token_bytes(instance)
        if instance.role != "decode" or tokens is None or token_bytes is None:
            return
        last = self._external_tokens.get(instance)
        self._external_tokens[instance] = tokens
        if last is not None and tokens >= last:  # a counter that went back: vLLM restarted, count from here
            self.metrics.kv_bytes.labels(instance.name).inc((tokens - last) * token_bytes)

    # ---- choosing ---------------------------------------------------------------------------------------------

    def take_slot(self) -> bool:
        if self._slots >= self.config.max_concurrent:
            return False
        self._slots += 1
        self.metrics.in_flight.set(self._slots)
        return True

    def release_slot(self) -> None:
        self._slots -= 1
        self.metrics.in_flight.set(self._slots)

    def usable(self, instance: Instance) -> bool:
        """Not known to be unregistered (or its bootstrap lookup failing) right now."""
        return self.tp.failure(instance) is None

    def pick_prefill(self) -> Instance | None:
        choose = first_in_turn if self.config.policy == "round_robin" else least_loaded
        return self._picked(self.prefill.pick((), self.usable, choose))

    def pick_decode(self, blocks: PromptBlocks, exclude: frozenset[Instance] = frozenset()) -> Route | None:
        """The decode for one attempt (and whether it skips prefill), among those not in `exclude`."""
        policy = self.config.policy
        if policy != "prefix":
            choose = first_in_turn if policy == "round_robin" else least_loaded
            decode = self._picked(self.decode.pick(exclude, self.usable, choose))
            return None if decode is None else Route(decode)
        held: dict[Instance, int] = {}

        def holds(instance: Instance) -> int:
            held[instance] = self.prefixes.held(instance, blocks)
            return held[instance]

        bound = LoadBound(self.config.prefix_balance, self.config.prefix_slack)
        choose_prefix = partial(by_prefix, key=blocks.key, ring=self.decode.ring, bound=bound)
        decode = self._picked(self.decode.pick(exclude, self.usable, choose_prefix, holds))
        if decode is None:
            return None
        count = held.get(decode, 0)
        return Route(decode, skip_prefill=count > 0 and blocks.uncached_units(count) < blocks.block_units)

    def _picked(self, instance: Instance | None) -> Instance | None:
        if instance is not None:
            self.metrics.routed.labels(instance.role, instance.name).inc()
        return instance

    def served(self, decode: Instance, blocks: PromptBlocks) -> None:
        """Decode answered the request: it now holds the prompt's blocks (prefix policy)."""
        if self.config.policy == "prefix" and decode in self.decode.instances:
            self.prefixes.record(decode, blocks)

    def unavailable(self, pool: Pool) -> UpstreamFailure:
        """A 503 naming why no instance of `pool` can take a request (the first one's reason)."""
        for instance in pool.instances:
            lookup = self.tp.failure(instance)
            if lookup is not None:
                return UpstreamFailure(instance, lookup.reason, 503, str(lookup))
            skipped = pool.why_skipped(instance)
            if skipped is not None:
                return skipped
        first = pool.instances[0] if pool.instances else Instance("(none)", pool.role, "")
        return UpstreamFailure(first, "unavailable", 503, f"no {pool.role} instance can take the request now")

    # ---- /v1/models and /health -------------------------------------------------------------------------------

    async def models(self, request_id: str) -> Response:
        """A decode instance's `/v1/models` (both roles serve the same model), read up to `MODELS_BYTES`."""
        decode = self.decode.pick((), self.usable)
        if decode is None:
            failure = self.unavailable(self.decode)
        else:
            answer = await self._models_of(decode, request_id)
            if isinstance(answer, Response):
                self.metrics.request_done("/v1/models", "ok")
                return answer
            failure = answer
            self.decode.failed(failure)
            self.metrics.upstream_error(decode.role, decode.name, failure.reason)
        log.warning("request %s: model list unavailable: %s", request_id, failure)
        self.metrics.request_done("/v1/models", outcome_of(failure))
        return failure_response(failure)

    async def _models_of(self, decode: Instance, request_id: str) -> Response | UpstreamFailure:
        headers = upstream_headers(request_id, self.config.upstream_api_key)
        url = decode.url + "/v1/models"
        try:
            async with self.client.stream("GET", url, headers=headers, timeout=self.config.health_timeout_s) as got:
                raw = await read_bounded(got, MODELS_BYTES + 1)
        except httpx.HTTPError as exc:
            return failure_from_exception(decode, exc)
        if got.status_code >= 400:
            return failure_from_response(decode, got.status_code, raw)
        if len(raw) > MODELS_BYTES:
            return UpstreamFailure(decode, "protocol", 502, f"/v1/models answer over {MODELS_BYTES} bytes")
        self.decode.succeeded(decode)
        return Response(raw, media_type=got.headers.get("content-type"))

    def health(self) -> tuple[int, JSONBody]:
        """Each instance's state as the router sees it; 200 while some decode instance is up."""
        states = [self._state(pool, i) for pool in (self.prefill, self.decode) for i in pool.instances]
        decode_up = any(s["up"] for s in states if s["role"] == "decode")
        status = "ok" if all(s["up"] for s in states) else "degraded" if decode_up else "down"
        return (200 if decode_up else 503), {"status": status, "policy": self.config.policy, "instances": states}

    def _state(self, pool: Pool, instance: Instance) -> JSONBody:
        state: JSONBody = {"name": instance.name, "role": instance.role, "url": instance.url}
        state["breaker"] = pool.breaker_state(instance)
        state["in_flight"] = pool.outstanding(instance)
        tp = self.tp.known(instance)
        if tp is not None:
            state["tp_size"] = tp
        lookup = self.tp.last_failure(instance)
        skipped = pool.why_skipped(instance)
        if lookup is not None:
            return {**state, "up": False, "reason": f"{lookup.reason}: {lookup}"}
        if skipped is not None:
            return {**state, "up": False, "reason": f"{skipped.reason}: {skipped.detail}"}
        return {**state, "up": True}
