"""Several node agents on one machine: ``elastictrain run --local-nodes N``.

Each node is a separate ``elastictrain run`` process with its own agent, exactly
as on separate hosts, so a multi-node job (and its failures) can be seen and
tested on one machine. The launcher waits for every node, forwards Ctrl-C and
SIGTERM to them, and exits with the job's outcome (see :func:`job_outcome`): 0 when the job
finished, whatever happened to a node on the way; the root cause's code otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastictrain.launch import failure_report
from elastictrain._process import dying_with_us

logger = logging.getLogger(__name__)

__all__ = ["JobOutcome", "job_outcome", "run_local_nodes"]


def run_local_nodes(count: int, node_args: Sequence[str], *, grace_seconds: float = 30.0,
                    per_node: Callable[[int], list[str]] | None = None, log_dir: str | None = None,
                    summary: Callable[[float, float, bool], None] | None = None) -> int:
    """Start ``count`` node agents with ``elastictrain run <node_args>`` and wait for all.

    Args:
        count: Number of node processes.
        node_args: Arguments of ``elastictrain run`` for each node (no ``--local-nodes``).
        grace_seconds: After a signal, how long nodes get to stop before SIGKILL.
        per_node: Flags of node ``i`` alone (put before ``node_args``), e.g. its metrics port.
        log_dir: Where the nodes write their log files (``node0.log``, ...), named once here.
        summary: Prints the run summary, given the job's start (unix seconds), its seconds and
            whether it finished; called once, before the job's last line.

    Returns:
        0 if every node exited 0, else the first non-zero exit code seen.
    """
    procs: list[subprocess.Popen[bytes]] = []
    received: list[int] = []
    outcomes = tempfile.mkdtemp(prefix="elastictrain-outcomes-")

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    started, started_at = time.monotonic(), time.time()
    try:
        for index in range(count):
            own = per_node(index) if per_node else []
            cmd = [sys.executable, "-m", "elastictrain", "run", "--node-name", f"node{index}", *own, *node_args]
            env = {**os.environ, failure_report.OUTCOME_FILE_ENV: os.path.join(outcomes, f"node{index}.json")}
            # A node outlives neither this launcher nor, through its own agent, its workers.
            procs.append(subprocess.Popen(dying_with_us(cmd), env=env))
        logs = f"; their logs (torch's own lines too; -v shows them here): {log_dir}/node*.log" if log_dir else ""
        logger.info("started %d local nodes: pids %s%s", count, [p.pid for p in procs], logs)
        codes: dict[int, int] = {}  # node index -> exit code, in the order they ended
        pending = list(procs)
        signalled_at: float | None = None
        while pending:
            for proc in list(pending):
                code = proc.poll()
                if code is not None:
                    pending.remove(proc)
                    codes[procs.index(proc)] = code
            if received and signalled_at is None:
                signalled_at = time.monotonic()
            if signalled_at is not None and time.monotonic() - signalled_at > grace_seconds:
                for proc in pending:
                    proc.kill()
            time.sleep(0.05)
        if received:  # said once here, not by each node
            print(f"elastictrain: stopped by {signal.Signals(received[0]).name}; the {count} local nodes were "
                  "stopped", file=sys.stderr, flush=True)
            return 128 + received[0]
        outcome = job_outcome(codes)
        if summary is not None:
            summary(started_at, time.monotonic() - started, not outcome.failed_nodes and outcome.exit_code == 0)
        if outcome.failed_nodes:
            return _report(outcomes, count, outcome.exit_code)
        if outcome.why:  # said last: the job's outcome, and why a node's own code is not it
            logger.info("%s", outcome.why)
        return outcome.exit_code
    finally:
        shutil.rmtree(outcomes, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How a ``--local-nodes`` job ended, decided from its nodes' exit codes alone."""

    exit_code: int
    """The job's: 0 when it finished; else a failed node's (its root cause's, once reported)."""

    failed_nodes: tuple[int, ...] = ()
    """Nodes that ended with a failure of their own (an exit code, not a signal that killed
    the node's agent): their outcome files name the root cause."""

    why: str = ""
    """A line for the end of the output where a node's own code is not the job's; empty otherwise."""


def job_outcome(codes: dict[int, int]) -> JobOutcome:
    """The job's outcome from its nodes' exit codes (``subprocess`` codes: negative when a signal
    killed the node's agent process itself), in the order the nodes ended.

    A node whose agent was itself killed has no say: it could not tell how the job went. Its
    peers do: the job finished when every other node exited 0 (the job trained to its end
    without the killed node, or a stop closed it), else failed with the first failed peer's
    code. With no peer left to say, the first killed node's 128+N is the job's.
    """
    killed = {node: -code for node, code in codes.items() if code < 0}
    failed = tuple(node for node, code in codes.items() if code > 0)
    said = [node for node in codes if node not in killed]
    if failed:
        return JobOutcome(exit_code=codes[failed[0]], failed_nodes=failed)
    if killed and said:
        names = ", ".join(f"node{n}'s by {_signal_name(sig)}" for n, sig in killed.items())
        return JobOutcome(exit_code=0, why=(
            f"job finished (exit code 0): {len(said)} of {len(codes)} nodes ended with success; a node agent was "
            f"killed on the way ({names}), and a killed agent has no say in the job's outcome"))
    if killed:
        first, sig = next(iter(killed.items()))
        return JobOutcome(exit_code=128 + sig, why=(
            f"job failed (exit code {128 + sig}): every node's agent was killed, node{first}'s first, by "
            f"{_signal_name(sig)}"))
    return JobOutcome(exit_code=0)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _report(outcomes: str, count: int, first_failure: int) -> int:
    """Report a failed job once, for all its nodes: the root cause's traceback and one line.

    Returns:
        The job's exit code: the root-cause worker's, else the first failed node's.
    """
    found = [failure_report.read_outcome(os.path.join(outcomes, f"node{i}.json")) for i in range(count)]
    nodes = [o for o in found if o is not None]
    failures = [f for o in nodes for f in o["failures"]]
    root = failure_report.root_cause(failures)
    if root is not None:
        restarts = next(o["restarts"] for o in nodes if root in o["failures"])
        text = failure_report.report(failures, restarts)
        head, _, last = text.rpartition("\n")
        if head:
            print(head, file=sys.stderr, flush=True)
        logger.error("%s", last)
        code = root.exit_code
        return 128 - code if code < 0 else (code or first_failure)
    for summary in dict.fromkeys(o["summary"] for o in nodes):  # once each, in node order
        logger.error("%s", summary)
    return first_failure
