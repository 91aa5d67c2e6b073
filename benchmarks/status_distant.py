"""``elastictrain status`` through a distant etcd: seconds for one run of many nodes, and for
every run on the etcd (``--all``).

The etcd holds ``--runs`` runs of one node each and one run of ``--nodes`` nodes (their keys
written here: a round, a member key per node on a lease of its own, the run's metadata). A TCP
proxy delays each direction by ``--delay-ms``. Each rep runs ``python -m elastictrain status``
in a fresh process, as a user would, from each checkout of ``--code`` (default: this one; give
a worktree of an earlier commit to compare with it in the same run).

    python benchmarks/status_distant.py --delay-ms 250 --nodes 64 --runs 50 --reps 5 --code .,/tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, machine, summarize

_REPO = Path(__file__).resolve().parent.parent


def _write_runs(endpoint: str, nodes: int, runs: int) -> str:
    """Write the runs' keys; the id of the run of ``nodes`` nodes."""
    from elastictrain.etcd import kv
    from elastictrain.etcd.client import EtcdClient
    from elastictrain.etcd.conf import EtcdSettings, parse_endpoints
    from elastictrain.rendezvous.keys import RunKeys
    from tests.support.runs import formed_round

    client = EtcdClient(EtcdSettings(endpoints=tuple(parse_endpoints(endpoint))))
    tag = uuid.uuid4().hex[:6]
    try:
        for index, size in enumerate([nodes] + [1] * runs):
            keys = RunKeys.of(f"bench-{tag}-{index}")
            puts = [kv.put(keys.meta, json.dumps({"script": "train.py"}).encode()),
                    *formed_round(client, keys, [f"node{i}" for i in range(size)], lease_ttl=600)]
            for start in range(0, len(puts), 100):  # etcd takes 128 operations a transaction
                kv.txn(client, [], puts[start:start + 100], what="writing a run")
    finally:
        client.close()
    return f"bench-{tag}-0"


def _status_seconds(code: Path, endpoint: str, *which: str) -> float | None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "elastictrain", "status", "--etcd", endpoint, *which],
                            cwd=code, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        print(f"[status_distant] {code}: status {' '.join(which)} failed: {result.stderr.strip()[-300:]}",
              file=sys.stderr)
        return None
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=250.0, help="one-way delay to etcd (ms)")
    parser.add_argument("--nodes", type=int, default=64, help="nodes of the large run")
    parser.add_argument("--runs", type=int, default=50, help="runs of one node besides it")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--code", default=".", help="checkouts to run status from, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from elastictrain.etcd import EtcdServer
    from tests.support.tcp_proxy import TcpProxy

    checkouts = [(_REPO / c).resolve() for c in args.code.split(",") if c]
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    with EtcdServer() as server:
        big = _write_runs(server.endpoint, args.nodes, args.runs)
        host, port = server.endpoint.rsplit(":", 1)
        with TcpProxy(host, int(port), delay_s=args.delay_ms / 1000) as proxy:
            samples: dict[tuple[str, str], list[float | None]] = {}
            for _ in range(args.reps):  # the checkouts in turns, so that drift hits each alike
                for code in checkouts:
                    for name, which in (("run", ("--run-id", big)), ("all", ("--all",))):
                        samples.setdefault((str(code), name), []).append(_status_seconds(code, proxy.endpoint,
                                                                                         *which))
    for (code, name), values in samples.items():
        result = {"code": code, "status": name, "seconds": summarize(values)}
        print(f"[status_distant] {json.dumps(result)}", file=sys.stderr, flush=True)
        results.append(result)
    emit({"benchmark": "status_distant", "machine": machine(), "delay_ms": args.delay_ms, "nodes": args.nodes,
          "runs": args.runs, "reps": args.reps, "loadavg_before": list(load_before),
          "loadavg_after": list(os.getloadavg()), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
