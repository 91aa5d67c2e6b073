"""The one place elastictrain talks to etcd: import, endpoints, failover and retries.

``etcd3`` 0.12 (the newest release) ships protobuf stubs generated for protobuf 3;
under protobuf 4+ importing it fails deep inside generated code. That import is
done here and nowhere else, so the failure becomes one sentence saying how to
fix it instead of a traceback.

:class:`EtcdClient` wraps one ``etcd3`` client per endpoint. Every call goes
through :meth:`EtcdClient.call`, which retries only transient gRPC failures
(unavailable, deadline exceeded) with exponential back-off and jitter, moving to
the next endpoint on each failure, until a total deadline; then it raises
:class:`~elastictrain.errors.EtcdUnavailableError` naming every endpoint and
the last error. Authentication and TLS failures are not retried.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import tenacity

from elastictrain import errors
from elastictrain.errors import DependencyError
from elastictrain.etcd.conf import Endpoint, EtcdSettings

logger = logging.getLogger(__name__)

_RETRY_NOTICE_EVERY = 5.0
"""Seconds between warnings that a request is being retried because etcd does not answer."""

_LAST_ATTEMPT = 0.5
"""Seconds an attempt waits for etcd's answer once a node's goodbyes have spent their shared time
(see :meth:`EtcdClient.wind_down`): a live etcd answers well within it, an unreachable one (a cut
link answers nothing) costs no more."""

__all__ = [
    "EtcdClient",
    "connect",
    "import_etcd3",
]

_T = TypeVar("_T")

# gRPC's own reconnect back-off grows to 120 s by default: after an etcd restart a
# client could sit out two minutes before even trying again. Keep it short; our
# retry loop already paces the attempts.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


def _grpc_options(settings: EtcdSettings) -> list[tuple[str, int]]:
    """:data:`_GRPC_OPTIONS` plus the deadline of one connection attempt.

    gRPC names that deadline ``min_reconnect_backoff_ms``: it is not a back-off but
    how long the TCP, TLS and HTTP/2 handshake may take. At 100 ms, every etcd more
    than about 50 ms away was "unreachable". A connection may take as long as a request.
    """
    return [*_GRPC_OPTIONS, ("grpc.min_reconnect_backoff_ms", int(settings.request_timeout.total_seconds() * 1000))]


_etcd3: Any = None


def import_etcd3() -> Any:
    """Import and return the ``etcd3`` module, explaining any failure in one line.

    Raises:
        DependencyError: etcd3 is missing or cannot be imported.
    """
    global _etcd3
    if _etcd3 is not None:
        return _etcd3
    # gRPC's C core logs every failed TLS handshake to stderr at INFO; our errors
    # already say what failed. An explicit GRPC_VERBOSITY still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        with warnings.catch_warnings():
            # Its generated stubs use descriptor APIs protobuf 3.20 marks deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            import etcd3
    except ModuleNotFoundError as exc:
        raise DependencyError(
            f"the python etcd client is not installed ({exc}); "
            "run: pip install 'etcd3==0.12.0' 'protobuf<4'"
        ) from exc
    except TypeError as exc:
        # protobuf >= 4 rejects the descriptors etcd3 0.12 generated for protobuf 3.
        import google.protobuf

        raise DependencyError(
            f"etcd3 0.12 cannot run on protobuf {google.protobuf.__version__}; "
            "run: pip install 'protobuf<4' (or set "
            "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, which is slower)"
        ) from exc
    _etcd3 = etcd3
    return etcd3


def _grpc_code_name(exc: BaseException) -> str | None:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # noqa: BLE001 - a broken error object tells us nothing
            return None
    return None


class EtcdClient:
    """A fail-over, retrying front to one ``etcd3`` client per endpoint.

    Thread-safe: the heartbeat thread of a rendezvous handler and the agent's
    main thread share one instance.
    """

    def __init__(self, settings: EtcdSettings) -> None:
        if not settings.endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self._settings = settings
        self._etcd3 = import_etcd3()
        if settings.password and not settings.ca_cert:
            _warn_plaintext_password(settings)
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}
        self._current = 0
        self._watch_hub: Any = None
        self._keepalive_hub: Any = None
        self._goodbyes_end: float | None = None  # time.monotonic() past which calls make one attempt
        self._closed = False

    @property
    def settings(self) -> EtcdSettings:
        return self._settings

    def wind_down(self, deadline: timedelta) -> None:
        """Retry calls only until ``deadline`` from now (the first such deadline given), all of
        them together, and make a single attempt of at most :data:`_LAST_ATTEMPT` seconds after
        it: for a node whose job has ended, whose goodbyes (closing the rendezvous as finished,
        its last record, closing it again at shutdown, revoking its lease) must not each wait on
        an unreachable etcd. What they would have said expires with the node's leases."""
        end = time.monotonic() + deadline.total_seconds()
        self._goodbyes_end = min(end, self._goodbyes_end or end)

    @property
    def current_index(self) -> int:
        """Index of the endpoint requests go to now."""
        return self._current

    @property
    def current_endpoint(self) -> Endpoint:
        return self._settings.endpoints[self._current]

    @property
    def transactions(self) -> Any:
        """The ``etcd3`` transaction builders (compare and operation constructors)."""
        return self._etcd3.client.Transactions()

    def _client_for(self, index: int) -> Any:
        with self._lock:
            if self._closed:
                raise errors.EtcdError("this etcd client was closed (its node left the run): no more requests")
            client = self._clients.get(index)
            if client is None:
                endpoint = self._settings.endpoints[index]
                client = self._etcd3.client(
                    # etcd3 joins host and port with a colon: an IPv6 address needs its brackets.
                    host=f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host,
                    port=endpoint.port,
                    ca_cert=self._settings.ca_cert,
                    cert_key=self._settings.cert_key,
                    cert_cert=self._settings.cert_cert,
                    timeout=self._settings.request_timeout.total_seconds(),
                    user=self._settings.user,
                    password=self._settings.password,
                    grpc_options=_grpc_options(self._settings),
                )
                if not client.uses_secure_channel:
                    # etcd3 0.12 sends the auth token both as metadata and as gRPC call
                    # credentials; current gRPC refuses call credentials on a plain-text
                    # channel, and etcd reads the metadata anyway.
                    client.call_credentials = None
                self._clients[index] = client
            return client

    def _fail_over(self, index: int, exc: BaseException) -> None:
        with self._lock:
            if self._current == index:
                nxt = (index + 1) % len(self._settings.endpoints)
                if nxt != index:
                    logger.warning(
                        "etcd endpoint %s failed (%s); failing over to %s",
                        self._settings.endpoints[index],
                        _describe(exc),
                        self._settings.endpoints[nxt],
                    )
                self._current = nxt

    def _is_transient(self, exc: BaseException) -> bool:
        if _is_expired_token(exc) or _is_expired_token(exc.__cause__ or exc.__context__ or exc):
            return True  # the channel is rebuilt, which authenticates anew
        if _is_auth_failure(exc):
            return False  # retrying a refused certificate or password only floods etcd
        etcd3_errors = self._etcd3.exceptions
        if isinstance(exc, (etcd3_errors.ConnectionFailedError, etcd3_errors.ConnectionTimeoutError)):
            return True
        return _grpc_code_name(exc) in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}

    def _discard(self, index: int, client: Any, exc: BaseException) -> None:
        """A request to endpoint ``index`` through ``client`` failed transiently: fail over.

        The channel stays open (gRPC reconnects it by itself, and watches and keep-alive
        streams of other threads share it); only a client whose auth token etcd forgot
        is replaced, since logging in again takes a new one.
        """
        self._fail_over(index, exc)
        if not (_is_expired_token(exc) or _is_expired_token(exc.__cause__ or exc.__context__ or exc)):
            return
        with self._lock:
            stale = self._clients.pop(index, None) if self._clients.get(index) is client else None
        if stale is not None:
            _close_quietly(stale)

    def watch_hub(self) -> Any:
        """The :class:`~elastictrain.etcd.watch.WatchHub` that carries this client's watches."""
        from elastictrain.etcd.watch import WatchHub

        with self._lock:
            if self._watch_hub is None:
                self._watch_hub = WatchHub(self)
                if self._closed:
                    self._watch_hub.close()  # it opens nothing
            return self._watch_hub

    def keepalive_hub(self) -> Any:
        """The :class:`~elastictrain.etcd.lease.KeepAliveHub` that refreshes this client's leases."""
        from elastictrain.etcd.lease import KeepAliveHub

        with self._lock:
            if self._keepalive_hub is None:
                self._keepalive_hub = KeepAliveHub(self)
                if self._closed:
                    self._keepalive_hub.close()  # it opens nothing
            return self._keepalive_hub

    def stream_client(self) -> tuple[int, Any]:
        """The current endpoint's index and ``etcd3`` client, to open a long-lived stream on
        (a watch, a lease keep-alive); report its failure with :meth:`stream_failed`."""
        index = self._current
        return index, self._client_for(index)

    def stream_failed(self, index: int, client: Any, exc: BaseException) -> None:
        """A stream on endpoint ``index`` (through ``client``) broke: fail over as a failed call would.

        Errors that no retry can fix (a refused password or certificate) are left to the
        next :meth:`call` to report.
        """
        if self._is_transient(exc):
            self._discard(index, client, exc)

    def _tls_mismatch(self, index: int, exc: BaseException) -> errors.EtcdAuthError | None:
        """An error if a failed handshake came from TLS on one side only (retrying would not help).

        gRPC reports both as transient (a TLS handshake that read nothing, a socket
        closed), as it does for a server that is restarting: ask the server directly.
        """
        endpoint = self._settings.endpoints[index]
        timeout = min(2.0, self._settings.request_timeout.total_seconds())
        if (self._settings.ca_cert and _grpc_says(exc, _TLS_HANDSHAKE_UNANSWERED)
                and _serves_plaintext_etcd(endpoint, timeout)):
            return errors.EtcdAuthError(f"etcd at {endpoint} serves plain text, not TLS: drop --etcd-ca-cert, --etcd-cert "
                                 "and --etcd-key, or serve etcd with TLS")
        if not self._settings.ca_cert and _grpc_says(exc, _PLAINTEXT_REFUSED) and _serves_tls(endpoint, timeout):
            return errors.EtcdAuthError(f"etcd at {endpoint} serves TLS: pass --etcd-ca-cert with the CA that signed "
                                 "its certificate")
        return None

    def call(self, operation: Callable[[Any], _T], what: str = "etcd request", *, once: bool = False,
             deadline: timedelta | None = None) -> _T:
        """Run ``operation(etcd3_client)`` with failover and bounded retries.

        Args:
            operation: Receives the ``etcd3`` client of the current endpoint.
            what: Names the operation in errors and logs.
            once: Make a single attempt. For a request that must not be repeated
                blindly: a transient failure may have come after etcd applied it.
            deadline: Retry for this long instead of ``retry_deadline``, without the
                warnings that etcd does not answer: for a request that may as well not
                happen (revoking a lease that expires on its own), whose caller says
                what giving up means.

        Returns:
            Whatever ``operation`` returns.

        Raises:
            errors.EtcdIndeterminateError: With ``once``, the attempt failed transiently: etcd
                may or may not have applied it.
            errors.EtcdUnavailableError: No endpoint answered within ``retry_deadline`` (or ``deadline``).
            errors.EtcdAuthError: etcd refused our credentials or TLS setup.
            errors.EtcdLeaseNotFoundError: The request named a lease etcd does not know (it
                expired or was revoked).
        """
        if self._closed:
            raise errors.EtcdError(f"cannot send {what}: this etcd client was closed (its node left the run)")
        last: list[tuple[Endpoint, BaseException]] = []
        retry_s = (deadline or self._settings.retry_deadline).total_seconds()
        if self._goodbyes_end is not None:
            retry_s = min(retry_s, max(0.0, self._goodbyes_end - time.monotonic()))

        def attempt() -> _T:
            index, client = self._current, None
            try:
                client = self._client_for(index)
                if self._goodbyes_end is not None:
                    # etcd3 gives each request its client's timeout: bound it by the time the
                    # goodbyes have left (every request of a node that winds down is one).
                    left = self._goodbyes_end - time.monotonic()
                    client.timeout = max(_LAST_ATTEMPT, min(self._settings.request_timeout.total_seconds(), left))
                return operation(client)
            except Exception as exc:
                last.append((self._settings.endpoints[index], exc))
                transient = self._is_transient(exc)
                mismatch = self._tls_mismatch(index, exc) if transient else None
                if mismatch is not None:
                    raise mismatch from exc
                if transient:
                    self._discard(index, client, exc)
                raise

        said_at: list[float] = []

        def say_retrying(state: Any) -> None:
            # An unreachable etcd is said at once (and every few seconds), not only when the
            # retry deadline gives up.
            now = time.monotonic()
            if not last or (said_at and now - said_at[-1] < _RETRY_NOTICE_EVERY):
                return
            said_at.append(now)
            endpoint, exc = last[-1]
            others = len(self._settings.endpoints) > 1
            logger.warning("etcd at %s does not answer %s (%s); retrying%s for up to %gs", endpoint, what,
                           _describe(exc), " on the next endpoint" if others else "",
                           round(retry_s, 1))

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self._is_transient),
            before_sleep=None if once or deadline is not None else say_retrying,
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
            stop=tenacity.stop_after_attempt(1) if once else tenacity.stop_before_delay(retry_s),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except Exception as exc:
            if _is_auth_failure(exc):
                raise errors.EtcdAuthError(
                    f"etcd at {self.current_endpoint} refused {what}: {_describe(exc)} "
                    "(check the etcd user and password, and the TLS CA and client certificate)"
                ) from exc
            if once and self._is_transient(exc):
                raise errors.EtcdIndeterminateError(
                    f"etcd at {last[-1][0] if last else self.current_endpoint} did not confirm {what} "
                    f"({_describe(exc)}): it may or may not have been applied"
                ) from exc
            if self._is_transient(exc):
                tried = ", ".join(sorted({f"{ep} ({_describe(e)})" for ep, e in last}))
                within = (f"after {retry_s:g}s" if self._goodbyes_end is None
                          else "within the time this node's goodbyes share")
                raise errors.EtcdUnavailableError(f"etcd unreachable for {what} {within}: {tried}") from exc
            if _grpc_code_name(exc) == "NOT_FOUND":
                # etcd's KV, lease and transaction services answer NOT_FOUND only for a lease it
                # does not know (ErrGRPCLeaseNotFound); etcd3 0.12 passes the gRPC error through.
                raise errors.EtcdLeaseNotFoundError(
                    f"etcd at {self.current_endpoint} failed {what}: {_describe(exc)}"
                ) from exc
            if isinstance(exc, self._etcd3.exceptions.Etcd3Exception) or _grpc_code_name(exc):
                raise errors.EtcdUnavailableError(
                    f"etcd at {self.current_endpoint} failed {what}: {_describe(exc)}"
                ) from exc
            raise

    def close(self) -> None:
        """Stop this client's watches and keep-alives and close its channels, for good: a
        request made after it (by a thread that has not yet seen its node leave) fails with
        :class:`~elastictrain.errors.EtcdError` instead of opening a channel again, so that a
        node that left neither registers anew nor keeps a lease alive."""
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
            hubs = [h for h in (self._watch_hub, self._keepalive_hub) if h is not None]
        for hub in hubs:
            hub.close()
        for client in clients:
            _close_quietly(client)


