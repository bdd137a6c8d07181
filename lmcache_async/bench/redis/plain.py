"""The baseline of ``bench --redis``: a blocking socket speaking just enough RESP to send
``SET`` s straight from memory and read ``GET`` replies into preallocated buffers.

Nothing here checks, copies or allocates beyond what the wire needs: each value leaves
from its buffer in one ``sendmsg`` with its framing, and each reply's payload is received
(``recv_into``) into a buffer of its own, past a 64 KiB scratch buffer that holds only the
reply lines. It is what the Redis tier's bulk path is measured against.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Final
from urllib.parse import unquote, urlsplit

from lmcache_async.errors import InvalidInputError, TierError

__all__ = ["PlainRedis"]

_SCRATCH: Final = 64 * 1024
_TCP_SCHEMES: Final = ("redis", "valkey")


class PlainRedis:
    """A blocking RESP client on one socket, with ``timeout`` seconds on every receive
    and send; close it with :meth:`close` (or ``with``)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._scratch = bytearray(_SCRATCH)
        self._start = self._end = 0

    @classmethod
    def connect(cls, url: str, *, timeout: float) -> PlainRedis:
        """A socket to the server of ``url`` (``redis://``, ``valkey://`` or ``unix://``,
        with its user, password and database number applied).

        Raises:
            InvalidInputError: another scheme (TLS and clusters are not measured against
                a plain socket).
            TierError: the server refused the login or the database.
            OSError: the server cannot be reached.
        """
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(parts.path)
            except BaseException:
                sock.close()
                raise
        elif scheme in _TCP_SCHEMES:
            sock = socket.create_connection((parts.hostname, parts.port or 6379), timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            raise InvalidInputError(
                f"--redis measures against a plain socket: use a redis://, valkey:// or "
                f"unix:// URL, not {scheme}://"
            )
        plain = cls(sock)
        try:
            plain._login(parts.username, parts.password, parts.path, parts.query, scheme)
        except BaseException:
            plain.close()
            raise
        return plain

    def _login(
        self, user: str | None, password: str | None, path: str, query: str, scheme: str
    ) -> None:
        if password is not None:
            words = [unquote(user or "default"), unquote(password)]
            self.command(b"AUTH", *(word.encode() for word in words))
        options = dict(pair.partition("=")[::2] for pair in query.split("&") if pair)
        db = options.get("db") or ("" if scheme == "unix" else path.strip("/"))
        if db:
            self.command(b"SELECT", db.encode())

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> PlainRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self) -> None:
        """Receive more reply bytes into the scratch buffer."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            if self._start == 0:
                raise TierError("a reply line longer than the plain client's buffer")
            kept = self._end - self._start
            self._scratch[:kept] = self._scratch[self._start : self._end]
            self._start, self._end = 0, kept
        got = self._sock.recv_into(memoryview(self._scratch)[self._end :])
        if not got:
            raise TierError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        """The next reply line, without its CRLF; an error reply raises TierError."""
        while True:
            at = self._scratch.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._scratch[self._start : at])
                self._start = at + 2
                if line.startswith(b"-"):
                    raise TierError(f"the server answered {line[1:].decode(errors='replace')}")
                return line
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        """The next ``len(dest)`` bytes of the stream into ``dest``: what the scratch
        buffer already holds, the rest straight from the socket."""
        take = min(len(dest), self._end - self._start)
        dest[:take] = self._scratch[self._start : self._start + take]
        self._start += take
        got = take
        while got < len(dest):
            more = self._sock.recv_into(dest[got:])
            if not more:
                raise TierError("the server closed the connection mid-value")
            got += more

    def _skip_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        self._start += 2

    def _send(self, parts: list[memoryview]) -> None:
        while parts:
            sent = self._sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][sent:]

    def command(self, *words: bytes) -> bytes:
        """Send one command, return its reply line (``:3``, ``+OK``...)."""
        frame = b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
        self._sock.sendall(frame)
        return self._line()

    def sets(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        """``SET key value NX`` for each pair, pipelined, each value sent from its buffer;
        then every reply read.

        Raises:
            TierError: an error reply, or a key that existed.
        """
        for key, value in zip(keys, values, strict=True):
            head = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
            self._send([memoryview(head), value, memoryview(b"\r\n$2\r\nNX\r\n")])
        for key in keys:
            if self._line() != b"+OK":
                raise TierError(f"SET NX of {key!r} found the key there")

    def gets(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[int]:
        """``GET`` every key, pipelined; each value received into the start of its own
        buffer of ``dests``; returns the values' sizes.

        Raises:
            TierError: a missing key, or a value larger than its buffer.
        """
        self._sock.sendall(
            b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)
        )
        sizes = []
        for key, dest in zip(keys, dests, strict=True):
            size = int(self._line()[1:])
            if size < 0 or size > len(dest):
                raise TierError(f"GET {key!r}: {size} bytes for a buffer of {len(dest)}")
            self._read_into(dest[:size])
            self._skip_crlf()
            sizes.append(size)
        return sizes

    def delete(self, keys: Sequence[bytes]) -> int:
        """``DEL`` the keys (the server frees the values before it answers); how many were
        there."""
        return int(self.command(b"DEL", *keys)[1:])
