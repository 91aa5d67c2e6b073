"""etcd client settings from ``--rdzv-conf``-style keys and the ``ELASTICTRAIN_ETCD_*`` environment.

Shared by ``elastictrain run``, ``status``/``stop``, the rendezvous handlers torchrun builds and the
benchmarks. Every value is checked once, here; bad input raises
:class:`~elastictrain.errors.ConfigError` naming the value.
"""

from __future__ import annotations

import os
from typing import Any

from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError
from elastictrain.etcd.client import Endpoint, EtcdSettings, parse_endpoints

__all__ = ["ETCD_CONF_KEYS", "ETCD_PASSWORD_ENV", "check_readable_file", "endpoints_from", "etcd_settings_from"]

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
