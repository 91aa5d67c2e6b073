"""The RendezvousBackend contract, run against the opt-in etcd3-dynamic backend on a real etcd.

The same contract also runs against an in-memory fake, so a contract test that
cannot fail shows up as one that also passes for a backend we know is wrong.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastictrain.errors import ConfigError, EtcdUnavailableError
from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous.dynamic import Etcd3RendezvousBackend
from elastictrain.rendezvous.keys import RunKeys
from tests.conftest import make_client
from tests.support.ranks import next_report, rank_context


class FakeRendezvousBackend(RendezvousBackend):
    """In-memory reference implementation of the contract."""

    def __init__(self) -> None:
        self._state: bytes | None = None
        self._token = 0

    @property
    def name(self) -> str:
        return "fake"

    def get_state(self) -> tuple[bytes, Token] | None:
        return None if self._state is None else (self._state, self._token)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if (token is None and self._state is None) or (token is not None and token == self._token and self._state is not None):
            self._state, self._token = state, self._token + 1
            return state, self._token, True
        current = self.get_state()
        return None if current is None else (*current, False)


class BackendContract:
    """Torch's RendezvousBackend contract; subclasses provide ``backend``."""

    backend: RendezvousBackend

    def test_get_state_returns_none_if_backend_state_does_not_exist(self) -> None:
        assert self.backend.get_state() is None

    def test_set_state_with_none_token_sets_state_if_absent(self) -> None:
        result = self.backend.set_state(b"a")
        assert result is not None
        state, token, has_set = result
        assert (state, has_set) == (b"a", True)
        assert self.backend.get_state() == (b"a", token)

    def test_set_state_with_current_token_sets_state_and_returns_new_token(self) -> None:
        _, token, _ = self.backend.set_state(b"a")  # type: ignore[misc]
        state, new_token, has_set = self.backend.set_state(b"b", token)  # type: ignore[misc]
        assert (state, has_set) == (b"b", True)
        assert new_token != token
        assert self.backend.get_state() == (b"b", new_token)

    def test_set_state_returns_current_backend_state_if_token_is_old(self) -> None:
        _, old, _ = self.backend.set_state(b"a")  # type: ignore[misc]
        _, current, _ = self.backend.set_state(b"b", old)  # type: ignore[misc]
        assert self.backend.set_state(b"c", old) == (b"b", current, False)
        assert self.backend.get_state() == (b"b", current)

    def test_set_state_returns_current_backend_state_if_token_is_none_and_state_exists(self) -> None:
        _, token, _ = self.backend.set_state(b"a")  # type: ignore[misc]
        assert self.backend.set_state(b"x", None) == (b"a", token, False)

    @pytest.mark.parametrize("bad_token", ["not-a-token", 3.5, -1, object()])
    def test_set_state_returns_current_backend_state_if_token_is_invalid(self, bad_token: Any) -> None:
        _, token, _ = self.backend.set_state(b"a")  # type: ignore[misc]
        assert self.backend.set_state(b"x", bad_token) == (b"a", token, False)

    def test_set_state_with_token_returns_none_if_state_is_absent(self) -> None:
        assert self.backend.set_state(b"x", 12345) is None
        assert self.backend.get_state() is None


class TestFakeBackendContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _backend(self) -> None:
        self.backend = FakeRendezvousBackend()


class TestEtcd3BackendContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _backend(self, etcd_client: Any, run_id: str) -> None:
        self.backend = Etcd3RendezvousBackend(etcd_client, run_id)


