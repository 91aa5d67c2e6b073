"""WorkerContext from the launcher's environment (elastictrain run, torchrun, or none)."""

from __future__ import annotations

import pytest

from elastictrain.errors import ConfigError
from elastictrain.train.worker import STANDALONE_RUN_ID, WorkerContext

pytestmark = pytest.mark.timeout(10)

AGENT_ENV = {
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_a_process_without_launcher_variables_is_rank_0_of_1() -> None:
    context = WorkerContext.from_env({})
    assert context == WorkerContext()
    assert (context.rank, context.world_size, context.run_id, context.launched) == (0, 1, STANDALONE_RUN_ID, False)


def test_the_agent_environment_is_read_field_by_field() -> None:
    context = WorkerContext.from_env(AGENT_ENV)
    assert context == WorkerContext(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
                                    restart_count=2, run_id="job-7", master_addr="10.0.0.1", master_port=29500)
    assert context.launched and not context.is_rank_zero


@pytest.mark.parametrize("changes, match", [
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"RANK": "4"}, "rank 4 is outside world size 4"),
    ({"LOCAL_RANK": "2"}, "local rank 2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be at least 1"),
    ({"MASTER_PORT": ""}, "set together"),
])
def test_bad_variables_raise_config_error_naming_them(changes: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkerContext.from_env({**AGENT_ENV, **changes})


def test_a_world_of_several_needs_a_rendezvous_address() -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        WorkerContext.from_env({"RANK": "0", "WORLD_SIZE": "2"})


class _Recording:
    """A stream that records each write call."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_each_prefixed_line_goes_out_in_one_write() -> None:
    """print() writes a line's text and its newline apart; written through as they came, the
    lines of two ranks sharing the terminal interleaved ('[vm 0] a[vm 1] b')."""
    from elastictrain.launch._worker_boot import _PrefixedStream

    sink = _Recording()
    stream = _PrefixedStream(sink, lambda: "[n 0] ")
    print("RESULT rank=0 done", file=stream)
    stream.write("two\nlines\n")
    stream.write("partial")
    assert sink.writes == ["[n 0] RESULT rank=0 done\n", "[n 0] two\n[n 0] lines\n"]
    stream.flush()  # a partial line goes out on a flush (a progress bar's \r updates do)
    assert sink.writes[-1] == "[n 0] partial"
    stream.write(" end\n")
    assert sink.writes[-1] == " end\n"
