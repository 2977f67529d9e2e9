"""Exception hierarchy of kvstage.

Owns: every exception type kvstage raises on purpose. Callers catch `KVStageError` to handle all of them.
Invariant: each error carries a message that names the offending setting or value and, where one exists,
the fix. Used by every layer; imports nothing from kvstage.
"""

from __future__ import annotations


class KVStageError(Exception):
    """Base class of every error kvstage raises on purpose."""


class ConfigError(KVStageError, ValueError):
    """A configuration that kvstage cannot run with; the message names the setting and the fix."""


class CompatibilityError(ConfigError):
    """Two peers disagree on something that must match (layout, dtype, page size, ...)."""


class InvalidRequest(KVStageError, ValueError):
    """A per-request argument (token counts, prefix, pages) that is out of range for its room."""


class StagingOversized(KVStageError):
    """An allocation larger than the whole staging ring: it can never fit, so its room fails at once."""

    def __init__(self, nbytes: int, capacity_bytes: int) -> None:
        super().__init__(
            f"staging request of {nbytes} bytes exceeds the ring capacity of {capacity_bytes} bytes; "
            "use a smaller chunk_tokens or a larger staging ring"
        )
        self.nbytes = nbytes
        self.capacity_bytes = capacity_bytes


class ProtocolError(KVStageError):
    """A frame or message that violates the wire protocol (bad type, out-of-range field, too large)."""


class TransportError(KVStageError):
    """A data or control transport failed; scoped to the room(s) that used it."""


class TransportUnavailable(TransportError):
    """A transport backend whose Python package is not installed; the message names the pip extra."""


class KVPoolExhausted(KVStageError):
    """A KV pool has fewer free pages than a request needs; nothing was allocated."""

    def __init__(self, requested: int, free: int, num_pages: int) -> None:
        super().__init__(
            f"KV pool exhausted: {requested} pages requested, {free} of {num_pages} free; "
            "admit fewer requests or configure more pages"
        )
        self.requested = requested
        self.free = free
        self.num_pages = num_pages
