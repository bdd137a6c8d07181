"""The bandwidth-limiting TCP proxy of lmcache_async/bench/throttle.py: bytes through it are
exact, the rate holds (bounded below by the bucket's arithmetic, above only loosely), it
tells when the bytes forwarded reached a total, and closing it leaves no thread, socket or
listener behind."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from lmcache_async.bench.throttle import ThrottleProxy
from tests.servers import RedisServer


class _Server:
    """A loopback TCP server on its own thread: ``echo`` sends back what it reads;
    otherwise it reads to EOF (``received``), or sends ``send`` and closes."""

    def __init__(self, *, echo: bool = False, send: bytes = b"") -> None:
        self.echo = echo
        self.send = send
        self.received = bytearray()
        self.last_byte_at = 0.0
        self.done = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            if self.send:
                conn.sendall(self.send)
                conn.shutdown(socket.SHUT_WR)
            while data := conn.recv(1 << 16):
                self.received += data
                self.last_byte_at = time.monotonic()
                if self.echo:
                    conn.sendall(data)
        self.done.set()

    def close(self) -> None:
        self._thread.join(10)
        self.listener.close()
        assert not self._thread.is_alive()


def _receive_all(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        data = sock.recv(1 << 16)
        if not data:
            break
        chunks += data
    return bytes(chunks)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _proxy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("throttle-proxy")]


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """The test's proxies leave no thread and no file descriptor behind."""
    before = _open_fds()
    yield
    assert _proxy_threads() == []
    assert _open_fds() == before


@pytest.mark.parametrize("rate", [None, 50e6])
@pytest.mark.timeout(60)
def test_bytes_through_the_proxy_are_exact_both_ways(rate: float | None, no_leaks: None) -> None:
    payload = os.urandom(3_000_017)
    server = _Server(echo=True)
    with ThrottleProxy("127.0.0.1", server.port, bytes_per_s=rate) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            sender = threading.Thread(target=client.sendall, args=(payload,))
            sender.start()
            echoed = _receive_all(client, len(payload))
            sender.join(30)
            client.shutdown(socket.SHUT_WR)
            assert client.recv(1) == b""  # the server's EOF came through
        assert server.done.wait(30)
        assert echoed == payload
        assert bytes(server.received) == payload
    # Read once the pumps are joined: a pump counts its bytes after forwarding them.
    assert proxy.statistics() == (1, len(payload), len(payload))
    server.close()


