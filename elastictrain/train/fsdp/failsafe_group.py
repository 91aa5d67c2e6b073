"""A process group for FSDP2's collectives that records a collective failure instead of raising it
(TorchFT's ``ErrorSwallowingProcessGroupWrapper``): :class:`FailsafeGroup`, :class:`SwallowedFailure`.

Under in-process recovery a sharded model's forward runs collectives (each unit's all-gather) in
the user's code: ``logits = session.model(x)``. A peer lost meanwhile would fail the all-gather
there, and the error would leave the user's loop and end the worker. So the mesh a sharded session
trains on is made of these groups (:func:`~elastictrain.train.fsdp.mesh.build_mesh` with
``failures=``): while a step's micro-batches run (:meth:`SwallowedFailure.swallowing`), a collective
that fails as a peer dies or hangs (:func:`~elastictrain._torch_compat.is_collective_failure`) is
recorded in the :class:`SwallowedFailure` every group of the mesh shares, and it and every later
collective of those groups return completed work without communicating: their output buffers hold
whatever they held. The forward and backward run to the end on that garbage, and the step loop,
at the step's end, finds the failure recorded, discards the step and re-forms the group, as for
a failed gradient reduction. Inside the backward the step loop runs (:meth:`SwallowedFailure.abandoning`,
whose caller catches what leaves it) a collective that fails, or comes after a failure, raises
:class:`AbandonedStep` instead: the rest of a doomed backward, a step's compute on garbage, is not run
while the group waits to re-form (and a replacement shares the cores).

Not swallowed: an error raised as a collective is issued that is not typed as a failed collective
(torch's ``DistError`` family): a bad argument (``ProcessGroupGloo::allgather: invalid tensor
size``, which names gloo); any error outside the window (the step's boundary: clipping, the
optimizer step, checkpoints, the gathering of full weights), which raises as on the group
underneath. Errors of the user's own code are never seen here.

A wait gloo does not end: once a rank's connections are shut down under a collective stuck on a
peer that is gone (the generation's stuck callback), gloo fails the collective's pending receives
but not a send it had half written to that peer (its transport signals no error to a send in
flight), which waits out the group's timeout (a worker SIGKILLed mid-transfer held a survivor 60 s).
So a step's wait for a collective on the CPU (gloo) happens on a thread of its own, and the step
waits for that thread or for :meth:`SwallowedFailure.cut` (the stuck callback's last act): the
failure is recorded and the wait returns as for any failure, while gloo's thread stays in the send
until its timeout. The waiting thread holds the group till then: a group dropped while gloo's
thread runs one of its collectives joins that thread as it is destroyed, which would hold up the
rank leaving the generation for the rest of the timeout (seen: 39 s of 40).

Each group wraps a group that exists (the default group for fsdp, hsdp's sub-groups) and shares
its connections: leaving the generation severs them as before. It is made by ``new_group`` with
a backend registered here (``DeviceMesh.from_group`` needs a group torch registered by name), and
destroyed with the default group.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastictrain._torch_compat import COLLECTIVE_ERRORS, is_collective_failure, python_group_name
from elastictrain.errors import ConfigError

__all__ = ["BACKEND", "AbandonedStep", "FailsafeGroup", "SwallowedFailure", "failsafe_group"]

logger = logging.getLogger(__name__)

BACKEND = "elastictrain_failsafe"
"""The name of the backend :func:`failsafe_group` makes its groups with (``new_group(backend=...)``)."""

_COLLECTIVES = (
    "_allgather_base", "_reduce_scatter_base", "all_gather_single", "all_gather_single_coalesced",
    "all_to_all_single", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "allreduce",
    "allreduce_coalesced", "alltoall", "alltoall_base", "barrier", "broadcast", "gather", "recv",
    "recv_anysource", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "scatter", "send",
)
"""torch 2.13's ``ProcessGroup`` operations that communicate: each goes through :meth:`FailsafeGroup._run`."""


class AbandonedStep(dist.DistError):
    """Raised by a collective inside :meth:`SwallowedFailure.abandoning` once a collective failure
    is recorded (caused by it): a failed collective, the step is discarded."""


