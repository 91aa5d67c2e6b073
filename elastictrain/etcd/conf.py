"""How to reach etcd: its endpoints and the client's settings, parsed from ``--etcd``-style endpoint
lists, ``--rdzv-conf``-style keys and the ``ELASTICTRAIN_ETCD_*`` environment.

Shared by ``elastictrain run``, ``status``/``stop``, the rendezvous handlers torchrun builds and the
benchmarks. Every value is checked once, here; bad input raises
:class:`~elastictrain.errors.ConfigError` naming the value.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError

__all__ = ["ETCD_CONF_KEYS", "ETCD_PASSWORD_ENV", "Endpoint", "EtcdSettings", "check_readable_file", "endpoints_from",
           "etcd_settings_from", "parse_endpoints"]

DEFAULT_ETCD_PORT = 2379


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One etcd client URL, reduced to host and port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> list[Endpoint]:
    """Parse ``host:port[,host:port...]`` (``http(s)://`` prefixes allowed).

    Args:
        text: Comma-separated endpoints. A missing port means 2379.

    Returns:
        The endpoints, in the order given (that is the failover order).

    Raises:
        ValueError: An endpoint is empty, its host cannot be one (a name of other characters
            than letters, digits, '.', '-' and '_', or a malformed IPv6 address), or its port
            is not a number in 1..65535: said at once, not after retrying it.
    """
    endpoints = []
    for raw in text.split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        if not item:
            raise ValueError(f"malformed etcd endpoint list {text!r}: empty endpoint")
        if item.startswith("["):  # [ipv6]:port
            host, bracket, rest = item[1:].partition("]")
            if not bracket:
                raise ValueError(f"malformed etcd endpoint {raw.strip()!r}: no ']' after the IPv6 address")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        elif ":" in item:  # bare IPv6 address, no port
            host, port_text = item, ""
        else:
            host, port_text = item, ""
        if not host:
            raise ValueError(f"malformed etcd endpoint {raw.strip()!r}: no host")
        _check_host(host, raw.strip())
        if port_text == "":
            port = DEFAULT_ETCD_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ValueError(
                f"malformed etcd endpoint {raw.strip()!r}: port must be a number in 1..65535"
            )
        endpoints.append(Endpoint(host, port))
    return endpoints


_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _check_host(host: str, endpoint: str) -> None:
    """Raise ``ValueError`` unless ``host`` can be a host: a name or IPv4 address, or an IPv6 address."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"malformed etcd endpoint {endpoint!r}: {host!r} is not an IPv6 address (write "
                             "host:port, or [IPv6 address]:port)") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"malformed etcd endpoint {endpoint!r}: host {host!r} may hold only letters, digits, "
                         "'.', '-' and '_'")


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdSettings:
    """How to reach etcd and how hard to try."""

    endpoints: tuple[Endpoint, ...]
    """Members to try, in failover order."""

    request_timeout: timedelta = timedelta(seconds=5)
    """Deadline of a single gRPC request."""

    retry_deadline: timedelta = timedelta(seconds=30)
    """Total time one operation may spend retrying transient failures."""

    ca_cert: str | None = None
    """CA bundle that signed the etcd server certificates; enables TLS."""

    cert_cert: str | None = None
    """Client certificate for mutual TLS."""

    cert_key: str | None = None
    """Private key of ``cert_cert``."""

    user: str | None = None
    """etcd user for password authentication."""

    password: str | None = field(default=None, repr=False)
    """Password of ``user``; never logged (``repr=False``)."""

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)


ETCD_PASSWORD_ENV = "ELASTICTRAIN_ETCD_PASSWORD"


# The etcd client keys of --rdzv-conf, read by etcd_settings_from (next to rendezvous.config.RendezvousConfig's).
ETCD_CONF_KEYS = ("request_timeout", "retry_deadline", "ca_cert", "client_cert", "cert", "client_key", "key",
                  "user", "password")


