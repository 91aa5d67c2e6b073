"""The rank-0 progress line."""

from __future__ import annotations

import io

import pytest

from elastictrain.train.progress import ProgressHook, progress_wanted


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_only_on_rank_0_of_a_terminal_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert progress_wanted(0, _Tty())
    assert not progress_wanted(1, _Tty())
    assert not progress_wanted(0, io.StringIO())
    monkeypatch.setenv("ELASTICTRAIN_PROGRESS", "0")
    assert not progress_wanted(0, _Tty())


def test_progress_line_has_step_loss_throughput_and_world_size() -> None:
    out = _Tty()
    hook = ProgressHook(total=40, stream=out)
    hook.on_rendezvous(rank=0, world_size=3, restart_count=1)
    hook.on_step_end(step=10, loss=0.5, throughput=1234.0)
    hook.on_end(step=40)
    text = out.getvalue()
    assert text.startswith("\r[#####...............] 10/40  loss 0.5000  1,234 samples/s  world 3")
    assert text.endswith("\n")


def test_both_spellings_of_no_progress_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from elastictrain.train.progress import progress_wanted

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("ELASTICTRAIN_PROGRESS", raising=False)
    monkeypatch.setenv("ELASTICTRAIN_NO_PROGRESS", "1")  # what --no-progress's help names
    assert not progress_wanted(0, Tty())
    monkeypatch.setenv("ELASTICTRAIN_NO_PROGRESS", "0")
    assert progress_wanted(0, Tty())


def test_a_log_line_prints_above_the_progress_line_not_glued_to_it() -> None:
    import io
    import logging

    from elastictrain.train.progress import ProgressHook

    terminal = io.StringIO()
    log = logging.getLogger("elastictrain.test_progress_collision")
    handler = logging.StreamHandler(terminal)
    log.addHandler(handler)
    log.propagate = False
    try:
        hook = ProgressHook(total=10, stream=terminal)
        hook.on_step_end(step=1, loss=0.5, throughput=100.0)
        log.warning("a log line")
        hook.on_end(step=10)
    finally:
        log.removeHandler(handler)
    # What a terminal shows: each \r returns to the line's start, so take what follows the last one.
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in terminal.getvalue().split("\n")]
    assert shown[0] == "a log line"
    assert shown[1].startswith("[##") and "1/10" in shown[1]
    assert handler.stream is terminal  # given back at the end
