"""Rank-aware logging: the prefix, info on rank 0 only, JSON lines."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from elastictrain.train.rank_logging import (
    PREFIXED_LINES_ENV,
    RankLoggerAdapter,
    format_prefix,
    get_logger,
    setup_logging,
    terminal_is_prefixed,
)
from elastictrain.train.worker import WorkerContext

pytestmark = pytest.mark.timeout(10)


def context(rank: int, run_id: str = "job") -> WorkerContext:
    return WorkerContext(rank=rank, world_size=4, node_rank=rank // 2, local_rank=rank % 2, local_world_size=2,
                         restart_count=3, run_id=run_id)


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_prefix_names_run_node_rank_world_and_restart() -> None:
    assert format_prefix(context(3)) == "[run=job node=1 rank=3/4 restart=3]"


def test_info_comes_from_rank_0_only_and_warnings_from_every_rank(stream: io.StringIO) -> None:
    setup_logging(context(0), stream=stream, json_lines=False)
    for rank in range(2):
        log = get_logger("test.rank", context(rank))
        log.info("info from %d", rank)
        log.warning("warning from %d", rank)
    get_logger("test.rank", context(1), all_ranks=True).info("all ranks")
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [
        "[run=job node=0 rank=0/4 restart=3] info from 0",
        "[run=job node=0 rank=0/4 restart=3] warning from 0",
        "[run=job node=0 rank=1/4 restart=3] warning from 1",
        "[run=job node=0 rank=1/4 restart=3] all ranks",
    ]


def test_records_from_plain_loggers_get_the_prefix_and_the_rank_policy(stream: io.StringIO) -> None:
    setup_logging(context(2), stream=stream, json_lines=False)
    logging.getLogger("elastictrain.train.sampler").info("resharded")  # info on rank 2: dropped
    logging.getLogger("elastictrain.train.sampler").warning("odd %s", "thing")
    assert stream.getvalue().splitlines()[-1].endswith(
        "elastictrain.train.sampler: [run=job node=1 rank=2/4 restart=3] odd thing")
    assert "resharded" not in stream.getvalue()


def test_a_re_formed_group_gives_the_module_loggers_the_workers_new_rank(stream: io.StringIO) -> None:
    # Probe, stop 29: after a resize the sampler's and the checkpoints' lines kept the starting
    # rank/world (and a worker that became rank 0 kept its old rank's policy: its info was dropped).
    from elastictrain._control import Assignment
    from elastictrain.train.group_keeper import GroupKeeper
    from elastictrain.train.hooks import HookDispatcher
    from elastictrain.train.session_config import SessionConfig

    setup_logging(context(2), stream=stream, json_lines=False)
    keeper = GroupKeeper(SessionConfig(global_batch_size=8), HookDispatcher([]), context(2), None, state=None,  # type: ignore[arg-type]
                         restore=lambda: None)
    keeper._adopt(Assignment(generation=1, round=1, world_size=2, master_addr="127.0.0.1", master_port=1,
                             ranks={"0": 0}, group_rank=0, group_world_size=1))
    logging.getLogger("elastictrain.train.sampler").info("resharded")
    assert stream.getvalue().splitlines()[-1].endswith(
        "elastictrain.train.sampler: [run=job node=0 rank=0/2 restart=3] resharded")


def test_json_lines_carry_the_context_as_fields(stream: io.StringIO) -> None:
    setup_logging(context(1), stream=stream, json_lines=True)
    try:
        raise ValueError("bad")
    except ValueError:
        get_logger("test.json", context(1)).exception("step %d failed", 5)
    record = json.loads(stream.getvalue().splitlines()[-1])
    assert record["message"] == "step 5 failed"
    assert {k: record[k] for k in ("level", "logger", "run_id", "node", "rank", "world_size", "restart")} == {
        "level": "ERROR", "logger": "test.json", "run_id": "job", "node": 0, "rank": 1, "world_size": 4,
        "restart": 3}
    assert "ValueError: bad" in record["exception"]


def test_a_percent_sign_in_the_run_id_does_not_break_formatting(stream: io.StringIO) -> None:
    setup_logging(context(0, run_id="a%sb"), stream=stream, json_lines=False)
    log = RankLoggerAdapter(logging.getLogger("test.pct"), context(0, run_id="a%sb"))
    log.info("value %d", 7)
    log.info("no args 100%")
    assert stream.getvalue().splitlines()[-2].endswith("[run=a%sb node=0 rank=0/4 restart=3] value 7")
    assert stream.getvalue().splitlines()[-1].endswith("[run=a%sb node=0 rank=0/4 restart=3] no args 100%")


def test_the_record_points_at_the_caller_not_the_adapter(stream: io.StringIO) -> None:
    setup_logging(context(0), stream=stream, json_lines=False)
    handler = logging.getLogger().handlers[0]
    handler.setFormatter(logging.Formatter("%(filename)s"))
    get_logger("test.caller", context(0)).info("here")
    assert stream.getvalue().strip() == "test_rank_logging.py"


def test_brief_lines_are_time_and_message_with_level_and_logger_from_warning_up(stream: io.StringIO) -> None:
    # The session's own lines on a terminal that already says [node rank] (issue 43).
    setup_logging(context(0), stream=stream, json_lines=False, brief=True)
    get_logger("elastictrain.train.session", context(0)).info("step %d", 10)
    logging.getLogger("elastictrain.train.sampler").warning("odd %s", "thing")
    first, second = stream.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d step 10", first), first
    assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING elastictrain.train.sampler: odd thing", second), second


@pytest.mark.parametrize(("prefixed", "verbose", "brief"), [("1", "", True), ("1", "1", False), ("", "", False)])
def test_lines_are_brief_only_where_the_launcher_prefixes_them_and_not_verbose(
        monkeypatch: pytest.MonkeyPatch, prefixed: str, verbose: str, brief: bool) -> None:
    monkeypatch.setenv(PREFIXED_LINES_ENV, prefixed)
    monkeypatch.setenv("ELASTICTRAIN_VERBOSE", verbose)
    assert terminal_is_prefixed() is brief


@pytest.mark.parametrize(("prefixed", "brief"), [("1", True), ("", False)])
def test_a_scripts_own_set_up_is_brief_where_the_launcher_prefixes_its_lines(
        monkeypatch: pytest.MonkeyPatch, stream: io.StringIO, prefixed: str, brief: bool) -> None:
    """The README's example job calls setup_logging itself: under `elastictrain run` its lines
    carried the 60-character [run= node= rank=] prefix after the launcher's [node0 0]."""
    monkeypatch.setenv(PREFIXED_LINES_ENV, prefixed)
    monkeypatch.delenv("ELASTICTRAIN_VERBOSE", raising=False)
    setup_logging(context(0), stream=stream, json_lines=False)
    logging.getLogger("mlp").info("done")
    assert ("[run=" not in stream.getvalue()) is brief, stream.getvalue()
