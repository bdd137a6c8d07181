"""Reading a request's header fields and key frames, each checked as it is read.

A field of the wrong type is the client's mistake in speaking the protocol: ProtocolError,
which the server answers with an ERROR reply (``PROTOCOL``). A missing lookup id where one
is needed is bad input (InvalidInputError, ``INVALID_INPUT``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.rpc.protocol import Message, hashes_from_wire, tokens_from_payload

__all__ = [
    "checksums_field",
    "digests_frame",
    "flag_field",
    "int_field",
    "key_input",
    "locations_field",
    "lookup_id_field",
    "seconds_field",
    "txn_deadline",
]


def flag_field(header: dict[str, Any], name: str, *, required: bool = False) -> bool:
    """A bool field (False when absent and not ``required``). Raises ProtocolError."""
    value = header.get(name)
    if value is None and not required:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a bool")
    return value


def int_field(header: dict[str, Any], name: str, default: int) -> int:
    """An int field >= 0 (``default`` when absent). Raises ProtocolError."""
    value = header.get(name, default)
    if not is_strict_int(value) or value < 0:
        raise ProtocolError(f"'{name}' must be an int >= 0")
    return int(value)


def seconds_field(header: dict[str, Any], name: str) -> float | None:
    """A positive number of seconds, or None when absent. Raises ProtocolError."""
    value = header.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ProtocolError(f"'{name}' must be a positive number of seconds")
    return float(value)


def checksums_field(header: dict[str, Any], count: int) -> list[int]:
    """The ``"checksums"`` of a push: one unsigned 64-bit int per payload frame.

    Raises:
        ProtocolError: not a list of ``count`` such ints.
    """
    value = header.get("checksums")
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(is_strict_int(item) and 0 <= item < 1 << 64 for item in value)
    ):
        raise ProtocolError(f"'checksums' must list one unsigned 64-bit int per payload ({count})")
    return value


def lookup_id_field(header: dict[str, Any], *, required: bool) -> int | str | None:
    """The request's ``lookup_id`` (an int or str), None when absent.

    Raises:
        InvalidInputError: absent but ``required``.
        ProtocolError: neither an int nor a str.
    """
    value = header.get("lookup_id")
    if value is None:
        if required:
            raise InvalidInputError("this request needs a lookup_id")
        return None
    if not (is_strict_int(value) or isinstance(value, str)):
        raise ProtocolError("'lookup_id' must be an int or str")
    return value  # type: ignore[no-any-return]


def locations_field(header: dict[str, Any], name: str) -> list[str] | None:
    """A list of tier names, or None when absent. Raises ProtocolError."""
    value = header.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"'{name}' must be a list of tier names")
    return value


def digests_frame(message: Message) -> memoryview:
    """A LOOKUP's chunk digests: one payload frame of :data:`DIGEST_SIZE`-byte digests, as
    they came (the engine takes them so).

    Raises:
        ProtocolError: not exactly one frame, or not a whole number of digests.
    """
    if len(message.payloads) != 1:
        raise ProtocolError("a lookup by digests carries one payload frame")
    frame = message.payloads[0]
    if frame.nbytes % DIGEST_SIZE:
        raise ProtocolError(f"the digests frame is not a multiple of {DIGEST_SIZE} bytes")
    return frame


def key_input(
    message: Message,
) -> tuple[np.ndarray | None, list[int | bytes] | None, list[int] | None]:
    """A request's keys: one token payload frame, or ``hashes`` with ``offsets``.

    Raises:
        ProtocolError: neither, hashes without offsets, or a malformed token frame.
    """
    header = message.header
    if "hashes" in header:
        offsets = header.get("offsets")
        if not isinstance(offsets, list):
            raise ProtocolError("a request by hashes needs an 'offsets' list")
        return None, hashes_from_wire(header["hashes"]), offsets
    if not message.payloads:
        raise ProtocolError("a request carries 'hashes' or a token payload frame")
    return tokens_from_payload(message.payloads[0]), None, None


def txn_deadline(header: dict[str, Any], longest: float) -> float:
    """When a transaction is given up: the client says how long it waits for each request
    (``"timeout"``); past twice that it has given up too. At most ``longest`` seconds."""
    wait = header.get("timeout")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait < longest:
        return time.monotonic() + min(2 * float(wait), longest)
    return time.monotonic() + longest
