"""The connections of this worker's gloo groups to their peers, on record so that a worker that
leaves its group and lives on (in-process recovery) can shut them down.

gloo cannot abort a collective (pytorch/pytorch#130345), and a group outlives ``destroy``
while anything holds it (DDP, a pending collective), so a peer blocked on this rank would
wait out the whole timeout. :mod:`elastictrain.train.process_group` records the connections
each gloo group opens as it forms (:func:`recording`); :func:`sever` shuts them down, and
their collectives, and this rank's own pending ones, fail at once. :func:`lost_peer` tells,
with one ``poll`` and no collective, whether a peer closed its end.

A connection is an fd with its socket's inode, which tells it from a later socket that
reuses the fd: nothing that may not be the group's is ever shut down or watched. Linux only
(``/proc``); elsewhere nothing is recorded, and a peer waits out its timeout as before.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from elastictrain._process import fd_targets

__all__ = ["Connections", "closed", "forget_all", "keep", "lost_peer", "on_record", "recording", "sever", "shut_down"]

logger = logging.getLogger(__name__)

Connections = tuple[tuple[int, int], ...]
"""Connections on record: (fd, the socket's inode) each."""

_WORLD = ""
"""The default group's key among the groups whose connections are on record."""

_on_record: dict[str, Connections] = {}
"""The connections to its peers of each gloo group formed here, by group name."""

_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
"""What :func:`select.poll` says of a connection whose other end closed or reset."""


def _key(group: dist.ProcessGroup | None) -> str:
    return _WORLD if group is None else group.group_name


@contextmanager
def recording(peers: int, exclude_port: int | None = None) -> Iterator[list[tuple[int, int]]]:
    """The connections a gloo group opened to its ``peers`` other ranks while the block ran: the
    TCP connections this process opened meanwhile, but for those to or from ``exclude_port`` (the
    store's). gloo opens one per peer for each of its listeners; when the count is not that (a
    thread of the user's connected somewhere meanwhile, gloo connects lazily), none are
    recorded: nothing that may not be gloo's is ever shut down or watched."""
    before = set(_socket_inodes().items())
    connections: list[tuple[int, int]] = []
    yield connections
    new = {fd: inode for fd, inode in _socket_inodes().items() if (fd, inode) not in before}
    if not new:
        return
    tcp = _tcp_sockets()
    ours = {fd: tcp[inode] for fd, inode in new.items() if inode in tcp and exclude_port not in tcp[inode][:2]}
    listeners = sum(1 for _, _, listening in ours.values() if listening)
    found = [(fd, new[fd]) for fd, (_, _, listening) in ours.items() if not listening]
    if len(found) == listeners * peers:
        connections.extend(found)
    else:
        logger.info("could not tell this gloo group's %d connection(s) from others opened meanwhile (found %d): "
                    "a peer blocked on this rank as it leaves the group will wait out the group's timeout",
                    listeners * peers, len(found))


def keep(group: dist.ProcessGroup | None, connections: list[tuple[int, int]]) -> None:
    """Put ``connections`` (from :func:`recording`) on record for ``group`` (``None``: the default
    group)."""
    _on_record[_key(group)] = tuple(connections)


def forget_all() -> None:
    """Take every group's connections off the record (the default group is gone, and every group
    with it); nothing is shut down."""
    _on_record.clear()


def on_record(group: dist.ProcessGroup | None) -> Connections:
    """The connections to its peers on record of a gloo group (``None``: the default group), as
    :func:`sever` would find them now: for :func:`shut_down` later, from another thread, which
    then touches these and never a later group's."""
    return _on_record.get(_key(group), ())


def sever(*groups: dist.ProcessGroup | None) -> int:
    """Shut down the connections to its peers of each gloo group given (``None``: the default
    group) that are on record; others are left alone. Never raises.

    The group stays to be destroyed, but is of no use any more: each of its collectives in
    flight here or on a peer (one that waits for this rank) fails at once, where it would
    otherwise wait out the group's timeout. gloo cannot abort a collective, and destroying a
    group closes its connections only once nothing holds it: DDP, a collective still queued
    on it (a DDP bucket launched before another failed) keep it, and the group's destructor
    itself waits for its queued collectives. For a worker that leaves its group and lives on.

    Returns:
        How many connections were shut down.
    """
    return sum(shut_down(_on_record.pop(_key(group), ())) for group in groups)


def shut_down(recorded: Connections) -> int:
    """Shut down the ``recorded`` connections (see :func:`on_record`) that are still open, as
    :func:`sever` does; how many it shut down. Never raises."""
    return sum(_shut_down(fd, inode) for fd, inode in recorded)


def lost_peer(group: dist.ProcessGroup | None) -> bool:
    """Whether a peer of ``group`` (``None``: the default group), one whose connections are on
    record, closed its connection to this rank: its process died, or it left the group. One
    ``poll`` of its connections, no collective; False for a group not on record.

    For a rank that waits on its peers outside a collective (for their checkpoint files):
    a collective would fail at once on a dead peer, a wait on files would not.
    """
    return closed(on_record(group))


def closed(recorded: Connections) -> bool:
    """Whether a peer closed one of the ``recorded`` connections (see :func:`on_record`), or gloo
    did as it broke: :func:`lost_peer` of connections read earlier, from another thread."""
    held: list[int] = []
    try:
        poller = select.poll()
        for fd, inode in recorded:
            duplicate = _held(fd, inode)
            if duplicate is None:
                return True  # gloo closed it: the connection broke
            held.append(duplicate)
            poller.register(duplicate, _HANGUP)
        return any(events & _HANGUP for _, events in poller.poll(0))
    finally:
        for fd in held:
            os.close(fd)


def _socket_inodes() -> dict[int, int]:
    """This process's sockets: fd -> inode; empty where ``/proc`` is not (not Linux)."""
    return {fd: int(target[8:-1]) for fd, target in fd_targets().items() if target.startswith("socket:[")}


def _held(fd: int, inode: int) -> int | None:
    """A duplicate of ``fd`` if it still is the socket ``inode`` (the caller closes it), else None
    (gloo closed it, and the fd may have been reused): whatever becomes of ``fd`` meanwhile, the
    duplicate stays that socket."""
    try:
        held = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(held).st_ino == inode:
            return held
    except OSError:
        pass
    os.close(held)
    return None


def _tcp_sockets() -> dict[int, tuple[int, int, bool]]:
    """The TCP sockets of this network namespace: inode -> (local port, remote port, listening),
    from ``/proc`` (nothing of a socket is touched: its flags, its blocking mode stay as they are)."""
    table = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9:
                        table[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16),
                                                 int(fields[2].rsplit(":", 1)[1], 16), fields[3] == "0A")
        except OSError:
            continue
    return table


def _shut_down(fd: int, inode: int) -> int:
    """Shut down the connection on ``fd`` if it still is the socket ``inode``; 1 if it did."""
    held = _held(fd, inode)
    if held is None:
        return 0
    try:
        sock = socket.socket(fileno=held)
    except OSError:
        os.close(held)
        return 0
    with sock:  # closes the duplicate only
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return 1
        except OSError:
            return 0
