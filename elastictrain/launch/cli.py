"""``elastictrain`` command line: run each subcommand, and turn what goes wrong into one line
and an exit code.

Subcommands (their flags: :mod:`elastictrain.launch.arguments`):

- ``run``: launch this node's agent (or ``--local-nodes N`` agents) for a script;
  with no ``--etcd`` a private etcd server is started and stopped with the job.
- ``status``, ``stop``: show a run as etcd holds it; close it (or purge its keys).
- ``etcd``: run an etcd server in the foreground, for multi-node trials on one
  machine or a quick shared rendezvous point.
- ``checkpoint export``: write a checkpoint's model to one safetensors file.
- ``chaos``: handed to :mod:`elastictrain.chaos` whole.

Errors are one line and a non-zero exit; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastictrain.launch import _logging
from elastictrain.launch.arguments import (
    build_parser,
    etcd_options,
    node_args,
    precheck,
    resolve_torchrun_spellings,
    run_config,
)
from elastictrain.launch.config import check_writable_dir, default_local_addr
from elastictrain.launch.failure_report import OUTCOME_FILE_ENV
from elastictrain.errors import ConfigError, ElasticTrainError
from elastictrain.train.progress import PROGRESS_ENV

if TYPE_CHECKING:
    from elastictrain.etcd.server import EtcdServerOptions

logger = logging.getLogger(__name__)

__all__ = ["main"]

_EXIT_USAGE = 2

_QUERY_RETRY_DEADLINE_S = 10
"""How long ``status`` and ``stop`` retry an etcd that does not answer, unless ``--rdzv-conf
retry_deadline=`` says otherwise: long enough for a leader election, short enough that a
wrong port is reported while the user still waits for the answer (nodes keep 30 s)."""


def _check_event_log(path: str) -> None:
    """Make the event log's directory and check that the file takes appends, before any process starts."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as exc:
        # makedirs says "File exists" where a file stands in the way of the directory
        reason = "a file stands where its directory would be" if isinstance(exc, FileExistsError) else (
            exc.strerror or exc)
        raise ConfigError(f"cannot write the event log {path!r}: {reason}; pass --event-log with a "
                          "path in a writable directory") from None


def _check_local_addr(address: str) -> None:
    """``--local-addr`` resolves: other nodes are told to reach this one there, and a name that
    does not resolve left the job retrying its store connection for minutes."""
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--local-addr {address!r} does not resolve to an address: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None


