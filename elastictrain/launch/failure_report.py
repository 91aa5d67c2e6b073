"""What a failed job tells its operator: the root cause first, in one line, and its traceback once.

A worker that raises is seldom the only one to fail: with a plain script on gloo or
NCCL, every peer's next collective fails too ("Connection closed by peer ... GLHF"),
and each of those failures is recorded just like the root cause. This module turns
torch's :class:`ProcessFailure` records into :class:`WorkerFailure` (plain data, JSON
round-trip, so a ``--local-nodes`` launcher can gather its nodes' failures), tells a
*consequential* failure (a collective that failed because a peer went away) from a
root cause, and writes the report:

- one line per job: ``rank 1 on node1 failed: ValueError: bad batch 1234 in shard 7
  (train.py:42); job failed after 0 restart(s)``, with the peers that failed in
  consequence summarised in a clause;
- the root cause's traceback once, trimmed to the script's own frames.

Nothing here imports torch: it reads a ``ProcessFailure`` by its public fields.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["OUTCOME_FILE_ENV", "WorkerFailure", "final_error", "from_process_failure", "job_line", "peer_caused",
           "read_outcome", "report", "root_cause", "strip_noise", "write_outcome"]

OUTCOME_FILE_ENV = "ELASTICTRAIN_OUTCOME_FILE"
"""Set by a ``--local-nodes`` launcher for each node: where the node writes its outcome (JSON)
instead of reporting a failure itself, so the launcher reports the job's once."""

# A collective or store call that failed because a peer went away: the consequence of
# another rank's failure, not a cause. gloo, NCCL and c10d's TCPStore each word it their way.
_CONSEQUENTIAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|remote process exited"
    r"|NCCL communicator was aborted|DistNetworkError|DistBackendError|Broken pipe|Socket Timeout"
    r"|ProcessGroupGloo.*(?:timed out|Timed out)|Application timeout caused pair closure"
    r"|failed to recv, got 0 bytes|recvBytes|Read error \[",
)

# Noise around gloo's messages: the source location it was raised at, and the advice.
_GLOO_SOURCE = re.compile(r"\[/[^\]]*?\.(?:cc|cpp|h):\d+\] ")
_ADVICE = re.compile(r"\s*This is typically caused by a remote worker crashing\..*$", re.S)

# Frames of the machinery between the worker's start and the script: not the user's.
_MACHINERY = ("/torch/", "/elastictrain/launch/_worker_boot.py", "<frozen runpy>", "/runpy.py",
              "/torch/distributed/elastic/")

_MAX_MESSAGE = 300

_FINAL_ERRORS = ("elastictrain.errors.ConfigError", "elastictrain.errors.CheckpointMismatchError",
                 "elastictrain.errors.NonFiniteStateError", "elastictrain.errors.CheckpointDirectoryError",
                 "elastictrain.errors.DependencyError", "elastictrain.errors.TorchCompatError",
                 "SyntaxError", "IndentationError", "TabError")
"""Errors that a restart would meet again, as a traceback's last line names them: input
elastictrain refused, a checkpoint that does not fit the model, a training state gone NaN
(live peers and a restart from a checkpoint carry it on or train into it again), a checkpoint
directory that is read-only or not shared by all nodes, a dependency that does not import (or a
torch without a name elastictrain needs), and code that does not compile."""

_DIAGNOSED = "elastictrain.errors."
"""Where the errors elastictrain raised on purpose live (:mod:`elastictrain.errors`): each one's
message is the diagnosis, so the report prints no traceback for it, and does not cut it short."""

