"""False node losses: live nodes that a rendezvous declares gone, under etcd latency and CPU load.

N participants (rendezvous handlers in 2 processes, elastictrain's defaults: 1 s
keep-alives, dead after 5 s) form one round through a TCP proxy that delays each
direction by ``--delay-ms``, while ``--burners`` processes spin on the CPU. Then
nothing happens for ``--seconds``: every node stays alive, so every loss counted is
a false one.

- ``etcd3``: a loss is etcd expiring a member's lease (a delete event on the members
  prefix, seen by an observer connected to etcd directly), or a participant seeing a
  reason to re-form its round (``num_nodes_waiting() > 0``).
- ``etcd3-dynamic`` (our previous mode: torch's dynamic rendezvous on etcd v3): a loss
  is a participant missing from the rendezvous state (torch drops a node whose
  heartbeat, a wall-clock time written by the node, is older than the window), or a
  participant seeing ``num_nodes_waiting() > 0``.

    python benchmarks/liveness.py --nodes 16 --delay-ms 0,100 --burners 0,2 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, machine

BACKENDS = ("etcd3", "etcd3-dynamic")
_BURN = "while True: pass"


def child(args: argparse.Namespace) -> int:
    """Participants of one process: join, then report every second how many see a reason to re-form."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastictrain.etcd.conf import etcd_settings_from
    from elastictrain.etcd.client import EtcdClient

    conf = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "5"}
    params = RendezvousParameters(args.backend, args.endpoint, args.run_id, args.n, args.n, local_addr="127.0.0.1",
                                  **conf)
    if args.backend == "etcd3":
        from elastictrain.rendezvous.handler import create_handler

        shared = EtcdClient(etcd_settings_from({}, args.endpoint))  # as in rendezvous_scale.py
        handlers = [create_handler(params, client=shared) for _ in range(args.count)]
    else:
        from elastictrain.rendezvous.dynamic import create_dynamic_handler

        handlers = [create_dynamic_handler(params) for _ in range(args.count)]
    import threading

    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("JOINED", flush=True)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        print(json.dumps({"waiting": sum(1 for h in handlers if h.num_nodes_waiting() > 0)}), flush=True)
        time.sleep(1.0)
    print("DONE", flush=True)
    sys.stdin.readline()
    return 0


def _dynamic_participants(endpoint: str, run_id: str) -> int | None:
    import pickle

    from elastictrain.etcd.conf import etcd_settings_from
    from elastictrain.etcd.client import EtcdClient
    from elastictrain.rendezvous.dynamic import Etcd3RendezvousBackend

    client = EtcdClient(etcd_settings_from({}, endpoint))
    try:
        current = Etcd3RendezvousBackend(client, run_id).get_state()
        return None if current is None else len(pickle.loads(current[0]).participants)  # noqa: S301 - our own state
    finally:
        client.close()


def trial(backend: str, n: int, delay_ms: float, burners: int, seconds: float, endpoint: str) -> dict[str, Any]:
    from elastictrain.etcd.conf import etcd_settings_from
    from elastictrain.etcd import kv
    from elastictrain.etcd.client import EtcdClient
    from elastictrain.etcd.watch import Watch
    from elastictrain.rendezvous.keys import RunKeys
    from tests.support.tcp_proxy import TcpProxy

    run_id = f"live-{uuid.uuid4().hex[:8]}"
    host, port = endpoint.rsplit(":", 1)
    spinners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(burners)]
    observer = EtcdClient(etcd_settings_from({}, endpoint))
    expired: list[str] = []
    keys = RunKeys.of(run_id)
    revision, _ = kv.range_(observer, keys.prefix, prefix=True, what="benchmark")
    watch = Watch(observer, keys.members, prefix=True, start_revision=revision + 1,
                  on_events=lambda events, _: expired.extend(e.key for e in events if e.deleted)).start()
    try:
        with TcpProxy(host, int(port), delay_s=delay_ms / 1000) as proxy:
            counts = [n // 2 + n % 2, n // 2]
            procs = [subprocess.Popen([sys.executable, __file__, "--child", "--backend", backend, "--endpoint",
                                       proxy.endpoint, "--run-id", run_id, "--n", str(n), "--count", str(c),
                                       "--seconds", str(seconds)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for c in counts if c]
            for proc in procs:
                line = proc.stdout.readline().strip()  # type: ignore[union-attr]
                if line != "JOINED":
                    return {"error": f"participants did not join (said {line!r})"}
            joined_at = time.monotonic()
            fewest = n
            re_form_seconds = 0
            reports: list[int] = []  # one line a second from each process
            while True:
                lines = [proc.stdout.readline().strip() for proc in procs]  # type: ignore[union-attr]
                if any(line == "DONE" or not line for line in lines):
                    break
                waiting = sum(json.loads(line)["waiting"] for line in lines)
                reports.append(waiting)
                if waiting:
                    re_form_seconds += 1
                if backend == "etcd3-dynamic":
                    seen = _dynamic_participants(endpoint, run_id)
                    fewest = min(fewest, seen if seen is not None else 0)
            for proc in procs:
                proc.communicate("exit\n", timeout=30)
    finally:
        watch.close()
        observer.close()
        for spinner in spinners:
            spinner.kill()
    lost = len(set(expired)) if backend == "etcd3" else n - fewest
    return {"nodes": n, "delay_ms": delay_ms, "burners": burners, "seconds": round(time.monotonic() - joined_at, 1),
            "false_losses": lost, "seconds_with_a_re_form_reason": re_form_seconds,
            "most_participants_seeing_a_reason": max(reports, default=0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--delay-ms", default="0,100", help="one-way delays to etcd (ms), comma-separated")
    parser.add_argument("--burners", default="0,2", help="CPU-spinning processes, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    from elastictrain.etcd import EtcdServer

    results = []
    with EtcdServer() as server:
        for delay in (float(d) for d in args.delay_ms.split(",") if d):
            for burners in (int(b) for b in args.burners.split(",") if b):
                for backend in (b for b in args.backends.split(",") if b):
                    result = {"backend": backend, **trial(backend, args.nodes, delay, burners, args.seconds,
                                                          server.endpoint)}
                    print(f"[liveness] {json.dumps(result)}", file=sys.stderr, flush=True)
                    results.append(result)
    emit({"benchmark": "liveness", "machine": machine(), "cpus": multiprocessing.cpu_count(), "results": results},
         args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
