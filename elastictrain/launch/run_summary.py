"""The few lines that end every run: what the job went through, read from its event log.

A recovered fault leaves the job ``finished`` with exit code 0, and the terminal's scroll-back
was the only trace of it. At the end of a run the node (or the ``--local-nodes`` launcher, once
for all its nodes) prints a summary from the run's events (:mod:`elastictrain.events`) written
since the job started:

- the steps trained (the session's ``session_end``) and the wall time;
- each worker that failed on its own (not because a peer went away; in a job that finished:
  a failed job's report names them), hung, and each recovery in place (its step, seconds,
  world sizes and cause);
- each checkpoint abandoned;
- the traceback of the first user exception the job recovered from, once.

Pure: :func:`summarize` takes the events and returns the lines; :func:`read_events` reads them.
"""

from __future__ import annotations

import json
from typing import Any

from elastictrain.launch.failure_report import strip_noise

__all__ = ["read_events", "summarize"]

_MAX_CAUSE = 200


def read_events(path: str, since: float) -> list[dict[str, Any]]:
    """The events of ``path`` stamped at or after ``since`` (unix seconds); none if it cannot be
    read. A line that does not parse (a write cut short) is skipped."""
    found: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and float(event.get("ts", 0)) >= since:
                    found.append(event)
    except OSError:
        return []
    return found


def _short(text: str) -> str:
    text = " ".join(strip_noise(str(text)).split())
    return text if len(text) <= _MAX_CAUSE else text[:_MAX_CAUSE - 3] + "..."


def _own_failures(events: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(rank, node, fields) of each worker failure that was no consequence of a peer's."""
    out = []
    for event in events:
        if event.get("kind") != "worker_failure":
            continue
        for rank, fields in sorted((event.get("failures") or {}).items(), key=lambda item: int(item[0])):
            if not fields.get("consequential"):
                out.append((str(rank), str(event.get("node", "?")), fields))
    return out


def _how(fields: dict[str, Any]) -> str:
    if fields.get("signal"):
        return f"was killed by {fields['signal']}"
    if fields.get("error"):
        where = f" ({fields['location']})" if fields.get("location") else ""
        return f"failed: {_short(fields['error'])}{where}"
    return f"exited with code {fields.get('exitcode')}"


def summarize(events: list[dict[str, Any]], *, seconds: float, finished: bool) -> tuple[list[str], str]:
    """The summary of a job whose events are ``events``, that ran ``seconds`` and ``finished``
    (else it failed, and its report gives the root cause's traceback: none here).

    Returns:
        Its lines, and the traceback of the first user exception recovered from (empty if none).
    """
    ends = [e for e in events if e.get("kind") == "session_end"]
    steps = max((int(e.get("step", 0)) for e in ends), default=None)
    recoveries = [e for e in events if e.get("kind") == "recovery" and "step" in e]  # the session's, rank 0
    failures = _own_failures(events)
    hangs = [e for e in events if e.get("kind") == "hang"]
    abandoned = [e for e in events if e.get("kind") == "checkpoint_abandoned"]
    head = f"summary: {f'{steps} steps in ' if steps is not None else ''}{seconds:.1f}s"
    counts = [f"{len(recoveries)} recovery(ies) in place" if recoveries else "",
              f"{len(failures)} worker failure(s)" if failures else "",
              f"{len(hangs)} hung worker(s)" if hangs else "",
              f"{len(abandoned)} checkpoint(s) abandoned" if abandoned else ""]
    lines = [head + ("; " + ", ".join(c for c in counts if c) if any(counts) else "; no fault")]
    if finished:  # a failed job's report names its failures, root cause first
        lines += [f"  rank {rank} on {node} {_how(fields)}" for rank, node, fields in failures]
    lines += [f"  rank {e.get('rank', e.get('local_rank', '?'))} on {e.get('node', '?')} hung, killed" for e in hangs]
    lines += [f"  recovered in {float(e.get('seconds', 0)):.2f}s after step {e.get('step')} "
              f"(world size {e.get('old_world_size')} -> {e.get('world_size')}): {_short(e.get('cause', ''))}"
              for e in recoveries]
    lines += [f"  checkpoint of step {e.get('step')} abandoned ({_short(e.get('reason', ''))}); the next was due "
              + (f"at step {e['next_step']}" if e.get("next_step") is not None else "at the end of the run")
              for e in abandoned]
    first = next(((rank, node, f) for rank, node, f in failures if f.get("traceback")), None)
    traceback = ""
    if first is not None and finished:
        rank, node, fields = first
        lines.append(f"  the first exception recovered from, rank {rank} on {node} (its traceback, once):")
        traceback = str(fields["traceback"]).rstrip()
    return lines, traceback
