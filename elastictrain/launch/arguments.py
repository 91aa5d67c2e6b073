"""The ``elastictrain`` command line's flags: the parser of every subcommand, the checks of
``run``'s flags as a whole, and ``run``'s flags made into a :class:`RunConfig` (or into the
flags of each ``--local-nodes`` child).

Every flag falls back to ``ELASTICTRAIN_<FLAG>`` (``--min-nodes`` ->
``ELASTICTRAIN_MIN_NODES``); a flag beats the variable, the variable beats the default.
torchrun's spellings are accepted where they mean the same, and refused with the reason
where they do not.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from elastictrain._durations import parse_duration
from elastictrain.launch.config import RunConfig
from elastictrain.rendezvous.config import RendezvousConfig, check_conf_keys
from elastictrain.errors import ConfigError

__all__ = ["build_parser", "check_run_flags", "etcd_options", "node_args", "precheck",
           "resolve_torchrun_spellings", "run_config"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors stay one line, and
    that names the flag a mistyped one was probably meant to be (argparse's ``suggest_on_error``
    arrives only with Python 3.14)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # `run`'s script arguments are optional; argparse names them with the script.
        raise ConfigError(message.replace("required: script, script_args", "required: script"))

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """See base class; unknown flags are reported with a suggestion from the flags of the
        subcommand given (see :func:`_unrecognized`)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser: argparse.ArgumentParser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 - no public handle
                    parser = action.choices.get(getattr(parsed, action.dest, None) or "", self)
            raise ConfigError(_unrecognized(extras, _flags_of(parser)))
        return parsed


def _flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags ``parser`` accepts (torchrun's spellings included, refused ones not)."""
    return [option for action in parser._actions for option in action.option_strings  # noqa: SLF001
            if option.startswith("--") and option not in _REFUSED_SPELLINGS]


def _unrecognized(unknown: Sequence[str], flags: Sequence[str]) -> str:
    """``unrecognized arguments: A B``, and for each unknown flag close to a known one (by
    ``difflib``'s ratio): ``A: did you mean --flag?``."""
    hints = []
    for word in unknown:
        name = word.partition("=")[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75) if name.startswith("--") else []
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *hints])


def _env(dest: str, default: Any) -> Any:
    return os.environ.get(f"ELASTICTRAIN_{dest.upper()}", default)


def _add(parser: argparse.ArgumentParser, flag: str, *aliases: str, default: Any, help: str, **kwargs: Any) -> None:
    """A flag (and its torchrun spellings in ``aliases``) falling back to ``ELASTICTRAIN_<FLAG>``."""
    dest = flag.lstrip("-").replace("-", "_")
    value = _env(dest, default)
    shown = "none" if default is None else default
    parser.add_argument(flag, dest=dest, default=value,
                        help=f"{help} (default: {shown}; env ELASTICTRAIN_{dest.upper()})", **kwargs)
    _add_aliases(parser, aliases, dest, **kwargs)


