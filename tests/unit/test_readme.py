"""The README's multi-host recipes: what they set must exist, and what they need must be there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from elastictrain.launch.arguments import build_parser
from tests.conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def _kubernetes_recipe() -> str:
    section = README.split("## On Slurm and Kubernetes", 1)[1]
    return section.split("```yaml", 1)[1].split("```", 1)[0]


def _run_flag_variables() -> set[str]:
    parser = build_parser()
    run = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "run" in a.choices).choices["run"]
    return {f"ELASTICTRAIN_{a.dest.upper()}" for a in run._actions if a.option_strings}


def test_kubernetes_recipe_sets_only_real_variables_and_a_user_with_the_password() -> None:
    names = set(re.findall(r"name: (ELASTICTRAIN_\w+)", _kubernetes_recipe()))
    assert names - _run_flag_variables() <= {"ELASTICTRAIN_ETCD_PASSWORD"}
    if "ELASTICTRAIN_ETCD_PASSWORD" in names:
        assert "ELASTICTRAIN_ETCD_USER" in names  # a password without a user is refused


def test_kubernetes_recipe_keeps_checkpoints_on_a_shared_volume() -> None:
    recipe = _kubernetes_recipe()
    command = json.loads(re.search(r"command: (\[.*?\])", recipe, re.S).group(1))  # type: ignore[union-attr]
    checkpoint_dir = command[command.index("--checkpoint-dir") + 1]
    mounts = dict(re.findall(r"\{name: (\S+), mountPath: (\S+)\}", recipe))
    volume = next(name for name, path in mounts.items() if checkpoint_dir.startswith(path.rstrip("/") + "/"))
    claim = re.search(rf"- name: {re.escape(volume)}\b.*?\n\s+persistentVolumeClaim:", recipe, re.S)
    assert claim is not None, f"volume {volume!r} is not a PersistentVolumeClaim"
    assert "ReadWriteMany" in recipe


def test_readme_says_the_store_and_collective_ports_need_a_trusted_network() -> None:
    paragraph = README.split("**Trusted network.**", 1)[1].split("\n\n", 1)[0]
    for what in ("store", "gloo", "NCCL", "neither encrypted nor authenticated"):
        assert what in paragraph


def test_the_status_demo_job_runs_the_steps_it_is_given() -> None:
    import runpy

    demo = re.search(r"examples/mlp\.py --steps (\d+)", README)
    assert demo is not None
    steps = int(demo.group(1))
    mlp = runpy.run_path(str(REPO_ROOT / "examples" / "mlp.py"), run_name="not_main")
    # 4096 samples, global batch 64 (the example's defaults): enough epochs for every step.
    assert mlp["epochs_for"](steps, 64, 4096) * (4096 // 64) >= steps


def test_readme_and_session_docs_say_what_restore_step_means_and_that_hooks_take_a_list() -> None:
    session = (REPO_ROOT / "docs" / "session.md").read_text()
    for text in (README, session):
        assert "`info.step` is the step number you passed to `save`" in text
    assert "`hooks=` takes a list" in README and "`hooks=` takes a list" in session


def test_the_session_conversion_example_runs_and_shows_what_a_real_loop_needs(tmp_path: Path) -> None:
    """Issue 43: the README's DDP-to-Session example shows stopping after N steps, the step
    number, rank and world size and the log interval, by their real names: it runs as written."""
    section = README.split("## The training session: from a DDP script to an elastic one", 1)[1]
    diff = section.split("```diff", 1)[1].split("```", 1)[0]
    converted = "\n".join(line[1:] for line in diff.splitlines() if line[:1] in (" ", "+"))
    for name in ("max_steps=", "log_every=", "step.number", "session.rank", "session.world_size"):
        assert name in converted, name
    stubs = ("import torch\n"
             "from torch.utils.data import TensorDataset\n"
             "def build_model():\n    return torch.nn.Linear(4, 1)\n"
             "dataset = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))\n"
             "loss_fn = torch.nn.functional.mse_loss\n")
    script = stubs + converted.replace('"/shared/ckpt"', repr(str(tmp_path / "ckpt")))
    script = script.replace("max_steps=1000", "max_steps=4").replace("% 500 ==", "% 2 ==")
    # A plain process, world 1: no launcher's variables (another test's process may have left some).
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("ELASTICTRAIN_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                          env={**env, "ELASTICTRAIN_PROGRESS": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["step 2 at world size 1", "step 4 at world size 1"]
