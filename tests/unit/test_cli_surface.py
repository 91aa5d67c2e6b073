"""Freezes the command-line surface: a flag added, renamed or removed must be a decision.

Update EXPECTED (and the README) in the same change that alters a flag.
"""

from __future__ import annotations

import argparse

from elastictrain.launch.arguments import build_parser

ETCD_CLIENT = ["--debug", "--etcd", "--etcd-ca-cert", "--etcd-cert", "--etcd-key", "--etcd-user", "--help",
               "--rdzv-conf", "--run-id"]
EXPECTED = {
    "run": sorted(["--debug", "--etcd", "--etcd-ca-cert", "--etcd-cert", "--etcd-key", "--etcd-user",
                   "--event-log", "--help", "--join", "--join-timeout", "--keep-alive-interval",
                   "--last-call-timeout", "--local-addr", "--local-nodes", "--log-dir", "--max-nodes",
                   "--max-restarts", "--min-nodes", "--monitor-interval", "--no-progress", "--node-name", "--nproc-per-node",
                   "--rdzv-conf", "--recovery", "--restart-window", "--run-id", "--standalone",
                   "--verbose",  # issue 43: torch's own lines and the long worker prefix on the terminal
                   # torchrun's spellings (issue 17): same meaning, or refused in one line saying why
                   "--nnodes", "--nproc_per_node", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id",
                   "--rdzv-backend", "--rdzv_backend", "--rdzv_conf", "--max_restarts", "--monitor_interval",
                   "--local_addr", "--log_dir", "--redirects", "--tee", "--local-ranks-filter",
                   "--local_ranks_filter", "--role", "--module", "--no-python", "--no_python",
                   "--master-addr", "--master_addr", "--master-port", "--master_port", "--node-rank", "--node_rank",
                   "--metrics-port"]),
    "status": sorted([*ETCD_CLIENT, "--all", "--checkpoint-dir", "--json", "--verify-checksums"]),
    "stop": sorted([*ETCD_CLIENT, "--purge"]),
    "etcd": sorted(["--cert-file", "--client-cert-auth", "--data-dir", "--help", "--host", "--insecure", "--key-file",
                    "--port", "--trusted-ca-file"]),
    "chaos": [],  # its flags belong to elastictrain.chaos (python -m elastictrain.chaos --help)
    "checkpoint": ["--help"],
    "checkpoint export": ["--entry", "--help", "--step"],  # issue 41: a checkpoint's model as safetensors
}


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every subcommand, nested ones as "checkpoint export"."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[prefix + name] = sub
                found.update(_commands(sub, f"{prefix}{name} "))
    return found


def test_cli_flags_are_exactly_the_documented_ones() -> None:
    actual = {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
              for name, p in _commands(build_parser()).items()}
    assert actual == EXPECTED


def test_every_visible_flag_has_help_with_a_default_or_env() -> None:
    for name, p in _commands(build_parser()).items():
        for action in p._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            assert "ELASTICTRAIN_" in (action.help or ""), f"{name} {action.option_strings}: help names no env var"


def test_torchrun_short_flags_are_accepted() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    short = sorted(o for a in sub.choices["run"]._actions for o in a.option_strings if not o.startswith("--"))
    assert short == ["-h", "-m", "-r", "-t", "-v"]
