"""The address a node is reached at, when ``--local-addr`` is not given."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.etcd import EtcdServer, EtcdServerOptions
from tests.conftest import REPO_ROOT, subprocess_env

PROBE = str(REPO_ROOT / "tests" / "scripts" / "env_probe.py")


def _global_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine, from ``ip`` (``None`` if it has none)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


@pytest.fixture
def etcd_on_a_global_address(tmp_path: Path) -> Iterator[EtcdServer]:
    address = _global_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    server = EtcdServer(EtcdServerOptions(host=address, data_dir=str(tmp_path / "etcd"), durable=False)).start()
    yield server
    server.stop()


@pytest.mark.timeout(180)
def test_a_node_is_reached_at_its_address_towards_etcd(etcd_on_a_global_address: EtcdServer, run_id: str,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", etcd_on_a_global_address.endpoint, "--run-id", run_id,
         PROBE, str(out), "MASTER_ADDR"],
        env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Rank 0's node address is where every worker meets the round's store: not "localhost"
    # (this host's FQDN where /etc/hosts maps the hostname to 127.0.0.1).
    assert json.loads(out.read_text()) == {"MASTER_ADDR": etcd_on_a_global_address.options.host}