def _check_metrics_ports(first: int, count: int) -> None:
    """``--metrics-port`` (and the next ones, one per local node) free, and ``prometheus_client``
    there, before any process starts."""
    import importlib.util

    if first + count - 1 > 65535:
        raise ConfigError(f"--metrics-port {first} with {count} local nodes needs ports up to {first + count - 1}, "
                          "beyond 65535")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("--metrics-port needs the prometheus_client package: pip install 'elastictrain[metrics]'")
    for port in range(first, first + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError as exc:
                raise ConfigError(f"--metrics-port {port}: cannot serve metrics there: {exc.strerror or exc}") from None


class _Stopped(BaseException):
    """SIGTERM or SIGHUP before torch's agent handles them (it raises its own SignalException
    once workers start): a BaseException, so that every ``finally`` on the way runs (the
    private etcd is stopped and its data removed) and no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signal(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _cmd_run(args: argparse.Namespace) -> int:
    # Python's default for SIGTERM ends the process at once: no finally, the private etcd's
    # data left in /tmp (a node forks its workers' forkserver with these, which resets them).
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = {signum: signal.signal(signum, _stop_on_signal) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace) -> int:
    from elastictrain.etcd.server import EtcdServer

    _logging.quiet_torch_cpp()  # before anything here imports torch
    resolve_torchrun_spellings(args)
    embedded = args.standalone or not args.etcd
    etcd = None if embedded else args.etcd
    if not embedded and not args.run_id:
        raise ConfigError("--run-id is required with --etcd: every node of one job must pass the same one")
    run_id = args.run_id or "local"
    local_addr = args.local_addr or ("127.0.0.1" if embedded else default_local_addr(etcd))  # type: ignore[arg-type]
    # Validate everything before starting any process; a private etcd's address comes later.
    config = run_config(args, etcd=etcd or "127.0.0.1", run_id=run_id, local_addr=local_addr)
    _check_event_log(str(config.event_log))
    if config.log_dir:
        check_writable_dir(config.log_dir, "--log-dir")
    if args.local_addr:
        _check_local_addr(args.local_addr)
    if config.metrics_port:
        _check_metrics_ports(config.metrics_port, args.local_nodes or 1)
    nodes_here = args.local_nodes or 1
    if embedded and nodes_here < config.min_nodes:
        raise ConfigError(
            f"a private etcd serves only this machine, so --min-nodes {config.min_nodes} can never gather: "
            f"pass --local-nodes {config.min_nodes}, or start `elastictrain etcd --host 0.0.0.0` and give "
            "every node --etcd HOST:PORT"
        )

    server: EtcdServer | None = None
    try:
        if embedded:
            server = EtcdServer().start()
            logger.info("private etcd at %s (stopped when the job ends)", server.endpoint)
            endpoint = server.endpoint
        else:
            endpoint = etcd  # type: ignore[assignment]
        if args.no_progress:
            os.environ[PROGRESS_ENV] = "0"  # read by the session in every worker
        if args.local_nodes:
            from elastictrain.launch.local_cluster import run_local_nodes

            children = node_args(args.run_parser, args, endpoint=endpoint, run_id=run_id, local_addr=local_addr)
            port = args.metrics_port
            return run_local_nodes(args.local_nodes, children,
                                   per_node=(lambda i: [f"--metrics-port={port + i}"]) if port else None,
                                   log_dir=os.path.dirname(os.path.abspath(config.event_log)),
                                   summary=lambda since, seconds, finished: print_summary(
                                       str(config.event_log), since=since, seconds=seconds, finished=finished))
        from elastictrain.launch import node_setup

        node_log = _node_log_path(config)
        _logging.log_to_file(node_log)

        started, started_at = time.monotonic(), time.time()
        node = node_setup.prepare(config)
        try:
            from elastictrain.launch.launcher import launch

            outcome = launch(config, endpoint, node)
        finally:
            node.close()
        elapsed = time.monotonic() - started
        if OUTCOME_FILE_ENV not in os.environ:  # a --local-nodes launcher sums up its nodes once
            print_summary(str(config.event_log), since=started_at, seconds=elapsed,
                          finished=outcome.exit_code == 0, node_log=node_log)
        _report_outcome(outcome, elapsed)
        return outcome.exit_code
    finally:
        if server is not None:
            server.stop()


def print_summary(event_log: str, *, since: float, seconds: float, finished: bool,
                  node_log: str | None = None) -> None:
    """The run summary (:mod:`elastictrain.launch.run_summary`) of the events since ``since``,
    and where this node's log is (a --local-nodes launcher names its nodes' logs as they start)."""
    from elastictrain.launch.run_summary import read_events, summarize

    lines, traceback = summarize(read_events(event_log, since), seconds=seconds, finished=finished)
    if node_log:
        lines.append(f"  this node's log (torch's own lines too; -v shows them here): {node_log}")
    for line in lines:
        logger.info("%s", line)
    if traceback:
        print(traceback, file=sys.stderr, flush=True)


def _node_log_path(config: Any) -> str:
    """The node's log file: beside the run's event log, named for the node."""
    name = config.node_name or socket.gethostname()
    return os.path.join(os.path.dirname(os.path.abspath(config.event_log)), f"{name}.log")


def _report_outcome(outcome: Any, elapsed: float) -> None:
    """Say how this node's part of the job ended: one line, after the root cause's traceback.

    Under a ``--local-nodes`` launcher a failure goes to the launcher instead (it reports
    the whole job once, with the root cause among every node's failures)."""
    from elastictrain.launch import failure_report

    outcome_file = os.environ.get(failure_report.OUTCOME_FILE_ENV)
    if outcome_file and outcome.exit_code != 0:
        failure_report.write_outcome(outcome_file, exit_code=outcome.exit_code, summary=outcome.summary,
                                     restarts=outcome.restarts, failures=outcome.failures)
        logger.debug("%s (%.1fs)", outcome.summary, elapsed)
        return
    if outcome.exit_code == 0:
        logger.info("%s (%.1fs)", outcome.summary, elapsed)
        return
    if outcome.failures:
        text = failure_report.report(list(outcome.failures), outcome.restarts)
        head, _, last = text.rpartition("\n")
        if head:
            print(head, file=sys.stderr, flush=True)
        logger.error("%s (%.1fs)", last, elapsed)
        return
    logger.error("%s (%.1fs)", outcome.summary, elapsed)


def _client_for(args: argparse.Namespace) -> Any:
    from elastictrain.etcd.conf import etcd_settings_from
    from elastictrain.etcd.client import connect

    if not args.etcd:
        raise ConfigError("--etcd HOST:PORT is required")
    options = etcd_options(args)
    options.setdefault("retry_deadline", _QUERY_RETRY_DEADLINE_S)
    return connect(etcd_settings_from(options, args.etcd))


def _cmd_status(args: argparse.Namespace) -> int:
    from elastictrain.launch import status_report
    from elastictrain.launch.run_state import read_every_status, read_status

    if args.verify_checksums and not args.checkpoint_dir:
        raise ConfigError("--verify-checksums needs --checkpoint-dir (the directory whose checkpoint to verify)")
    if args.all and args.run_id:
        raise ConfigError(f"--all lists every run: pass --run-id {args.run_id} without --all to show that run")
    if args.all and args.checkpoint_dir:
        raise ConfigError("--checkpoint-dir goes with --run-id, not --all")
    if args.checkpoint_dir and not args.checkpoint_dir.startswith("s3://") and not os.path.isdir(args.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir!r} is not a directory")
    client = _client_for(args)
    if args.all:
        runs = read_every_status(client)
        print(json.dumps([r.to_json() for r in runs], indent=2) if args.json else status_report.runs_table(runs))
        return 0
    if not args.run_id:
        raise ConfigError("--run-id is required (or --all)")
    status = read_status(client, args.run_id)
    checkpoint = status_report.newest_checkpoint(
        args.checkpoint_dir, checksums=args.verify_checksums) if args.checkpoint_dir else None
    if args.json:
        print(json.dumps({**status.to_json(), "checkpoint": checkpoint}, indent=2))
    else:
        print(status_report.run_table(status, checkpoint, args.checkpoint_dir))
    return 0 if status.exists else 1


def _cmd_stop(args: argparse.Namespace) -> int:
    from elastictrain.launch.run_state import purge, read_status, request_stop

    if not args.run_id:
        raise ConfigError("--run-id is required")
    client = _client_for(args)
    status = read_status(client, args.run_id)
    if not status.exists:
        print(f"elastictrain: run {args.run_id!r} has no keys on {args.etcd}; nothing to stop", file=sys.stderr)
        return 1
    if args.purge and status.live:
        raise ConfigError(f"run {args.run_id!r} is training; stop it first (without --purge), then purge it")
    if args.purge:
        deleted = purge(client, args.run_id)
        print(f"deleted {deleted} key(s) of run {args.run_id!r}; the run id is free again")
        return 0
    request_stop(client, args.run_id)
    print(f"run {args.run_id!r} closed: its agents stop their workers and exit 0")
    return 0


def _etcd_server_options(args: argparse.Namespace) -> EtcdServerOptions:
    """``elastictrain etcd``'s flags as :class:`EtcdServerOptions`, after the checks.

    A server that other hosts reach must encrypt and authenticate (TLS and client
    certificates) unless ``--insecure`` says the network is trusted, and keeps its
    data, fsynced: losing the rendezvous of a running job to a power cut is not a
    trade for speed there. On loopback it is a throwaway for trials on one machine.
    """
    from elastictrain._addresses import is_loopback
    from elastictrain.etcd.conf import check_readable_file
    from elastictrain.etcd.server import EtcdServerOptions

    if bool(args.cert_file) != bool(args.key_file):
        raise ConfigError("--cert-file and --key-file go together: a server certificate and its private key")
    if args.client_cert_auth and not (args.trusted_ca_file and args.cert_file):
        raise ConfigError("--client-cert-auth needs --trusted-ca-file (the CA of the clients' certificates) "
                          "and TLS (--cert-file, --key-file)")
    extra: list[str] = []
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path:
            check_readable_file(path, flag)
            extra += [flag, os.path.abspath(path)]
    if args.client_cert_auth:
        extra.append("--client-cert-auth")
    serves_others = not is_loopback(args.host)
    if serves_others and not args.insecure and not (args.cert_file and args.client_cert_auth):
        raise ConfigError(
            f"refusing to serve etcd on {args.host} without TLS and client certificates: whoever reaches port "
            f"{args.port} could read, rewrite or stop every run; pass --cert-file, --key-file, --trusted-ca-file "
            "and --client-cert-auth, or --insecure on a trusted network"
        )
    data_dir = args.data_dir or (os.path.join("elastictrain-runs", f"etcd-{args.port}") if serves_others else None)
    if data_dir:
        check_writable_dir(data_dir, "--data-dir")
    return EtcdServerOptions(host=args.host, client_port=int(args.port), data_dir=data_dir, extra_args=extra)


def _cmd_etcd(args: argparse.Namespace) -> int:
    from elastictrain.errors import EtcdServerError
    from elastictrain.etcd.server import EtcdServer

    server = EtcdServer(_etcd_server_options(args))
    # Before anything is printed: whoever read "serving at" may send SIGTERM at once.
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    server.start()
    if server.durable:
        kept = f"data in {server.options.data_dir} (kept, fsynced)"
    else:
        kept = "data in a temporary directory, without fsync (for trials on this machine)"
    tls = " over TLS" if server.client_url.startswith("https") else ""
    print(f"etcd serving at {server.endpoint}{tls} (pid {server.pid}); {kept}; Ctrl-C stops it", flush=True)
    host = socket.gethostname() if args.host in {"0.0.0.0", "::"} else server.endpoint.rpartition(":")[0]
    tls_flags = (" --etcd-ca-cert CA" if args.cert_file else "") + (
        " --etcd-cert CERT --etcd-key KEY" if args.client_cert_auth else "")
    print(f"  nodes join with: elastictrain run --etcd {host}:{args.port}{tls_flags} --run-id NAME ...", flush=True)
    try:
        while not stop and server.is_running():
            time.sleep(0.2)
        if not stop:
            raise EtcdServerError(f"etcd at {server.endpoint} exited on its own with code {server.returncode}: "
                                  f"{server.exit_reason()}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.checkpoint_command != "export":
        raise ConfigError("checkpoint needs an action: export (elastictrain checkpoint export --help)")
    from elastictrain.checkpoint import export_safetensors

    try:
        info = export_safetensors(args.directory, args.out, step=args.step, entry=args.entry)
    except OSError as exc:  # OUT cannot be written, or the storage failed
        raise ElasticTrainError(f"cannot export {args.directory} to {args.out}: {exc}") from exc
    print(f"wrote {info.tensors} tensors ({info.bytes / 1e6:.1f} MB) of step {info.step} to {args.out}")
    return 0


def _command(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "etcd":
        return _cmd_etcd(args)
    if args.command == "status":
        return _cmd_status(args)
    if args.command == "stop":
        return _cmd_stop(args)
    if args.command == "checkpoint":
        return _cmd_checkpoint(args)
    build_parser().print_help()
    return _EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastictrain`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chaos"]:
        from elastictrain.chaos.__main__ import main as chaos_main

        return chaos_main(argv[1:])
    debug = os.environ.get("ELASTICTRAIN_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        parser = build_parser()
        precheck(parser, argv)
        args = parser.parse_args(argv)
        debug = debug or args.debug
        if getattr(args, "verbose", False):
            os.environ[_logging.VERBOSE_ENV] = "1"  # the node's workers and --local-nodes children too
        _logging.setup(debug=debug, node=getattr(args, "node_name", None))
        code = _command(args)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader closed our stdout (`elastictrain status | head -1`): nobody is left to
        # tell; exit as a process killed by SIGPIPE would, without Python's shutdown noise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ConfigError as exc:
        if debug:
            raise
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except ElasticTrainError as exc:
        if debug:
            raise
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _stopped_by(signal.SIGINT, "interrupted")
    except _Stopped as exc:
        return _stopped_by(signal.Signals(exc.signum), f"stopped by {signal.Signals(exc.signum).name}")
    except Exception as exc:
        # torch's agent turns SIGTERM/SIGHUP/SIGQUIT into a SignalException: one line, 128+N.
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if debug or not isinstance(exc, SignalException):
            raise
        return _stopped_by(exc.sigval, f"stopped by {exc.sigval.name}; workers were stopped")


def _stopped_by(signum: signal.Signals, what: str) -> int:
    """Say that a signal stopped this process (once per job: a node that a ``--local-nodes``
    launcher started leaves it to the launcher); return 128+N."""
    from elastictrain.launch.failure_report import OUTCOME_FILE_ENV

    if OUTCOME_FILE_ENV in os.environ:
        logger.debug("%s", what)
    else:
        print(f"elastictrain: {what}", file=sys.stderr)
    return 128 + int(signum)

