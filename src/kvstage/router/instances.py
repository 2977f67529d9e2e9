"""The router's upstream instances: who they are, which one serves the next request, and their TP sizes.

Owns:
- `Instance`: one vLLM server (name as registered with the bootstrap, role, base URL);
- `parse_instance`: the command line's `NAME=URL`;
- `RoundRobin`: the next instance of one role, in turn;
- `TPDirectory`: each instance's TP size, looked up from the bootstrap (`BootstrapClient.lookup_instance`) on one
  worker thread (the client is for one thread), cached and looked up again every `refresh_s`. A failed first
  lookup is remembered for `retry_s`, so that a bootstrap that is down costs one timeout per `retry_s`, not one
  per request; a failed refresh keeps the size last found.

Invariants: the cache holds at most one entry per configured instance. Called by `router.app`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvstage.errors import KVStageError
from kvstage.transport.bootstrap import BootstrapClient

Role = Literal["prefill", "decode"]

log = logging.getLogger("kvstage.router")


@dataclass(frozen=True)
class Instance:
    name: str
    role: Role
    url: str  # base URL without a trailing slash, e.g. http://10.0.0.5:8100

    def describe(self) -> str:
        return f"{self.role} instance {self.name!r} ({self.url})"


def parse_instance(spec: str, role: Role) -> Instance:
    """`NAME=URL` -> `Instance`; `ValueError` naming what is wrong."""
    name, sep, url = spec.partition("=")
    parts = urlsplit(url)
    if not sep or not name or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected NAME=http://HOST:PORT for a {role} instance, got {spec!r}")
    return Instance(name, role, url.rstrip("/"))


class RoundRobin:
    """The instances of one role, handed out in turn."""

    def __init__(self, instances: Iterable[Instance]) -> None:
        self.instances = tuple(instances)
        if not self.instances:
            raise ValueError("at least one instance is needed")
        self._next: Iterator[Instance] = itertools.cycle(self.instances)

    def pick(self) -> Instance:
        return next(self._next)


class InstanceUnavailable(KVStageError):
    """An instance's TP size could not be looked up: `reason` is "unregistered" (the bootstrap has no record of it)
    or "bootstrap" (the bootstrap did not answer, or refused the lookup)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TPDirectory:
    """TP size of each instance, from the bootstrap, cached; lookups run on one worker thread."""

    def __init__(
        self,
        bootstrap: str,
        *,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
        refresh_s: float = 30.0,
        secret: bytes | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self._client = BootstrapClient(bootstrap, timeout_s=timeout_s, secret=secret)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstage-router-bootstrap")
        self._retry_s = retry_s
        self._refresh_s = refresh_s
        self._tp: dict[Instance, tuple[int, float]] = {}  # TP size, when it is to be looked up again
        self._failed: dict[Instance, tuple[float, InstanceUnavailable]] = {}  # when to try again, why it failed

    async def tp_size(self, instance: Instance) -> int:
        """The instance's TP size; `InstanceUnavailable` with the reason when it was never found.

        A known size is looked up again every `refresh_s` (an instance restarted under its name may have another
        TP size); while the bootstrap cannot answer, the size last found is kept.
        """
        now = time.monotonic()
        known = self._tp.get(instance)
        if known is not None and now < known[1]:
            return known[0]
        failed = self._failed.get(instance)
        if known is None and failed is not None and now < failed[0]:
            raise failed[1]
        loop = asyncio.get_running_loop()
        try:
            tp = await loop.run_in_executor(self._executor, self._lookup, instance)
        except InstanceUnavailable as exc:
            if known is None:
                self._failed[instance] = (time.monotonic() + self._retry_s, exc)
                raise
            log.warning("%s: keeping TP size %d: %s", instance.describe(), known[0], exc)
            tp = known[0]
        if known is not None and tp != known[0]:
            log.info("%s: TP size %d, was %d", instance.describe(), tp, known[0])
        self._tp[instance] = (tp, time.monotonic() + self._refresh_s)
        self._failed.pop(instance, None)
        return tp

    def _lookup(self, instance: Instance) -> int:
        try:
            records = self._client.lookup_instance(instance.name, instance.role)
        except KVStageError as exc:
            raise InstanceUnavailable(f"bootstrap lookup failed: {exc}", "bootstrap") from exc
        if not records:
            raise InstanceUnavailable(f"not registered with the bootstrap {self.bootstrap}", "unregistered")
        return records[0].tp_size

    def close(self) -> None:
        self._executor.submit(self._client.close).result()
        self._executor.shutdown(wait=True)
