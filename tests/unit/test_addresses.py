"""Ports chosen for servers this project starts (etcd, the rendezvous' store)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elastictrain._addresses import free_port

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not _RANGE.exists(), reason="no Linux ephemeral port range to stay out of")
@pytest.mark.parametrize("host", ["127.0.0.1", "::1", ""])
def test_a_servers_port_lies_below_the_ephemeral_range_so_no_outgoing_connection_takes_it_while_it_restarts(
        host: str) -> None:
    # An etcd killed and restarted on its ports (tests/integration/test_etcd3_rendezvous.py's
    # outage test) found its peer port taken: bind(0) had picked it from the ephemeral range,
    # from which the kernel also gives outgoing connections their local ports.
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    low, high = map(int, _RANGE.read_text().split())
    ports = {free_port(host) for _ in range(20)}
    assert all(port < low for port in ports), (sorted(ports), low, high)
    for port in ports:  # and each can be listened on
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
