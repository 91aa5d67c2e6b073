"""Library hooks: where a user's own infrastructure (metrics, alerting, schedulers) plugs in.

Implement :class:`Hooks` (subclass it to inherit no-op defaults, or write any
object with some of its methods) and pass instances to the session. Hooks run
in every worker process, on every rank, in registration order; check
``rank == 0`` in ``on_rendezvous`` to act once per job. Every method takes
keyword arguments only, so new arguments can be added without breaking hooks
that accept ``**kwargs``.

A hook that raises is logged, with the hook's name and the event, and
training continues: a broken metrics exporter must not cost a training run.

Order of events in one worker process::

    on_start -> on_rendezvous -> [on_restore -> [on_world_change] | on_recovery]
      -> (on_step_end, [before_save -> after_save],
          [on_rendezvous -> on_recovery -> [on_world_change]])*
      -> [before_save -> after_save] -> on_end
    any exception from on_start on: on_failure, then the process group is destroyed

Under in-process recovery a worker lives through several process groups: each
re-formation dispatches ``on_rendezvous`` and ``on_recovery`` (also in a worker that
joined a live group and received its state).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from elastictrain.errors import ConfigError
from elastictrain.train.worker import WorkerContext

__all__ = ["EVENTS", "HookDispatcher", "Hooks"]

logger = logging.getLogger(__name__)


class Hooks(Protocol):
    """Callbacks of a training session; every method is optional and defaults to doing nothing."""

    def on_start(self, *, context: WorkerContext) -> None:
        """The session is starting in this worker, before the process group is formed."""

    def on_rendezvous(self, *, rank: int, world_size: int, restart_count: int) -> None:
        """The process group of this round is formed.

        Args:
            rank: This worker's global rank.
            world_size: Workers in this round.
            restart_count: Restarts after failures so far (membership changes do not count).
        """

    def on_restore(self, *, step: int, path: str) -> None:
        """A checkpoint was restored: training resumes after optimizer step ``step``."""

    def on_recovery(self, *, step: int, cause: str, generation: int, world_size: int, seconds: float) -> None:
        """The process group re-formed in place (in-process recovery) and training goes on after ``step``.

        Args:
            step: The committed step the group continues from (none is redone).
            cause: Why it re-formed (a peer failed, a node joined or left, ...).
            generation: The agent's generation number of the new group.
            world_size: Workers in the new group.
            seconds: How long the re-formation took on this worker.
        """

    def on_world_change(self, *, old_world_size: int, new_world_size: int) -> None:
        """The restored checkpoint was saved by ``old_world_size`` workers, and this round has ``new_world_size``.

        The global batch stays the same; each worker's share and gradient
        accumulation are recomputed. Adjust anything that depends on the
        world size here.
        """

    def before_save(self, *, step: int) -> None:
        """A checkpoint of ``step`` is about to be written."""

    def after_save(self, *, step: int, directory: str, seconds: float) -> None:
        """The checkpoint of ``step`` is committed under ``directory``, which took ``seconds``.

        With ``async_save`` it is handed to a background writer instead, and
        ``seconds`` is the time training was blocked. With ``overlap_save`` the
        copy to CPU memory goes on in the background too: ``seconds`` is the time
        ``save`` took, and the next optimizer step may still wait for the copy.
        """

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        """Optimizer step ``step`` (1 for the first) is applied and committed.

        Args:
            step: Optimizer steps completed since the run began.
            loss: The step's mean loss: over the global batch with the session's
                ``sync_loss``, else over this rank's samples.
            throughput: Samples per second of the whole job over this step.
        """

    def on_end(self, *, step: int) -> None:
        """Training finished normally after ``step`` optimizer steps (and the final checkpoint)."""

    def on_failure(self, *, error: BaseException) -> None:
        """An exception is leaving the session; the worker will exit and the agent decide what follows."""


EVENTS = ("on_start", "on_rendezvous", "on_restore", "on_recovery", "on_world_change", "before_save",
          "after_save", "on_step_end", "on_end", "on_failure")
"""Every event :class:`Hooks` defines."""

_EVENT_PREFIXES = ("on_", "before_", "after_")


def _name(hook: object) -> str:
    return getattr(hook, "name", None) or type(hook).__qualname__


def _method(hook: object, event: str) -> Any:
    """``hook``'s method for ``event``, or None when it has none or only inherits the no-op."""
    method = getattr(hook, event, None)
    if not callable(method) or getattr(type(hook), event, None) is getattr(Hooks, event):
        return None
    return method


class HookDispatcher:
    """Calls each registered hook's method for an event, in order, isolating failures.

    Args:
        hooks: Hook objects; any object with some of :class:`Hooks`' methods.

    Raises:
        ConfigError: A hook is a class, has none of the event methods, or has a method
            named like an event that is none (``on_step_ended``: it would never be called).
    """

    def __init__(self, hooks: Iterable[object] = ()) -> None:
        self._hooks: list[object] = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook: object) -> None:
        """Register ``hook`` after the others.

        Raises:
            ConfigError: ``hook`` is a class, has no event method, or has a method named
                like an event that is none.
        """
        if isinstance(hook, type):
            raise ConfigError(f"hook {hook.__qualname__} is a class; pass an instance")
        # A method named like an event but none of them is never called: most likely a typo.
        for name in dir(hook):
            if name.startswith(_EVENT_PREFIXES) and name not in EVENTS and callable(getattr(hook, name, None)):
                close = difflib.get_close_matches(name, EVENTS, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(f"hook {_name(hook)} has a method {name}, which is no event and would never be "
                                  f"called ({hint}events: {', '.join(EVENTS)}; rename a helper to start with _)")
        if not any(callable(getattr(hook, event, None)) for event in EVENTS):
            raise ConfigError(f"hook {_name(hook)} has none of the methods {', '.join(EVENTS)}")
        self._hooks.append(hook)

    @property
    def hooks(self) -> tuple[object, ...]:
        """The registered hooks, in call order."""
        return tuple(self._hooks)

    def wants(self, event: str) -> bool:
        """True if some hook has a method for ``event`` (lets callers skip computing its arguments)."""
        return any(_method(hook, event) is not None for hook in self._hooks)

    def dispatch(self, event: str, **kwargs: Any) -> None:
        """Call ``event`` on every hook that has it; a hook that raises is logged and skipped.

        Raises:
            ValueError: ``event`` is not one of :data:`EVENTS`.
        """
        if event not in EVENTS:
            raise ValueError(f"unknown hook event {event!r}; expected one of {EVENTS}")
        for hook in self._hooks:
            method = _method(hook, event)
            if method is None:
                continue
            try:
                method(**kwargs)
            except Exception:  # a hook's bug must not end the training run
                logger.warning("hook %s raised in %s; ignored, training continues", _name(hook), event,
                               exc_info=True)