def _add_aliases(parser: argparse.ArgumentParser, aliases: Sequence[str], dest: str, **kwargs: Any) -> None:
    """torchrun's other spellings of a flag: the same ``dest``, not in ``--help``, and an error
    names the spelling the user typed."""
    for alias in aliases:
        parser.add_argument(alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def _add_switch(parser: argparse.ArgumentParser, flag: str, *aliases: str, help: str) -> None:
    """An on/off flag that ``ELASTICTRAIN_<FLAG>=1`` (or true/yes) also turns on."""
    dest = flag.lstrip("-").replace("-", "_")
    default = _env(dest, "").strip().lower() in {"1", "true", "yes", "on"}
    short = [a for a in aliases if not a.startswith("--")]  # shown in --help: -v, --verbose
    parser.add_argument(*short, flag, dest=dest, action="store_true", default=default,
                        help=f"{help} (env ELASTICTRAIN_{dest.upper()}=1)")
    _add_aliases(parser, [a for a in aliases if a.startswith("--")], dest, action="store_true")


# torchrun flags that have no meaning here, and why: refused in one line each.
_REFUSED = {
    "--master-addr": "--master-addr/--master-port: not needed, the rendezvous (etcd) picks rank 0's address "
                     "and a free port every round",
    "--node-rank": "--node-rank: node ranks are assigned by the rendezvous, in the order nodes join, anew "
                   "every round",
}
_REFUSED_SPELLINGS = {"--master-addr": "--master-addr", "--master_addr": "--master-addr",
                      "--master-port": "--master-addr", "--master_port": "--master-addr",
                      "--node-rank": "--node-rank", "--node_rank": "--node-rank"}


def _nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        bounds = (0, 0)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


def _nproc(text: str) -> int | str:
    """torchrun's ``--nproc-per-node``: a positive integer, ``auto``, ``gpu`` or ``cpu``."""
    if text in {"auto", "gpu", "cpu"}:
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, auto, gpu or cpu, got {text!r}") from None


def _std(text: str) -> str:
    """torchrun's ``--redirects``/``--tee``: 0-3 (none, stdout, stderr, both), or per local rank
    ``0:1,1:2``."""
    if not re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", text.strip()):
        raise argparse.ArgumentTypeError(f"expected 0 (none), 1 (stdout), 2 (stderr), 3 (both) or "
                                         f"LOCAL_RANK:N,..., got {text!r}")
    return text.strip()


def _int_set(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        ranks = ()
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"expected local ranks as N[,N...], got {text!r}")
    return ranks


def _rdzv_backend(text: str) -> str:
    if text not in {"etcd3", "etcd-v3"}:
        raise argparse.ArgumentTypeError(f"elastictrain run always uses its etcd3 rendezvous, got {text!r}; for "
                                         "another backend use torchrun")
    return text


class _Refused(argparse.Action):
    """A torchrun flag with no meaning here (see ``_REFUSED``); the pre-scan of ``run``'s
    arguments reports it, with every other bad flag, in one line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise ConfigError(_REFUSED[_REFUSED_SPELLINGS[option_string or ""]])


def _int_at_least(minimum: int, kind: str, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum`` (and <= ``maximum``), described as ``kind``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "positive")
_non_negative_int = _int_at_least(0, "non-negative")
_port = _int_at_least(1, "port (1-65535)", 65535)


def _kv_pairs(text: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value[,key=value...], got {item!r}")
        pairs[key.strip()] = value.strip()
    try:
        check_conf_keys(pairs)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return pairs


def _add_etcd_security(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--etcd-ca-cert", default=None, help="CA certificate that signed etcd's server certificate; enables TLS")
    _add(parser, "--etcd-cert", default=None, help="client certificate for etcd mutual TLS")
    _add(parser, "--etcd-key", default=None, help="private key of --etcd-cert")
    _add(parser, "--etcd-user", default=None, help="etcd user; its password comes from ELASTICTRAIN_ETCD_PASSWORD only")


def _add_etcd_client(parser: argparse.ArgumentParser) -> None:
    """Flags of the commands that only talk to an existing etcd (status, stop)."""
    _add_switch(parser, "--debug", help="show tracebacks and debug logs")
    _add(parser, "--etcd", default=None, help="etcd endpoints host:port[,host:port...] (required)")
    _add(parser, "--run-id", default=None, help="the run to act on")
    _add(parser, "--rdzv-conf", default="", type=_kv_pairs, help="etcd client settings as key=value,... (request_timeout, retry_deadline, ...)")
    _add_etcd_security(parser)


def etcd_options(args: argparse.Namespace) -> dict[str, Any]:
    """etcd client settings from ``--rdzv-conf`` and the ``--etcd-*`` flags."""
    rdzv_keys = set(RendezvousConfig._KEYS)  # noqa: SLF001
    options = {k: v for k, v in args.rdzv_conf.items() if k not in rdzv_keys}
    for key, value in (("ca_cert", args.etcd_ca_cert), ("client_cert", args.etcd_cert),
                       ("client_key", args.etcd_key), ("user", args.etcd_user)):
        if value:
            options[key] = value
    return options


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``elastictrain`` and its subcommands (``chaos`` has its own)."""
    defaults = RendezvousConfig()
    parser = _Parser(prog="elastictrain", description="Fault-tolerant elastic training for PyTorch.")
    _add_switch(parser, "--debug", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run", allow_abbrev=False,
        epilog="torchrun's spellings are accepted too: the _ forms (--nproc_per_node, --rdzv_conf, --max_restarts, "
               "--monitor_interval, --local_addr, --log_dir, --local_ranks_filter, --no_python, --rdzv_backend), "
               "--rdzv-endpoint/--rdzv_endpoint for --etcd, --rdzv-id/--rdzv_id for --run-id, -m for --module, "
               "-r for --redirects, -t for --tee. --master-addr, --master-port and --node-rank are refused: the "
               "rendezvous picks rank 0's address and every node's rank each round.",
        help="launch an elastic training job",
        description="Launch this node's elastic agent (or several local ones) for SCRIPT.",
    )
    _add_switch(run, "--debug", help="show tracebacks and debug logs")
    _add_switch(run, "--verbose", "-v", help="show everything on the terminal: torch's C++ warnings and "
                "torch.elastic's own lines (otherwise in the node's log file, or dropped), and the long worker "
                "log prefix")
    _add(run, "--nnodes", default=None, type=_nnodes, help="torchrun's spelling of the node counts: N, or "
         "MIN:MAX (same as --min-nodes MIN --max-nodes MAX)")
    _add(run, "--min-nodes", default=None, type=_positive_int,
         help="fewest nodes the job trains with; none means --local-nodes N (no more than --max-nodes), else 1")
    _add(run, "--max-nodes", default=None, type=_positive_int, help="most nodes admitted; none means --min-nodes")
    _add(run, "--nproc-per-node", "--nproc_per_node", default=1, type=_nproc,
         help="workers (ranks) started on each node: N, or auto (one per GPU, else per CPU), gpu, cpu")
    _add(run, "--etcd", "--rdzv-endpoint", "--rdzv_endpoint", default=None,
         help="etcd endpoints host:port[,host:port...]; none starts a private etcd on this machine")
    _add(run, "--rdzv-backend", "--rdzv_backend", default="etcd3", type=_rdzv_backend,
         help="accepted for torchrun's sake; only etcd3")
    _add_switch(run, "--standalone", help="force a private etcd even if ELASTICTRAIN_ETCD is set")
    _add(run, "--run-id", "--rdzv-id", "--rdzv_id", default=None,
         help="job name shared by all its nodes; namespaces its etcd keys (required with --etcd)")
    _add(run, "--max-restarts", "--max_restarts", default=3, type=_non_negative_int, help="failures of this node's own workers the job survives (within --restart-window; with --recovery restart, torch's group restarts); a worker that failed because a peer went away is not its node's failure")
    _add(run, "--recovery", default="in-process", choices=("in-process", "restart"), help="in-process: workers keep their processes through faults and resizes; restart: every worker restarts from the last checkpoint")
    _add(run, "--restart-window", default=3600.0, type=float, help="seconds over which --max-restarts counts this node's failures (in-process recovery)")
    _add(run, "--local-nodes", default=None, type=_positive_int, help="start this many node agents on this machine (a multi-node job without several hosts)")
    _add(run, "--local-addr", "--local_addr", default=None, help="address other nodes reach this node at (default: this host's address on its route to etcd, 127.0.0.1 with a private etcd)")
    _add(run, "--monitor-interval", "--monitor_interval", default=0.1, type=float, help="longest wait between the agent's checks of its workers (in-process recovery acts sooner, on each change: a worker's state, a worker's end, the rendezvous)")
    _add(run, "--join-timeout", default=defaults.join_timeout.total_seconds(), type=float, help="seconds to wait for --min-nodes to gather")
    _add(run, "--last-call-timeout", default=defaults.last_call_timeout.total_seconds(), type=float, help="extra seconds to wait for more nodes once --min-nodes are there")
    _add(run, "--keep-alive-interval", default=defaults.keep_alive_interval.total_seconds(), type=float, help="seconds between node heartbeats; a node silent for 5 of them is dead")
    _add(run, "--rdzv-conf", "--rdzv_conf", default="", type=_kv_pairs, help="more rendezvous/etcd settings as key=value,... (e.g. ca_cert=...,request_timeout=5)")
    _add(run, "--log-dir", "--log_dir", default=None, help="directory for per-worker logs and error files (kept; "
         "without it a temporary one, removed when the node ends)")
    _add(run, "--redirects", "-r", default="0", type=_std, help="worker streams into per-rank files under "
         "--log-dir instead of the terminal: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:N,...")
    _add(run, "--tee", "-t", default="0", type=_std, help="as --redirects, but to the files and the terminal")
    _add(run, "--local-ranks-filter", "--local_ranks_filter", default=None, type=_int_set,
         help="only these local ranks (N[,N...]) print on the terminal; the others only to their files")
    _add(run, "--role", default="trainer", help="the workers' role name (ROLE_NAME)")
    _add(run, "--metrics-port", default=None, type=_port, help="serve this node agent's Prometheus "
         "metrics on this port (with --local-nodes N: PORT..PORT+N-1); needs prometheus_client")
    _add_switch(run, "--module", "-m", help="SCRIPT is a module name, run as python -m SCRIPT")
    _add_switch(run, "--no-python", "--no_python", help="SCRIPT is a program, executed as is (not by python)")
    _add_switch(run, "--no-progress", help="no progress line on rank 0 (it only shows on a terminal anyway)")
    _add_switch(run, "--join", help="join a job already training under --run-id (without it, a live run id is refused)")
    _add(run, "--event-log", default=None, help="JSON-lines event file of this run (default: elastictrain-runs/RUN_ID/events.jsonl)")
    _add_etcd_security(run)
    run.add_argument("--master-addr", "--master_addr", "--master-port", "--master_port", action=_Refused,
                     help=argparse.SUPPRESS)
    run.add_argument("--node-rank", "--node_rank", action=_Refused, help=argparse.SUPPRESS)
    run.add_argument("--node-name", default=None, help=argparse.SUPPRESS)
    run.set_defaults(run_parser=run)
    run.add_argument("script", help="training script (.py) each worker runs; a module with -m, a program with "
                     "--no-python")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    status = sub.add_parser("status", help="show a run's rendezvous, nodes and checkpoints",
                            description="Show what etcd knows about a run (or, with --all, list runs).")
    _add_etcd_client(status)
    _add_switch(status, "--all", help="list every run id on this etcd")
    _add(status, "--checkpoint-dir", default=None, help="also show the newest committed checkpoint in this directory or s3://bucket/prefix (its manifest and file sizes checked)")
    _add_switch(status, "--verify-checksums", help="with --checkpoint-dir: also check the sha256 of every file of that checkpoint (reads every byte)")
    _add_switch(status, "--json", help="print JSON instead of a table")

    stop = sub.add_parser("stop", help="close a run so that every node exits 0",
                          description="Close a run's rendezvous: its agents stop their workers and exit 0.")
    _add_etcd_client(stop)
    _add_switch(stop, "--purge", help="also delete every etcd key of the run (frees the run id)")

    # Parsed by elastictrain.chaos itself (see main()); listed here for --help.
    sub.add_parser("chaos", add_help=False, help="run a job under injected faults and check nothing was lost "
                   "(elastictrain chaos --help)")

    checkpoint = sub.add_parser("checkpoint", help="work with checkpoints (elastictrain checkpoint export --help)",
                                description="Work with the checkpoints of a CheckpointManager or Session.")
    actions = checkpoint.add_subparsers(dest="checkpoint_command", metavar="ACTION", parser_class=_Parser)
    export = actions.add_parser(
        "export", help="write a checkpoint's model to one safetensors file, for inference",
        description="Write the full tensors of a checkpoint's model (sharded or DDP) to one safetensors file.")
    export.add_argument("directory", metavar="DIR", help="a checkpoint directory (step_N), or the directory or "
                        "s3://bucket/prefix that holds them (then the newest committed one)")
    export.add_argument("out", metavar="OUT", help="the safetensors file to write (replaced if it exists)")
    _add(export, "--step", default=None, type=_non_negative_int, help="with a directory of checkpoints: this step's")
    _add(export, "--entry", default="model", help="the name the model was saved under in the checkpoint's state")

    etcd = sub.add_parser("etcd", help="run an etcd server in the foreground", description="Run an etcd server until Ctrl-C.")
    _add(etcd, "--host", default="127.0.0.1", help="address to listen on; one other hosts reach needs TLS and "
         "client certificates, or --insecure")
    _add(etcd, "--port", default=2379, type=_port, help="client port")
    _add(etcd, "--data-dir", default=None, help="data directory, fsynced (default: on a loopback --host a temporary "
         "one, removed on exit, without fsync; otherwise elastictrain-runs/etcd-PORT, kept)")
    _add(etcd, "--cert-file", default=None, help="server certificate: serve TLS (etcd's --cert-file)")
    _add(etcd, "--key-file", default=None, help="private key of --cert-file")
    _add(etcd, "--trusted-ca-file", default=None, help="CA that signs the clients' certificates")
    _add_switch(etcd, "--client-cert-auth", help="accept only clients with a certificate signed by --trusted-ca-file")
    _add_switch(etcd, "--insecure", help="serve other hosts without TLS and client certificates (a trusted network only)")
    return parser


def run_config(args: argparse.Namespace, *, etcd: str, run_id: str, local_addr: str | None) -> RunConfig:
    """``run``'s parsed flags (after :func:`resolve_torchrun_spellings`) as a :class:`RunConfig`.

    Raises:
        ConfigError: Flags that exclude each other, or a value out of range.
    """
    rdzv_keys = set(RendezvousConfig._KEYS)  # noqa: SLF001
    rdzv_conf = {k: v for k, v in args.rdzv_conf.items() if k in rdzv_keys}
    rdzv_conf.setdefault("join_timeout", args.join_timeout)
    rdzv_conf.setdefault("last_call_timeout", args.last_call_timeout)
    rdzv_conf.setdefault("keep_alive_interval", args.keep_alive_interval)
    if args.module and args.no_python:
        raise ConfigError("-m/--module and --no-python exclude each other: SCRIPT is a module or a program")
    return RunConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        entry="module" if args.module else "program" if args.no_python else "script",
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=tuple(args.local_ranks_filter or ()),
        role=args.role,
        metrics_port=args.metrics_port,
        min_nodes=int(args.min_nodes),
        max_nodes=int(args.max_nodes or args.min_nodes),
        nproc_per_node=int(args.nproc_per_node),
        run_id=run_id,
        etcd=etcd,
        max_restarts=int(args.max_restarts),
        recovery=args.recovery,
        restart_window=parse_duration("--restart-window", args.restart_window, minimum=1),
        monitor_interval=parse_duration("--monitor-interval", args.monitor_interval, minimum=0.01),
        local_addr=local_addr,
        rendezvous=RendezvousConfig.from_mapping(rdzv_conf),
        etcd_options=etcd_options(args),
        log_dir=args.log_dir,
        join=args.join,
        event_log=args.event_log or os.path.join("elastictrain-runs", run_id, "events.jsonl"),
        node_name=args.node_name,
    )


