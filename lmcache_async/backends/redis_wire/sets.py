"""The bulk ``SET NX``: pipelined on one connection, each value sent from where it lies.

A value is a header (bytes) and a payload (a view on the object's memory, or bytes a
codec made): the command's framing, the header, the payload and the options go out
together, the payload from its own memory (:meth:`~.stream.WireStream.send`).
The next value is encoded (its checksum computed) while this one is sent
(:func:`~.overlap.overlapped`), and the replies are read as they come, beside the
sending, and handed to a callback in order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ...errors import ProtocolError
from .overlap import concurrently, overlapped
from .resp import ReplyError, read_reply
from .stream import WireStream

__all__ = ["Encode", "Outgoing", "Replied", "set_options", "set_values"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One value to send: ``header ‖ payload``."""

    header: bytes
    payload: bytes | memoryview

    @property
    def size(self) -> int:
        return len(self.header) + memoryview(self.payload).nbytes


Encode = Callable[[int], Awaitable[Outgoing]]
"""``encode(index)``: the value of key ``index`` (may run in a worker thread)."""

Replied = Callable[[int, bool], Awaitable[None]]
"""``replied(index, stored)``: the server's answer for key ``index``, in order."""


def set_options(ttl_ms: int | None) -> bytes:
    """The arguments after the value: ``NX`` and, with a TTL, ``PX <ttl_ms>``."""
    options = b"$2\r\nNX\r\n"
    if ttl_ms is not None:
        ttl = str(ttl_ms).encode()
        options += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    return options


async def set_values(
    stream: WireStream,
    rkeys: Sequence[bytes],
    indices: Sequence[int],
    encode: Encode,
    replied: Replied,
    *,
    ttl_ms: int | None,
) -> list[ReplyError]:
    """``SET rkeys[n] <encode(indices[n])> NX [PX ttl_ms]`` for each ``n`` in order on
    ``stream``; ``replied`` hears each answer (stored or not). Returns the error replies
    (their keys counted as not stored).

    Raises:
        ProtocolError: a malformed reply.
        ConnectionResetError: the connection was lost.
    """
    options = set_options(ttl_ms)
    start = b"*%d\r\n$3\r\nSET\r\n" % (4 if ttl_ms is None else 6)
    errors: list[ReplyError] = []

    async def send(n: int, out: Outgoing) -> bool:
        rkey = rkeys[n]
        head = b"%s$%d\r\n%s\r\n$%d\r\n" % (start, len(rkey), rkey, out.size)
        await stream.send((head, out.header, out.payload, b"\r\n" + options))
        return False

    async def sending() -> None:
        await overlapped(len(indices), lambda n: encode(indices[n]), send)

    async def receiving() -> None:
        for index in indices:
            reply = await read_reply(stream)
            if isinstance(reply, ReplyError):
                errors.append(reply)
            elif reply not in (b"OK", None):
                raise ProtocolError(f"unexpected redis reply to SET {reply!r:.40}")
            await replied(index, reply == b"OK")

    await concurrently(sending, receiving)
    return errors
