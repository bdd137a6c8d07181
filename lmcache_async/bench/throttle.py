"""A real TCP proxy on loopback that limits bandwidth: a slow tier for the benchmarks and
the tests.

:class:`ThrottleProxy` listens on a free ``127.0.0.1`` port and forwards every connection
to a target (a Redis server, say), each direction through a token bucket of its own shared
by all connections, so the proxy behaves like one slow link::

    with ThrottleProxy("127.0.0.1", redis.port, bytes_per_s=20e6) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"

A connection is two pump threads (one per direction); closing the proxy stops accepting,
shuts every connection down and joins every thread, so nothing is left behind.
:meth:`ThrottleProxy.reached` tells when the bytes forwarded one way first reached a total
(``time.monotonic``, comparable across the processes of one machine).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import select
import socket
import threading
import time
from typing import Final, Literal, NamedTuple

__all__ = ["DEFAULT_PIECE", "HISTORY", "ProxyStatistics", "ThrottleProxy", "TokenBucket"]

DEFAULT_PIECE: Final = 64 * 1024
"""Most bytes read and forwarded at a time."""

HISTORY: Final = 65536
"""Forwarded pieces remembered per direction for :meth:`ThrottleProxy.reached`."""

JOIN_TIMEOUT: Final = 5.0
"""Seconds each thread gets to end once the proxy closes."""


class ProxyStatistics(NamedTuple):
    """What went through the proxy so far."""

    connections: int
    """Connections accepted."""
    upstream_bytes: int
    """Bytes forwarded from clients to the target."""
    downstream_bytes: int
    """Bytes forwarded from the target to clients."""


class TokenBucket:
    """``bytes_per_s`` on average, bursts of at most ``burst`` bytes, shared by threads.

    A taker reserves its bytes at once (the bucket may go into debt) and sleeps off the
    debt, so concurrent takers together never exceed the rate over any window longer than
    a burst.
    """

    def __init__(self, bytes_per_s: float, burst: int, stopped: threading.Event) -> None:
        self.rate = bytes_per_s
        self.burst = burst
        self._stopped = stopped
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def set_rate(self, bytes_per_s: float) -> None:
        """Refill at ``bytes_per_s`` from now on."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self.rate = bytes_per_s

    def take(self, nbytes: int) -> None:
        """Reserve ``nbytes`` and return once the bucket has paid for them (early when the
        proxy closes)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            debt = -self._tokens
        if debt > 0:
            self._stopped.wait(debt / self.rate)


class ThrottleProxy:
    """Forward TCP connections from a free loopback port to ``target_host:target_port``.

    ``bytes_per_s`` limits each direction (None: no limit); ``burst`` is the bucket's size
    in bytes (default: 10 ms of traffic, at least one piece of :data:`DEFAULT_PIECE`).
    Use as a context manager, or call :meth:`start` and :meth:`close`.

    Raises (at construction):
        ValueError: ``bytes_per_s`` or ``burst`` is not a finite number > 0.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        bytes_per_s: float | None = 20e6,
        burst: int | None = None,
    ) -> None:
        if bytes_per_s is not None:
            _check_rate(bytes_per_s)
        if burst is not None and (isinstance(burst, bool) or burst <= 0):
            raise ValueError(f"burst: expected a number of bytes > 0, got {burst!r}")
        self.target = (target_host, target_port)
        self.bytes_per_s = bytes_per_s
        if burst is None:
            burst = max(DEFAULT_PIECE, int((bytes_per_s or 0) / 100))
        self.burst = burst
        self._piece = min(DEFAULT_PIECE, burst)
        self._stopped = threading.Event()
        self._buckets: tuple[TokenBucket | None, TokenBucket | None] = (None, None)
        if bytes_per_s is not None:
            self._buckets = (
                TokenBucket(bytes_per_s, burst, self._stopped),
                TokenBucket(bytes_per_s, burst, self._stopped),
            )
        self._listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._accepter: threading.Thread | None = None
        self._connections = 0
        self._bytes = [0, 0]
        self._sending = [0, 0]  # as _bytes, with the pieces being sent now
        # Per direction: (time.monotonic() before a piece was sent, the total with it).
        self._history: tuple[collections.deque[tuple[float, int]], ...] = (
            collections.deque(maxlen=HISTORY),
            collections.deque(maxlen=HISTORY),
        )
        self.port = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``: the proxy's address as a Redis URL."""
        return f"redis://127.0.0.1:{self.port}"

    def set_rate(self, bytes_per_s: float) -> None:
        """Change the limit of both directions from now on (the buckets keep their fill).

        Raises:
            ValueError: ``bytes_per_s`` is not a finite number > 0, or the proxy was made
                without a limit.
        """
        _check_rate(bytes_per_s)
        up, down = self._buckets
        if up is None or down is None:
            raise ValueError("set_rate: this proxy was made without a limit")
        up.set_rate(bytes_per_s)
        down.set_rate(bytes_per_s)
        self.bytes_per_s = bytes_per_s

    def statistics(self) -> ProxyStatistics:
        """Connections accepted and bytes forwarded each way so far."""
        with self._lock:
            return ProxyStatistics(self._connections, self._bytes[0], self._bytes[1])

    def reached(
        self, nbytes: int, direction: Literal["upstream", "downstream"] = "downstream"
    ) -> float | None:
        """When the bytes forwarded ``direction`` (``downstream``: from the target to the
        clients) first totalled ``nbytes`` or more: the ``time.monotonic()`` taken just
        before the piece that brought them there was sent, so no receiver had that piece
        earlier (and a receiver that has it finds it noted). None when they have not yet
        (or did longer ago than the last :data:`HISTORY` pieces)."""
        with self._lock:
            history = list(self._history[0 if direction == "upstream" else 1])
        index = bisect.bisect_left(history, nbytes, key=lambda entry: entry[1])
        if index == len(history) or (index == 0 and len(history) == HISTORY):
            return None
        return history[index][0]

    def start(self) -> ThrottleProxy:
        """Listen on a free loopback port (:attr:`port`) and start accepting.

        Raises:
            RuntimeError: already started or closed.
        """
        if self._listener is not None or self._stopped.is_set():
            raise RuntimeError("a ThrottleProxy starts once")
        self._wake = socket.socketpair()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"throttle-proxy-{self.port}", daemon=True
        )
        self._accepter.start()
        return self

    def close(self) -> None:
        """Stop accepting, shut every connection down and join every thread.

        Raises:
            RuntimeError: a thread did not end within :data:`JOIN_TIMEOUT`.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._wake is not None:
            self._wake[1].send(b"x")
        if self._accepter is not None:
            self._accepter.join(JOIN_TIMEOUT)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(JOIN_TIMEOUT)
        alive = [t.name for t in (self._accepter, *threads) if t is not None and t.is_alive()]
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
        if self._listener is not None:
            self._listener.close()
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
        if alive:
            raise RuntimeError(f"throttle proxy threads did not end: {alive}")

    def __enter__(self) -> ThrottleProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- threads --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener, wake = self._listener, self._wake
        if listener is None or wake is None:
            return
        while not self._stopped.is_set():
            readable, _, _ = select.select([listener, wake[0]], [], [])
            if wake[0] in readable or self._stopped.is_set():
                return
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            self._open(client)

    def _open(self, client: socket.socket) -> None:
        """Connect to the target for ``client`` and start its two pumps (a refused target
        closes the client's connection)."""
        try:
            upstream = socket.create_connection(self.target, timeout=JOIN_TIMEOUT)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream)
        with self._lock:
            if self._stopped.is_set():
                client.close()
                upstream.close()
                return
            self._connections += 1
            self._sockets.update((client, upstream))
            for direction, (src, dst) in enumerate(((client, upstream), (upstream, client))):
                thread = threading.Thread(
                    target=self._pump,
                    args=(pair, src, dst, direction),
                    name=f"throttle-proxy-{self.port}-{self._connections}-{direction}",
                    daemon=True,
                )
                self._threads.add(thread)
                thread.start()

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, direction: int) -> None:
        """Forward ``src`` to ``dst`` through the direction's bucket until EOF or an error;
        the second pump of a pair to end closes both sockets."""
        bucket = self._buckets[direction]
        try:
            while not self._stopped.is_set():
                data = src.recv(self._piece)
                if not data:
                    break
                if bucket is not None:
                    bucket.take(len(data))
                if self._stopped.is_set():
                    break
                with self._lock:  # noted before the send: its receiver may act at once
                    self._sending[direction] += len(data)
                    self._history[direction].append((time.monotonic(), self._sending[direction]))
                dst.sendall(data)
                with self._lock:
                    self._bytes[direction] += len(data)
        except OSError:
            _shutdown(src)
        finally:
            _shutdown(dst, socket.SHUT_WR)
            if pair.done():
                with self._lock:
                    for sock in (pair.client, pair.upstream):
                        self._sockets.discard(sock)
                        sock.close()
            with self._lock:
                self._threads.discard(threading.current_thread())


class _Pair:
    """The two sockets of one proxied connection and how many of its pumps have ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self._ended = 0
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Count one pump as ended; True for the second."""
        with self._lock:
            self._ended += 1
            return self._ended == 2


def _check_rate(bytes_per_s: float) -> None:
    if isinstance(bytes_per_s, bool) or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s: expected a finite number > 0, got {bytes_per_s!r}")


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)