# Flags a --local-nodes child must not inherit: the parent decides them for it (--nnodes is
# resolved into --min-nodes/--max-nodes first).
_PARENT_ONLY = {"local_nodes", "standalone", "etcd", "run_id", "local_addr", "node_name", "help", "nnodes",
                "metrics_port"}


def resolve_torchrun_spellings(args: argparse.Namespace) -> None:
    """``--nnodes`` into ``--min-nodes``/``--max-nodes``, ``--nproc-per-node auto|gpu|cpu`` into a count,
    and the default ``--min-nodes``.

    ``--local-nodes N`` alone is a job of N nodes: with a default of 1, the first node formed a
    1-node job and the others waited for a place that never came, until the join timeout. Below
    N, ``--max-nodes`` caps the job and the other local nodes wait as its hot spares.
    """
    if args.nnodes is not None:
        if args.max_nodes is not None or args.min_nodes is not None:
            raise ConfigError("--nnodes and --min-nodes/--max-nodes say the same thing: pass one of them")
        args.min_nodes, args.max_nodes = args.nnodes
        args.nnodes = None
    if args.min_nodes is None:
        local = args.local_nodes or 1
        args.min_nodes = min(local, args.max_nodes) if args.max_nodes is not None else local
    if isinstance(args.nproc_per_node, str):
        args.nproc_per_node = _count_of(args.nproc_per_node)


