"""The processes of a chaos run's nodes, found from the process tree.

A node agent forks each worker from its forkserver, so the workers of a node are the
children of the agent's child that serves as its forkserver
(:data:`~elastictrain.launch.node_setup.FORKSERVER_TITLE`, or ``multiprocessing.forkserver``).
"""

from __future__ import annotations

import os

from elastictrain._process import proc_stat
from elastictrain.launch.node_setup import FORKSERVER_TITLE

__all__ = ["children", "descendants", "process_state", "worker_pids"]



def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of ``pid``, or None if it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] == pid and stat[1] != "Z":
                out.append(int(entry))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    out, queue = [], [pid]
    while queue:
        for child in children(queue.pop()):
            out.append(child)
            queue.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(agent_pid: int) -> list[int]:
    """The worker processes of a node agent: the children of its forkserver."""
    workers = []
    for child in children(agent_pid):
        if any(title in _cmdline(child) for title in (FORKSERVER_TITLE, "multiprocessing.forkserver")):
            workers.extend(children(child))
    return workers


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T`` when stopped), or None if gone."""
    stat = _stat(pid)
    return None if stat is None else stat[1]
