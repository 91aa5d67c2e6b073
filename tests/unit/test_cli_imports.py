"""`elastictrain --help`, `status` and `stop` answer without importing torch (about 1.2 s here), and
a worker's side of the package does not import the launch side (etcd, rendezvous, run configuration)."""

from __future__ import annotations

import ast
import subprocess
import sys

from elastictrain.etcd import kv
from elastictrain.rendezvous.keys import RunKeys
from tests.conftest import REPO_ROOT, subprocess_env

# Runs a command of the CLI in a fresh interpreter, then says whether torch got imported.
_PROBE = """
import sys
from elastictrain.launch.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help
    code = exc.code
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", code, file=sys.stderr)
"""


def _probe(*argv: str) -> str:
    result = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=60,
                            env=subprocess_env(), cwd=REPO_ROOT)
    return result.stderr.strip().splitlines()[-1]


def test_help_does_not_import_torch() -> None:
    assert _probe("--help").startswith("NO-TORCH 0")
    assert _probe("run", "--help").startswith("NO-TORCH 0")


def test_status_and_stop_do_not_import_torch(etcd_server, etcd_client, run_id) -> None:
    # A run whose keys elastictrain did not all write: saying so imported torch (the rendezvous's
    # error for it is torch's), and whether --all did depended on what the tests before left in etcd.
    keys = RunKeys.of(run_id)
    kv.txn(etcd_client, [], [kv.put(keys.meta, b'{"script": "train.py"}'), kv.put(keys.round, b"not a record"),
                             kv.put(keys.member("n1"), b"not a record")], what="test")
    assert _probe("status", "--etcd", etcd_server.endpoint, "--run-id", "no-such-run").startswith("NO-TORCH 1")
    assert _probe("status", "--etcd", etcd_server.endpoint, "--run-id", run_id).startswith("NO-TORCH 0")
    assert _probe("status", "--etcd", etcd_server.endpoint, "--all").startswith("NO-TORCH 0")
    assert _probe("stop", "--etcd", etcd_server.endpoint, "--run-id", "no-such-run").startswith("NO-TORCH 1")


def _loaded_by(modules: str, select: str) -> list[str]:
    """The modules (``sys.modules`` names for which the expression ``select`` of ``m`` holds)
    that importing ``modules`` loads, in a fresh interpreter."""
    probe = f"import sys, {modules}\nprint(sorted(m for m in sys.modules if {select}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env=subprocess_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout)


def test_a_worker_imports_no_launch_side_module() -> None:
    # Layers point down (STYLE.md): a training worker never talks to etcd, so it has no business
    # importing the etcd client, the rendezvous or the run's configuration (which imports both). Its
    # boot module lives in launch/; torch's registry imports the light torchrun plugin by entry point.
    allowed = ("elastictrain.launch", "elastictrain.launch._worker_boot", "elastictrain.rendezvous",
               "elastictrain.rendezvous._torchrun_plugin")
    assert _loaded_by("elastictrain.launch._worker_boot, elastictrain.train.session, elastictrain.train.elastic, "
                      "elastictrain.train.sampler, elastictrain.checkpoint",
                      f"m not in {allowed!r} and (m.split('.')[:2] in (['elastictrain', 'launch'], "
                      "['elastictrain', 'etcd'], ['elastictrain', 'rendezvous']) or m.split('.')[0] in "
                      "('grpc', 'etcd3'))") == []


def test_the_rendezvous_imports_nothing_from_the_launch_side() -> None:
    # torchrun builds our handler without elastictrain's launcher: launch -> rendezvous -> etcd, never back up.
    assert _loaded_by("elastictrain.rendezvous.handler, elastictrain.rendezvous.dynamic, elastictrain.etcd.conf",
                      "m.startswith('elastictrain.launch')") == []


def test_the_public_api_still_imports_on_first_use() -> None:
    import elastictrain
    from elastictrain.errors import EtcdUnavailableError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    assert issubclass(EtcdUnavailableError, RendezvousConnectionError)
    assert elastictrain.Session.__name__ == "Session" and "Session" in dir(elastictrain)


def test_a_torch_that_changed_a_private_name_is_refused_in_one_line(tmp_path) -> None:
    """As torch 2.11 was on a GPU machine (its LocalElasticAgent._shutdown takes no timeout): the
    start-up check names what changed, in one line, with no traceback."""
    (tmp_path / "sitecustomize.py").write_text(
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "def _shutdown(self, death_sig=15):\n"
        "    pass\n"
        "LocalElasticAgent._shutdown = _shutdown\n")
    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}".rstrip(":")
    result = subprocess.run([sys.executable, "-m", "elastictrain", "run", "--nproc-per-node", "1",
                             str(REPO_ROOT / "tests" / "scripts" / "print_probe.py")],
                            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("elastictrain: error: elastictrain needs torch 2.13.*: torch ")
    assert "changed LocalElasticAgent._shutdown('self', 'death_sig', 'timeout') to ('self', 'death_sig')" in last
