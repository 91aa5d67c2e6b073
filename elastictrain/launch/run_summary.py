"""The few lines that end every run: what the job went through, read from its event log.

A recovered fault leaves the job ``finished`` with exit code 0, and the terminal's scroll-back
was the only trace of it. At the end of a run the node (or the ``--local-nodes`` launcher, once
for all its nodes) prints a summary from the run's events (:mod:`elastictrain.events`) written
since the job started:

- the steps trained (the session's ``session_end``) and the wall time;
- each worker that failed on its own (not because a peer went away; in a job that finished:
  a failed job's report names them), hung, and each recovery: in place (its step, seconds,
  world sizes, 0 steps redone) or a restart from a checkpoint (the steps trained past that
  checkpoint, which were trained again), each with its cause: the rank and node that failed
  (named by name and node rank, as the node that saw it said) and what the session saw;
- each checkpoint abandoned;
- each straggler once: rank, node, its worst factor and the steps it straggled over;
- the traceback of the first user exception the job recovered from, once.

Pure: :func:`summarize` takes the events and returns the lines; :func:`read_events` reads them.
"""

from __future__ import annotations

import json
from typing import Any

from elastictrain._fault import Fault, node_label, node_name_of
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


def _how(fields: dict[str, Any]) -> str:
    if fields.get("signal"):
        return f"was killed by {fields['signal']}"
    if fields.get("error"):
        where = f" ({fields['location']})" if fields.get("location") else ""
        return f"failed: {_short(fields['error'])}{where}"
    return f"exited with code {fields.get('exitcode')}"


def _label(event: dict[str, Any]) -> str:
    """An event's node: its name and, when the event says it, its node rank then."""
    rank = event.get("node_rank")
    known = isinstance(rank, int) and not isinstance(rank, bool)
    return node_label(str(event.get("node", "?")), rank if known else None)