class SwallowedFailure:
    """The collective failure the groups of one mesh recorded instead of raising, and whether they
    swallow one now. One per generation of the group; the step loop reads it at each step's end."""

    def __init__(self) -> None:
        self._failure: BaseException | None = None
        self._active = False
        self._abandon = False
        self._waiting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self._lock = threading.Lock()
        self._cut = False
        self._wakes: set[threading.Event] = set()
        self._waiter: queue.SimpleQueue[_Waited | None] | None = None

    @property
    def failure(self) -> BaseException | None:
        """The first collective failure swallowed, or None."""
        return self._failure

    @property
    def active(self) -> bool:
        """Whether a collective failure is swallowed now (inside :meth:`swallowing`)."""
        return self._active

    @contextlib.contextmanager
    def swallowing(self, waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                   ) -> Iterator[None]:
        """Swallow collective failures inside: a step's micro-batches (the user's forward and backward).

        Args:
            waiting: Entered around each wait for a collective inside (the step loop's marker of a
                step's own collectives: a rank waiting there for its peers is not hung in its step).
        """
        before, self._active = self._active, True
        outer, self._waiting = self._waiting, waiting or contextlib.nullcontext
        try:
            yield
        finally:
            self._active, self._waiting = before, outer

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        """Inside :meth:`swallowing`, around code whose caller catches :class:`AbandonedStep` (the
        step loop's backward): a collective that fails there, or comes after a recorded failure,
        raises it instead of returning completed work, so the rest of that code is not run.
        What it leaves half done (FSDP2's unsharded units) is for the caller to reset."""
        before, self._abandon = self._abandon, True
        try:
            yield
        finally:
            self._abandon = before

    def skipped(self, operation: str, result: list[Any]) -> dist.Work:
        """A collective not run after the recorded failure: completed work holding ``result``, or
        :class:`AbandonedStep` raised inside :meth:`abandoning`."""
        if self._abandon:
            raise AbandonedStep(f"{operation} abandoned: an earlier collective of the step failed ({self._failure})"
                                ) from self._failure
        return _DoneWork(result)

    def waiting(self) -> contextlib.AbstractContextManager[Any]:
        """What :meth:`swallowing` was given to enter around a wait for a collective."""
        return self._waiting()

    def record(self, error: BaseException) -> None:
        """Record ``error``; the groups communicate no more (the first one recorded is kept)."""
        with self._lock:
            if self._failure is None:
                self._failure = error
                logger.warning("a collective of the sharded model failed inside the step (%s): its collectives "
                               "return at once from now on, and the step is discarded at its end", error)

    def cut(self) -> None:
        """This rank's connections under the groups were shut down, a collective stuck on a peer that
        is gone (the generation's stuck callback, on another thread): record the failure and end the
        waits for collectives on the CPU now, those in progress and those to come, which gloo may
        not end (see the module docstring)."""
        self.record(dist.DistNetworkError("a collective is stuck on a peer that is gone: this rank shut down its "
                                          "connections"))
        with self._lock:
            self._cut = True
            wakes = list(self._wakes)
        for woken in wakes:
            woken.set()

    def close(self) -> None:
        """The generation is left: the waiting thread ends (once gloo ends a wait a cut left it in)."""
        with self._lock:
            if self._waiter is not None:
                self._waiter.put(None)
                self._waiter = None

    def wait_done_or_cut(self, work: dist.Work, group: dist.ProcessGroup) -> bool:
        """Wait until ``work`` (a collective of ``group`` on the CPU) completes, failed or not: True;
        or until :meth:`cut`: False, at once for a work waited for after the cut. Its wait in C++
        runs on a thread of this object's (gloo's works do not all complete a future), which a cut
        leaves behind, blocked until gloo's timeout and holding ``group`` till then (see the module
        docstring), a work waited for after the cut included."""
        woken, done = threading.Event(), threading.Event()
        with self._lock:
            cut = self._cut
            if not cut:
                self._wakes.add(woken)
            if self._waiter is None:
                self._waiter = queue.SimpleQueue()
                threading.Thread(target=_wait_each, args=(self._waiter,), name="elastictrain-collective-wait",
                                 daemon=True).start()
            self._waiter.put((work, group, done, woken))
        if cut:
            return False
        try:
            woken.wait()
        finally:
            with self._lock:
                self._wakes.discard(woken)
        return done.is_set()


_Waited = tuple[dist.Work, dist.ProcessGroup, threading.Event, threading.Event]
"""A work to wait for on the waiting thread, its group, and the events it sets once done."""


def _wait_each(works: queue.SimpleQueue[_Waited | None]) -> None:
    """A waiting thread's loop: wait for each work put on ``works`` (its failure is the waiter's to
    raise), its group held meanwhile, then set its two events (done, then the waiter's wake-up);
    until None comes."""
    while (waited := works.get()) is not None:
        work, group, done, woken = waited
        del waited
        try:
            work.wait()
        except Exception:  # noqa: BLE001, S110 - raised again by the waiter's own wait, on its thread
            pass
        del work, group
        done.set()
        woken.set()


class _DoneWork(dist.Work):
    """Work that is complete: a collective skipped, or one whose failure was swallowed."""

    def __init__(self, result: list[Any]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._result)
        return future


