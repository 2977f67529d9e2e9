"""kvstage as an sglang transfer backend: `--disaggregation-transfer-backend kvstage` (docs/sglang.md).

Modules, bottom up: version.py (the one sglang version, and the check refusing others), settings.py (`KVSTAGE_*`
environment settings), kvargs.py (sglang's `KVArgs` -> kvstage's layout and `EngineKV`, and its aux rows),
bootstrap.py (the per-prefill mailbox: prefill's instance info), manager.py (one rank's agent and background work),
rooms.py (one request's sender or receiver as kvstage room calls; the aux row rides kvstage's protocol), conn.py
(sglang's base classes over them; imports sglang), plugin.py (the `sglang.srt.plugins` entry point). Importing this
package imports neither sglang nor torch.
"""

from kvstage.integrations.sglang.version import SGLANG_VERSION, check_sglang_version

__all__ = ["SGLANG_VERSION", "check_sglang_version"]
