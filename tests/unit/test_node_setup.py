"""What a node sets up before its agent imports torch (``elastictrain.node_setup``)."""

from __future__ import annotations

import pytest

from elastictrain import node_setup


@pytest.mark.parametrize(("idle_ticks", "spare"), [(20, True), (16, True), (15, False), (10, False), (0, False)])
def test_the_forkserver_starts_before_torch_only_with_more_than_one_idle_core(
        monkeypatch: pytest.MonkeyPatch, idle_ticks: int, spare: bool) -> None:
    # 2 cores, 20 ticks of CPU time in the window: the agent's own import takes one core, the
    # forkserver's must find another mostly idle.
    readings = iter([(1000, 5000), (1000 + idle_ticks, 5020)])
    monkeypatch.setattr(node_setup, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(node_setup.os, "cpu_count", lambda: 2)
    assert node_setup.core_to_spare(window=0) is spare


def test_cpu_times_are_read_from_proc_stat() -> None:
    idle, total = node_setup._cpu_times()  # noqa: SLF001
    assert 0 < idle <= total
