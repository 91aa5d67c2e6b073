"""WorkerContext from the launcher's environment (elastictrain run, torchrun, or none)."""

from __future__ import annotations

import pytest

from elastictrain.errors import ConfigError
from elastictrain.worker import STANDALONE_RUN_ID, WorkerContext

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
