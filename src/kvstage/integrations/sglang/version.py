"""The one sglang version this integration is written and tested against, and the check that refuses any other.

Owns `SGLANG_VERSION` and `check_sglang_version`. sglang's disaggregation internals (the queues that call a
transfer backend, `get_kv_class`, the `TransferBackend` enum, the aux metadata buffers) change from release to
release without a stable API, so the plugin refuses every version but the pinned one with an error that names
both versions and how to install the right one. Pure; called by plugin.py at registration and by conn.py at import.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

from kvstage.errors import ConfigError

SGLANG_VERSION: Final = "0.5.23"


def installed_sglang_version() -> str | None:
    """The version of the installed sglang distribution, or None when none is installed."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(found: str | None = None) -> None:
    """Raise `ConfigError` unless sglang `SGLANG_VERSION` is installed (`found` overrides the lookup, for tests)."""
    found = installed_sglang_version() if found is None else found
    if found == SGLANG_VERSION:
        return
    what = f"sglang {found} is installed" if found else "no sglang is installed"
    raise ConfigError(
        f"kvstage's sglang transfer backend supports sglang {SGLANG_VERSION} only, but {what}; "
        f"install it with `pip install --no-deps sglang=={SGLANG_VERSION}` (docs/sglang.md)"
    )
