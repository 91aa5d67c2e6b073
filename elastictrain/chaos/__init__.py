"""Chaos testing of elastic jobs: inject faults into a real multi-node run, then check invariants.

- :class:`Recorder` (in the job): writes the evidence the invariants read.
- :func:`run_chaos` with a :class:`ChaosConfig` (or ``python -m elastictrain.chaos``):
  runs the job on local node agents against its own etcd, injects faults, checks
  the invariants and writes ``report.json`` (and ``report.png``).

Workers import this package for the :class:`Recorder`; the harness's modules
(processes, etcd, invariants) are imported on first use only, so a worker pays
for none of them.

See docs/chaos.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from elastictrain.chaos.recorder import CHAOS_DIR_ENV, Recorder, fingerprint

__all__ = [
    "CHAOS_DIR_ENV",
    "DEFAULT_KINDS",
    "ChaosConfig",
    "ChaosResult",
    "Evidence",
    "FaultKind",
    "InvariantResult",
    "PlannedFault",
    "RandomPlanner",
    "Recorder",
    "fingerprint",
    "parse_schedule",
    "run_chaos",
]

_LAZY = {
    "DEFAULT_KINDS": "config", "ChaosConfig": "config", "ChaosResult": "harness", "run_chaos": "harness",
    "FaultKind": "schedule", "PlannedFault": "schedule", "RandomPlanner": "schedule", "parse_schedule": "schedule",
    "Evidence": "invariants", "InvariantResult": "invariants",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"elastictrain.chaos.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'elastictrain.chaos' has no attribute {name!r}")
