"""Frozen configuration of a run, with validation and the defaults we chose.

Durations are ``timedelta``. Every value is checked once, here; bad input raises
:class:`~elastictrain.errors.ConfigError` naming the value.

Rendezvous defaults differ from torch's on purpose (see README, "Defaults"):
torch waits 30 s of ``last_call`` whenever fewer than ``max_nodes`` join and
notices a dead node after 5 s x 3 missed heartbeats; we use 1 s and 1 s x 5, so
a failed node costs seconds, not minutes. (1 s x 3 was measured too tight: on a
loaded 2-core machine an agent's heartbeats stalled for up to 3.8 s while its
workers started, and the other nodes dropped it from the rendezvous.)
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
from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError
from elastictrain.etcd.client import Endpoint, EtcdSettings, parse_endpoints
from elastictrain.rendezvous.keys import validate_run_id

__all__ = ["ETCD_CONF_KEYS", "ETCD_PASSWORD_ENV", "RendezvousConfig", "RunConfig",
           "check_conf_keys", "check_readable_file", "check_writable_dir", "default_local_addr", "etcd_settings_from",
           "take_etcd_password"]

ETCD_PASSWORD_ENV = "ELASTICTRAIN_ETCD_PASSWORD"


def _positive_int(name: str, value: Any) -> int:
    try:
        number = value if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    """Timing of the etcd3 rendezvous (``elastictrain.rendezvous.handler``)."""

    join_timeout: timedelta = timedelta(seconds=600)
    """How long a node waits for ``min_nodes`` to gather before giving up."""

    last_call_timeout: timedelta = timedelta(seconds=1)
    """Extra wait for latecomers once ``min_nodes`` are there (torch: 30 s)."""

    keep_alive_interval: timedelta = timedelta(seconds=1)
    """Period of each node's lease keep-alive (torch's heartbeat: 5 s)."""

    keep_alive_max_attempt: int = 5
    """The node's liveness lease lives this many intervals: etcd expires it (the node is
    gone) after this many keep-alives in a row were lost or late. 5 s by default."""

    state_ttl: timedelta = timedelta(hours=2)
    """Lifetime of the run's etcd keys once no node keeps them alive."""

    def __post_init__(self) -> None:
        for name in ("join_timeout", "last_call_timeout", "keep_alive_interval", "state_ttl"):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise ConfigError(f"{name} must be a timedelta, got {value!r}")
        if self.keep_alive_interval.total_seconds() <= 0:
            raise ConfigError("keep_alive_interval must be positive")
        if self.join_timeout.total_seconds() <= 0:
            # 0 timed the first round out before a node could form it, blaming a stale run
            raise ConfigError(f"join_timeout (--join-timeout) must be positive, got {self.join_timeout.total_seconds():g} s")
        if self.keep_alive_max_attempt < 2:
            # With one attempt a single late keep-alive expires a live node.
            raise ConfigError(
                f"keep_alive_max_attempt must be at least 2, got {self.keep_alive_max_attempt}"
            )
        window = self.liveness_ttl.total_seconds()
        if window < 2:
            # etcd rounds a shorter lease up to its own minimum (1.5 x its election
            # timeout; 1.5 s by default), and a busy machine stalls a keep-alive thread
            # for a second or more: a shorter lease drops live nodes.
            raise ConfigError(
                f"keep_alive_interval x keep_alive_max_attempt must be at least 2 s, got {window:g} s"
            )
        if self.state_ttl.total_seconds() < 10:
            raise ConfigError(f"state_ttl must be at least 10 s, got {self.state_ttl.total_seconds():g} s")

    @property
    def liveness_ttl(self) -> timedelta:
        """TTL of each node's liveness lease: ``keep_alive_interval x keep_alive_max_attempt``."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    _KEYS = ("join_timeout", "last_call_timeout", "keep_alive_interval", "keep_alive_max_attempt", "state_ttl")

    @classmethod
    def from_mapping(cls, conf: dict[str, Any]) -> RendezvousConfig:
        """Build from ``--rdzv-conf``-style keys (values in seconds, strings allowed)."""
        kwargs: dict[str, Any] = {}
        for key in cls._KEYS:
            if key in conf and conf[key] is not None:
                if key == "keep_alive_max_attempt":
                    kwargs[key] = _positive_int(key, conf[key])
                else:
                    kwargs[key] = parse_duration(key, conf[key])
        return cls(**kwargs)

    def as_mapping(self) -> dict[str, Any]:
        """The inverse of :meth:`from_mapping` (seconds as floats)."""
        out: dict[str, Any] = {}
        for key in self._KEYS:
            value = getattr(self, key)
            out[key] = value.total_seconds() if isinstance(value, timedelta) else value
        return out


# The etcd client keys of --rdzv-conf, read by etcd_settings_from (next to RendezvousConfig._KEYS).
ETCD_CONF_KEYS = ("request_timeout", "retry_deadline", "ca_cert", "client_cert", "cert", "client_key", "key",
                  "user", "password")


def check_conf_keys(conf: dict[str, Any]) -> None:
    """Raises:
        ConfigError: ``conf`` (``--rdzv-conf``) has a key neither the rendezvous nor the etcd client reads.
    """
    valid = (*RendezvousConfig._KEYS, *ETCD_CONF_KEYS)  # noqa: SLF001
    unknown = sorted(set(conf) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                          f"valid keys: {', '.join(valid)}")


def _endpoints(text: str) -> tuple[Endpoint, ...]:
    try:
        return tuple(parse_endpoints(text))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def etcd_settings_from(conf: dict[str, Any], endpoints: str) -> EtcdSettings:
    """Build :class:`EtcdSettings` from an endpoint list and ``--rdzv-conf``-style keys.

    TLS and auth come from the keys ``ca_cert``, ``cert``/``client_cert``,
    ``key``/``client_key``, ``user``, ``password``, each falling back to
    ``ELASTICTRAIN_ETCD_<KEY>``; a password should come from the environment,
    not a command line that ``ps`` shows.
    """

    def pick(*keys: str) -> str | None:
        for key in keys:
            if conf.get(key):
                return str(conf[key])
        for key in keys:
            env = os.environ.get(f"ELASTICTRAIN_ETCD_{key.upper()}")
            if env:
                return env
        return None

    parsed = _endpoints(endpoints)
    kwargs: dict[str, Any] = {}
    if conf.get("request_timeout") is not None:
        kwargs["request_timeout"] = parse_duration("request_timeout", conf["request_timeout"], minimum=0.01)
    if conf.get("retry_deadline") is not None:
        kwargs["retry_deadline"] = parse_duration("retry_deadline", conf["retry_deadline"])
    settings = EtcdSettings(
        endpoints=parsed,
        ca_cert=pick("ca_cert"),
        cert_cert=pick("client_cert", "cert"),
        cert_key=pick("client_key", "key"),
        user=pick("user"),
        password=pick("password"),
        **kwargs,
    )
    _check_etcd_security(settings, endpoints)
    return settings


def _check_etcd_security(settings: EtcdSettings, endpoints: str) -> None:
    """Refuse TLS and auth settings that etcd3 would ignore, misuse or crash on.

    Raises:
        ConfigError: A half-given pair, an unreadable file, or TLS asked for without a CA.
    """
    if (settings.cert_cert is None) != (settings.cert_key is None):
        given, missing = ("--etcd-cert", "--etcd-key") if settings.cert_key is None else ("--etcd-key", "--etcd-cert")
        raise ConfigError(f"{given} needs {missing}: a client certificate and its private key go together")
    if settings.cert_cert is not None and settings.ca_cert is None:
        raise ConfigError("--etcd-cert and --etcd-key need --etcd-ca-cert (the CA that signed etcd's certificate): "
                          "without it the client would not use TLS at all")
    if settings.ca_cert is None and "https://" in endpoints:
        # etcd3 would open a plain-text channel. Public CAs are not trusted implicitly:
        # pass the system bundle if one of them signed etcd's certificate.
        raise ConfigError(f"etcd endpoint {endpoints!r} asks for TLS (https://): pass --etcd-ca-cert with the CA that "
                          "signed etcd's certificate (the system bundle, e.g. /etc/ssl/certs/ca-certificates.crt, "
                          "for a public CA)")
    # Given as flags or in --rdzv-conf (torchrun's only way): name both spellings.
    for flag, path in (("--etcd-ca-cert (ca_cert)", settings.ca_cert), ("--etcd-cert (client_cert)", settings.cert_cert),
                       ("--etcd-key (client_key)", settings.cert_key)):
        if path is not None:
            check_readable_file(path, flag)
    if settings.user and not settings.password:
        raise ConfigError(f"--etcd-user {settings.user!r} needs its password in {ETCD_PASSWORD_ENV}")
    if settings.password and not settings.user:
        raise ConfigError(f"{ETCD_PASSWORD_ENV} is set but no etcd user was given: pass --etcd-user, or unset the variable")


def check_readable_file(path: str, flag: str) -> None:
    """Raises:
        ConfigError: ``path`` (given as ``flag``) cannot be opened for reading.
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path!r}: {exc.strerror or exc}") from None


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
    parsed = _endpoints(endpoints)
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