_MAX_DIAGNOSIS = 1000


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """One failed worker, as the operator needs to see it."""

    rank: int
    """Global rank."""

    node: str
    """The node that ran it: its name (``--local-nodes``' ``node1``, or the host name) and its node
    rank then (``node1 (node rank 0)``, :func:`~elastictrain._fault.node_label`)."""

    pid: int
    exit_code: int
    """The process's exit code; negative: killed by that signal."""

    signal: str | None
    """Signal name when it was killed by one (``SIGKILL``)."""

    error: str
    """``Type: message`` of the exception it raised, cleaned of noise; empty if none was recorded."""

    location: str
    """``script.py:42``: the innermost frame of the user's code, if a traceback was recorded."""

    traceback: str
    """The traceback trimmed to the user's frames; empty if none was recorded."""

    consequential: bool
    """Whether it failed because a peer went away (a consequence, not a cause)."""

    final: bool
    """Whether it raised an error that a restart would meet again (:data:`_FINAL_ERRORS`): the job
    fails without a restart, and the report gives no traceback (the line says what and where)."""

    timestamp: float
    """When it failed (seconds since the epoch, from its error file)."""

    diagnosed: bool = False
    """Whether the error is one elastictrain raised on purpose (:mod:`elastictrain.errors`): its
    message says what is wrong, and the report shows no traceback for it."""

    def describe(self) -> str:
        """``rank 1 on node1 (node rank 0) failed: ValueError: bad batch (train.py:42)``."""
        return f"rank {self.rank} on {self.node} {self.how()}"

    def how(self) -> str:
        """How it ended: ``was killed by SIGKILL``, ``failed: ValueError: bad batch (train.py:42)``,
        ``exited with code 3``."""
        if self.signal:
            return f"was killed by {self.signal}"
        if self.error:
            where = f" ({self.location})" if self.location else ""
            return f"failed: {self.error}{where}"
        return f"exited with code {self.exit_code}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerFailure:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__
                      if name in data})


def strip_noise(text: str) -> str:
    """``text`` (an error, or a cause that quotes one) without gloo's source locations and advice."""
    return _ADVICE_INLINE.sub("", _GLOO_SOURCE.sub("", text))


_ADVICE_INLINE = re.compile(r"\s*This is typically caused by a remote worker[^)]*")


def _clean(error: str, limit: int = _MAX_MESSAGE) -> str:
    """One line: gloo's source location and advice removed, cut at a sane length."""
    error = _ADVICE.sub("", _GLOO_SOURCE.sub("", error.strip()))
    line = error.splitlines()[0].strip() if error else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _frames(callstack: str) -> tuple[list[list[str]], list[str]]:
    """Split a formatted traceback into its frames (each a ``File`` line and what follows)
    and the closing exception lines."""
    frames: list[list[str]] = []
    tail: list[str] = []
    for line in callstack.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            continue
        if line.startswith("  File "):
            frames.append([line])
            tail = []
        elif line.startswith("    ") and frames and not tail:
            frames[-1].append(line)
        else:
            tail.append(line)
    return frames, tail


_FILE_LINE = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+)')

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""elastictrain's own files: a library frame, where the user's code called it is the location."""


def _location(frames: list[list[str]]) -> str:
    """``file:line`` of the innermost frame of the user's code: not installed packages, and not
    elastictrain's (an error it raised, a ConfigError for one, is placed where the script called
    it), nor code without a file (``<string>``: a dataclass's ``__init__``, elastictrain's
    SessionConfig for one), unless no other frame is left."""
    for skip_package in (True, False):
        for frame in reversed(frames):
            match = _FILE_LINE.match(frame[0])
            if (match and not any(m in frame[0] for m in _MACHINERY) and "site-packages" not in frame[0]
                    and not (skip_package and (os.path.abspath(match["path"]).startswith(_PACKAGE)
                                               or match["path"].startswith("<")))):
                return f"{os.path.basename(match['path'])}:{match['line']}"
    return ""


def _trim(callstack: str) -> tuple[str, str]:
    """The traceback without the launcher's own frames, and the innermost user frame as ``file:line``."""
    frames, tail = _frames(callstack)
    kept = [f for f in frames if not any(m in f[0] for m in _MACHINERY)] or frames
    location = _location(kept)
    if not frames:
        return "", location
    lines = ["Traceback (most recent call last):", *(line for f in kept for line in f), *tail]
    return "\n".join(lines).rstrip(), location


def from_process_failure(rank: int, failure: Any, node: str) -> WorkerFailure:
    """A :class:`WorkerFailure` from torch's ``ProcessFailure`` of global rank ``rank``.

    The error file ``@record`` wrote holds the exception as ``{"message": ..., "extraInfo":
    {"py_callstack": ...}}``; without one (a signal, ``sys.exit``) only the exit code is known.
    """
    message, callstack = _recorded(failure)
    code = int(failure.exitcode)
    signal = failure.signal_name() if code < 0 else None
    traceback, location = _trim(callstack) if callstack else ("", "")
    diagnosed = _closing_line(callstack).startswith(_DIAGNOSED)
    error = _clean(message, _MAX_DIAGNOSIS if diagnosed else _MAX_MESSAGE)
    return WorkerFailure(
        rank=rank, node=node, pid=int(failure.pid), exit_code=code, signal=signal, error=error,
        location=location, traceback=traceback, consequential=bool(_CONSEQUENTIAL.search(message)),
        final=_final_error(callstack) is not None, timestamp=float(failure.timestamp or 0), diagnosed=diagnosed)


