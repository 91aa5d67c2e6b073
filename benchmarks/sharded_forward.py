"""What a sharded forward holds unsharded, and its step time, under in-process recovery: the failsafe
groups (issue 41) against plain FSDP2 and against the full gather before the forward they replace.

Two worker processes (gloo, a file store) train the same model (``--layers`` blocks of a square
float32 layer, one FSDP unit each, and a head in the root's unit; ``--mb`` MB of parameters, AdamW)
through ``FsdpStrategy``, as a ``Session`` does, in three modes:

- ``plain``: restart recovery's mesh; each unit gathers its parameters in its own forward (FSDP2);
- ``gather``: the same mesh, and every unit's parameters gathered before the forward (``unshard()``
  on each unit: what in-process recovery did before the failsafe groups, reproduced here);
- ``failsafe``: in-process recovery's mesh of failsafe groups, each step's forward and backward
  inside ``swallowing()``.

Per mode: the median steps/s over ``--reps`` (min-max) against ``plain``'s, and the most parameter
bytes held unsharded at once during a forward (sampled before and after each unit's forward; the
same in every repetition), in MB and as a share of the model's. The modes run in an order that
rotates from one repetition to the next; the load average before and after. Prints a table, one
JSON line, and writes the JSON to ``--out``.

    python benchmarks/sharded_forward.py --mb 100 --layers 8 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402 - after the path is set
    add_step_options, emit, finish_gloo_worker, layer_width, machine, run_gloo_workers, summarize, worker_or_main,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sharded_forward.json"
MODES = ("plain", "gather", "failsafe")
WORLD = 2
BATCH = 8


def _unsharded_bytes(units: list[Any]) -> int:
    """Bytes of the parameters the units hold unsharded now (FSDP2 swaps plain tensors in for them)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    total = 0
    for unit in units:
        stack = [unit]
        while stack:  # the unit's own modules: not those of units nested in it
            module = stack.pop()
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)
                         if not isinstance(p, DTensor))
            stack += [child for child in module.children() if not isinstance(child, FSDPModule)]
    return total


def _run(mode: str, rank: int, width: int, layers: int, warmup: int, steps: int) -> tuple[float, int, int]:
    """Steps/s of one mode, the most parameter bytes unsharded at once in a forward, and the model's."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp import FsdpStrategy
    from elastictrain.train.strategy import GroupView

    torch.manual_seed(0)
    block = torch.nn.Sequential
    model = torch.nn.Sequential(*[block(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)],
                                torch.nn.Linear(width, 1))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    placement = pg.Placement(torch.device("cpu"), "gloo", pg.resolve_timeout(60), rank, WORLD, owned=False)
    view = GroupView(placement=placement, group=None, in_process=mode == "failsafe", local_world_size=1)
    strategy = FsdpStrategy(units=lambda fqn, module: isinstance(module, block) and fqn != "")
    sharded = strategy.wrap(model, optimizer, view, identical=False)
    units = [m for m in sharded.modules() if isinstance(m, FSDPModule)]
    most = [0]

    def sample(*_: Any) -> None:
        most[0] = max(most[0], _unsharded_bytes(units))

    for unit in units:
        unit.register_forward_pre_hook(sample)
        unit.register_forward_hook(sample)
    data = torch.Generator().manual_seed(1 + rank)
    started = time.perf_counter()
    for index in range(warmup + steps):
        if index == warmup:
            started = time.perf_counter()
        inputs, targets = torch.randn(BATCH, width, generator=data), torch.randn(BATCH, 1, generator=data)
        strategy.before_forward()
        if mode == "gather":
            for unit in units:
                unit.unshard()
        with strategy.swallowing():
            torch.nn.functional.mse_loss(sharded(inputs), targets).backward()
        if strategy.swallowed() is not None:
            raise RuntimeError(f"a collective failed: {strategy.swallowed()}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    strategy.end()
    return steps / elapsed, most[0], full


def _worker(rank: int, store: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    width = layer_width(options["mb"], options["layers"])
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    most: dict[str, int] = {}
    full = 0
    for rep in range(options["reps"]):
        for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
            rate, most[mode], full = _run(mode, rank, width, options["layers"], options["warmup"], options["steps"])
            rates[mode].append(rate)
    finish_gloo_worker(rank, {"width": width, "rates": rates, "most": most, "full": full}, options["result"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_options(parser, layers=8, out=DEFAULT_OUT)
    args = parser.parse_args()
    before = machine()
    raw = run_gloo_workers(__file__, WORLD, {**vars(args), "out": None})
    plain = statistics.median(raw["rates"]["plain"])
    results: dict[str, Any] = {}
    for mode in MODES:
        rate = summarize(raw["rates"][mode])
        results[mode] = {"steps_per_s": rate, "step_time_vs_plain": plain / rate["median"],
                         "unsharded_mb_at_once": round(raw["most"][mode] / 1e6, 2),
                         "unsharded_share_of_model": round(raw["most"][mode] / raw["full"], 3)}
    record = {"benchmark": "sharded_forward", "world_size": WORLD, "mb": args.mb, "layers": args.layers,
              "width": raw["width"], "model_mb": round(raw["full"] / 1e6, 2), "steps": args.steps,
              "warmup": args.warmup, "reps": args.reps, "results": results, "machine": before,
              "loadavg_after": machine()["loadavg_1_5_15"]}
    print("| mode | steps/s, median (min-max) | step time / plain's | unsharded at once in a forward |\n"
          "|---|---|---|---|", file=sys.stderr)
    for mode, r in results.items():
        s = r["steps_per_s"]
        print(f"| {mode} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {r['step_time_vs_plain']:.2f}x "
              f"| {r['unsharded_mb_at_once']:g} MB ({100 * r['unsharded_share_of_model']:.0f} % of "
              f"{record['model_mb']:g} MB) |", file=sys.stderr)
    emit(record, args.out)


if __name__ == "__main__":
    worker_or_main(_worker, main)