class _SwallowingWork(dist.Work):
    """A collective's work whose failure, when it waits, is recorded (a failed collective) instead of
    raised; on the CPU its wait ends when the group is cut (:meth:`SwallowedFailure.cut`)."""

    def __init__(self, work: dist.Work, failures: SwallowedFailure, result: list[Any],
                 group: FailsafeGroup | None) -> None:
        super().__init__()
        self._work, self._failures, self._result = work, failures, result
        self._group = group
        """The group where a cut ends the wait (a collective on the CPU), else None."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            with self._failures.waiting():
                completed = self._wait(timeout)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            self._failures.record(exc)
            completed = False
        if not completed:
            self._failures.skipped("wait", self._result)  # raises inside abandoning()
        return True

    def _wait(self, timeout: timedelta | None) -> bool:
        """Wait for the work (raising its failure): True, or False when a cut ended the wait first."""
        if timeout is not None:
            self._work.wait(timeout)
        elif self._group is None:
            self._work.wait()
        elif self._failures.wait_done_or_cut(self._work, self._group):
            self._work.wait()  # done: raises its failure, if any
        else:
            return False
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        # A future is waited on in C++ (Future.wait, torch.futures.wait_all), where no marker can be
        # entered: a rank blocked there for a late peer would pass for hung in its step. So the wait
        # happens here, marked as in wait(), and the future handed back is complete (on gloo, code
        # between get_future() and the future's wait no longer overlaps the collective; on NCCL,
        # wait() only orders the current stream after it, as the future's wait would).
        self.wait()
        if self._failures.failure is None:
            return self._work.get_future()
        return _DoneWork(self._result).get_future()


class FailsafeGroup(dist.ProcessGroup):
    """``inner``'s collectives, a failure of which is recorded in ``failures`` while it swallows
    (see the module docstring); made by :func:`failsafe_group`, not directly.

    Args:
        inner: The group that communicates (gloo, or NCCL's).
        failures: Shared by every group of one mesh.
    """

    def __init__(self, inner: dist.ProcessGroup, failures: SwallowedFailure) -> None:
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]  # the stub lacks this overload
        self.inner = inner
        self.failures = failures

    @property
    def group_name(self) -> str:  # type: ignore[override]  # a property in torch's stub too
        """The name ``new_group`` registered this group under (``DeviceMesh`` resolves it by name)."""
        return python_group_name(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """See base class."""
        return BACKEND

    def name(self) -> str:
        """See base class."""
        return BACKEND

    def _run(self, operation: str, *args: Any) -> dist.Work:
        """``inner``'s ``operation``, its failure recorded instead of raised while swallowing."""
        failures = self.failures
        failed = failures.failure
        result = _outputs(args)
        if failed is not None:
            if failures.active:
                return failures.skipped(operation, result)
            raise dist.DistError(f"{operation} skipped: an earlier collective of this group failed ({failed})") \
                from failed
        try:
            work = getattr(self.inner, operation)(*args)
        except COLLECTIVE_ERRORS as exc:  # only a typed failure: a bad argument names gloo as well
            if not failures.active:
                raise
            failures.record(exc)
            return failures.skipped(operation, result)
        if not failures.active:
            return work
        return _SwallowingWork(work, failures, result, self if _on_cpu(result) else None)


def _operation(name: str) -> Callable[..., dist.Work]:
    def run(self: FailsafeGroup, *args: Any) -> dist.Work:
        return self._run(name, *args)
    run.__name__ = run.__qualname__ = name
    run.__doc__ = f"``inner.{name}``, see :class:`FailsafeGroup`."
    return run


for _name in _COLLECTIVES:
    setattr(FailsafeGroup, _name, _operation(_name))


def _outputs(args: tuple[Any, ...]) -> list[Any]:
    """What a completed work's future holds: the operation's output tensors (its first argument)."""
    first = args[0] if args else None
    if isinstance(first, list):
        return first
    return [first] if isinstance(first, torch.Tensor) else []


def _on_cpu(result: list[Any]) -> bool:
    """Whether a collective with outputs ``result`` runs on the CPU (gloo's), where a cut ends its
    wait. NCCL's wait is left as it is: it only orders the stream, and an abort ends it."""
    tensors = [t for item in result for t in (item if isinstance(item, list) else [item])]
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)


_pending = threading.local()


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> FailsafeGroup:
    """The backend's creator: the group :func:`failsafe_group` is making."""
    made: FailsafeGroup | None = getattr(_pending, "group", None)
    if made is None or made.rank() != rank or made.size() != size:
        raise ConfigError(f"backend {BACKEND!r} wraps a group elastictrain names; make it with failsafe_group()")
    _pending.group = None
    return made


if not hasattr(dist.Backend, BACKEND.upper()):  # register_backend sets it; a second call raises
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def failsafe_group(inner: dist.ProcessGroup, failures: SwallowedFailure,
                   timeout: timedelta | None = None) -> FailsafeGroup:
    """A :class:`FailsafeGroup` over ``inner``, recording into ``failures``; a collective of
    ``inner``'s ranks (``new_group`` with a group-local synchronization): each of them calls it,
    in the same order as the other groups it makes, and no other rank.

    Raises:
        ConfigError: torch did not adopt the group.
    """
    _pending.group = FailsafeGroup(inner, failures)
    try:
        made = dist.new_group(dist.get_process_group_ranks(inner), timeout=timeout, backend=BACKEND,
                              use_local_synchronization=True)
    finally:
        _pending.group = None
    if not isinstance(made, FailsafeGroup):
        raise ConfigError(f"new_group(backend={BACKEND!r}) gave a {type(made).__name__}, not the failsafe group")
    return made
