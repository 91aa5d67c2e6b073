"""Run elastictrain's benchmarks against stock torchrun and write JSON, a markdown table and plots.

``python -m benchmarks [--mode smoke|quick|full]`` (or ``python benchmarks/run.py``)
runs, in one go and each interleaved with its stock counterpart:

1. recovery from a worker crash, 2. a node loss, 3. a node join
   (``benchmarks/recovery.py``: elastictrain vs ``torchrun --rdzv-backend c10d``);
4. rendezvous time against the number of participants, etcd3 vs c10d
   (``benchmarks/rendezvous_scale.py``);
5. checkpoint stall, sync, async and overlapped, vs ``torch.save`` and
   ``torch.distributed.checkpoint`` (``benchmarks/checkpoint_compare.py``, on the
   state of ``benchmarks/checkpoint_stall.py``): around the save call, and as the
   training time lost per checkpoint around a training loop;
6. per-step overhead (``benchmarks/step_overhead.py`` when it exists, and the step
   time of the recovery runs' training script under each launcher);
7. the load one job puts on etcd (measured inside the first elastictrain
   worker-crash trial, plus ``benchmarks/etcd_load.py`` jobs in full mode).

Modes: ``smoke`` (CI: one repetition of the cheapest form of each, under a minute
on an idle machine; no numbers worth reading), ``quick`` (a few minutes) and
``full`` (about an hour on 2 cores). Results go to ``--out-dir``
(``benchmarks/results``): ``<mode>.json``, ``<mode>.md`` and, when matplotlib is
installed, ``<mode>-*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report, etcd_load, recovery, rendezvous_scale
from benchmarks._common import BENCH_DIR, machine, summarize

SECTIONS = ("recovery", "rendezvous_scale", "checkpoint", "step_overhead", "etcd_load")


@dataclass(frozen=True)
class Mode:
    recovery_scenarios: tuple[str, ...]
    recovery_launchers: tuple[str, ...]
    recovery_reps: int
    action_step: int
    etcd_window: float
    scale_sizes: tuple[int, ...]
    scale_backends: tuple[str, ...]
    scale_reps: int
    scale_timeout: float
    scale_hold: float
    checkpoint_state_mb: tuple[int, ...]
    checkpoint_reps: int
    checkpoint_warmup: int
    step_overhead_args: tuple[tuple[str, str], ...]
    etcd_load_nodes: tuple[int, ...] = ()
    etcd_load_window: float = 0.0


MODES = {
    "smoke": Mode(
        recovery_scenarios=("worker_crash",), recovery_launchers=("elastictrain",), recovery_reps=1,
        action_step=12, etcd_window=1.0,
        scale_sizes=(2,), scale_backends=("etcd3", "etcd3-dynamic", "c10d"), scale_reps=1, scale_timeout=60.0,
        scale_hold=0.0,
        checkpoint_state_mb=(3,), checkpoint_reps=1, checkpoint_warmup=0,
        step_overhead_args=(),  # not run in smoke mode: it belongs to another benchmark's owner
    ),
    "quick": Mode(
        recovery_scenarios=recovery.CLASSIC_SCENARIOS,
        recovery_launchers=("elastictrain", "torchrun_tuned"),
        recovery_reps=1, action_step=25, etcd_window=5.0,
        scale_sizes=(2, 8, 32, 64), scale_backends=("etcd3", "etcd3-dynamic", "c10d"), scale_reps=1,
        scale_timeout=60.0, scale_hold=3.0,
        checkpoint_state_mb=(10, 100), checkpoint_reps=3, checkpoint_warmup=1,
        step_overhead_args=(("--reps", "2"), ("--steps", "50"), ("--warmup", "10")),
    ),
    "full": Mode(
        recovery_scenarios=recovery.CLASSIC_SCENARIOS,
        # The previous version only where one is installed for comparison (see recovery.py).
        recovery_launchers=tuple(name for name in recovery.CLASSIC_LAUNCHERS
                                 if name != "elastictrain_prev" or os.environ.get(recovery.PREV_ENV)),
        recovery_reps=5, action_step=25, etcd_window=20.0,
        scale_sizes=(2, 8, 32, 64, 256, 1024), scale_backends=("etcd3", "etcd3-dynamic", "c10d"), scale_reps=3,
        scale_timeout=60.0, scale_hold=5.0,
        checkpoint_state_mb=(10, 100, 1000), checkpoint_reps=5, checkpoint_warmup=1,
        step_overhead_args=(("--reps", "5"),),
        etcd_load_nodes=(3,), etcd_load_window=20.0,
    ),
}


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _script(name: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run ``benchmarks/<name>`` and return the JSON line it prints."""
    out = subprocess.run([sys.executable, str(BENCH_DIR / name), *args], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{name} exited with {out.returncode}: {out.stderr.strip()[-800:]}")
    return _last_json_line(out.stdout)


def section_recovery(mode: Mode) -> dict[str, Any]:
    return recovery.run(list(mode.recovery_scenarios), list(mode.recovery_launchers), mode.recovery_reps,
                        action_step=mode.action_step, etcd_window=mode.etcd_window,
                        log=lambda m: _log(m))


def section_rendezvous_scale(mode: Mode) -> dict[str, Any]:
    return rendezvous_scale.run(list(mode.scale_sizes), mode.scale_reps, list(mode.scale_backends),
                                timeout=mode.scale_timeout, hold=mode.scale_hold, log=lambda m: _log(m))


def section_checkpoint(mode: Mode) -> dict[str, Any]:
    """``benchmarks/checkpoint_compare.py``, one process per state size (a 1 GB state needs the memory back)."""
    sizes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for state_mb in mode.checkpoint_state_mb:
            model_mb = max(1, round(state_mb / 3))  # AdamW keeps two moments: the state is ~3x the model
            args = ["--sizes", str(model_mb), "--reps", str(mode.checkpoint_reps),
                    "--warmup", str(mode.checkpoint_warmup), "--out", str(Path(tmp) / "ckpt.json")]
            timeout = 120 + 0.3 * state_mb * (mode.checkpoint_reps + mode.checkpoint_warmup)
            try:
                entry = {"state_mb_target": state_mb,
                         **_script("checkpoint_compare.py", args, timeout)["results"][0]}
            except Exception as exc:  # noqa: BLE001 - one failed size must not hide the others
                entry = {"state_mb_target": state_mb, "error": str(exc)[-800:]}
            if "async_stall" in entry:
                _log(f"[checkpoint] {entry['checkpoint_mb']} MB: async stall "
                     f"{entry['async_stall']['median'] * 1e3:.1f} ms, torch.save "
                     f"{entry['torch_save']['median'] * 1e3:.1f} ms, DCP async stall "
                     f"{entry['dcp_async_stall']['median'] * 1e3:.1f} ms; training time lost per overlapped save "
                     f"{entry['loop']['overlapped_save']['lost_s']['median'] * 1e3:.1f} ms "
                     f"(torch.save {entry['loop']['torch_save']['lost_s']['median'] * 1e3:.1f} ms)")
            else:
                _log(f"[checkpoint] ~{state_mb} MB: FAILED: {entry.get('error')}")
            sizes.append(entry)
    return {"reps": mode.checkpoint_reps, "warmup": mode.checkpoint_warmup, "sizes": sizes}


def section_step_overhead(mode: Mode) -> dict[str, Any]:
    """``benchmarks/step_overhead.py`` if it exists (its owner writes it); else a TODO."""
    script = BENCH_DIR / "step_overhead.py"
    if not mode.step_overhead_args:
        return {"status": "skipped", "reason": "not run in this mode"}
    if not script.exists():
        return {"status": "todo", "reason": "benchmarks/step_overhead.py does not exist yet"}
    help_text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    # Its flags may still change: pass only those its --help lists.
    args = [x for flag, value in mode.step_overhead_args if flag in help_text for x in (flag, value)]
    with tempfile.TemporaryDirectory() as tmp:
        if "--out" in help_text:
            args += ["--out", str(Path(tmp) / "step_overhead.json")]  # never overwrite its owner's results
        try:
            record = _script("step_overhead.py", args, timeout=1800)
        except Exception as exc:  # noqa: BLE001 - a script under construction may fail
            return {"status": "error", "reason": str(exc)[-800:]}
    _log("[step_overhead] " + ", ".join(f"{k}: {v.get('overhead_pct', float('nan')):.1f}%"
                                        for k, v in record.get("results", {}).items()))
    return {"status": "ok", "record": record}


def section_etcd_load(mode: Mode, results: dict[str, Any]) -> dict[str, Any]:
    """The job measured inside the recovery section, plus dedicated jobs of other sizes (full mode)."""
    jobs = []
    inside = results.get("recovery", {}).get("etcd_load")
    if inside:
        jobs.append({**inside, "source": "first elastictrain worker_crash trial"})
    if mode.etcd_load_nodes:
        extra = etcd_load.run(list(mode.etcd_load_nodes), mode.etcd_load_window, log=lambda m: _log(m))
        jobs += [{**j, "source": "benchmarks/etcd_load.py"} for j in extra["jobs"]]
    rest = results.get("rendezvous_scale", {}).get("by_size", {})
    at_rest = {n: e["etcd3"]["etcd_at_rest_requests_per_s"] for n, e in rest.items()
               if "etcd_at_rest_requests_per_s" in e.get("etcd3", {})}
    return {"jobs": jobs, "rendezvous_scale_at_rest": {
        n: {"requests_per_s": at_rest[n],
            "sent_bytes_per_s": rest[n]["etcd3"].get("etcd_at_rest_sent_bytes_per_s"),
            "received_bytes_per_s": rest[n]["etcd3"].get("etcd_at_rest_received_bytes_per_s")}
        for n in at_rest}}


def launcher_step_time(results: dict[str, Any]) -> dict[str, Any]:
    """Median step time of the benchmark script before the action, per launcher, over all recovery trials."""
    per: dict[str, list[float]] = {}
    for scenario in results.get("recovery", {}).get("scenarios", {}).values():
        for launcher, entry in scenario.items():
            if isinstance(entry, dict) and "trials" in entry:
                per.setdefault(launcher, []).extend(
                    t["step_time_before_s"] for t in entry["trials"] if t.get("step_time_before_s"))
    return {launcher: summarize(samples) for launcher, samples in per.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=list(MODES), default="quick")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, from {','.join(SECTIONS)}")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of recovery and rendezvous trials")
    parser.add_argument("--launchers", default=None, help=f"recovery launchers, from {','.join(recovery.LAUNCHERS)}")
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument("--name", default=None, help="file name stem (default: the mode)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots even if matplotlib is installed")
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="only re-render the markdown (and plots) of an earlier run's JSON next to it")
    args = parser.parse_args(argv)

    if args.render is not None:
        results = json.loads(args.render.read_text())
        results["goals"] = _report.goals(results)
        stem, out_dir = args.render.stem, args.render.parent
        plots = [] if args.no_plots else _report.plots(results, out_dir, stem)
        markdown = _report.markdown(results, plots=[p.name for p in plots])
        (out_dir / f"{stem}.md").write_text(markdown)
        print(markdown)
        return 0

    mode = MODES[args.mode]
    if args.reps is not None:
        if args.reps < 1:
            parser.error("--reps must be at least 1")
        mode = replace(mode, recovery_reps=args.reps, scale_reps=args.reps)
    if args.launchers:
        launchers = tuple(x for x in args.launchers.split(",") if x)
        unknown = set(launchers) - set(recovery.LAUNCHERS)
        if unknown:
            parser.error(f"unknown launchers {sorted(unknown)}; choose from {recovery.LAUNCHERS}")
        mode = replace(mode, recovery_launchers=launchers)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")

    started = time.time()
    results: dict[str, Any] = {"benchmark": "elastictrain_vs_torchrun", "mode": args.mode,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine_at_start": machine(),
                               "settings": asdict(mode)}
    runners = {
        "recovery": lambda: section_recovery(mode),
        "rendezvous_scale": lambda: section_rendezvous_scale(mode),
        "checkpoint": lambda: section_checkpoint(mode),
        "step_overhead": lambda: section_step_overhead(mode),
        "etcd_load": lambda: section_etcd_load(mode, results),
    }
    for name in SECTIONS:
        if name not in only:
            results[name] = {"status": "skipped", "reason": "not selected with --only"}
            continue
        _log(f"section {name} ...")
        t0 = time.time()
        try:
            results[name] = runners[name]()
        except Exception as exc:  # noqa: BLE001 - report the failure and run the other sections
            results[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-3000:]}
            _log(f"section {name} failed: {exc}")
        results[name]["seconds"] = round(time.time() - t0, 1)
    results["launcher_step_time_s"] = launcher_step_time(results)
    results["machine_at_end"] = machine()
    results["seconds"] = round(time.time() - started, 1)
    results["goals"] = _report.goals(results)

    stem = args.name or args.mode
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")
    plots = [] if args.no_plots else _report.plots(results, args.out_dir, stem)
    markdown = _report.markdown(results, plots=[p.name for p in plots])
    (args.out_dir / f"{stem}.md").write_text(markdown)
    print(markdown)
    _log(f"wrote {json_path}, {args.out_dir / (stem + '.md')}" + (f" and {len(plots)} plots" if plots else "")
         + f" in {results['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