def final_error(failures: dict[int, Any]) -> tuple[int, str] | None:
    """The first global rank among torch's ``ProcessFailure`` records (by global rank) whose
    worker raised an error that a restart would meet again, and that error's name; ``None``
    if none did."""
    for rank, failure in sorted(failures.items()):
        name = _final_error(_recorded(failure)[1])
        if name is not None:
            return rank, name
    return None


def peer_caused(failures: dict[int, Any]) -> bool:
    """Whether every one of torch's ``ProcessFailure`` records failed because a peer went away
    (its recorded error says so: a collective or store call broken by the peer, see
    ``_CONSEQUENTIAL``): a consequence of another node's failure, not this node's own. A worker
    killed by a signal or that left no error recorded is its node's own failure."""
    return bool(failures) and all(int(f.exitcode) > 0 and bool(_CONSEQUENTIAL.search(_recorded(f)[0]))
                                  for f in failures.values())


def _recorded(failure: Any) -> tuple[str, str]:
    """The exception message and the traceback a ``ProcessFailure``'s error file holds
    (``@record`` writes ``{"message": ..., "extraInfo": {"py_callstack": ...}}``); empty
    strings for what was not recorded."""
    message: Any = failure.message
    callstack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        callstack = str(extra.get("py_callstack") or "")
        message = message.get("message") or ""
    message = str(message or "")
    if message.startswith("To enable traceback") or message.startswith("Signal "):
        message = ""  # torch's placeholders: nothing was recorded
    return message, callstack


def _closing_line(callstack: str) -> str:
    """The last line of a formatted traceback: ``module.Type: message`` of the exception raised."""
    lines = callstack.rstrip().splitlines()
    return lines[-1] if lines else ""


def _final_error(callstack: str) -> str | None:
    """The name of the error among :data:`_FINAL_ERRORS` that closes ``callstack``, if one does."""
    last = _closing_line(callstack)
    return next((error.rpartition(".")[2] for error in _FINAL_ERRORS if last.startswith(f"{error}: ")), None)


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure | None:
    """The failure that caused the others: the earliest that is not a consequence of a
    peer's (any failure if all look consequential)."""
    if not failures:
        return None
    causes = [f for f in failures if not f.consequential] or failures
    return min(causes, key=lambda f: (f.timestamp, f.rank))


def job_line(failures: list[WorkerFailure], restarts: int) -> str:
    """One line for the whole job: the root cause, the peers it took down, the restarts."""
    root = root_cause(failures)
    if root is None:
        return f"job failed after {restarts} restart(s)"
    seen = {(root.rank, root.pid)}
    others = [f for f in failures if (f.rank, f.pid) not in seen and f.rank != root.rank]
    peers = sorted({f.rank for f in others})
    clause = ""
    if peers:
        ranks = ", ".join(str(r) for r in peers[:8]) + (", ..." if len(peers) > 8 else "")
        why = "their collectives failed when it went away" if all(f.consequential for f in others) else \
            "they failed too"
        clause = f"; rank(s) {ranks} stopped after it ({why})"
    return f"{root.describe()}{clause}; job failed after {restarts} restart(s)"


def report(failures: list[WorkerFailure], restarts: int) -> str:
    """The text for the terminal: the root cause's traceback (once; none for a consequence, a
    signal, an error a restart would meet again, or one elastictrain diagnosed), then the job's
    one line."""
    root = root_cause(failures)
    line = job_line(failures, restarts)
    if root is None or root.consequential or root.final or root.diagnosed or not root.traceback:
        return line
    return f"traceback of rank {root.rank} on {root.node} (the root cause):\n{root.traceback}\n{line}"


def write_outcome(path: str, *, exit_code: int, summary: str, restarts: int,
                  failures: tuple[WorkerFailure, ...] | list[WorkerFailure]) -> None:
    """Write one node's outcome for its ``--local-nodes`` launcher (atomically: the launcher
    reads it once the node has exited)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"exit_code": exit_code, "summary": summary, "restarts": restarts,
                   "failures": [f.to_json() for f in failures]}, fh)
    os.replace(tmp, path)


def read_outcome(path: str) -> dict[str, Any] | None:
    """A node's outcome as :func:`write_outcome` wrote it (``failures`` as :class:`WorkerFailure`),
    or ``None`` if it wrote none (it was killed, or failed before its agent ran)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        data["failures"] = [WorkerFailure.from_json(item) for item in data.get("failures", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data
