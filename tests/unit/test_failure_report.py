"""The failure report: root cause first, one line, its traceback once, no raw dicts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastictrain.launch import failure_report
from elastictrain.launch.launcher import _failure_outcome

USER_STACK = """Traceback (most recent call last):
  File "/venv/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/src/elastictrain/launch/_worker_boot.py", line 72, in run_script
    runpy.run_path(script, run_name="__main__")
  File "<frozen runpy>", line 291, in run_path
  File "/jobs/train.py", line 42, in <module>
    raise ValueError("bad batch 1234 in shard 7")
ValueError: bad batch 1234 in shard 7
"""

GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:2954. This is typically caused by a remote worker crashing. Check the logs of the "
        "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")


def _failure(tmp_path: Path, name: str, message: str | None, *, exitcode: int = 1, ts: int = 100,
             stack: str = "") -> ProcessFailure:
    error_file = tmp_path / f"{name}.json"
    if message is not None:  # what torch's @record writes
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": stack, "timestamp": str(ts)}}}))
    return ProcessFailure(local_rank=0, pid=1000 + ts, exitcode=exitcode, error_file=str(error_file))


def test_the_raising_rank_is_the_root_cause_even_when_a_peer_failed_first(tmp_path: Path) -> None:
    raised = _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", ts=101, stack=USER_STACK)
    peer = _failure(tmp_path, "r0", GLOO, ts=100, stack="Traceback (most recent call last):\n" + GLOO)
    outcome = _failure_outcome({0: peer, 1: raised}, restarts=0, node="node1")
    assert outcome.exit_code == 1
    assert outcome.summary == ("rank 1 on node1 failed: ValueError: bad batch 1234 in shard 7 (train.py:42); "
                               "rank(s) 0 stopped after it (their collectives failed when it went away); "
                               "job failed after 0 restart(s)")
    assert "{" not in outcome.summary and "GLHF" not in outcome.summary


def test_the_report_prints_the_root_cause_traceback_once_trimmed_to_the_script(tmp_path: Path) -> None:
    raised = failure_report.from_process_failure(
        1, _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", stack=USER_STACK), "node1")
    peer = failure_report.from_process_failure(0, _failure(tmp_path, "r0", GLOO, stack=GLOO), "node0")
    text = failure_report.report([peer, raised], restarts=2)
    assert text.count("Traceback (most recent call last)") == 1
    assert 'File "/jobs/train.py", line 42' in text
    assert "_worker_boot" not in text and "runpy" not in text and "errors/__init__" not in text
    assert "Connection closed" not in text  # the consequence is summarised, not printed
    assert text.splitlines()[-1].endswith("job failed after 2 restart(s)")


def test_a_peer_error_is_cleaned_of_gloo_noise(tmp_path: Path) -> None:
    peer = failure_report.from_process_failure(0, _failure(tmp_path, "r0", GLOO), "node0")
    assert peer.consequential
    assert peer.error == "RuntimeError: Connection closed by peer [127.0.0.1]:2954."


def test_a_signal_and_a_plain_exit_code_read_as_such(tmp_path: Path) -> None:
    killed = failure_report.from_process_failure(3, _failure(tmp_path, "k", None, exitcode=-9), "host-a")
    exited = failure_report.from_process_failure(0, _failure(tmp_path, "e", None, exitcode=7), "host-a")
    assert killed.describe() == "rank 3 on host-a was killed by SIGKILL"
    assert exited.describe() == "rank 0 on host-a exited with code 7"
    assert _failure_outcome({3: _failure(tmp_path, "k", None, exitcode=-9)}, 1, "h").exit_code == 128 + 9


def test_an_outcome_file_round_trips_for_the_local_launcher(tmp_path: Path) -> None:
    raised = failure_report.from_process_failure(
        1, _failure(tmp_path, "r1", "ValueError: x", ts=int(time.time()), stack=USER_STACK), "node1")
    path = str(tmp_path / "node1.json")
    failure_report.write_outcome(path, exit_code=1, summary="s", restarts=0, failures=[raised])
    data = failure_report.read_outcome(path)
    assert data is not None and data["failures"] == [raised]
    assert failure_report.read_outcome(str(tmp_path / "missing.json")) is None


def test_a_config_error_is_placed_where_the_script_called_elastictrain_and_printed_without_traceback(
        tmp_path: Path) -> None:
    """A ConfigError is raised inside elastictrain (its own files, wherever it is installed), but
    refuses what the script passed: the location is the script's call, and no traceback shows."""
    package = Path(failure_report.__file__).parent
    stack = USER_STACK.replace('    raise ValueError("bad batch 1234 in shard 7")\nValueError: bad batch 1234 in shard 7\n', (
        "    sampler = ElasticSampler(1000, global_batch_size=0)\n"
        f'  File "{package}/sampler.py", line 56, in _check_int\n'
        '    raise ConfigError(f"{name} must be {bound}, got {value}")\n'
        "elastictrain.errors.ConfigError: global_batch_size must be >= 1, got 0\n"))
    process_failure = _failure(tmp_path, "r0", "ConfigError: global_batch_size must be >= 1, got 0", stack=stack)
    other = _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", ts=101, stack=USER_STACK)
    assert failure_report.final_error({1: other, 0: process_failure}) == (0, "ConfigError")
    assert failure_report.final_error({1: other}) is None
    refused = failure_report.from_process_failure(0, process_failure, "node0")
    assert refused.final and refused.location == "train.py:42"
    assert failure_report.report([refused], restarts=0) == (
        "rank 0 on node0 failed: ConfigError: global_batch_size must be >= 1, got 0 (train.py:42); "
        "job failed after 0 restart(s)")


