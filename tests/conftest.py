"""Suite-wide options: long soak runs are opt-in (`--run-slow`), so `make test` stays within its budget."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow (soak runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="soak run: pass --run-slow to include it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
