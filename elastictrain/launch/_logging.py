"""Handler set-up for elastictrain's own processes (agent, launcher, etcd).

Only :mod:`elastictrain.launch.cli` calls :func:`setup`; library modules just use
``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["VERBOSE_ENV", "forget", "log_to_file", "quiet_torch_cpp", "setup", "verbose"]


class _WorkerFailureFilter(logging.Filter):
    """Drops torch's own report of a failed worker (``failed (exitcode: 1) ...`` with the
    wrapped traceback of every failed rank, survivors' consequential errors included): the
    launcher reports the failure itself, root cause first and its traceback once (see
    :mod:`elastictrain.launch.failure_report`). ``--debug`` keeps torch's report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "torch.distributed.elastic.multiprocessing.api"
                    and isinstance(record.msg, str) and record.msg.startswith("failed (exitcode"))


_OURS, _TORCH_ELASTIC, _EVENTS = "elastictrain", "torch.distributed.elastic", "elastictrain.events"
_TORCH_MP = "torch.multiprocessing"  # torch's agent stops workers through it: "Terminating process ..."
_CONFIGURED = (_OURS, _TORCH_ELASTIC, _TORCH_MP, _EVENTS)
"""The loggers :func:`setup` configures (and :func:`forget` resets)."""


VERBOSE_ENV = "ELASTICTRAIN_VERBOSE"
"""``1`` (``run -v``): everything on the terminal. Set in the environment of a node's own
processes by ``run``, so that its workers (and ``--local-nodes`` children) see it too."""

_CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"


def verbose() -> bool:
    """Whether ``-v``/``ELASTICTRAIN_VERBOSE`` asked for everything on the terminal."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def quiet_torch_cpp() -> None:
    """Keep torch's C++ warnings (``[W... socket.cpp] [c10d] waitForInput ... likely a timeout``,
    two every 250 ms while a peer is stuck) off the terminal: errors only, unless ``-v``.

    torch reads ``TORCH_CPP_LOG_LEVEL`` once, when it is imported; this process (the agent), its
    workers' forkserver and, through it, every worker import it after this call. C++ writes
    straight to the worker's stderr, so below ERROR the lines are dropped, not moved to the node's
    log file. A level the user set stays."""
    if not verbose():
        os.environ.setdefault(_CPP_LOG_LEVEL_ENV, "ERROR")


def setup(*, debug: bool = False, node: str | None = None) -> None:
    """Send elastictrain's logs to stderr with a ``[elastictrain node=...]`` prefix.

    torch.elastic's own lines show on the terminal only from ERROR up, unless ``-v``
    (``ELASTICTRAIN_VERBOSE``) or ``debug``: the others (``Closing process ... via signal
    SIGTERM``) go to the node's log file, see :func:`log_to_file`."""
    level = logging.DEBUG if debug else getattr(logging, os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO").upper(), logging.INFO)
    prefix = f"[elastictrain{' ' + node if node else ''}]"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger(_OURS)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # torch's log formatter imports torch's whole compiler stack to format a record that
    # carries an exception, and torch's agent logs every worker failure that way:
    # measured 2.2-3.5 s before the agent even reacted to a crash. A plain formatter
    # on torch's elastic loggers says the same in microseconds.
    elastic_handler = logging.StreamHandler(sys.stderr)
    elastic_handler.setFormatter(_ELASTIC_FORMAT)
    if not debug:
        elastic_handler.addFilter(_WorkerFailureFilter())
    if not (debug or verbose()):
        elastic_handler.setLevel(logging.ERROR)
    for name in (_TORCH_ELASTIC, _TORCH_MP):
        torch_log = logging.getLogger(name)
        torch_log.handlers[:] = [elastic_handler]
        torch_log.propagate = False
    # Events go to the run's JSON-lines file; on the terminal they would drown the
    # log, so they show there only with --debug.
    logging.getLogger(_EVENTS).propagate = debug


_ELASTIC_FORMAT = logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s")


def log_to_file(path: str) -> None:
    """Also write elastictrain's, torch.elastic's and torch.multiprocessing's log lines (every level their loggers
    pass) to the node's log file ``path``, appended to: what the terminal leaves out without
    ``-v`` is there."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in (_OURS, _TORCH_ELASTIC, _TORCH_MP):
        logging.getLogger(name).handlers.append(handler)


def forget() -> None:
    """Undo :func:`setup` in a process forked from one that called it (the workers'
    forkserver): a worker configures its own logging, or the session does."""
    for name in _CONFIGURED:
        log = logging.getLogger(name)
        log.handlers[:] = []
        log.setLevel(logging.NOTSET)
        log.propagate = True