_ERRORS = "elastictrain.errors."


@pytest.mark.parametrize(("raised", "final"), [
    (_ERRORS + "ConfigError", True), (_ERRORS + "CheckpointMismatchError", True),
    (_ERRORS + "NonFiniteStateError", True), (_ERRORS + "CheckpointDirectoryError", True),
    (_ERRORS + "DependencyError", True), (_ERRORS + "TorchCompatError", True),
    ("SyntaxError", True), ("IndentationError", True),
    (_ERRORS + "CheckpointError", False), (_ERRORS + "CorruptCheckpointError", False),
    (_ERRORS + "SessionError", False), ("ValueError", False), ("ModuleNotFoundError", False)])
def test_errors_a_restart_would_meet_again_end_the_job_at_once(tmp_path: Path, raised: str, final: bool) -> None:
    """A checkpoint that does not fit the model, a diverged state, or code that does not compile
    comes back after a restart as surely as refused input; a failed write or a corrupt
    checkpoint may not."""
    stack = USER_STACK.replace('ValueError: bad batch 1234 in shard 7\n', f"{raised}: it\n")
    name = raised.rpartition(".")[2]
    failure = _failure(tmp_path, "r0", f"{name}: it", stack=stack)
    assert failure_report.final_error({0: failure}) == ((0, name) if final else None)
    assert failure_report.from_process_failure(0, failure, "node0").final is final


def test_an_error_elastictrain_diagnosed_prints_its_line_without_a_traceback_and_is_not_cut(tmp_path: Path) -> None:
    """Issue 40, item 6: the traceback is for the script's own errors; elastictrain's message is the
    diagnosis (before, a CheckpointError printed 20 lines of elastictrain's frames above its line,
    and the line was cut at 300 characters)."""
    message = "CheckpointError: checkpoint of step 4 was not committed: " + "x" * 400
    stack = USER_STACK.replace('ValueError: bad batch 1234 in shard 7\n', f"{_ERRORS}{message}\n")
    failure = failure_report.from_process_failure(0, _failure(tmp_path, "r0", message, stack=stack), "node0")
    assert failure.diagnosed and not failure.final and failure.error == message
    assert failure_report.report([failure], restarts=1) == (
        f"rank 0 on node0 failed: {message} (train.py:42); job failed after 1 restart(s)")
    user = failure_report.from_process_failure(
        0, _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", stack=USER_STACK), "node0")
    assert not user.diagnosed and "Traceback" in failure_report.report([user], restarts=0)


def test_a_config_error_from_a_dataclass_init_is_placed_at_the_script_s_call(tmp_path: Path) -> None:
    """SessionConfig's __init__ is generated code (File "<string>"): the report said
    '(<string>:27)' instead of the script's line."""
    package = Path(failure_report.__file__).parent
    stack = USER_STACK.replace('    raise ValueError("bad batch 1234 in shard 7")\nValueError: bad batch 1234 in shard 7\n', (
        "    session = Session(model, opt, data, precision='fp8')\n"
        f'  File "{package}/train/session.py", line 163, in __init__\n'
        "    config = SessionConfig(**options)\n"
        '  File "<string>", line 27, in __init__\n'
        f'  File "{package}/train/session_config.py", line 123, in __post_init__\n'
        '    raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")\n'
        "elastictrain.errors.ConfigError: precision must be one of ('auto', 'fp32'), got 'fp8'\n"))
    failure = _failure(tmp_path, "r0", "ConfigError: precision must be one of ('auto', 'fp32'), got 'fp8'",
                       stack=stack)
    assert failure_report.from_process_failure(0, failure, "node0").location == "train.py:42"
