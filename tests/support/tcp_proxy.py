"""A TCP forwarder for tests: adds latency to a link, or loses a reply.

``TcpProxy(host, port, delay_s=0.05)`` listens on ``127.0.0.1`` and forwards each
connection to ``host:port``. Every chunk is delivered ``delay_s`` after it was
read, in each direction (so a round trip costs ``2 * delay_s``), in the order it
was read. :meth:`TcpProxy.drop_next_response` loses the next chunk the server
sends, on whichever connection sends it first, and all that connection's server
sends in the next second, then closes the connection: the request reached the
server and was carried out, the client never hears the answer.

Pure Python and threads, so it runs wherever the tests run (no ``tc``, no root)::

    with TcpProxy("127.0.0.1", etcd_port, delay_s=0.1) as proxy:
        client = connect(proxy.endpoint)
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from types import TracebackType

__all__ = ["TcpProxy"]

_CHUNK = 65536
_EOF = b""
_DROP_LINGER_S = 1.0


class _Link:
    """One proxied connection: a client socket, a server socket and four threads.

    Per direction, a reader stamps each chunk with its due time and a writer sends
    the chunks in order once due; the FIFO between them keeps the byte order."""

    def __init__(self, proxy: TcpProxy, client: socket.socket, server: socket.socket) -> None:
        self._proxy = proxy
        self._client = client
        self._server = server
        self._closed = threading.Event()
        self._muted = False
        self._queues: list[queue.Queue[tuple[float, bytes | None]]] = []
        threads = []
        for source, target, from_server in ((client, server, False), (server, client, True)):
            chunks: queue.Queue[tuple[float, bytes | None]] = queue.Queue()
            self._queues.append(chunks)
            threads.append(threading.Thread(target=self._read, args=(source, chunks, from_server), daemon=True))
            threads.append(threading.Thread(target=self._write, args=(target, chunks), daemon=True))
        for thread in threads:
            thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _read(self, source: socket.socket, chunks: queue.Queue[tuple[float, bytes | None]], from_server: bool) -> None:
        while not self._closed.is_set():
            try:
                data = source.recv(_CHUNK)
            except OSError:
                data = _EOF
            if data and from_server and self._proxy._take_drop():
                # Not cut at once: a server may send a ping or window update before its
                # reply, and a connection cut then would cancel the request too.
                threading.Timer(_DROP_LINGER_S, self.close).start()
                self._muted = True
            if self._muted:
                if not data:
                    return
                continue
            chunks.put((time.monotonic() + self._proxy.delay_s, data))
            if not data:
                return

    def _write(self, target: socket.socket, chunks: queue.Queue[tuple[float, bytes | None]]) -> None:
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if data is None or (wait > 0 and self._closed.wait(wait)) or self._closed.is_set():
                return
            if not data:
                # The sender finished: pass the end on (a half-close, as TCP does).
                try:
                    target.shutdown(socket.SHUT_WR)
                except OSError:
                    self.close()
                return
            try:
                target.sendall(data)
            except OSError:
                self.close()
                return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for chunks in self._queues:
            chunks.put((0.0, None))  # wakes a writer waiting for its next chunk
        for sock in (self._client, self._server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class TcpProxy:
    """Forwards TCP connections from ``127.0.0.1:<free port>`` to ``target_host:target_port``.

    Args:
        target_host: Where to forward to (a name, an IPv4 or an IPv6 address).
        target_port: Its port.
        delay_s: One-way delay added to each direction (see :meth:`set_delay`).
    """

    def __init__(self, target_host: str, target_port: int, *, delay_s: float = 0.0) -> None:
        self._target = (target_host, target_port)
        self._delay = float(delay_s)
        self._lock = threading.Lock()
        self._drop = False
        self._drop_after = 0
        self._links: list[_Link] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True)
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: where clients connect instead of the target."""
        return f"127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def delay_s(self) -> float:
        """The one-way delay now in force."""
        return self._delay

    def set_delay(self, seconds: float) -> None:
        """Delay each chunk read from now on by ``seconds``, in each direction.

        Chunks already read keep their due time; bytes are never reordered (a chunk
        read after a shortening waits for the ones before it)."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0, got {seconds}")
        self._delay = float(seconds)

    def drop_next_response(self, after: int = 0) -> None:
        """Lose the next chunk any server connection sends (after letting ``after`` chunks
        through, to aim at a later reply of a multi-request operation), and close that connection.

        Everything that server connection sends for a second more is lost too, and
        only then is the connection closed: a cut right at the first chunk (often an
        HTTP/2 ping or window update sent before the reply) would cancel the request
        on the server as well."""
        with self._lock:
            self._drop, self._drop_after = True, after

    def _take_drop(self) -> bool:
        with self._lock:
            if self._drop and self._drop_after > 0:
                self._drop_after -= 1
                return False
            drop, self._drop = self._drop, False
            return drop

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()  # as if the target refused: the client sees the connection end
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopped.is_set():
                    client.close()
                    server.close()
                    return
                self._links = [link for link in self._links if not link.closed]
                self._links.append(_Link(self, client, server))

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout=5)
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
