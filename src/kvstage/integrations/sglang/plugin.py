"""The sglang plugin: what sglang's plugin loader runs to make `--disaggregation-transfer-backend kvstage` work.

Owns `register`, the entry point of group `sglang.srt.plugins` (pyproject.toml). sglang 0.5.23 calls every such
entry point from `load_plugins()` in each process (the launcher before it parses arguments, the scheduler, the
engine), then applies the hooks they registered. `register`:

1. refuses any sglang but the pinned one (version.py), by raising: sglang logs the error with its message and the
   `kvstage` choice stays unknown to its argument parser;
2. adds "kvstage" to the argument parser's choices (`add_disagg_transfer_backend_choices`);
3. adds a `KVSTAGE` member to sglang's `TransferBackend` enum, which the scheduler builds from the flag
   (`TransferBackend(server_args.disaggregation_transfer_backend)`). sglang 0.5.23 has no way to register a
   member, so it is added the way `Enum` stores members (its member, name and value maps);
4. wraps `get_kv_class` (a closed if/elif over the enum in 0.5.23, with no registry) with an AROUND hook in
   sglang's `HookRegistry`: for `TransferBackend.KVSTAGE` it answers kvstage's classes (conn.py), for every
   other backend it calls sglang's own function. `HookRegistry.apply_hooks` also rebinds the modules that
   imported `get_kv_class` by name.

Invariants: idempotent (a second call changes nothing); imports sglang only inside `register`, so importing this
module never needs sglang; conn.py, which needs sglang and torch, is imported only when sglang asks for a class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstage.integrations.sglang.version import check_sglang_version

log = logging.getLogger(__name__)

BACKEND_NAME = "kvstage"
MEMBER_NAME = "KVSTAGE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def register() -> None:
    """The `sglang.srt.plugins` entry point. Raises `ConfigError` on any sglang but the pinned version."""
    check_sglang_version()
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND_NAME])
    add_enum_member(utils.TransferBackend, MEMBER_NAME, BACKEND_NAME)
    if not any(hook is kv_class_hook for _, hook, _ in HookRegistry._hooks.get(GET_KV_CLASS, [])):
        HookRegistry.register(GET_KV_CLASS, kv_class_hook, HookType.AROUND)
    log.info("kvstage: transfer backend %r registered with sglang", BACKEND_NAME)


def add_enum_member(enum_cls: Any, name: str, value: str) -> None:
    """Add member `name` = `value` to `enum_cls` in place (no-op when it is there), so `enum_cls(value)`,
    `enum_cls[name]`, `enum_cls.name` and iteration all see it."""
    if value in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)


def kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """sglang's `get_kv_class`, answering kvstage's classes for the kvstage backend."""
    if getattr(transfer_backend, "value", None) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from kvstage.integrations.sglang.conn import kv_class

    return kv_class(class_type.value, original)
