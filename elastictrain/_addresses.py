"""Which addresses are this machine's own, and which one other machines reach it at."""

from __future__ import annotations

import ipaddress
import random
import socket

__all__ = ["address_family", "free_port", "is_loopback", "source_address_towards"]


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only ever means this machine.

    A name counts when every address it resolves to is a loopback one (``localhost``,
    or a hostname that ``/etc/hosts`` maps to 127.0.0.1); a name that does not
    resolve does not count.
    """
    literal = _literal(host)
    if literal is not None:
        return literal.is_loopback
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addresses = [_literal(str(info[4][0])) for info in infos]
    return bool(addresses) and all(a is not None and a.is_loopback for a in addresses)


def source_address_towards(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host:port``, or ``None`` if there is no route.

    The kernel picks it for a UDP socket "connected" to the destination; no packet
    is sent. It is the address the destination's network sees this machine at.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_SERVER_PORT = 10000


def address_family(host: str) -> socket.AddressFamily:
    """The socket family of an address literal (IPv6 when it has a colon); "" is IPv4's any."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _ephemeral_low() -> int | None:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (an IPv4 or IPv6 address; "" for all of
    this host's IPv4 addresses), for a server to listen on.

    The port lies below the kernel's ephemeral range, where ``bind(0)`` would pick it: a port
    from that range can be taken by any outgoing connection's local end while its server is
    down, and a server restarted on it (an etcd brought back on its ports) then cannot bind.
    """
    low = _ephemeral_low()
    below = range(_LOWEST_SERVER_PORT, low) if low is not None and low > _LOWEST_SERVER_PORT else range(0)
    for port in [*random.sample(below, k=min(64, len(below))), 0]:
        with socket.socket(address_family(host), socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                if port == 0:
                    raise
                continue
            return int(sock.getsockname()[1])
    raise AssertionError("unreachable: port 0 binds or raises")