def endpoints_from(text: str) -> tuple[Endpoint, ...]:
    """Raises:
        ConfigError: ``text`` is not a comma-separated list of ``host:port`` endpoints.
    """
    try:
        return tuple(parse_endpoints(text))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def etcd_settings_from(conf: dict[str, Any], endpoints: str) -> EtcdSettings:
    """Build :class:`EtcdSettings` from an endpoint list and ``--rdzv-conf``-style keys.

    TLS and auth come from the keys ``ca_cert``, ``cert``/``client_cert``,
    ``key``/``client_key``, ``user``, ``password``, each falling back to
    ``ELASTICTRAIN_ETCD_<KEY>``; a password should come from the environment,
    not a command line that ``ps`` shows.
    """

    def pick(*keys: str) -> str | None:
        for key in keys:
            if conf.get(key):
                return str(conf[key])
        for key in keys:
            env = os.environ.get(f"ELASTICTRAIN_ETCD_{key.upper()}")
            if env:
                return env
        return None

    parsed = endpoints_from(endpoints)
    kwargs: dict[str, Any] = {}
    if conf.get("request_timeout") is not None:
        kwargs["request_timeout"] = parse_duration("request_timeout", conf["request_timeout"], minimum=0.01)
    if conf.get("retry_deadline") is not None:
        kwargs["retry_deadline"] = parse_duration("retry_deadline", conf["retry_deadline"])
    settings = EtcdSettings(
        endpoints=parsed,
        ca_cert=pick("ca_cert"),
        cert_cert=pick("client_cert", "cert"),
        cert_key=pick("client_key", "key"),
        user=pick("user"),
        password=pick("password"),
        **kwargs,
    )
    _check_etcd_security(settings, endpoints)
    return settings


def _check_etcd_security(settings: EtcdSettings, endpoints: str) -> None:
    """Refuse TLS and auth settings that etcd3 would ignore, misuse or crash on.

    Raises:
        ConfigError: A half-given pair, an unreadable file, or TLS asked for without a CA.
    """
    if (settings.cert_cert is None) != (settings.cert_key is None):
        given, missing = ("--etcd-cert", "--etcd-key") if settings.cert_key is None else ("--etcd-key", "--etcd-cert")
        raise ConfigError(f"{given} needs {missing}: a client certificate and its private key go together")
    if settings.cert_cert is not None and settings.ca_cert is None:
        raise ConfigError("--etcd-cert and --etcd-key need --etcd-ca-cert (the CA that signed etcd's certificate): "
                          "without it the client would not use TLS at all")
    if settings.ca_cert is None and "https://" in endpoints:
        # etcd3 would open a plain-text channel. Public CAs are not trusted implicitly:
        # pass the system bundle if one of them signed etcd's certificate.
        raise ConfigError(f"etcd endpoint {endpoints!r} asks for TLS (https://): pass --etcd-ca-cert with the CA that "
                          "signed etcd's certificate (the system bundle, e.g. /etc/ssl/certs/ca-certificates.crt, "
                          "for a public CA)")
    # Given as flags or in --rdzv-conf (torchrun's only way): name both spellings.
    for flag, path in (("--etcd-ca-cert (ca_cert)", settings.ca_cert), ("--etcd-cert (client_cert)", settings.cert_cert),
                       ("--etcd-key (client_key)", settings.cert_key)):
        if path is not None:
            check_readable_file(path, flag)
    if settings.user and not settings.password:
        raise ConfigError(f"--etcd-user {settings.user!r} needs its password in {ETCD_PASSWORD_ENV}")
    if settings.password and not settings.user:
        raise ConfigError(f"{ETCD_PASSWORD_ENV} is set but no etcd user was given: pass --etcd-user, or unset the variable")


def check_readable_file(path: str, flag: str) -> None:
    """Raises:
        ConfigError: ``path`` (given as ``flag``) cannot be opened for reading.
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path!r}: {exc.strerror or exc}") from None
