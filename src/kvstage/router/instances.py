"""The router's upstream instances: who they are, and their TP sizes.

Owns:
- `Instance`: one vLLM server (name as registered with the bootstrap, role, base URL);
- `parse_instance`: the command line's `NAME=URL`;
- `TPDirectory`: each configured instance's TP size, looked up from the bootstrap off the request path.

How `TPDirectory` looks up: `run` (a background task for the router's life) looks every instance up at once when
it starts, then each known one again every `refresh_s` (an instance restarted under its name may have another TP
size; while the bootstrap cannot answer, the size last found is kept) and each one never found every `retry_s`.
The request path (`tp_size`) answers from what is known; for an instance never found, it fails at once while the
last lookup failed less than `retry_s` ago, else it joins the lookup under way or starts one: one lookup per
instance at a time (single flight), however many requests wait for it. Each lookup runs in a worker thread with a
directory client of its own (`kvstage bootstrap` or etcd, transport/directory.py; the client blocks, and is for one
thread), bounded by `timeout_s`: the event loop never waits on the bootstrap, and one instance's lookup never waits
for another's.

Instances found by discovery (`router.discovery`) come with their TP size and layout: `learn` records them, and
`forget` drops an instance that left; they are never looked up.

Invariants: at most one lookup per instance is under way; sizes and failures are kept for configured and
discovered instances only. Called by `router.proxy`, `router.health` and `router.discovery`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus

from kvstage.errors import KVStageError
from kvstage.transport.bootstrap import LayoutRecord, PeerRecord
from kvstage.transport.directory import open_directory

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


class InstanceUnavailable(KVStageError):
    """An instance's TP size could not be looked up: `reason` is "unregistered" (the bootstrap has no record of it)
    or "bootstrap" (the bootstrap did not answer, or refused the lookup)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def again(self) -> InstanceUnavailable:
        """A fresh copy to raise (one lookup's failure is raised in every request that waited for it)."""
        return InstanceUnavailable(str(self), self.reason)


@dataclass
class _Lookup:
    """One lookup under way, shared by everyone who waits for it."""

    done: anyio.Event = field(default_factory=anyio.Event)
    result: int | InstanceUnavailable | None = None  # None: cancelled (the router is stopping)


class TPDirectory:
    """TP size of each instance, from the bootstrap; `run` must be running for lookups to happen."""

    def __init__(
        self,
        bootstrap: str,
        instances: Iterable[Instance],
        *,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
        refresh_s: float = 30.0,
        secret: bytes | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.instances = tuple(dict.fromkeys(instances))
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._refresh_s = refresh_s
        self._secret = secret
        self._known: dict[Instance, int] = {}
        self._token_bytes: dict[Instance, int] = {}  # KV bytes of one token, all layers and heads, K and V
        self._failed: dict[Instance, tuple[float, InstanceUnavailable]] = {}  # last failure: when, why
        self._pending: dict[Instance, _Lookup] = {}
        self._tasks: TaskGroup | None = None

    def known(self, instance: Instance) -> int | None:
        """The TP size last found, or None."""
        return self._known.get(instance)

    def token_bytes(self, instance: Instance) -> int | None:
        """KV bytes of one token of the instance's model (from its layout), when known."""
        return self._token_bytes.get(instance)

    def learn(self, instance: Instance, tp_size: int, layout: LayoutRecord) -> None:
        """An instance found by discovery, with its TP size and layout (it is not looked up)."""
        self._known[instance] = tp_size
        self._token_bytes[instance] = layout.to_layout().bytes_per_token()
        self._failed.pop(instance, None)

    def forget(self, instance: Instance) -> None:
        """A discovered instance left."""
        self._known.pop(instance, None)
        self._token_bytes.pop(instance, None)
        self._failed.pop(instance, None)

    def failure(self, instance: Instance) -> InstanceUnavailable | None:
        """Why an instance never found cannot be used now (its last lookup failed less than `retry_s` ago)."""
        if instance in self._known or instance not in self._failed:
            return None
        when, why = self._failed[instance]
        return why if time.monotonic() - when < self._retry_s else None

    def last_failure(self, instance: Instance) -> InstanceUnavailable | None:
        """Why an instance never found was not found, however long ago its last lookup was."""
        if instance in self._known or instance not in self._failed:
            return None
        return self._failed[instance][1]

    async def tp_size(self, instance: Instance) -> int:
        """The instance's TP size; `InstanceUnavailable` with the reason when it was never found."""
        known = self._known.get(instance)
        if known is not None:
            return known
        failure = self.failure(instance)
        if failure is not None:
            raise failure.again()
        lookup = self._start(instance)
        await lookup.done.wait()
        if isinstance(lookup.result, InstanceUnavailable):
            raise lookup.result.again()
        if lookup.result is None:
            raise InstanceUnavailable("the lookup was cancelled: the router is stopping", "bootstrap")
        return lookup.result

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Look every instance up, report started, then keep each one fresh until cancelled."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            first = [self._start(i) for i in self.instances]
            for instance in self.instances:
                tasks.start_soon(self._keep, instance)
            for lookup in first:
                await lookup.done.wait()
            task_status.started()
            await anyio.sleep_forever()  # with no configured instance too: lookups may still start

    async def _keep(self, instance: Instance) -> None:
        while True:
            await self._start(instance).done.wait()
            await anyio.sleep(self._refresh_s if instance in self._known else self._retry_s)

    def _start(self, instance: Instance) -> _Lookup:
        """The lookup of `instance` under way, started now if there is none."""
        if self._tasks is None:
            raise RuntimeError("TPDirectory.run is not running")
        lookup = self._pending.get(instance)
        if lookup is None:
            lookup = self._pending[instance] = _Lookup()
            self._tasks.start_soon(self._look_up, instance, lookup)
        return lookup

    async def _look_up(self, instance: Instance, lookup: _Lookup) -> None:
        result: PeerRecord | InstanceUnavailable
        try:
            try:
                result = await anyio.to_thread.run_sync(self._lookup_blocking, instance, abandon_on_cancel=True)
            except InstanceUnavailable as exc:
                result = exc
            self._record(instance, result)
            lookup.result = result.tp_size if isinstance(result, PeerRecord) else result
        finally:  # cancelled too: whoever waits wakes up
            del self._pending[instance]
            lookup.done.set()

    def _record(self, instance: Instance, result: PeerRecord | InstanceUnavailable) -> None:
        known = self._known.get(instance)
        if isinstance(result, PeerRecord):
            size = result.tp_size
            if known is not None and size != known:
                log.info("%s: TP size %d, was %d", instance.describe(), size, known)
            if instance in self._failed:
                log.info("%s: TP size %d found", instance.describe(), size)
            self._known[instance] = size
            self._token_bytes[instance] = result.layout.to_layout().bytes_per_token()
            self._failed.pop(instance, None)
            return
        if instance not in self._failed:  # logged when the trouble starts, not on every retry
            kept = "" if known is None else f" (keeping TP size {known})"
            log.warning("%s: %s%s", instance.describe(), result, kept)
        self._failed[instance] = (time.monotonic(), result)

    def _lookup_blocking(self, instance: Instance) -> PeerRecord:
        client = open_directory(self.bootstrap, timeout_s=self._timeout_s, secret=self._secret)
        try:
            records = client.lookup_instance(instance.name, instance.role)
        except KVStageError as exc:
            raise InstanceUnavailable(f"bootstrap lookup failed: {exc}", "bootstrap") from exc
        finally:
            client.close()
        if not records:
            raise InstanceUnavailable(f"not registered with the bootstrap {self.bootstrap}", "unregistered")
        return records[0]
