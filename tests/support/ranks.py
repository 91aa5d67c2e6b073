"""Run ranks of one gloo job in processes of their own and wait for them: a worker script per rank
(:func:`run_ranks`), or functions started from :func:`rank_context` that report on a queue
(:func:`next_report`)."""

from __future__ import annotations

import faulthandler
import io
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

EXIT_DRAIN_S = 5.0
"""How long a report may still be on its way once the process that sent it has exited (a
``multiprocessing`` queue's feeder thread flushes it as the process exits)."""


def run_ranks(script: str, world: int, *args: str, timeout: float = 160) -> None:
    """Start ``script RANK *args`` for every rank of ``world``, wait for all of them (killing what is
    left after ``timeout`` s), and fail with the tail of each one's output unless all exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(rank), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(o[-4000:] for o in outputs)


RANK_PRELOAD = ["elastictrain.launch._worker_preload", "elastictrain.train"]
"""What the ranks' forkserver imports once (see :func:`rank_context`): what a node's worker forkserver
does (torch.distributed and what building a DDP model imports: torch._dynamo, 1.3 s of CPU a rank
here), and the training package."""

_SERVER = multiprocessing.forkserver.ForkServer()
"""The ranks' forkserver: their own, not multiprocessing's, which anything in the test process may
start first without :data:`RANK_PRELOAD` (torch's ``start_processes``, the launcher's node setup)
or stop (a test SIGSTOPs it); every rank forked from it then imported torch again."""
_SERVER.set_forkserver_preload(RANK_PRELOAD)


class _RankPopen(multiprocessing.popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, forking from :data:`_SERVER`."""

    def _launch(self, process_obj: Any) -> None:
        # Popen._launch of CPython 3.10-3.13, with _SERVER for the module's one server.
        prep_data = multiprocessing.spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.context.reduction.dump(prep_data, buf)
            multiprocessing.context.reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process
        self.finalizer = multiprocessing.util.Finalize(self, multiprocessing.util.close_fds,
                                                       (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(self.sentinel)


class RankProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the ranks' forkserver that writes its output to :attr:`log`: the server's
    own stdout and stderr are those of the test that started it (pytest's capture of that test)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _RankPopen(process_obj)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fd, self.log = tempfile.mkstemp(prefix="rank-", suffix=".log")
        os.close(fd)
        weakref.finalize(self, os.unlink, self.log)

    def run(self) -> None:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND)
        for stream in (1, 2):
            os.dup2(fd, stream)
        os.close(fd)
        faulthandler.enable(file=2, all_threads=True)  # SIGABRT: every thread's stack in the log (_give_up_on)
        super().run()

    def output(self, limit: int = 4000) -> str:
        """The last ``limit`` characters this process wrote."""
        try:
            return Path(self.log).read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class _RankContext(multiprocessing.context.ForkServerContext):
    Process = RankProcess  # type: ignore[assignment]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The context to start a test's ranks in: each a fork of one server per test process that has
    imported torch (:data:`RANK_PRELOAD`), as the launcher forks its workers, not a fresh interpreter
    importing torch again (2-3 s of CPU a rank, the most of what these tests cost). Its processes
    are :class:`RankProcess`es. The server is the ranks' own (:data:`_SERVER`), whatever else in the
    test process uses multiprocessing's.

    The server starts at the first rank and keeps the environment of that moment: a rank sets what
    it needs of ``os.environ`` itself.
    """
    return _RankContext()


def fork_ranks(target: Callable[..., None], world: int, args_of: Callable[[int], tuple[Any, ...]], *,
               timeout: float = 90) -> None:
    """Run ``target(*args_of(rank))`` for every rank of ``world``, forked from :func:`rank_context`'s
    server; wait ``timeout`` seconds for each at most, and fail with the output of every rank that did
    not exit 0."""
    context = rank_context()
    procs = [context.Process(target=target, args=args_of(rank), name=f"rank {rank}") for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    except BaseException:  # the test's timeout, or an interrupt
        sys.stderr.write(_give_up_on(procs))
        raise
    finally:
        _give_up_on(procs)  # the stacks of those still running go into their output, shown below
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p for p in procs if p.exitcode != 0]
    assert not failed, "".join(f"\n--- {p.name} exited {p.exitcode} ---\n{p.output()}" for p in failed)


def next_report(results: Any, watched: list[Any], timeout: float) -> Any:
    """The next report on the ``multiprocessing`` queue ``results``, waiting ``timeout`` seconds at most.

    Fails as soon as a process of ``watched`` (those still to report) has exited and no report came
    within :data:`EXIT_DRAIN_S` after: with its exit code, rather than after the whole ``timeout``.
    """
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return results.get(timeout=0.2)
            except queue.Empty:
                pass
            gone = [p for p in watched if p.exitcode is not None]
            if gone:
                try:
                    return results.get(timeout=EXIT_DRAIN_S)
                except queue.Empty:
                    said = "".join(f"\n--- {p.name} (pid {p.pid}) exited {p.exitcode} without reporting ---\n"
                                   + (p.output() if isinstance(p, RankProcess) else "") for p in gone)
                    raise AssertionError(said) from None
            if time.monotonic() > deadline:
                raise AssertionError(f"no report within {timeout:g}s" + _give_up_on(watched))
    except BaseException as exc:
        if not isinstance(exc, AssertionError):  # the test's timeout, or an interrupt
            sys.stderr.write(_give_up_on(watched))
        raise


def _give_up_on(procs: list[Any]) -> str:
    """Each :class:`RankProcess` of ``procs`` still running writes every thread's stack to its output
    (SIGABRT, which its ``faulthandler`` takes) and ends; returns what each wrote. What a rank was
    doing when the test stopped waiting for it: a rank that pytest's timeout found waiting used to
    leave nothing but the test's own stack."""
    running = [p for p in procs if isinstance(p, RankProcess) and p.is_alive()]
    for p in running:
        os.kill(p.pid, signal.SIGABRT)
    for p in running:
        p.join(timeout=5)
    return "".join(f"\n--- {p.name} (pid {p.pid}) was still running; its output, then its stacks ---\n{p.output()}"
                   for p in running)
