"""The chaos command's etcd members log warnings and errors only: a soak at etcd's default
level left a 123 MB log in the run's directory (under the working directory)."""

from __future__ import annotations

from pathlib import Path

from elastictrain.chaos.cluster import EtcdCluster


def test_chaos_etcd_members_log_at_warn_level(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", members=3)
    for server in cluster.servers:
        command = server.command()
        assert command[command.index("--log-level") + 1] == "warn"
        assert server.log_path is None or str(tmp_path) in server.log_path
