"""A worker's semaphores leave /dev/shm once it holds them (issue 43: 'resource_tracker: There
appear to be 7 leaked semaphore objects' after an agent was killed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from elastictrain import _torch_compat

pytestmark = pytest.mark.timeout(90)


def test_the_names_go_once_the_worker_holds_them_and_its_return_value_still_comes_back(tmp_path: Path) -> None:
    context = start_processes(name="probe", entrypoint=os.getpid, args={0: ()}, envs={0: {}},
                              logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)), start_method="forkserver")
    names = {lock._semlock.name.lstrip("/") for queue in context._ret_vals.values()
             for lock in _torch_compat._semlocks(queue)}
    names |= {lock._semlock.name.lstrip("/") for lock in _torch_compat._semlocks(context._worker_finished_event)}
    assert len(names) == 7 and all(Path(f"/dev/shm/sem.{name}").exists() for name in names)
    _torch_compat.release_semaphore_names(context)
    deadline = time.monotonic() + 30
    while any(Path(f"/dev/shm/sem.{name}").exists() for name in names) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [name for name in names if Path(f"/dev/shm/sem.{name}").exists()]
    result = context.wait(60)  # the worker's queue and event still work: its value comes back
    assert result is not None and not result.is_failed()
    assert result.return_values[0] == context.pids()[0]