def _own_failures(events: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(rank, node, fields) of each worker failure that was no consequence of a peer's."""
    out = []
    for event in events:
        if event.get("kind") != "worker_failure":
            continue
        for rank, fields in sorted((event.get("failures") or {}).items(), key=lambda item: int(item[0])):
            if not fields.get("consequential"):
                out.append((str(rank), _label(event), fields))
    return out


def _fault_seen(event: dict[str, Any]) -> Fault | None:
    """The fault a ``worker_failure`` (its first own failure) or ``hang`` event records, as a cause."""
    if event.get("kind") == "hang" and event.get("rank") is not None:
        return Fault(rank=int(event["rank"]), node=str(event.get("node", "?")), node_rank=event.get("node_rank"),
                     how="hung and was killed")
    for rank, fields in sorted((event.get("failures") or {}).items(), key=lambda item: int(item[0])):
        if not fields.get("consequential"):
            return Fault(rank=int(rank), node=str(event.get("node", "?")), node_rank=event.get("node_rank"),
                         how=_how(fields))
    return None


def _recoveries(events: list[dict[str, Any]]) -> list[str]:
    """A line per recovery, in order: each in place (rank 0's ``recovery`` event) and each restart
    from a checkpoint (a ``restore`` after a failure), with the steps redone and the cause: the
    fault the recovery event carries (said by the node that saw it), else the last fault seen
    before it (a worker's own failure, a hang, else a node that left)."""
    lines: list[str] = []
    seen: Fault | None = None
    failed_at: int | None = None  # the newest step committed by a rank whose session failed
    world: int | None = None
    for event in events:
        kind = event.get("kind")
        if kind in ("worker_failure", "hang"):
            seen = _fault_seen(event) or seen
        elif kind == "membership_change" and event.get("nodes_left") and seen is None:
            # A node lost as a whole (its agent killed, its host gone): no failure event says so.
            names = ", ".join(dict.fromkeys(node_name_of(str(n)) for n in event["nodes_left"]))
            seen = Fault(rank=None, node=names, node_rank=None, how="left the job")
        elif kind == "session_failed" and isinstance(event.get("step"), int):
            failed_at = max(failed_at or 0, event["step"])
        elif kind == "recovery" and "step" in event:  # the session's, rank 0
            fault = Fault.from_json(event.get("fault")) or seen
            said = f"{fault.describe()}; " if fault is not None else ""
            seconds = float(event.get("seconds", 0))
            lines.append(f"  recovered in place in {seconds:.2f}s after step {event.get('step')} "
                         f"(world size {event.get('old_world_size')} -> {event.get('world_size')}), "
                         f"{int(event.get('steps_redone', 0))} step(s) redone: {said}{_short(event.get('cause', ''))}")
            seen, failed_at, world = None, None, event.get("world_size")
        elif kind == "restore" and isinstance(event.get("step"), int):
            if failed_at is not None or seen is not None:  # not the restore a job starts from
                redone = (f"{max(0, failed_at - event['step'])} step(s) redone (trained past it up to step "
                          f"{failed_at})" if failed_at is not None else "steps redone unknown")
                cause = f": {seen.describe()}" if seen is not None else ""
                lines.append(f"  restarted from the checkpoint of step {event['step']} (world size "
                             f"{event.get('saved_world_size', world)} -> {event.get('world_size')}), {redone}{cause}")
            seen, failed_at, world = None, None, event.get("world_size")
    return lines


def _stragglers(events: list[dict[str, Any]]) -> list[str]:
    """A line per straggler (rank and node), once however often it straggled: its worst factor and
    the steps from its first ``straggler`` event to its last ``straggler_recovered`` (or the end)."""
    found: dict[tuple[Any, Any], dict[str, Any]] = {}
    for event in events:
        kind = event.get("kind")
        if kind not in ("straggler", "straggler_recovered"):
            continue
        key = (event.get("rank"), event.get("node"))
        entry = found.setdefault(key, {"label": _label(event), "factor": 0.0, "first": None, "last": None})
        if kind == "straggler":
            entry["factor"] = max(entry["factor"], float(event.get("factor", 0)))
            if entry["first"] is None:
                entry["first"] = event.get("first_step", event.get("step"))
            entry["last"] = None
        else:
            entry["last"] = event.get("step")
    return [f"  rank {rank} on {e['label']} straggled: up to {e['factor']:.1f}x its peers' compute time, from step "
            f"{e['first']} " + (f"to step {e['last']}" if e["last"] is not None else "to the end of the run")
            for (rank, _node), e in found.items() if e["first"] is not None]


def summarize(events: list[dict[str, Any]], *, seconds: float, finished: bool) -> tuple[list[str], str]:
    """The summary of a job whose events are ``events``, that ran ``seconds`` and ``finished``
    (else it failed, and its report gives the root cause's traceback: none here).

    Returns:
        Its lines, and the traceback of the first user exception recovered from (empty if none).
    """
    ends = [e for e in events if e.get("kind") == "session_end"]
    steps = max((int(e.get("step", 0)) for e in ends), default=None)
    recoveries = _recoveries(events)
    in_place = sum(1 for line in recoveries if line.startswith("  recovered in place"))
    failures = _own_failures(events)
    hangs = [e for e in events if e.get("kind") == "hang"]
    abandoned = [e for e in events if e.get("kind") == "checkpoint_abandoned"]
    stragglers = _stragglers(events)
    head = f"summary: {f'{steps} steps in ' if steps is not None else ''}{seconds:.1f}s"
    counts = [f"{in_place} recovery(ies) in place" if in_place else "",
              f"{len(recoveries) - in_place} restart(s) from a checkpoint" if len(recoveries) > in_place else "",
              f"{len(failures)} worker failure(s)" if failures else "",
              f"{len(hangs)} hung worker(s)" if hangs else "",
              f"{len(abandoned)} checkpoint(s) abandoned" if abandoned else "",
              f"{len(stragglers)} straggler(s)" if stragglers else ""]
    lines = [head + ("; " + ", ".join(c for c in counts if c) if any(counts) else "; no fault")]
    if finished:  # a failed job's report names its failures, root cause first
        lines += [f"  rank {rank} on {node} {_how(fields)}" for rank, node, fields in failures]
    lines += [f"  rank {e.get('rank', e.get('local_rank', '?'))} on {_label(e)} hung, killed" for e in hangs]
    lines += recoveries
    lines += stragglers
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