# Some failures reach us only as words. gRPC reports every TLS problem with StatusCode.UNAVAILABLE,
# the code of a server that is down or restarting: grpc.RpcError has no subclass or status detail for
# TLS, and its debug_error_string() is the same text. etcd answers a wrong password and an expired
# auth token with codes it also uses for other refusals (INVALID_ARGUMENT, UNAUTHENTICATED). The
# words are read by _grpc_says alone; each list says what its words mean.
_TLS_REFUSED = ("ssl_error_ssl", "tsi_protocol_failure", "certificate_verify_failed")
"""TLS itself is misconfigured (a wrong CA, a refused client certificate): retrying cannot help. A
handshake cut short by a server that is starting or stopping says "Handshake read failed" instead,
and stays transient."""
_TLS_HANDSHAKE_UNANSWERED = ("handshake",)
"""Our TLS handshake got no TLS answer: a server restarting, or one that serves plain text (asked
directly, see :meth:`EtcdClient._tls_mismatch`)."""
_PLAINTEXT_REFUSED = ("socket closed",)
"""The server closed our plain-text connection: a server restarting, or one that serves TLS (asked
directly)."""
_AUTH_REFUSED = ("authentication failed", "user name is empty")
"""etcd's INVALID_ARGUMENT for a wrong user or password."""
_TOKEN_EXPIRED = ("invalid auth token",)
"""etcd's UNAUTHENTICATED for a token it forgot (its TTL passed, or etcd restarted)."""


