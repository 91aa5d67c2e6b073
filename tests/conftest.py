"""Shared fixtures: a real etcd server per test session, unique run ids, free ports."""

from __future__ import annotations

import itertools
import os
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastictrain.errors import EtcdServerError
from elastictrain.etcd import EtcdClient, EtcdServer, EtcdServerOptions, EtcdSettings, parse_endpoints

REPO_ROOT = Path(__file__).resolve().parent.parent
_counter = itertools.count()


def _start_server(tmp: Path) -> EtcdServer:
    try:
        # Test data is thrown away: skip fsync, as a private etcd does.
        server = EtcdServer(EtcdServerOptions(data_dir=str(tmp / "etcd-data"), durable=False))
    except EtcdServerError as exc:
        pytest.fail(f"{exc} (the test extra installs it: pip install -e '.[test]')", pytrace=False)
    return server.start()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the session; tests keep apart through unique run ids."""
    server = _start_server(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that kill or restart it."""
    server = _start_server(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    return f"test-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


def make_client(endpoint: str, retry_deadline: float = 10.0) -> EtcdClient:
    return EtcdClient(
        EtcdSettings(
            endpoints=tuple(parse_endpoints(endpoint)),
            retry_deadline=timedelta(seconds=retry_deadline),
            request_timeout=timedelta(seconds=2),
        )
    )


@pytest.fixture
def etcd_client(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    client = make_client(etcd_server.endpoint)
    yield client
    client.close()


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: this interpreter's scripts dir first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _restore_elastictrain_logging() -> Iterator[None]:
    """Tests that run the CLI in-process let it configure logging the way it does for a
    real process; undo that, so later tests see the library's default logging."""
    import logging

    names = ("elastictrain", "elastictrain.events")
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
