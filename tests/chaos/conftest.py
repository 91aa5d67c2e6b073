"""Chaos tests: soak runs (marked ``soak``) run only when asked for with ``pytest -m soak``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="soak run: select it with `pytest -m soak`")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)
