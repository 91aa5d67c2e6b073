"""TLS and password auth against real etcd servers: certificates are made here."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastictrain.errors import EtcdAuthError
from elastictrain.etcd import EtcdClient, EtcdServer, EtcdServerOptions, EtcdSettings, parse_endpoints
from elastictrain.rendezvous.dynamic import Etcd3RendezvousBackend


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory)


def _make_cert(directory: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _make_cert(directory, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    _make_cert(directory, "client", "ca", "DNS:client")
    return directory


@pytest.fixture(scope="module")
def tls_etcd(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(EtcdServerOptions(
        data_dir=str(tmp_path_factory.mktemp("etcd-tls") / "data"),
        extra_args=["--cert-file", str(pki / "server.crt"), "--key-file", str(pki / "server.key"),
                    "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth"],
    ))
    server.start()
    yield server
    server.stop()


def _settings(endpoint: str, **kwargs: object) -> EtcdSettings:
    return EtcdSettings(endpoints=tuple(parse_endpoints(endpoint)), retry_deadline=timedelta(seconds=5),
                        request_timeout=timedelta(seconds=2), **kwargs)  # type: ignore[arg-type]


def test_mutual_tls_client_reads_and_writes(tls_etcd: EtcdServer, pki: Path, run_id: str) -> None:
    client = EtcdClient(_settings(tls_etcd.endpoint, ca_cert=str(pki / "ca.crt"),
                                  cert_cert=str(pki / "client.crt"), cert_key=str(pki / "client.key")))
    backend = Etcd3RendezvousBackend(client, run_id)
    assert backend.set_state(b"tls")[2]  # type: ignore[index]
    assert backend.get_state()[0] == b"tls"  # type: ignore[index]


def test_wrong_ca_fails_fast_with_auth_error(tls_etcd: EtcdServer, pki: Path, run_id: str) -> None:
    client = EtcdClient(_settings(tls_etcd.endpoint, ca_cert=str(pki / "other-ca.crt"),
                                  cert_cert=str(pki / "client.crt"), cert_key=str(pki / "client.key")))
    started = time.monotonic()
    with pytest.raises(EtcdAuthError, match="refused"):
        client.call(lambda c: c.status(), what="a status check")
    assert time.monotonic() - started < 4, "a certificate error must not be retried until the deadline"


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    # A 1 s token TTL, so that a test can see the client log in again after expiry.
    server = EtcdServer(EtcdServerOptions(data_dir=str(tmp_path_factory.mktemp("etcd-auth") / "data"),
                                          extra_args=["--auth-token-ttl", "1"]))
    server.start()
    etcdctl = str(Path(server.binary).with_name("etcdctl"))
    base = [etcdctl, f"--endpoints={server.endpoint}"]
    for args in (["user", "add", "root:rootpw"], ["user", "add", "trainer:s3cret"],
                 ["role", "add", "trainer"],
                 ["role", "grant-permission", "trainer", "--prefix=true", "readwrite", "/elastictrain/"],
                 ["user", "grant-role", "trainer", "trainer"], ["auth", "enable"]):
        subprocess.run([*base, *args], check=True, capture_output=True, timeout=30)
    yield server
    server.stop()


def test_password_auth_client_reads_and_writes(auth_etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(_settings(auth_etcd.endpoint, user="trainer", password="s3cret"))
    backend = Etcd3RendezvousBackend(client, run_id)
    assert backend.set_state(b"auth")[2]  # type: ignore[index]


def test_client_logs_in_again_after_its_token_expires(auth_etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(_settings(auth_etcd.endpoint, user="trainer", password="s3cret"))
    backend = Etcd3RendezvousBackend(client, run_id)
    _, token, _ = backend.set_state(b"first")  # type: ignore[misc]
    time.sleep(2.5)  # past the 1 s token TTL (etcd checks it about once a second)
    assert backend.get_state() == (b"first", token)


def test_wrong_password_fails_fast_and_never_shows_the_password(auth_etcd: EtcdServer, run_id: str) -> None:
    settings = _settings(auth_etcd.endpoint, user="trainer", password="wrong-password-xyz")
    client = EtcdClient(settings)
    started = time.monotonic()
    with pytest.raises(EtcdAuthError) as info:
        Etcd3RendezvousBackend(client, run_id).get_state()
    assert time.monotonic() - started < 4
    assert "wrong-password-xyz" not in str(info.value)
    assert "wrong-password-xyz" not in repr(settings)


def test_no_credentials_on_an_auth_enabled_etcd_is_refused(auth_etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(_settings(auth_etcd.endpoint))
    with pytest.raises(EtcdAuthError):
        Etcd3RendezvousBackend(client, run_id).set_state(b"x")
