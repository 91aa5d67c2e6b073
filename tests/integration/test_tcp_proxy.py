"""The test proxy itself: it delays without reordering, and loses exactly one reply."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastictrain.etcd.client import import_etcd3
from tests.support.tcp_proxy import TcpProxy


@pytest.fixture
def echo_port() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def test_each_direction_is_delayed_and_bytes_keep_their_order(echo_port: int) -> None:
    with TcpProxy("127.0.0.1", echo_port, delay_s=0.1) as proxy:
        host, port = proxy.endpoint.split(":")
        with socket.create_connection((host, int(port))) as sock:
            started = time.monotonic()
            sock.sendall(b"ping")
            assert _read_exactly(sock, 4) == b"ping"
            assert time.monotonic() - started >= 0.2  # 0.1 s out, 0.1 s back
            proxy.set_delay(0.0)
            payload = bytes(range(256)) * 64
            for offset in range(0, len(payload), 1000):
                sock.sendall(payload[offset:offset + 1000])
            assert _read_exactly(sock, len(payload)) == payload


def test_drop_next_response_loses_the_reply_of_a_request_that_reached_etcd(etcd_server: Any) -> None:
    etcd3 = import_etcd3()
    with TcpProxy("127.0.0.1", etcd_server.options.client_port) as proxy:
        host, port = proxy.endpoint.split(":")
        client = etcd3.client(host=host, port=int(port), timeout=5)
        client.put("/proxy-test/warm-up", "1")  # the connection is up
        # gRPC pings the server after a reply (seen: its ack, taken for the next reply, muted the
        # connection before the put was sent, on busy cores): let that exchange end first.
        time.sleep(0.5)
        proxy.drop_next_response()
        with pytest.raises(Exception):
            client.put("/proxy-test/key", "written")
        client.close()
    direct = etcd3.client(host="127.0.0.1", port=etcd_server.options.client_port, timeout=5)
    assert direct.get("/proxy-test/key")[0] == b"written"
    direct.close()