@pytest.mark.timeout(60)
def test_reached_is_when_the_piece_that_made_the_total_was_sent(no_leaks: None) -> None:
    """Each direction's totals are told apart; a total is reached no later than a receiver
    had its last byte and no earlier than the sender began; one not forwarded yet is not."""
    size = 500_000
    server = _Server(send=os.urandom(size))  # sends as soon as the proxy connects
    with ThrottleProxy("127.0.0.1", server.port, bytes_per_s=None) as proxy:
        began = time.monotonic()
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        client.sendall(b"x" * 10)
        client.shutdown(socket.SHUT_WR)
        got = _receive_all(client, size)
        received = time.monotonic()
        assert server.done.wait(30)
        client.close()
    server.close()
    assert len(got) == size
    half, whole = proxy.reached(size // 2), proxy.reached(size)
    assert half is not None and whole is not None
    assert began <= half <= whole <= received
    assert proxy.reached(size + 1) is None
    upstream = proxy.reached(10, "upstream")
    # The server had the upstream bytes at its last_byte_at; the client's download may
    # have ended before the proxy forwarded them (its threads run when they are scheduled).
    assert upstream is not None and began <= upstream <= server.last_byte_at
    assert proxy.reached(11, "upstream") is None


@pytest.mark.parametrize("direction", ["upstream", "downstream"])
@pytest.mark.timeout(60)
def test_the_rate_holds_in_each_direction(direction: str, no_leaks: None) -> None:
    """2 MB at 4 MB/s: never faster than the bucket allows (its burst aside), and not
    many times slower either."""
    rate, size = 4e6, 2_000_000
    payload = os.urandom(size)
    server = _Server(send=payload if direction == "downstream" else b"")
    with (
        ThrottleProxy("127.0.0.1", server.port, bytes_per_s=rate) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client,
    ):
        began = time.monotonic()
        if direction == "upstream":
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            assert server.done.wait(30)
            elapsed = server.last_byte_at - began
            assert bytes(server.received) == payload
        else:
            client.shutdown(socket.SHUT_WR)
            got = _receive_all(client, size)
            elapsed = time.monotonic() - began
            assert got == payload
    server.close()
    floor = (size - proxy.burst) / rate  # the bucket starts full
    assert elapsed >= floor * 0.95, (elapsed, floor)
    assert elapsed <= size / rate * 4 + 1.0, elapsed  # loose: a loaded machine is slower


@pytest.mark.timeout(60)
def test_set_rate_changes_the_limit_from_then_on(no_leaks: None) -> None:
    size = 1_000_000
    server = _Server()
    with (
        ThrottleProxy("127.0.0.1", server.port, bytes_per_s=1e9) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client,
    ):
        proxy.set_rate(4e6)
        began = time.monotonic()
        client.sendall(os.urandom(size))
        client.shutdown(socket.SHUT_WR)
        assert server.done.wait(30)
        elapsed = server.last_byte_at - began
        assert proxy.bytes_per_s == 4e6
        with pytest.raises(ValueError, match="bytes_per_s"):
            proxy.set_rate(0)
    server.close()
    assert elapsed >= (size - proxy.burst) / 4e6 * 0.95, elapsed
    with pytest.raises(ValueError, match="without a limit"):
        ThrottleProxy("127.0.0.1", 1, bytes_per_s=None).set_rate(1e6)


@pytest.mark.timeout(60)
def test_connections_share_one_bucket_per_direction(no_leaks: None) -> None:
    """Two connections sending at once get the proxy's rate between them, not each."""
    rate, size = 4e6, 1_000_000
    servers = [_Server(), _Server()]
    with ThrottleProxy("127.0.0.1", servers[0].port, bytes_per_s=rate) as proxy:
        first = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        # The target is read at connect time: the second connection goes to the second server.
        assert _wait_for(lambda: proxy.statistics().connections == 1)
        proxy.target = ("127.0.0.1", servers[1].port)
        second = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        assert _wait_for(lambda: proxy.statistics().connections == 2)
        payloads = [os.urandom(size), os.urandom(size)]
        began = time.monotonic()
        senders = [
            threading.Thread(target=_send_and_close, args=(sock, data))
            for sock, data in zip((first, second), payloads, strict=True)
        ]
        for sender in senders:
            sender.start()
        for server in servers:
            assert server.done.wait(30)
        elapsed = max(s.last_byte_at for s in servers) - began
        for sender in senders:
            sender.join(30)
        for server, payload in zip(servers, payloads, strict=True):
            assert bytes(server.received) == payload
    for server in servers:
        server.close()
    assert elapsed >= (2 * size - proxy.burst) / rate * 0.95, elapsed


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    with sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass


def _wait_for(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.timeout(60)
def test_close_ends_open_connections_and_stops_listening(no_leaks: None) -> None:
    server = _Server(echo=True)
    proxy = ThrottleProxy("127.0.0.1", server.port, bytes_per_s=1e6).start()
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    client.sendall(b"ping")
    assert _receive_all(client, 4) == b"ping"
    # A big send is held in the bucket when the proxy closes: close does not wait it out.
    client.sendall(os.urandom(200_000))
    began = time.monotonic()
    proxy.close()
    assert time.monotonic() - began < 5
    assert _proxy_threads() == []
    with contextlib.suppress(ConnectionResetError):
        while client.recv(1 << 16):
            pass  # whatever was under way, then EOF
    client.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    proxy.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match="starts once"):
        proxy.start()
    server.close()


@pytest.mark.timeout(60)
def test_a_refused_target_closes_the_client_and_the_proxy_keeps_serving(
    no_leaks: None,
) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]  # bound but not listening: connections refused
        with ThrottleProxy("127.0.0.1", dead_port, bytes_per_s=None) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
                assert client.recv(1) == b""
            server = _Server(echo=True)
            proxy.target = ("127.0.0.1", server.port)
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
                client.sendall(b"again")
                assert _receive_all(client, 5) == b"again"
            assert proxy.statistics().connections == 1
    server.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bytes_per_s": 0}, "bytes_per_s"),
        ({"bytes_per_s": -1.0}, "bytes_per_s"),
        ({"bytes_per_s": float("inf")}, "bytes_per_s"),
        ({"burst": 0}, "burst"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str, no_leaks: None) -> None:
    with pytest.raises(ValueError, match=message):
        ThrottleProxy("127.0.0.1", 1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_redis_values_cross_the_proxy_intact(redis_server: RedisServer, no_leaks: None) -> None:
    """A real client of a real redis-server through the proxy: 1.5 MB values each way."""
    import redis

    value = os.urandom(1_500_000)
    with ThrottleProxy("127.0.0.1", redis_server.port, bytes_per_s=30e6) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=30)
        try:
            client.set("k", value)
            assert client.get("k") == value
        finally:
            client.close()
    stats = proxy.statistics()
    assert stats.upstream_bytes > len(value)
    assert stats.downstream_bytes > len(value)