def test_get_state_raises_state_error_if_key_holds_foreign_bytes(etcd_client: Any, run_id: str) -> None:
    backend = Etcd3RendezvousBackend(etcd_client, run_id)
    etcd_client.call(lambda c: c.put(backend.key, b"\x80\x04garbage"))
    with pytest.raises(RendezvousStateError, match="does not hold a torch rendezvous state"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x")  # a failed create reports the current (corrupt) value


class _Canary:
    """Unpickling this creates a file: the sign that reading a key ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_a_crafted_pickle_behind_the_header_runs_no_code(etcd_client: Any, run_id: str, tmp_path: Any) -> None:
    import pickle

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    canary = tmp_path / "canary"
    backend = Etcd3RendezvousBackend(etcd_client, run_id)
    etcd_client.call(lambda c: c.put(backend.key, b"ETRDZV1\n" + pickle.dumps(_Canary(str(canary)))))
    with pytest.raises(RendezvousStateError, match="is not part of a rendezvous state"):
        backend.get_state()
    # torch's own handler on this backend: its first read stops at our check too.
    from elastictrain.rendezvous.dynamic import create_dynamic_handler

    handler = create_dynamic_handler(RendezvousParameters(
        "etcd3-dynamic", str(etcd_client.current_endpoint), run_id, 1, 1, local_addr="127.0.0.1", join_timeout=5))
    assert isinstance(handler, DynamicRendezvousHandler)
    with pytest.raises(RendezvousStateError):
        handler.next_rendezvous()
    assert not canary.exists()


def test_two_run_ids_on_one_etcd_do_not_interfere(etcd_client: Any, run_id: str) -> None:
    first = Etcd3RendezvousBackend(etcd_client, run_id + "-a")
    second = Etcd3RendezvousBackend(etcd_client, run_id + "-b")
    _, token_a, _ = first.set_state(b"a")  # type: ignore[misc]
    assert second.get_state() is None
    _, token_b, set_b = second.set_state(b"b")  # type: ignore[misc]
    assert set_b
    assert first.get_state() == (b"a", token_a)
    assert second.get_state() == (b"b", token_b)
    prefix = RunKeys.of(run_id + "-a").prefix
    keys = [m.key.decode() for _, m in etcd_client.call(lambda c: list(c.get_prefix(prefix)))]
    assert sorted(keys) == sorted([first.key, RunKeys.of(run_id + "-a").lease])


def test_state_key_is_attached_to_a_lease_with_the_configured_ttl(etcd_client: Any, run_id: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=30))
    backend = Etcd3RendezvousBackend(etcd_client, run_id, lease=lease)
    backend.set_state(b"a")
    _, meta = etcd_client.call(lambda c: c.get(backend.key))
    assert meta.lease_id == lease.id() != 0
    info = etcd_client.call(lambda c: c.get_lease_info(meta.lease_id))
    assert 0 < info.TTL <= 30


def test_state_expires_once_nobody_refreshes_its_lease(etcd_client: Any, run_id: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=2))
    backend = Etcd3RendezvousBackend(etcd_client, run_id, lease=lease)
    backend.set_state(b"a")
    time.sleep(3)
    assert backend.get_state() is not None  # kept alive past its TTL while the process lives
    lease.close()
    deadline = time.monotonic() + 10
    while backend.get_state() is not None and time.monotonic() < deadline:
        time.sleep(0.25)
    assert backend.get_state() is None


def test_write_grants_a_new_lease_if_etcd_forgot_ours(etcd_client: Any, run_id: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    backend = Etcd3RendezvousBackend(etcd_client, run_id, lease=lease)
    _, token, _ = backend.set_state(b"a")  # type: ignore[misc]
    old = lease.id()
    etcd_client.call(lambda c: c.revoke_lease(old))  # deletes the key too
    assert backend.set_state(b"b")[2]  # type: ignore[index]
    assert lease.id() != old


def _racer(endpoint: str, run_id: str, token: int, name: bytes, start: Any, results: Any) -> None:
    backend = Etcd3RendezvousBackend(make_client(endpoint), run_id)
    start.wait()
    result = backend.set_state(name, token)
    results.put((name, result[2] if result else None))


def test_concurrent_set_state_from_processes_has_exactly_one_winner(etcd_server: Any, run_id: str) -> None:
    backend = Etcd3RendezvousBackend(make_client(etcd_server.endpoint), run_id)
    _, token, _ = backend.set_state(b"initial")  # type: ignore[misc]
    ctx = rank_context()
    n = 6
    start, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(etcd_server.endpoint, run_id, token, f"p{i}".encode(), start, results))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        outcome = []
        while len(outcome) < n:
            outcome.append(next_report(results, [p for p in procs if p.exitcode not in (None, 0)], timeout=60))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    winners = [name for name, won in outcome if won]
    assert len(winners) == 1
    state, _ = backend.get_state()  # type: ignore[misc]
    assert state == winners[0]


def test_unreachable_etcd_raises_connection_error_within_deadline(run_id: str) -> None:
    from elastictrain.etcd.server import free_port

    client = make_client(f"127.0.0.1:{free_port()}", retry_deadline=1.5)
    backend = Etcd3RendezvousBackend(client, run_id)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        backend.get_state()
    elapsed = time.monotonic() - started
    assert isinstance(info.value, EtcdUnavailableError)
    assert "127.0.0.1" in str(info.value)
    assert elapsed < 1.5 + 2 + 1  # the deadline, one request timeout, slack


def test_backend_recovers_after_etcd_restart(private_etcd: Any, run_id: str) -> None:
    client = make_client(private_etcd.endpoint, retry_deadline=15)
    backend = Etcd3RendezvousBackend(client, run_id)
    _, token, _ = backend.set_state(b"before")  # type: ignore[misc]
    private_etcd.kill()
    private_etcd.start()
    assert backend.get_state() == (b"before", token)
    assert backend.set_state(b"after", token)[2]  # type: ignore[index]


def test_client_fails_over_to_the_next_endpoint(etcd_server: Any, run_id: str) -> None:
    from elastictrain.etcd.server import free_port

    client = make_client(f"127.0.0.1:{free_port()},{etcd_server.endpoint}", retry_deadline=10)
    backend = Etcd3RendezvousBackend(client, run_id)
    assert backend.set_state(b"a")[2]  # type: ignore[index]
    assert str(client.current_endpoint) == etcd_server.endpoint


@pytest.mark.parametrize("run_id_value", ["", "a/b", "x" * 200, "..", "sp ace"])
def test_invalid_run_id_is_refused(etcd_client: Any, run_id_value: str) -> None:
    with pytest.raises(ConfigError):
        Etcd3RendezvousBackend(etcd_client, run_id_value)
