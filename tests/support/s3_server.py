"""A real S3 API for tests: moto's standalone server as a subprocess, and a small HTTP proxy in
front of it that injects throttling (503 SlowDown), access denial (403) or a stall."""

from __future__ import annotations

import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-s3cr3t",
               "AWS_DEFAULT_REGION": "us-east-1"}
"""Fake credentials: moto accepts any; tests check the secret never shows."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server(tmp: Path) -> Iterator[str]:
    """Start ``python -m moto.server`` on a free loopback port; yield its endpoint URL."""
    port = free_port()
    log = open(tmp / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto server did not start: {(tmp / 'moto.log').read_text()[-2000:]}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        log.close()


def new_bucket(endpoint: str) -> str:
    """Create a bucket of a unique name on ``endpoint``; return its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, **_client_args()).create_bucket(Bucket=name)
    return name


def client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, **_client_args())


def _client_args() -> dict[str, str]:
    return {"aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]}


_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")


class FaultProxy:
    """An HTTP proxy to an S3 endpoint that answers some requests itself.

    ``throttle(n)``: the next ``n`` requests get 503 SlowDown. ``deny()``: every request gets 403
    AccessDenied. ``stall(method)``: requests of that method (e.g. ``PUT``) hang until
    ``release()``. ``before(matches, action)``: the first request for which ``matches(method,
    path, body)`` holds waits for ``action()`` (a race made to happen) before it is forwarded.
    ``counts`` tallies what it did, ``requests`` lists each request's method and path.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self.lock = threading.Lock()
        self.throttled_left = 0
        self.denying = False
        self.stalled_method: str | None = None
        self.released = threading.Event()
        self.hook: tuple[Callable[[str, str, bytes], bool], Callable[[], None]] | None = None
        self.requests: list[tuple[str, str]] = []
        self.counts = {"forwarded": 0, "throttled": 0, "denied": 0, "stalled": 0}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                    hook = proxy.hook
                    if hook is not None and hook[0](self.command, self.path, body):
                        proxy.hook = None
                    else:
                        hook = None
                if hook is not None:
                    hook[1]()
                with proxy.lock:
                    action = "forward"
                    if proxy.denying:
                        action, proxy.counts["denied"] = "deny", proxy.counts["denied"] + 1
                    elif proxy.throttled_left > 0:
                        proxy.throttled_left -= 1
                        action, proxy.counts["throttled"] = "throttle", proxy.counts["throttled"] + 1
                    elif proxy.stalled_method == self.command and not proxy.released.is_set():
                        action, proxy.counts["stalled"] = "stall", proxy.counts["stalled"] + 1
                    else:
                        proxy.counts["forwarded"] += 1
                if action == "deny":
                    return self._answer(403, _DENIED)
                if action == "throttle":
                    return self._answer(503, _SLOW_DOWN)
                if action == "stall":
                    proxy.released.wait(60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                    self.send_response(reply.status)
                    head = self.command == "HEAD"  # its Content-Length is the object's size
                    for key, value in reply.getheaders():
                        if key.lower() not in ("transfer-encoding", "connection") and (
                                head or key.lower() != "content-length"):
                            self.send_header(key, value)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815 - http.server's names

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def throttle(self, n: int) -> None:
        with self.lock:
            self.throttled_left = n

    def before(self, matches: Callable[[str, str, bytes], bool], action: Callable[[], None]) -> None:
        with self.lock:
            self.hook = (matches, action)

    def deny(self) -> None:
        with self.lock:
            self.denying = True

    def stall(self, method: str) -> None:
        with self.lock:
            self.released.clear()
            self.stalled_method = method

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
