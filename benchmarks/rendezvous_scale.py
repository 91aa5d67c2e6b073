"""Time for N participants to complete one rendezvous round: etcd3 against our previous mode and c10d.

Each participant is one rendezvous handler driven by a thread, as one node agent
would drive it, without training. The N participants are spread over a few
processes (``--procs``; by default 2, or N/64 for large N) so that one GIL does not
serialize them all. Handlers are built first (not timed); then every thread calls
``next_rendezvous()`` at the same wall-clock instant, and the round's time is from
that instant until the last participant has its rank. ``min_nodes = max_nodes = N``,
so no backend waits for a last call.

- ``etcd3``: elastictrain's native rendezvous (``elastictrain.rendezvous.handler``)
  with its defaults, one private etcd server for the whole run (a fresh run id per
  trial). The participants of one process share one etcd connection (one keep-alive
  stream, one watch stream): N simulated nodes on 2 cores cannot each pay for idle
  gRPC streams of their own, while etcd still sees every participant's own lease,
  member key, join transaction and watches. The requests and bytes the round put on etcd are read from etcd's
  ``/metrics`` before and after it, by gRPC method: key-value requests (Range, Txn,
  Put, DeleteRange) and stream messages (lease keep-alives, watch creates).
- ``etcd3-dynamic``: our previous mode, torch's ``DynamicRendezvousHandler`` on
  elastictrain's etcd v3 backend (``torchrun --rdzv-backend etcd3-dynamic``),
  elastictrain's timings; the same etcd server.
- ``c10d``: torch's defaults; participant 0 hosts the TCPStore (``is_host``), every
  other participant connects to it, as on a cluster.

    python benchmarks/rendezvous_scale.py --sizes 64,256,1024 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, free_port, machine, metrics_delta, ratio, scrape_metrics, summarize

BACKENDS = ("etcd3", "etcd3-dynamic", "c10d")
ETCD_BACKENDS = ("etcd3", "etcd3-dynamic")
# The elastictrain timings the previous mode ran with (its README defaults).
DYNAMIC_CONF = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "5"}
KV_METHODS = ("Range", "Txn", "Put", "DeleteRange")
DEFAULT_TIMEOUT = 120.0


def _import(backend: str) -> None:
    """Import what the participants need, before any of them exists (on 2 cores, many
    processes importing torch at once starve the keep-alives of participants already made)."""
    import torch.distributed.elastic.rendezvous  # noqa: F401

    if backend == "etcd3":
        import elastictrain.rendezvous.handler
    elif backend == "etcd3-dynamic":
        import elastictrain.rendezvous.dynamic  # noqa: F401


def _handlers(backend: str, endpoint: str, run_id: str, n: int, count: int, first: int,
              conf: dict[str, str]) -> list[Any]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    if backend == "etcd3":
        from elastictrain.etcd.conf import etcd_settings_from
        from elastictrain.etcd.client import EtcdClient
        from elastictrain.rendezvous.handler import create_handler

        # The participants of one process share one etcd connection (one keep-alive stream, one
        # watch stream): a Python gRPC stream costs CPU even when idle, and 1,024 simulated
        # nodes on one 2-core machine cannot each pay for their own. etcd still sees every
        # participant's own lease, member key, join transaction and watches.
        shared = EtcdClient(etcd_settings_from(conf, endpoint))
        return [create_handler(RendezvousParameters("etcd3", endpoint, run_id, n, n, local_addr="127.0.0.1", **conf),
                               client=shared)
                for _ in range(count)]
    if backend == "etcd3-dynamic":
        from elastictrain.rendezvous.dynamic import create_dynamic_handler

        return [create_dynamic_handler(RendezvousParameters(backend, endpoint, run_id, n, n, local_addr="127.0.0.1",
                                                            **{**DYNAMIC_CONF, **conf}))
                for _ in range(count)]
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    handlers = []
    for i in range(first, first + count):
        params = RendezvousParameters("c10d", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                      is_host=(i == 0), **conf)
        backend_obj, store = c10d_rendezvous_backend.create_backend(params)
        handlers.append(dynamic_rendezvous.create_handler(store, backend_obj, params))
    return handlers


def child(args: argparse.Namespace) -> int:
    """One process of participants: import, build handlers, report READY, start at the given instant."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _import(args.backend)
    print("IMPORTED", flush=True)
    sys.stdin.readline()
    built = time.time()
    conf = dict(item.split("=", 1) for item in args.conf.split(",") if item)
    handlers = _handlers(args.backend, args.endpoint, args.run_id, args.n, args.count, args.first, conf)
    setup_s = time.time() - built
    print("READY", flush=True)
    start_at = float(sys.stdin.readline())
    results: list[dict[str, Any]] = [{} for _ in handlers]

    def participate(i: int) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        try:
            info = handlers[i].next_rendezvous()
            results[i] = {"done": time.time(), "rank": info.rank, "world_size": info.world_size}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the trial
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=participate, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    deadline = start_at + args.timeout
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    for i, t in enumerate(threads):
        if t.is_alive():
            results[i] = {"error": f"no rank after {args.timeout:g}s"}
    print(json.dumps({"setup_s": setup_s, "participants": results}), flush=True)
    # Stay until every process has its result: participant 0 hosts c10d's store, and
    # the others may still be reading the final state from it.
    sys.stdin.readline()
    # Heartbeat timers and watch threads would keep the process alive; nothing to clean up.
    os._exit(0)