def _grpc_says(exc: BaseException, words: tuple[str, ...]) -> bool:
    """Whether gRPC's (or etcd's) description of ``exc`` holds one of ``words``: for the failures
    that have no status code or type of their own (see above)."""
    text = _describe(exc).lower()
    return any(word in text for word in words)


def _is_expired_token(exc: BaseException) -> bool:
    """etcd forgot our auth token (its TTL passed, or etcd restarted): log in again."""
    return _grpc_says(exc, _TOKEN_EXPIRED)


def _is_auth_failure(exc: BaseException) -> bool:
    """A refused password, token or certificate (also when etcd3 wrapped the gRPC error)."""
    for err in (exc, exc.__cause__ or exc.__context__):
        if err is None:
            continue
        code = _grpc_code_name(err)
        if code in {"UNAUTHENTICATED", "PERMISSION_DENIED"} and not _is_expired_token(err):
            return True
        if code == "INVALID_ARGUMENT" and _grpc_says(err, _AUTH_REFUSED):
            return True
        if code == "UNAVAILABLE" and _grpc_says(err, _TLS_REFUSED):
            return True
    return False


def _serves_plaintext_etcd(endpoint: Endpoint, timeout: float) -> bool:
    """Whether ``endpoint`` answers etcd's ``/version`` over plain HTTP."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout) as sock:
            sock.sendall(b"GET /version HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n")
            answer = sock.recv(4096)
    except OSError:
        return False
    return answer.startswith(b"HTTP/") and b'"etcdserver"' in answer


def _serves_tls(endpoint: Endpoint, timeout: float) -> bool:
    """Whether ``endpoint`` speaks TLS: it completes a handshake (its certificate unchecked:
    we only ask), or answers ours with a TLS alert (it wants a client certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout) as sock:
            with context.wrap_socket(sock):
                return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason)
    except OSError:
        return False


