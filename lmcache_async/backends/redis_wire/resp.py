"""The little of RESP2 the bulk path speaks: commands out, and the replies of ``GET``,
``SET``, ``AUTH`` and ``SELECT`` in.

Replies come back as Python values: a simple string or a bulk string as ``bytes``, an
integer as ``int``, a null bulk string as ``None``, an error as a :class:`ReplyError`
(a value, not an exception: one key's error must not hide the replies after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ProtocolError
from .stream import SCRATCH_BYTES, WireStream

__all__ = ["Reply", "ReplyError", "command", "expect_crlf", "parse_length", "read_reply"]


@dataclass(frozen=True, slots=True)
class ReplyError:
    """An error reply (``-MOVED 3999 127.0.0.1:6381``, ``-NOAUTH ...``)."""

    message: str

    @property
    def redirect(self) -> bool:
        """Whether a cluster node answered that another node serves the key."""
        return self.message.startswith(("MOVED ", "ASK "))


Reply = bytes | int | None | ReplyError


def command(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def parse_length(line: bytes) -> int:
    """The length of a ``$<n>`` line (-1: a null bulk string).

    Raises:
        ProtocolError: not a length.
    """
    digits = line[1:]
    if not (digits.isdigit() or digits == b"-1") or len(digits) > 19:
        raise ProtocolError(f"bad redis bulk length {line[:40]!r}")
    return int(digits)


async def expect_crlf(stream: WireStream) -> None:
    """Read the ``\\r\\n`` that ends a bulk string.

    Raises:
        ProtocolError: other bytes came.
    """
    if await stream.read_exact(2) != b"\r\n":
        raise ProtocolError("redis bulk string not followed by CRLF")


async def read_reply(stream: WireStream) -> Reply:
    """One reply that is not an array (a bulk string of at most :data:`SCRATCH_BYTES`).

    Raises:
        ProtocolError: an array, an unknown type, or a bulk string too long.
        ConnectionResetError: the connection was lost first.
    """
    line = await stream.read_line()
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return rest
    if kind == b"-":
        return ReplyError(rest.decode(errors="replace"))
    if kind == b":":
        try:
            return int(rest)
        except ValueError:
            raise ProtocolError(f"bad redis integer reply {line[:40]!r}") from None
    if kind == b"$":
        size = parse_length(line)
        if size < 0:
            return None
        if size > SCRATCH_BYTES - 2:
            raise ProtocolError(f"unexpected redis bulk reply of {size} bytes")
        data = await stream.read_exact(size)
        await expect_crlf(stream)
        return data
    raise ProtocolError(f"unexpected redis reply {line[:40]!r}")
