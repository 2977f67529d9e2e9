"""The plugin as sglang loads it: through the entry point, into sglang's real argument parser and `get_kv_class`."""

from __future__ import annotations

import pytest

from kvstage.errors import ConfigError
from kvstage.integrations.sglang.version import SGLANG_VERSION, check_sglang_version


@pytest.fixture(scope="module")
def loaded() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what every sglang process does: runs the entry points of group sglang.srt.plugins


def test_argument_parser_accepts_kvstage(loaded: None) -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvstage"])
    assert args.disaggregation_transfer_backend == "kvstage"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvstage-typo"])


def test_scheduler_builds_kvstage_classes(loaded: None) -> None:
    """The scheduler turns the flag into `TransferBackend(...)`, and its queues ask `get_kv_class`, through the
    names their modules imported (prefill.py, decode.py, disagg_service.py)."""
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service

    from kvstage.integrations.sglang import conn

    backend = TransferBackend("kvstage")
    assert backend is TransferBackend.KVSTAGE and backend in list(TransferBackend)
    assert prefill.get_kv_class(backend, KVClassType.MANAGER) is conn.KVStageKVManager
    assert prefill.get_kv_class(backend, KVClassType.SENDER) is conn.KVStageKVSender
    assert decode.get_kv_class(backend, KVClassType.RECEIVER) is conn.KVStageKVReceiver
    assert disagg_service.get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is conn.KVStageBootstrapServer
    assert decode.get_kv_class(backend, KVClassType.KVARGS) is KVArgs
    assert prefill.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager  # others untouched


def test_register_is_idempotent(loaded: None) -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import TransferBackend

    from kvstage.integrations.sglang.plugin import register

    register()
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvstage") == 1
    assert [m.value for m in TransferBackend].count("kvstage") == 1


def test_other_versions_are_refused() -> None:
    check_sglang_version()  # the installed one is the pinned one
    with pytest.raises(ConfigError, match=rf"supports sglang {SGLANG_VERSION} only, but sglang 0.5.22 is installed"):
        check_sglang_version("0.5.22")
    with pytest.raises(ConfigError, match="no sglang is installed"):
        check_sglang_version("")
