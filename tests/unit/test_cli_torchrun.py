"""torchrun's spellings on `elastictrain run`: same meaning, or one line saying why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.launch import arguments, cli
from elastictrain.launch.config import RunConfig
from elastictrain.errors import ConfigError


def _config(*argv: str) -> RunConfig:
    args = arguments.build_parser().parse_args(["run", *argv])
    arguments.resolve_torchrun_spellings(args)
    return arguments.run_config(args, etcd=args.etcd or "127.0.0.1:2379", run_id=args.run_id or "local",
                                local_addr="127.0.0.1")


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_nnodes_takes_a_count_or_a_range(script: str) -> None:
    assert (_config("--nnodes", "2", script).min_nodes, _config("--nnodes", "2", script).max_nodes) == (2, 2)
    config = _config("--nnodes", "2:8", script)
    assert (config.min_nodes, config.max_nodes) == (2, 8)


def test_torchrun_spellings_mean_the_same(script: str) -> None:
    config = _config("--nproc_per_node", "3", "--rdzv_endpoint", "e1:2379", "--rdzv-id", "exp42",
                     "--rdzv-backend", "etcd3", "--rdzv_conf", "join_timeout=30", "--max_restarts", "2",
                     "--log_dir", "/tmp/x", "-r", "3", "--tee", "0:1,1:2", "--local_ranks_filter", "1,0",
                     "--role", "learner", script, "--lr", "3")
    assert config.nproc_per_node == 3 and config.max_restarts == 2 and config.run_id == "exp42"
    assert config.etcd == "e1:2379" and config.rendezvous.join_timeout.total_seconds() == 30
    assert (config.log_dir, config.redirects, config.tee) == ("/tmp/x", "3", "0:1,1:2")
    assert config.local_ranks_filter == (0, 1) and config.role == "learner"
    assert config.script_args == ("--lr", "3")


def test_nproc_per_node_cpu_and_auto_count_this_host(script: str) -> None:
    assert _config("--nproc-per-node", "cpu", script).nproc_per_node >= 1
    assert _config("--nproc-per-node", "auto", script).nproc_per_node >= 1


def test_nproc_per_node_gpu_counts_without_initializing_cuda(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count comes from NVML (torch.cuda.device_count): torch.cuda.is_available() initializes
    the CUDA driver, and the workers' forkserver, a fork of this process, could then not use CUDA."""
    import torch

    def initializes_the_driver() -> bool:
        raise AssertionError("torch.cuda.is_available() called: it initializes the CUDA driver")

    monkeypatch.setattr(torch.cuda, "is_available", initializes_the_driver)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _config("--nproc-per-node", "gpu", script).nproc_per_node == 4
    assert _config("--nproc-per-node", "auto", script).nproc_per_node == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _config("--nproc-per-node", "auto", script).nproc_per_node >= 1  # the CPUs


def test_module_and_program_entries(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)  # found where `python -m` looks first
    assert _config("-m", "pkg.train", "--x").entry == "module"
    assert _config("--no-python", "echo", "hi").entry == "program"
    assert _config(script).entry == "script"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--nnodes", "2", "--bogus", "--other", "7", "x.py"], "unrecognized arguments: --bogus --other"),
    (["--master-addr", "10.0.0.1", "--master_port", "29500", "x.py"],
     "--master-addr/--master-port: not needed, the rendezvous (etcd) picks rank 0's address"),
    (["--node_rank", "1", "x.py"], "--node-rank: node ranks are assigned by the rendezvous"),
    (["--nnodes", "3:2", "x.py"], "expected N or MIN:MAX"),
    (["--nnodes", "2", "--max-nodes", "3", "x.py"], "--nnodes and --min-nodes/--max-nodes say the same thing"),
    (["--nproc-per-node", "many", "x.py"], "expected a positive integer, auto, gpu or cpu"),
    (["--rdzv-backend", "c10d", "x.py"], "always uses its etcd3 rendezvous"),
    (["--tee", "4", "x.py"], "expected 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
    (["-m", "--no-python", "x"], "-m/--module and --no-python exclude each other"),
    (["-m", "not/a/module"], "-m/--module takes a module name"),
    (["--no-python", "no-such-program-17"], "--no-python: program 'no-such-program-17' is not an executable"),
])
def test_bad_torchrun_flags_are_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_every_unknown_and_refused_flag_is_reported_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--bogus", "--node-rank", "0", "--master-addr", "h", "--x=1", "t.py", "--y"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus --x" in err and "--node-rank:" in err and "--master-addr/" in err
    assert "--y" not in err  # the script's own


def test_local_nodes_alone_is_a_job_of_that_many_nodes(script: str) -> None:
    """With --min-nodes defaulting to 1, `--local-nodes 2` formed a 1-node job and the second
    node waited for a place until the join timeout."""
    assert (_config("--local-nodes", "3", script).min_nodes, _config("--local-nodes", "3", script).max_nodes) == (3, 3)
    spares = _config("--local-nodes", "3", "--max-nodes", "2", script)  # the third waits as a hot spare
    assert (spares.min_nodes, spares.max_nodes) == (2, 2)
    grows = _config("--local-nodes", "2", "--max-nodes", "4", script)
    assert (grows.min_nodes, grows.max_nodes) == (2, 4)
    explicit = _config("--local-nodes", "3", "--min-nodes", "1", script)
    assert (explicit.min_nodes, explicit.max_nodes) == (1, 1)
    assert (_config(script).min_nodes, _config(script).max_nodes) == (1, 1)


def test_nnodes_with_an_explicit_min_nodes_of_one_is_refused(script: str) -> None:
    with pytest.raises(ConfigError, match="say the same thing"):
        _config("--nnodes", "2", "--min-nodes", "1", script)


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "--max-node", "3", "x.py"], "unrecognized arguments: --max-node; --max-node: did you mean --max-nodes?"),
    (["run", "--verbos", "--bogus", "x.py"], "unrecognized arguments: --verbos --bogus; --verbos: did you mean --verbose?"),
    (["status", "--run-di", "x"], "unrecognized arguments: --run-di x; --run-di: did you mean --run-id?"),
    (["etcd", "--prot=3"], "unrecognized arguments: --prot=3; --prot: did you mean --port?"),
])
def test_a_mistyped_flag_gets_a_did_you_mean(argv: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 43: argparse's suggest_on_error is Python 3.14's; one line, exit 2, as every bad flag.
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"elastictrain: error: {expected}\n"


def test_a_flag_close_to_none_gets_no_suggestion_and_a_refused_one_is_never_suggested(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--bogus", "--master-adr", "h", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err, err


def test_verbose_falls_back_to_its_variable_and_reaches_local_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 43: -v/--verbose, like every flag, from ELASTICTRAIN_VERBOSE; a --local-nodes child gets it.
    parser = arguments.build_parser()
    assert parser.parse_args(["run", "x.py"]).verbose is False
    monkeypatch.setenv("ELASTICTRAIN_VERBOSE", "1")
    parser = arguments.build_parser()
    args = parser.parse_args(["run", "--local-nodes", "2", "x.py"])
    assert args.verbose is True
    assert "--verbose" in arguments.node_args(args.run_parser, args, endpoint="127.0.0.1:1", run_id="r", local_addr=None)
