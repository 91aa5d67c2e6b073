"""Which addresses are this machine's own, and which one other machines reach it at."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_loopback", "source_address_towards"]


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
