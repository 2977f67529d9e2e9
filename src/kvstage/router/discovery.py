"""`kvstage router --discover`: the router's instances followed from the directory at runtime.

Owns `Discovery`: a background task that asks the directory (`transport.discovery.InstanceDirectory`, over the
bootstrap the router is given) for its listing of instances, hands every new listing to the router
(`Router.track`: instances join and leave its pools), and then waits for the next change, in a worker thread
(the directory's calls block). Instances publish their OpenAI URL with their ranks' records (the connector's
`url` setting); the router takes an instance once every rank of it is registered, and lets it go when its records
go (unregistered when vLLM stops, or expired `RECORD_TTL_S` after its last registration when it died).

Invariants: while the directory cannot be asked, the last listing stays (the instances still serve; only changes
go unseen), the trouble is logged when it starts and when it ends, and the request is retried every `poll_s`;
the directory's calls never run two at a time (one worker thread at a time, through a limiter of one). Called by
`router.core`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from kvstage.errors import KVStageError
from kvstage.router.config import RouterConfig
from kvstage.transport.discovery import InstanceDirectory, Listing, open_instance_directory

log = logging.getLogger("kvstage.router")

#: How long one wait for a change may block a worker thread (the router's shutdown abandons it at most this long).
WAIT_S = 5.0


class Discovery:
    def __init__(self, config: RouterConfig, on_listing: Callable[[Listing], Awaitable[None]]) -> None:
        self._config = config
        self._on_listing = on_listing
        self._directory: InstanceDirectory = open_instance_directory(
            config.bootstrap, timeout_s=config.bootstrap_timeout_s, poll_s=config.discover_poll_s, secret=config.secret
        )
        self._limiter = anyio.CapacityLimiter(1)
        self._failing = False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take the first listing (an empty one if the directory does not answer), report started, then follow."""
        known = await self._ask(self._directory.list_instances) or ()
        await self._on_listing(known)
        task_status.started()
        while True:
            listing = await self._ask(partial(self._directory.wait_changed, known, WAIT_S))
            if listing is None:
                await anyio.sleep(self._config.discover_poll_s)
                continue
            if listing != known:
                known = listing
                await self._on_listing(listing)

    async def _ask(self, call: Callable[[], Listing]) -> Listing | None:
        """The directory's answer, or None (logged when the trouble starts) when it cannot give one."""
        try:
            listing = await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._limiter)
        except KVStageError as exc:
            if not self._failing:
                where = self._config.bootstrap
                log.warning("discovery: %s does not answer, keeping the instances known: %s", where, exc)
            self._failing = True
            return None
        if self._failing:
            log.info("discovery: %s answers again", self._config.bootstrap)
        self._failing = False
        return listing
