"""Reading a request's header fields and key frames, each checked as it is read.

A field of the wrong type is the client's mistake in speaking the protocol: ProtocolError,
which the server answers with an ERROR reply (``PROTOCOL``). A well-formed value the
sidecar will not take (a missing lookup id where one is needed, a value past a limit) is
bad input: InvalidInputError (``INVALID_INPUT``). No field reaches the engine unchecked or
makes a request's work grow past what its limits allow:

- a request names at most :func:`max_prompt_chunks` chunks (block hashes, digests): as many
  as the longest prompt a token frame within the message limits holds;
- a block hash is bytes of at most
  :data:`~lmcache_async.keys.block_hashes.MAX_BLOCK_HASH_BYTES`, or an int that fits in
  :data:`~lmcache_async.keys.block_hashes.BLOCK_HASH_INT_BYTES` signed bytes;
- an id or label (``lookup_id``, ``req_id``, a client's name) holds at most
  :data:`MAX_ID_CHARS` characters, a tier list at most :data:`MAX_TIER_NAMES` names.

The checks run for every request, lookups included: lengths and C-level passes over a
list (``set(map(type, ...))``), with a Python loop only for the unusual mixed forms.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.block_hashes import BLOCK_HASH_INT_BYTES, MAX_BLOCK_HASH_BYTES
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.keys.tokens import TOKEN_BYTES, is_strict_int
from lmcache_async.rpc.protocol import Message, MessageLimits, tenant_of, tokens_from_payload

if TYPE_CHECKING:
    from lmcache_async.engine import CacheEngine
    from lmcache_async.keys.chunks import ChunkSpan

__all__ = [
    "MAX_ID_CHARS",
    "MAX_TIER_NAMES",
    "block_hashes_field",
    "checksums_field",
    "digests_frame",
    "flag_field",
    "int_field",
    "key_input",
    "label_field",
    "locations_field",
    "lookup_id_field",
    "max_prompt_chunks",
    "request_spans",
    "seconds_field",
    "txn_deadline",
]

MAX_ID_CHARS: Final = 1024
"""Longest ``lookup_id``, ``req_id`` or client name a request may give (a serving engine's
request ids are tens of characters); a lookup id is kept while its pins last."""

MAX_TIER_NAMES: Final = 16
"""Most tier names a request may list (``search_range``, ``store_location``, ...): more
than there are tiers."""


def max_prompt_chunks(limits: MessageLimits, chunk_size: int) -> int:
    """The most chunks a request may name: those of the longest prompt whose token frame
    fits in ``limits.max_payload_bytes``, in chunks of ``chunk_size`` tokens."""
    return -(-(limits.max_payload_bytes // TOKEN_BYTES) // chunk_size)


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


def seconds_field(header: dict[str, Any], name: str, maximum: float = math.inf) -> float | None:
    """A positive number of seconds, at most ``maximum`` (a larger one is clamped: a
    client cannot make the server wait longer than it allows), or None when absent.
    Raises ProtocolError."""
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
    return min(float(value), maximum)


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
    if isinstance(value, str):
        if len(value) > MAX_ID_CHARS:
            raise InvalidInputError(
                f"'lookup_id' holds {len(value)} characters; at most {MAX_ID_CHARS} are allowed"
            )
        return value
    if not is_strict_int(value):
        raise ProtocolError("'lookup_id' must be an int or str")
    return value  # type: ignore[no-any-return]


def label_field(header: dict[str, Any], name: str, default: str) -> str:
    """A name the client gives (``req_id``, its own name in a HELLO): a str or int of at
    most :data:`MAX_ID_CHARS` characters, as a str; ``default`` when absent.

    Raises:
        ProtocolError: neither a str nor an int.
        InvalidInputError: too long.
    """
    value = header.get(name)
    if value is None:
        return default
    if not (isinstance(value, str) or is_strict_int(value)):
        raise ProtocolError(f"'{name}' must be a str or int")
    text = str(value)
    if len(text) > MAX_ID_CHARS:
        raise InvalidInputError(
            f"'{name}' holds {len(text)} characters; at most {MAX_ID_CHARS} are allowed"
        )
    return text


def locations_field(header: dict[str, Any], name: str) -> list[str] | None:
    """A list of tier names, or None when absent.

    Raises:
        ProtocolError: not a list of str.
        InvalidInputError: more than :data:`MAX_TIER_NAMES` names.
    """
    value = header.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"'{name}' must be a list of tier names")
    if len(value) > MAX_TIER_NAMES:
        raise InvalidInputError(
            f"'{name}' lists {len(value)} tiers; at most {MAX_TIER_NAMES} are allowed"
        )
    return value


def digests_frame(message: Message, max_chunks: int) -> memoryview:
    """A LOOKUP's chunk digests: one payload frame of :data:`DIGEST_SIZE`-byte digests, as
    they came (the engine takes them so).

    Raises:
        ProtocolError: not exactly one frame, or not a whole number of digests.
        InvalidInputError: more than ``max_chunks`` digests.
    """
    if len(message.payloads) != 1:
        raise ProtocolError("a lookup by digests carries one payload frame")
    frame = message.payloads[0]
    if frame.nbytes % DIGEST_SIZE:
        raise ProtocolError(f"the digests frame is not a multiple of {DIGEST_SIZE} bytes")
    if frame.nbytes > max_chunks * DIGEST_SIZE:
        raise InvalidInputError(_too_many("digests", frame.nbytes // DIGEST_SIZE, max_chunks))
    return frame


def block_hashes_field(value: object, max_chunks: int) -> list[int | bytes]:
    """The block hashes of a request's ``"hashes"``, as
    :func:`~lmcache_async.rpc.protocol.hashes_to_wire` wrote them: ints, bytes, and an int
    wider than msgpack's as ``[signed little-endian bytes]``.

    Raises:
        ProtocolError: not a list of those forms.
        InvalidInputError: more than ``max_chunks`` hashes, bytes longer than
            ``MAX_BLOCK_HASH_BYTES``, or an int wider than ``BLOCK_HASH_INT_BYTES``.
    """
    if not isinstance(value, list):
        raise ProtocolError(f"'hashes' must be a list, got {type(value).__name__}")
    if len(value) > max_chunks:
        raise InvalidInputError(_too_many("block hashes", len(value), max_chunks))
    kinds = set(map(type, value))
    # msgpack's ints (64 bits at most) all fit; bools, floats and lists take the loop.
    if kinds <= {int} or (kinds == {bytes} and max(map(len, value)) <= MAX_BLOCK_HASH_BYTES):
        return value
    hashes: list[int | bytes] = []
    for index, item in enumerate(value):
        kind = type(item)
        if kind is int:
            hashes.append(item)
        elif kind is bytes:
            if len(item) > MAX_BLOCK_HASH_BYTES:
                raise InvalidInputError(
                    f"'hashes'[{index}] is {len(item)} bytes long; a block hash is at most "
                    f"{MAX_BLOCK_HASH_BYTES} bytes"
                )
            hashes.append(item)
        elif kind is list and len(item) == 1 and type(item[0]) is bytes:
            wide = item[0]
            if len(wide) > BLOCK_HASH_INT_BYTES:
                raise InvalidInputError(
                    f"'hashes'[{index}] is an int of {len(wide)} bytes; a block hash int "
                    f"fits in {BLOCK_HASH_INT_BYTES} signed bytes"
                )
            hashes.append(int.from_bytes(wide, "little", signed=True))
        else:
            raise ProtocolError(f"'hashes'[{index}] is not an int, bytes or [bytes]")
    return hashes


def key_input(
    message: Message, max_chunks: int
) -> tuple[np.ndarray | None, list[int | bytes] | None, list[int] | None]:
    """A request's keys: one token payload frame, or ``hashes`` with as many ``offsets``
    (their values are the engine's to check), at most ``max_chunks`` of them.

    Raises:
        ProtocolError: neither, hashes without offsets, or a malformed token frame or
            hash.
        InvalidInputError: too many hashes, not one offset per hash, or a hash too big.
    """
    header = message.header
    if "hashes" in header:
        offsets = header.get("offsets")
        if not isinstance(offsets, list):
            raise ProtocolError("a request by hashes needs an 'offsets' list")
        hashes = block_hashes_field(header["hashes"], max_chunks)
        if len(offsets) != len(hashes):
            raise InvalidInputError(
                f"got {len(hashes)} hashes but {len(offsets)} offsets; they must match"
            )
        return None, hashes, offsets
    if not message.payloads:
        raise ProtocolError("a request carries 'hashes' or a token payload frame")
    return tokens_from_payload(message.payloads[0]), None, None


def _too_many(what: str, count: int, max_chunks: int) -> str:
    return (
        f"{count} {what}: more than the {max_chunks} chunks of the longest prompt within "
        f"this sidecar's message limits"
    )


def txn_deadline(header: dict[str, Any], longest: float) -> float:
    """When a transaction is given up: the client says how long it waits for each request
    (``"timeout"``); past twice that it has given up too. At most ``longest`` seconds."""
    wait = header.get("timeout")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait < longest:
        return time.monotonic() + min(2 * float(wait), longest)
    return time.monotonic() + longest


async def request_spans(
    engine: CacheEngine, message: Message, max_chunks: int
) -> tuple[list[ChunkSpan], np.ndarray | None]:
    """The chunks ``message`` names from its ``start`` (the mask's first True) on, keyed
    for the tenant it names (none: the session's own), and its tokens as int32 (None when
    keyed by block hashes); at most ``max_chunks`` keys are read.

    Raises:
        ProtocolError: a malformed field or key frame.
        InvalidInputError: ``start`` is not on a chunk boundary, bad keys (more chunks
            than a prompt within the message limits has, a block hash too big), or a
            bad tenant.
    """
    start = int_field(message.header, "start", 0)
    if start % engine.config.chunk_size:
        raise InvalidInputError(
            f"the mask must start on a chunk boundary (chunk_size "
            f"{engine.config.chunk_size}), got {start}"
        )
    tenant = tenant_of(message.header)
    tokens, hashes, offsets = key_input(message, max_chunks)
    return await engine.chunk_spans(
        tokens, hashes=hashes, offsets=offsets, start=start, tenant=tenant
    )
