"""Frozen configuration of a run, with validation and the defaults we chose.

Durations are ``timedelta``. Every value is checked once, here; bad input raises
:class:`~elastictrain.errors.ConfigError` naming the value.
The rendezvous' own timing is :class:`elastictrain.rendezvous.config.RendezvousConfig`;
etcd client settings come from :mod:`elastictrain.etcd.conf`.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from elastictrain._addresses import is_loopback, source_address_towards
from elastictrain._control import RECOVERY_MODES
from elastictrain.errors import ConfigError
from elastictrain.etcd.conf import ETCD_PASSWORD_ENV, endpoints_from, etcd_settings_from
from elastictrain.rendezvous.config import RendezvousConfig
from elastictrain.rendezvous.keys import validate_run_id

__all__ = ["RunConfig", "check_writable_dir", "default_local_addr", "take_etcd_password"]


def check_writable_dir(path: str, flag: str) -> None:
    """Create directory ``path`` if needed and check that files can be made in it.

    Raises:
        ConfigError: It is a file, or cannot be created or written (named as ``flag``, with the reason).
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".elastictrain-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r} is not a writable directory: {exc.strerror or exc}") from None


def default_local_addr(endpoints: str) -> str:
    """The address other nodes reach this node at, when ``--local-addr`` is not given.

    This machine's address on its route to etcd: every node reaches etcd, so that is
    a network they share (the host's FQDN is ``localhost`` wherever ``/etc/hosts``
    maps the hostname to 127.0.0.1). If no endpoint resolves yet, the FQDN after all.

    Raises:
        ConfigError: The address would be a loopback one while etcd is on another host.
    """
    parsed = endpoints_from(endpoints)
    routed = next(filter(None, (source_address_towards(e.host, e.port) for e in parsed)), None)
    addr = routed or socket.getfqdn()
    if is_loopback(addr) and not all(is_loopback(e.host) for e in parsed):
        if routed is None:
            raise ConfigError(
                f"etcd ({endpoints}) does not resolve to an address here, and this host's own name is {addr!r}, "
                "a loopback address: check --etcd, or pass --local-addr with an address the other nodes can reach")
        raise ConfigError(
            f"this node would tell the others to reach it at {addr!r}, a loopback address, but etcd "
            f"({endpoints}) is not on this host: pass --local-addr with an address the other nodes can reach"
        )
    return addr


def take_etcd_password(options: dict[str, Any]) -> dict[str, Any]:
    """Move the etcd password out of the environment and into a copy of ``options``.

    Call it before starting any process that must not know the password: children
    inherit the environment, and a training script (or anything it runs) has no use
    for the credentials of the rendezvous.
    """
    password = os.environ.pop(ETCD_PASSWORD_ENV, None)
    if password and not options.get("password"):
        return {**options, "password": password}
    return dict(options)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything ``elastictrain run`` needs to launch one node's agent."""

    script: str
    """What each worker runs: a script's path, a module name (``entry="module"``) or a program."""

    entry: str = "script"
    """``script``: run a ``.py`` file as ``__main__``; ``module``: ``python -m script``
    (torchrun's ``-m``); ``program``: execute ``script`` itself (torchrun's ``--no-python``)."""

    script_args: tuple[str, ...] = ()
    """Arguments passed to the script."""

    min_nodes: int = 1
    """Fewest nodes the job trains with."""

    max_nodes: int = 1
    """Most nodes admitted to the job."""

    nproc_per_node: int = 1
    """Workers (ranks) per node."""

    run_id: str = "elastictrain"
    """Names the job; namespaces its etcd keys."""

    etcd: str | None = None
    """``host:port[,host:port]`` of an etcd cluster; ``None`` starts a private one."""

    max_restarts: int = 3
    """In-process recovery: this node's own worker failures survived within ``restart_window``
    (peers' failures and membership changes never count). Restart recovery: torch's count of
    worker-group restarts after a failure, including one caused by a peer."""

    recovery: str = "in-process"
    """``in-process``: workers keep their processes through faults and membership changes;
    ``restart``: torch's way, every worker restarts from the last checkpoint."""

    restart_window: timedelta = timedelta(hours=1)
    """The window of ``max_restarts`` under in-process recovery."""
    """Worker-group restarts allowed after failures (joins do not count)."""

    monitor_interval: timedelta = timedelta(seconds=0.1)
    """How often the agent polls its workers."""

    local_addr: str | None = None
    """Address other nodes reach this node at; ``None``: this host's FQDN."""

    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    """Rendezvous timing."""

    etcd_options: dict[str, Any] = field(default_factory=dict)
    """TLS/auth/timeouts for the etcd client (see :func:`etcd_settings_from`)."""

    log_dir: str | None = None
    """Where worker logs go; ``None``: inherit the terminal."""

    redirects: str = "0"
    """torch's ``Std`` spelling (``0``-``3``, or ``local_rank:std,...``): worker streams written
    to per-rank files under ``log_dir`` instead of the terminal."""

    tee: str = "0"
    """As ``redirects``, but the streams go to the files and to the terminal."""

    local_ranks_filter: tuple[int, ...] = ()
    """Only these local ranks print on the terminal (the others to their files); empty: all."""

    role: str = "trainer"
    """The workers' role name (``ROLE_NAME``)."""

    metrics_port: int | None = None
    """Serve this agent's Prometheus metrics on this port; ``None``: no endpoint."""

    join: bool = False
    """Whether this node may join a job already training under ``run_id``."""

    event_log: str | None = None
    """JSON-lines file for this run's events; ``None``: Python logging only."""

    node_name: str | None = None
    """Names this node in logs and events; ``None``: the hostname."""

    def __post_init__(self) -> None:
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.min_nodes > self.max_nodes:
            raise ConfigError(
                f"--min-nodes ({self.min_nodes}) must not exceed --max-nodes ({self.max_nodes})"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be a non-negative integer, got {self.max_restarts!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ConfigError(f"--recovery must be one of {', '.join(RECOVERY_MODES)}, got {self.recovery!r}")
        validate_run_id(self.run_id)
        self._check_entry()
        if self.etcd is not None:
            etcd_settings_from(self.etcd_options, self.etcd)  # validates the endpoint list

    def _check_entry(self) -> None:
        if self.entry == "module":
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", self.script):
                raise ConfigError(f"-m/--module takes a module name (pkg.mod), got {self.script!r}")
            # Where a worker looks (`python -m` puts the working directory first). Only the top
            # package: finding a submodule would import (run) its package here.
            top = self.script.partition(".")[0]
            if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None and \
                    top not in sys.builtin_module_names:
                raise ConfigError(f"-m/--module {self.script}: no module named {top!r} in the working directory "
                                  "or on this Python's path")
            return
        if self.entry == "program":
            if not shutil.which(self.script):
                raise ConfigError(f"--no-python: program {self.script!r} is not an executable file or on PATH")
            return
        if os.path.isdir(self.script):
            raise ConfigError(f"training script {self.script!r} is a directory, not a Python file (.py)")
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script {self.script!r} does not exist")
        if not self.script.endswith(".py"):
            raise ConfigError(f"training script {self.script!r} is not a Python file (.py); for a module "
                              "pass -m, for a program --no-python")
