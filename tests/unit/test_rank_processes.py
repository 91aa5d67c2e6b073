"""The test support's ranks (``tests/support/ranks.py``): forked from a torch-preloaded server of
their own, whatever else in the test process uses multiprocessing's forkserver.

This module imports no torch: what a rank finds imported came from its server.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from typing import Any

from tests.support.ranks import RANK_PRELOAD, next_report, rank_context


def _nothing() -> None:
    pass


def _what_the_rank_found(results: Any) -> None:
    results.put((os.getppid(), [name for name in RANK_PRELOAD if name in sys.modules]))


def test_ranks_fork_from_a_preloaded_server_of_their_own_when_multiprocessings_runs_without_it() -> None:
    # multiprocessing's forkserver started first, without the preload, as torch's start_processes
    # starts it (test_inprocess_parts' forkserver test): the ranks forked from it afterwards, for
    # the rest of the test process, each imported torch again. On busy cores a DDP test's rank
    # took 40-100 s doing so (3 s with the preload), its peer waiting in gloo's connect: the
    # 120 s timeout in CI.
    plain = multiprocessing.get_context("forkserver").Process(target=_nothing)
    plain.start()
    plain.join(timeout=60)
    assert plain.exitcode == 0
    multiprocessings = multiprocessing.forkserver._forkserver._forkserver_pid  # whose child the rank is not
    context = rank_context()
    results = context.Queue()
    rank = context.Process(target=_what_the_rank_found, args=(results,), name="rank 0")
    rank.start()
    try:
        server, preloaded = next_report(results, [rank], timeout=60)
    finally:
        rank.join(timeout=30)
    assert server != multiprocessings, "the rank was forked from multiprocessing's forkserver"
    assert preloaded == RANK_PRELOAD, f"the rank's server had imported only {preloaded}"
