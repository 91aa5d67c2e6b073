"""HookDispatcher: order, isolation of failing hooks, and argument checks."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from elastictrain.errors import ConfigError
from elastictrain.train.hooks import HookDispatcher, Hooks

pytestmark = pytest.mark.timeout(10)


class Log(Hooks):
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        self.calls.append(f"{self.name}:{step}")


class Raises(Hooks):
    def on_step_end(self, **kwargs: Any) -> None:
        raise RuntimeError("metrics backend down")


def test_hooks_run_in_registration_order_and_a_raising_one_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    hooks = HookDispatcher([Log("a", calls), Raises(), Log("b", calls)])
    with caplog.at_level(logging.WARNING, logger="elastictrain.train.hooks"):
        hooks.dispatch("on_step_end", step=1, loss=0.5, throughput=10.0)
        hooks.dispatch("on_step_end", step=2, loss=0.4, throughput=10.0)
    assert calls == ["a:1", "b:1", "a:2", "b:2"]
    assert [r.getMessage() for r in caplog.records] == [
        "hook Raises raised in on_step_end; ignored, training continues"] * 2


def test_duck_typed_hooks_need_only_the_methods_they_use() -> None:
    class OnlyEnd:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_end(self, *, step: int) -> None:
            self.steps.append(step)

    hook = OnlyEnd()
    hooks = HookDispatcher([hook])
    hooks.dispatch("on_start", context=None)
    hooks.dispatch("on_end", step=7)
    assert hook.steps == [7]
    assert hooks.wants("on_end") and not hooks.wants("on_step_end")


def test_inherited_no_op_defaults_are_not_wanted() -> None:
    assert not HookDispatcher([Raises()]).wants("on_restore")
    assert HookDispatcher([Raises()]).wants("on_step_end")


def test_a_class_or_an_object_without_hook_methods_is_refused() -> None:
    # ConfigError: the job fails at once, without a restart (before: a TypeError, 3 restarts)
    with pytest.raises(ConfigError, match="pass an instance"):
        HookDispatcher([Raises])
    with pytest.raises(ConfigError, match="none of the methods"):
        HookDispatcher([object()])


def test_a_method_named_like_an_event_that_is_none_is_refused() -> None:
    """Before, a misspelled event method was never called, silently, next to a valid one."""

    class Typo:
        def on_start(self, **kwargs: Any) -> None: ...

        def on_step_ended(self, **kwargs: Any) -> None: ...

    with pytest.raises(ConfigError, match="has a method on_step_ended, which is no event.*did you mean on_step_end"):
        HookDispatcher([Typo()])

    class Helper:
        def on_start(self, **kwargs: Any) -> None: ...

        def _on_internal(self) -> None: ...  # private: not taken for an event

        def compute(self) -> None: ...

    assert len(HookDispatcher([Helper()]).hooks) == 1


def test_unknown_events_are_refused() -> None:
    with pytest.raises(ValueError, match="on_stpe_end"):
        HookDispatcher().dispatch("on_stpe_end")