def _count_of(kind: str) -> int:
    """Workers per node for torchrun's ``auto``, ``gpu`` and ``cpu``."""
    cpus = os.cpu_count() or 1
    if kind == "cpu":
        return cpus
    import torch  # only for these spellings: the CLI path does not import torch otherwise

    # NVML's count, which leaves CUDA uninitialized here: is_available() would initialize the
    # driver (cuInit), and the workers, forked from this process, could then not use CUDA.
    gpus = torch.cuda.device_count()
    if kind == "gpu" and gpus == 0:
        raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node; pass a number, cpu or auto")
    return gpus or cpus


def _check_run_arguments(run_parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Report every unknown or refused flag before SCRIPT in one line.

    argparse stops at the first unknown flag, and its value then passes for SCRIPT (so
    ``--nnodes 2 --bad x.py`` said only ``unrecognized arguments: --nnodes``)."""
    takes_value: dict[str, bool] = {}
    for action in run_parser._actions:  # noqa: SLF001 - argparse offers no public list
        for option in action.option_strings:
            takes_value[option] = action.nargs != 0
    unknown: list[str] = []
    refused: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--" or not token.startswith("-") or token == "-":
            break  # SCRIPT: what follows is the script's
        flag, eq, _ = token.partition("=")
        if flag in _REFUSED_SPELLINGS:
            reason = _REFUSED[_REFUSED_SPELLINGS[flag]]
            if reason not in refused:
                refused.append(reason)
            index += 1 if eq else 2
        elif flag in takes_value:
            index += 1 if (eq or not takes_value[flag]) else 2
        else:
            unknown.append(flag)
            following = argv[index + 1] if index + 1 < len(argv) else ""
            # Guess: an unknown flag followed by a word that is not a script takes it as its value.
            index += 2 if (not eq and following and not following.startswith("-")
                           and not following.endswith(".py") and index + 2 < len(argv)) else 1
    problems = ([_unrecognized(unknown, _flags_of(run_parser))] if unknown else []) + refused
    if problems:
        raise ConfigError("; ".join(problems))


def node_args(run_parser: argparse.ArgumentParser, args: argparse.Namespace, *,
               endpoint: str, run_id: str, local_addr: str | None) -> list[str]:
    """``elastictrain run`` arguments for each ``--local-nodes`` child: the parent's own
    flags (every one, so a new flag cannot be forgotten here) with etcd, run id and
    address fixed by the parent."""
    out = ["--etcd", endpoint, "--run-id", run_id]
    if local_addr:
        out += ["--local-addr", local_addr]
    for action in run_parser._actions:  # noqa: SLF001 - argparse offers no public list
        if not action.option_strings or action.dest in _PARENT_ONLY or action.default is argparse.SUPPRESS:
            continue
        value = getattr(args, action.dest)
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value:
                out.append(flag)
        elif isinstance(value, dict):
            if value:
                out.append(f"{flag}={','.join(f'{k}={v}' for k, v in value.items())}")
        elif isinstance(value, tuple):
            out.append(f"{flag}={','.join(str(v) for v in value)}")
        elif value is not None:
            out.append(f"{flag}={value}")
    return [*out, args.script, *args.script_args]


def precheck(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Check ``run``'s flags in ``argv`` as a whole, before argparse reads them one by one
    (see :func:`_check_run_arguments`)."""
    words = [i for i, token in enumerate(argv) if not token.startswith("-")]
    if words and argv[words[0]] == "run":
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        _check_run_arguments(sub.choices["run"], argv[words[0] + 1:])


def check_run_flags(argv: Sequence[str]) -> str:
    """Parse ``elastictrain run ARGV`` as ``run`` does, running nothing: for a tool that starts
    nodes with flags a user passed through (``elastictrain chaos --run-arg``).

    Returns:
        The script it would run (a word among the flags would be taken for it).

    Raises:
        ConfigError: An unknown flag, or a value its flag refuses.
    """
    parser = build_parser()
    precheck(parser, ["run", *argv])
    try:
        return str(parser.parse_args(["run", *argv]).script)
    except SystemExit as exc:  # --help, --version: printed, and would end this process
        raise ConfigError(f"'elastictrain run {' '.join(argv)}' prints its help and runs nothing") from exc
