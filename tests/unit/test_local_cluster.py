"""The exit code of a ``--local-nodes`` job from its nodes' exit codes (issue 43)."""

from __future__ import annotations

import pytest

from elastictrain.launch.local_cluster import job_outcome

pytestmark = pytest.mark.timeout(10)


def test_every_node_succeeding_is_success_without_a_line() -> None:
    outcome = job_outcome({0: 0, 1: 0, 2: 0})
    assert (outcome.exit_code, outcome.failed_nodes, outcome.why) == (0, (), "")


def test_a_killed_agent_has_no_say_when_its_peers_finished_the_job() -> None:
    outcome = job_outcome({2: -9, 0: 0, 1: 0})
    assert outcome.exit_code == 0 and outcome.failed_nodes == ()
    assert outcome.why.startswith("job finished (exit code 0): 2 of 3 nodes ended with success")
    assert "node2's by SIGKILL" in outcome.why


def test_a_peer_that_failed_gives_the_job_its_code_not_the_killed_agent() -> None:
    outcome = job_outcome({2: -9, 0: 7, 1: 0})
    assert outcome.exit_code == 7 and outcome.failed_nodes == (0,)


def test_every_agent_killed_fails_the_job_with_the_first_signal() -> None:
    outcome = job_outcome({1: -15, 0: -9})
    assert outcome.exit_code == 128 + 15 and "node1's first, by SIGTERM" in outcome.why