def _procs_for(n: int) -> int:
    return min(n, max(2, n // 64))


def trial(backend: str, n: int, etcd_endpoint: str | None, procs: int | None = None,
          timeout: float = DEFAULT_TIMEOUT, conf: dict[str, str] | None = None,
          hold: float = 0.0) -> dict[str, Any]:
    """One round of ``n`` participants on ``backend``; returns its timings (and etcd load).

    Args:
        timeout: Participants without a rank this long after the start fail the trial.
        conf: Extra rendezvous settings (``--rdzv-conf`` keys) for every participant.
        hold: Seconds to keep the completed round alive afterwards while measuring the
            etcd load it causes at rest (heartbeats, lease keep-alives).
    """
    procs = procs or _procs_for(n)
    run_id = f"scale-{uuid.uuid4().hex[:10]}"
    on_etcd = backend in ETCD_BACKENDS
    endpoint = etcd_endpoint if on_etcd else f"127.0.0.1:{free_port()}"
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = []
    first = 0
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for count in counts:
        cmd = [sys.executable, __file__, "--child", "--backend", backend, "--endpoint", str(endpoint),
               "--run-id", run_id, "--n", str(n), "--count", str(count), "--first", str(first),
               "--timeout", str(timeout), "--conf", ",".join(f"{k}={v}" for k, v in (conf or {}).items())]
        children.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        first += count
        if backend == "c10d" and len(children) == 1:
            time.sleep(0.5)  # the host's store first, as on a cluster where node 0 starts it
    try:
        for proc in children:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "IMPORTED":
                return {"error": f"a participant process did not start (said {line.strip()!r})"}
        for proc in children:
            proc.stdin.write("build\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        for proc in children:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "READY":
                return {"error": f"a participant process did not start (said {line.strip()!r})"}
        before = scrape_metrics(str(etcd_endpoint)) if on_etcd else None
        start_at = time.time() + 0.3
        for proc in children:
            proc.stdin.write(f"{start_at}\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        reports = [json.loads(proc.stdout.readline()) for proc in children]  # type: ignore[union-attr]
        finished = time.time()
        after_round = scrape_metrics(str(etcd_endpoint)) if before is not None else None
        at_rest = None
        if before is not None and hold > 0 and all("done" in p for r in reports for p in r["participants"]):
            rest_from, rest_t0 = scrape_metrics(str(etcd_endpoint)), time.time()
            time.sleep(hold)
            at_rest = metrics_delta(rest_from, scrape_metrics(str(etcd_endpoint)), time.time() - rest_t0)
        for proc in children:
            proc.communicate("exit\n", timeout=30)
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    participants = [p for r in reports for p in r["participants"]]
    errors = [p["error"] for p in participants if "error" in p]
    if errors or len(participants) != n:
        return {"error": f"{len(errors)} of {n} participants failed: {errors[:3]}"}
    ranks = sorted(p["rank"] for p in participants)
    if ranks != list(range(n)) or {p["world_size"] for p in participants} != {n}:
        return {"error": f"inconsistent round: ranks {ranks[:5]}..., world sizes {sorted({p['world_size'] for p in participants})}"}
    done = sorted(p["done"] - start_at for p in participants)
    out: dict[str, Any] = {
        "round_s": done[-1],
        "first_participant_s": done[0],
        "median_participant_s": done[len(done) // 2],
        "setup_s": max(r["setup_s"] for r in reports),
        "procs": procs,
    }
    if before is not None:
        load = metrics_delta(before, after_round, finished - start_at)  # the round alone, not the hold
        out["etcd"] = {k: load[k] for k in ("requests", "received_bytes", "sent_bytes", "txns", "writes",
                                           "requests_by_method")}
        kv_requests = sum(v for k, v in load["requests_by_method"].items() if k in KV_METHODS)
        out["etcd"]["kv_requests"] = kv_requests
        out["etcd"]["requests_per_participant"] = load["requests"] / n
        out["etcd"]["kv_requests_per_participant"] = kv_requests / n
        out["etcd"]["by_method_per_participant"] = {k: v / n for k, v in load["requests_by_method"].items()}
    if at_rest is not None:
        out["etcd_at_rest"] = {k: at_rest[k] for k in ("requests_per_s", "received_bytes_per_s", "sent_bytes_per_s",
                                                       "requests_by_method")}
    return out


def run(sizes: list[int], reps: int, backends: list[str], timeout: float = DEFAULT_TIMEOUT,
        hold: float = 0.0, etcd3_conf: dict[str, str] | None = None, log=print) -> dict[str, Any]:
    """Every (size, repetition) runs each backend once, interleaved.

    A size at which a backend fails every repetition is not tried at larger sizes.
    """
    from elastictrain.etcd import EtcdServer

    results: dict[str, Any] = {"sizes": sizes, "timeout_s": timeout, "etcd3_conf": etcd3_conf or {}, "by_size": {}}
    given_up: set[str] = set()
    with EtcdServer() as server:
        for n in sizes:
            trials: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
            for rep in range(reps):
                order = backends if rep % 2 == 0 else list(reversed(backends))
                for backend in order:
                    if backend in given_up:
                        trials[backend].append({"error": "skipped: failed every repetition at a smaller size"})
                        continue
                    conf = etcd3_conf if backend in ETCD_BACKENDS else None
                    t = trial(backend, n, server.endpoint, timeout=timeout, conf=conf, hold=hold)
                    trials[backend].append(t)
                    shown = f"{t['round_s']:.2f}s" if "round_s" in t else f"FAILED: {t['error']}"
                    log(f"[rendezvous_scale] N={n} rep {rep} {backend}: {shown}")
            given_up |= {b for b, ts in trials.items() if ts and all("error" in t for t in ts)}
            entry: dict[str, Any] = {}
            for backend, ts in trials.items():
                entry[backend] = {
                    "round_s": summarize(t.get("round_s") for t in ts),
                    "median_participant_s": summarize(t.get("median_participant_s") for t in ts),
                    "errors": [t["error"] for t in ts if "error" in t],
                    "trials": ts,
                }
                loads = [t["etcd"] for t in ts if "etcd" in t]  # the etcd backends
                if loads:
                    entry[backend]["etcd_requests"] = summarize(x["requests"] for x in loads)
                    entry[backend]["etcd_requests_per_participant"] = summarize(
                        x["requests_per_participant"] for x in loads)
                    entry[backend]["etcd_kv_requests_per_participant"] = summarize(
                        x["kv_requests_per_participant"] for x in loads)
                    entry[backend]["etcd_received_bytes"] = summarize(x["received_bytes"] for x in loads)
                rest = [t["etcd_at_rest"] for t in ts if "etcd_at_rest" in t]
                if rest:
                    entry[backend]["etcd_at_rest_requests_per_s"] = summarize(x["requests_per_s"] for x in rest)
                    entry[backend]["etcd_at_rest_sent_bytes_per_s"] = summarize(x["sent_bytes_per_s"] for x in rest)
                    entry[backend]["etcd_at_rest_received_bytes_per_s"] = summarize(
                        x["received_bytes_per_s"] for x in rest)
            if "etcd3" in entry and "c10d" in entry:
                entry["ratio_etcd3_over_c10d"] = ratio(entry["etcd3"]["round_s"], entry["c10d"]["round_s"])
            if "etcd3" in entry and "etcd3-dynamic" in entry:
                entry["ratio_etcd3_over_dynamic"] = ratio(entry["etcd3"]["round_s"],
                                                          entry["etcd3-dynamic"]["round_s"])
            results["by_size"][str(n)] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,8,32,64,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="a round not complete after this many seconds counts as failed")
    parser.add_argument("--conf", default="", help="extra rendezvous settings k=v,... for every participant")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="seconds to keep each etcd3 round alive afterwards, measuring etcd load at rest")
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    backends = [b for b in args.backends.split(",") if b]
    if not sizes or min(sizes) < 1 or any(b not in BACKENDS for b in backends):
        parser.error(f"need sizes >= 1 and backends from {BACKENDS}")
    conf = dict(item.split("=", 1) for item in args.conf.split(",") if item)
    result = run(sizes, args.reps, backends, timeout=args.timeout, hold=args.hold, etcd3_conf=conf,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    emit({"benchmark": "rendezvous_scale", "machine": machine(), "reps": args.reps, **result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
