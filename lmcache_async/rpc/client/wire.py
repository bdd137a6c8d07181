"""What a sidecar client puts on the wire and reads back: key fields (a prompt's chunk
digests too), counts in replies, and the refusals an ERROR reply maps to.

:class:`Unavailable` is not an error for the caller: it means "the sidecar cannot serve
this now" (no server, a timeout, a lost session) and every public call turns it into a
miss. The others map to the package's own errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio.to_thread

from lmcache_async.config import DEFAULT_INLINE_HASH_TOKENS
from lmcache_async.errors import InvalidInputError, PermissionDeniedError, ProtocolError
from lmcache_async.keys.chunks import ChunkHasher
from lmcache_async.keys.key_input import check_key_input
from lmcache_async.keys.tokens import Tokens, is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.protocol import (
    ErrorCode,
    Message,
    MessageType,
    hashes_to_wire,
    tokens_payload,
)

__all__ = [
    "SessionLost",
    "Unavailable",
    "check_lookup_id",
    "chunk_digests",
    "count",
    "key_fields",
    "raise_error",
]

log = get_logger(__name__)


class Unavailable(Exception):
    """The request could not be served (no server, timeout, lost session): a miss."""


class SessionLost(Unavailable):
    """The server does not know this client (it restarted, or our session expired)."""


def raise_error(msg_type: MessageType, reply: Message) -> None:
    """Raise what an ERROR reply to a ``msg_type`` request means here.

    Raises:
        InvalidInputError: the server refused the request's input.
        ProtocolError: the server could not read the request, or does not serve it.
        SessionLost: the server has no session for this client.
        PermissionDeniedError: this client's certificate does not allow the request.
        Unavailable: anything else (its engine is closed, it failed internally).
    """
    code = reply.header.get("code")
    text = str(reply.header.get("message", ""))
    if code == ErrorCode.INVALID_INPUT:
        raise InvalidInputError(text)
    if code in (ErrorCode.PROTOCOL, ErrorCode.UNSUPPORTED):
        raise ProtocolError(f"the sidecar refused a {msg_type.name} request: {text}")
    if code == ErrorCode.NO_SESSION:
        raise SessionLost(text)
    if code == ErrorCode.BUSY:
        raise Unavailable(text)  # a miss, like a timeout, without the wait
    if code == ErrorCode.FORBIDDEN:
        raise PermissionDeniedError(f"the sidecar refused a {msg_type.name} request: {text}")
    log.warning("sidecar_request_failed", type=msg_type.name, code=code, message=text)
    raise Unavailable(text)


def count(reply: Message, name: str) -> int:
    """The int >= 0 a reply holds in ``name``. Raises ProtocolError when it holds none."""
    value = reply.header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"'{name}' in the reply is not an int >= 0")
    return int(value)


def key_fields(
    tokens: Tokens | None,
    hashes: Sequence[int | bytes] | None,
    offsets: Sequence[int] | None,
) -> tuple[dict[str, Any], list[memoryview], int]:
    """The wire form of a request's keys, and its number of tokens.

    Raises:
        InvalidInputError: tokens and hashes both or neither given, bad tokens, hashes
            or offsets.
    """
    ends = check_key_input(tokens, hashes, offsets)
    if ends is not None:
        assert hashes is not None  # check_key_input: offsets come with hashes
        wire = hashes_to_wire(hashes)
        if len(wire) != len(ends):
            raise InvalidInputError(
                f"got {len(wire)} hashes but {len(ends)} offsets; they must match"
            )
        return {"hashes": wire, "offsets": ends}, [], (ends[-1] if ends else 0)
    assert tokens is not None
    payload = tokens_payload(tokens)
    return {}, [payload], payload.nbytes // 4


def check_lookup_id(lookup_id: object) -> int | str:
    """A lookup id as it crosses the wire. Raises InvalidInputError: not an int or str."""
    if is_strict_int(lookup_id) or isinstance(lookup_id, str):
        return lookup_id  # type: ignore[return-value]
    raise InvalidInputError(
        f"lookup_id must be an int or str over the sidecar, got {type(lookup_id).__name__}"
    )


async def chunk_digests(hasher: ChunkHasher, tokens: Tokens) -> list[bytes]:
    """The chunk digests of ``tokens``: remembered, hashed here when short, else in a
    worker thread. Raises InvalidInputError for bad tokens."""
    probe = hasher.probe(tokens)
    if probe.digests is not None:
        return probe.digests
    if len(tokens) < DEFAULT_INLINE_HASH_TOKENS:
        return hasher.digests(tokens, probe=probe)
    return await anyio.to_thread.run_sync(partial(hasher.digests, tokens, probe=probe))