_warned_plaintext: set[str] = set()


def _warn_plaintext_password(settings: EtcdSettings) -> None:
    """Say once per process and endpoint list that a password is about to cross the network unencrypted."""
    where = settings.describe()
    if where not in _warned_plaintext:
        _warned_plaintext.add(where)
        logger.warning("etcd password auth without TLS: the password and auth token cross the network to %s "
                       "in plain text; pass --etcd-ca-cert and serve etcd with TLS", where)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:
        logger.debug("closing an etcd channel failed", exc_info=True)


def _describe(exc: BaseException) -> str:
    """A short human description of an etcd/gRPC failure."""
    # etcd3 re-raises gRPC errors as its own bare types; the gRPC one says why.
    inner = exc.__cause__ or exc.__context__
    if inner is not None and callable(getattr(inner, "details", None)):
        exc = inner
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            text = details()
        except Exception:  # noqa: BLE001
            text = None
        name = _grpc_code_name(exc)
        if text:
            return f"{name}: {text}" if name else str(text)
    text = str(exc).strip()
    return text or type(exc).__name__


def connect(settings: EtcdSettings) -> EtcdClient:
    """Build an :class:`EtcdClient` and check that some endpoint answers.

    Raises:
        errors.EtcdUnavailableError: No endpoint answered within the retry deadline.
        errors.EtcdAuthError: etcd refused our credentials or TLS setup.
    """
    client = EtcdClient(settings)
    client.call(lambda c: c.status(), what="connecting")
    return client

