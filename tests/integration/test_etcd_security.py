"""TLS and password auth against real etcd servers: certificates are made here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastictrain.launch.cli import main
from elastictrain.errors import EtcdAuthError
from elastictrain.etcd import EtcdClient, EtcdServer, EtcdServerOptions, EtcdSettings, parse_endpoints
from elastictrain.rendezvous.dynamic import Etcd3RendezvousBackend
from tests.conftest import REPO_ROOT, subprocess_env


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


# --- bad TLS and auth input: one line, exit 2, before any connection --------------------------

BAD_SECURITY = [
    ("https-without-ca", lambda pki: ["--etcd", "https://{endpoint}"], "asks for TLS (https://): pass --etcd-ca-cert"),
    ("cert-without-ca", lambda pki: ["--etcd-cert", str(pki / "client.crt"), "--etcd-key", str(pki / "client.key")],
     "--etcd-cert and --etcd-key need --etcd-ca-cert"),
    ("cert-without-key", lambda pki: ["--etcd-ca-cert", str(pki / "ca.crt"), "--etcd-cert", str(pki / "client.crt")],
     "--etcd-cert needs --etcd-key"),
    ("key-without-cert", lambda pki: ["--etcd-ca-cert", str(pki / "ca.crt"), "--etcd-key", str(pki / "client.key")],
     "--etcd-key needs --etcd-cert"),
    ("missing-ca-file", lambda pki: ["--etcd-ca-cert", str(pki / "nope.crt")],
     "cannot read --etcd-ca-cert (ca_cert) '{pki}/nope.crt': No such file or directory"),
    ("missing-cert-file", lambda pki: ["--etcd-ca-cert", str(pki / "ca.crt"), "--etcd-cert", str(pki / "nope.crt"),
                                       "--etcd-key", str(pki / "client.key")],
     "cannot read --etcd-cert (client_cert) '{pki}/nope.crt'"),
    ("user-without-password", lambda pki: ["--etcd-user", "trainer"],
     "--etcd-user 'trainer' needs its password in ELASTICTRAIN_ETCD_PASSWORD"),
]


@pytest.mark.parametrize(("flags", "message"), [c[1:] for c in BAD_SECURITY], ids=[c[0] for c in BAD_SECURITY])
def test_bad_tls_or_auth_flags_give_one_line_and_exit_two(
    flags: Callable[[Path], list[str]], message: str, pki: Path, etcd_server: EtcdServer,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("ELASTICTRAIN_ETCD_PASSWORD", raising=False)
    argv = [a.format(endpoint=etcd_server.endpoint) for a in flags(pki)]
    if "--etcd" not in argv:
        argv = ["--etcd", etcd_server.endpoint, *argv]
    assert main(["status", *argv, "--all"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert message.format(pki=pki) in err[0]


def test_a_password_without_a_user_is_refused(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ELASTICTRAIN_ETCD_PASSWORD", "s3cret")
    assert main(["status", "--etcd", etcd_server.endpoint, "--all"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "elastictrain: error: ELASTICTRAIN_ETCD_PASSWORD is set but no etcd user was given: pass --etcd-user, "
        "or unset the variable"
    ]


def test_tls_client_against_a_plaintext_etcd_fails_fast_and_says_so(
    etcd_server: EtcdServer, pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["status", "--etcd", etcd_server.endpoint, "--etcd-ca-cert", str(pki / "ca.crt"), "--all"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"elastictrain: error: etcd at {etcd_server.endpoint} serves plain text, not TLS: drop "
                   "--etcd-ca-cert, --etcd-cert and --etcd-key, or serve etcd with TLS"]
    assert time.monotonic() - started < 10, "a TLS mismatch must not be retried until the 30 s deadline"


def test_plaintext_client_against_a_tls_etcd_fails_fast_and_says_so(
    tls_etcd: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["status", "--etcd", tls_etcd.endpoint, "--all"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"elastictrain: error: etcd at {tls_etcd.endpoint} serves TLS: pass --etcd-ca-cert with the CA "
                   "that signed its certificate"]
    assert time.monotonic() - started < 10


def test_a_password_over_plain_text_is_warned_about_in_one_line(auth_etcd: EtcdServer) -> None:
    # A process of its own: the warning is given once per process.
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "status", "--etcd", auth_etcd.endpoint, "--etcd-user", "trainer",
         "--run-id", "absent"],
        env=subprocess_env(ELASTICTRAIN_ETCD_PASSWORD="s3cret"), capture_output=True, text=True, timeout=120,
    )
    # Exit 1: the run does not exist; it was looked up, so etcd took the password.
    assert result.returncode == 1 and "elastictrain: error" not in result.stderr, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "etcd password auth without TLS" in line]
    assert len(warnings) == 1, result.stderr
    assert "WARNING" in warnings[0] and "plain text" in warnings[0]
    assert "s3cret" not in result.stderr


@pytest.mark.timeout(180)
def test_workers_do_not_inherit_the_etcd_password(auth_etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", auth_etcd.endpoint, "--run-id", run_id,
         "--etcd-user", "trainer", "--local-addr", "127.0.0.1", str(REPO_ROOT / "tests" / "scripts" / "env_probe.py"),
         str(out), "ELASTICTRAIN_ETCD_PASSWORD", "ELASTICTRAIN_ETCD_USER"],
        env=subprocess_env(ELASTICTRAIN_ETCD_PASSWORD="s3cret"), cwd=tmp_path, capture_output=True, text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen == {"ELASTICTRAIN_ETCD_PASSWORD": None, "ELASTICTRAIN_ETCD_USER": None}


def test_etcd_command_serves_other_hosts_over_tls_to_clients_with_certificates(pki: Path, tmp_path: Path) -> None:
    from elastictrain.etcd.server import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "etcd", "--host", "0.0.0.0", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--cert-file", str(pki / "server.crt"),
         "--key-file", str(pki / "server.key"), "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth"],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert f"etcd serving at 0.0.0.0:{port} over TLS" in line, line
        endpoint = f"127.0.0.1:{port}"
        client = EtcdClient(_settings(endpoint, ca_cert=str(pki / "ca.crt"), cert_cert=str(pki / "client.crt"),
                                      cert_key=str(pki / "client.key")))
        client.call(lambda c: c.put("/elastictrain/tls-probe", "1"))
        client.close()
        without_certificate = EtcdClient(_settings(endpoint, ca_cert=str(pki / "ca.crt")))
        with pytest.raises(EtcdAuthError):
            without_certificate.call(lambda c: c.get("/elastictrain/tls-probe"))
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0
