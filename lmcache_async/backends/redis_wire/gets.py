"""The bulk ``GET``: one pipelined round trip on one connection, each value handed to a
:class:`ValueSink` as it arrives, never assembled.

The sink sees a value as a :class:`BulkValue` of known size that it reads in order:
the record header through the scratch buffer (:meth:`BulkValue.read_exact`), the payload
straight into its destination (:meth:`BulkValue.read_into`). Whatever it leaves unread
(a value it refused, a key it no longer wants) is skipped, and the connection stays in
step with the replies. A value longer than the sink's :attr:`ValueSink.max_value` is not
read at all: the connection is given up (:class:`~lmcache_async.errors.ProtocolError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ...errors import ProtocolError
from .resp import ReplyError, command, expect_crlf, parse_length
from .stream import WireStream

__all__ = ["BulkValue", "ValueSink", "get_values"]


class BulkValue:
    """The value of one ``GET`` reply, still on the wire: ``size`` bytes to be read in
    order, at most that many."""

    __slots__ = ("_left", "_stream", "size")

    def __init__(self, stream: WireStream, size: int) -> None:
        self._stream = stream
        self.size = size
        self._left = size

    @property
    def left(self) -> int:
        """Bytes of the value not read yet."""
        return self._left

    def _take(self, nbytes: int) -> None:
        if nbytes > self._left:
            raise ProtocolError(f"read of {nbytes} bytes past the end of a redis value")
        self._left -= nbytes

    async def read_exact(self, nbytes: int) -> bytes:
        """The next ``nbytes`` bytes of the value (a header: at most 64 KiB)."""
        self._take(nbytes)
        return await self._stream.read_exact(nbytes)

    async def read_into(
        self, dest: memoryview, landed: Callable[[memoryview], None] | None = None
    ) -> None:
        """Receive the next ``len(dest)`` bytes of the value into ``dest`` (``landed``: see
        :meth:`~.stream.WireStream.read_into`)."""
        self._take(len(dest))
        await self._stream.read_into(dest, landed)

    def spare(self, nbytes: int) -> memoryview:
        """The connection's reusable buffer, ``nbytes`` long (see
        :meth:`~.stream.WireStream.spare`)."""
        return self._stream.spare(nbytes)


class ValueSink(Protocol):
    """What receives the values of a bulk ``GET``; ``index`` is the caller's numbering of
    the keys. Several connections (a cluster's nodes) may feed one sink at once."""

    @property
    def max_value(self) -> int:
        """The longest value it accepts (bytes)."""
        ...

    def wanted(self, index: int) -> bool:
        """Whether the value of ``index`` is still worth reading (a skipped one is
        drained from the connection unread)."""
        ...

    async def value(self, index: int, value: BulkValue | None) -> None:
        """Take the value of ``index`` (None: no such key, or a node that does not serve
        it). Reading part of it is fine; the rest is skipped."""
        ...


async def get_values(
    stream: WireStream, rkeys: Sequence[bytes], indices: Sequence[int], sink: ValueSink
) -> list[ReplyError]:
    """``GET`` every key of ``rkeys`` (``indices`` their numbers for ``sink``) in one
    round trip on ``stream``, each value fed to ``sink`` as it arrives; returns the error
    replies (their keys counted as absent).

    Raises:
        ProtocolError: a malformed reply, or a value longer than ``sink.max_value``.
        ConnectionResetError: the connection was lost.
    """
    await stream.send([b"".join(command(b"GET", rkey) for rkey in rkeys)])
    errors: list[ReplyError] = []
    for index in indices:
        line = await stream.read_line()
        kind = line[:1]
        if kind == b"-":
            errors.append(ReplyError(line[1:].decode(errors="replace")))
            if sink.wanted(index):
                await sink.value(index, None)
            continue
        if kind != b"$":
            raise ProtocolError(f"unexpected redis reply to GET {line[:40]!r}")
        size = parse_length(line)
        if size < 0:
            if sink.wanted(index):
                await sink.value(index, None)
            continue
        if size > sink.max_value:
            raise ProtocolError(
                f"redis value of {size} bytes is longer than any record ({sink.max_value})"
            )
        value = BulkValue(stream, size)
        if sink.wanted(index):
            await sink.value(index, value)
        await stream.skip(value.left)
        await expect_crlf(stream)
    return errors
