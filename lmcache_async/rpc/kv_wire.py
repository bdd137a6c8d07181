"""vLLM's KV event wire format, spoken without vLLM: the blocks a router indexes.

A KV-aware router (llm-d's prefix-cache scorer, NVIDIA Dynamo's KV router, vLLM's
production stack) subscribes to each engine's ``--kv-events-config`` stream: ZeroMQ PUB
messages ``[topic, sequence number (8 bytes, big-endian), payload]`` whose payload is a
msgpack ``KVEventBatch`` as ``vllm/distributed/kv_events.py`` defines it — an array
``[ts, [event, ...], data_parallel_rank]`` of map-encoded events tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (u64 ints, as vLLM sends by default), the
  ``parent_block_hash`` of the first, the blocks' ``token_ids``, ``block_size``,
  ``medium`` (``"CPU"`` for host RAM, ``"DISK"`` for local disk and Redis), ``lora_id`` and
  ``lora_name`` (nil);
- ``BlockRemoved``: ``block_hashes`` and ``medium``;
- ``AllBlocksCleared``: nothing else.

The engine records chunks (:class:`~lmcache_async.events.KVEvent`); a router indexes
blocks of the serving engine's block size. :func:`wire_events` cuts each chunk into its
whole blocks and names block ``j`` of a chunk ``(u64 of the chunk digest's last 8 bytes +
j) mod 2**64``: reproducible from the chunk key alone (so a removal names the very blocks
its store did), chained (a chunk's first block's parent is the last block of the chunk
before it), and as unlikely to meet another chunk's as two random u64s. A chunk's
trailing partial block is not published (vLLM publishes whole blocks only).

Encoding and decoding are plain msgpack: the suite checks them against vLLM's own decoder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgpack

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.events import EventKind, KVEvent
from lmcache_async.keys.tokens import is_strict_int

__all__ = [
    "MEDIA",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "WireEvent",
    "block_hashes_of",
    "decode_batch",
    "encode_batch",
    "wire_events",
]

MEDIA: Final = {"cpu": "CPU", "disk": "DISK", "redis": "DISK"}
"""The wire's ``medium`` of each tier: host RAM is ``"CPU"``; local disk and Redis, both
slower than host RAM and reached by reading a record, are ``"DISK"``."""

_U64: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered ``medium``, in prefix order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that left ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block this publisher announced is gone."""


WireEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


def block_hashes_of(digest: bytes, blocks: int) -> list[int]:
    """The u64 names of the first ``blocks`` blocks of the chunk with ``digest``."""
    base = int.from_bytes(digest[-8:], "big")
    return [(base + j) & _U64 for j in range(blocks)]


def wire_events(event: KVEvent, *, block_size: int, chunk_size: int) -> WireEvent | None:
    """``event`` (chunks of ``chunk_size`` tokens) as blocks of ``block_size`` tokens; None
    when it holds no whole block. ``chunk_size`` must be a multiple of ``block_size``.

    Raises:
        InvalidInputError: the sizes are not positive, or do not divide.
    """
    if not is_strict_int(block_size) or not is_strict_int(chunk_size) or block_size <= 0:
        raise InvalidInputError("block_size and chunk_size must be positive ints")
    if chunk_size <= 0 or chunk_size % block_size:
        raise InvalidInputError(
            f"chunk_size {chunk_size} is not a multiple of block_size {block_size}"
        )
    per_chunk = chunk_size // block_size
    medium = MEDIA.get(event.medium, event.medium.upper())
    if event.kind is EventKind.CLEARED:
        return AllBlocksCleared()
    if event.kind is EventKind.REMOVED:
        hashes = [h for digest in event.block_hashes for h in block_hashes_of(digest, per_chunk)]
        return BlockRemoved(tuple(hashes), medium) if hashes else None
    tokens = event.token_ids
    stored: list[int] = []
    for index, digest in enumerate(event.block_hashes):
        in_chunk = min(chunk_size, max(0, len(tokens) - index * chunk_size))
        stored.extend(block_hashes_of(digest, in_chunk // block_size))
        if in_chunk < chunk_size:
            break  # a short chunk ends the prompt
    if not stored:
        return None
    parent = event.parent_block_hash
    return BlockStored(
        block_hashes=tuple(stored),
        parent_block_hash=None if parent is None else block_hashes_of(parent, per_chunk)[-1],
        token_ids=tuple(tokens[: len(stored) * block_size]),
        block_size=block_size,
        medium=medium,
    )


def _to_map(event: WireEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[WireEvent], ts: float, *, data_parallel_rank: int = 0) -> bytes:
    """The msgpack ``KVEventBatch`` of ``events`` recorded at ``ts`` (seconds since the
    epoch): ``[ts, [event map, ...], data_parallel_rank]``, as vLLM's publisher fills it
    (routers read the rank as the third element).

    Raises:
        InvalidInputError: ``ts`` is not a finite number.
    """
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise InvalidInputError(f"ts must be a finite number, got {ts!r}")
    packed: bytes = msgpack.packb(
        [float(ts), [_to_map(event) for event in events], data_parallel_rank], use_bin_type=True
    )
    return packed


def _refuse_ext(code: int, data: bytes) -> object:
    raise ProtocolError(f"event batch holds a msgpack extension type ({code})")


def _hash_list(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        (is_strict_int(h) and 0 <= h <= _U64) or isinstance(h, bytes) for h in value
    ):
        raise ProtocolError(f"{name} must be a list of u64 ints or bytes")
    return tuple(h if isinstance(h, int) else int.from_bytes(h[-8:], "big") for h in value)


def _from_map(fields: object) -> WireEvent | None:
    """One event of a batch; None for a type this reader does not know (skipped, as a
    router skips what it does not index)."""
    if not isinstance(fields, dict):
        raise ProtocolError("an event must be a map")
    kind = fields.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = fields.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise ProtocolError("medium must be a str or nil")
    if kind == "BlockRemoved":
        return BlockRemoved(_hash_list(fields.get("block_hashes"), "block_hashes"), medium or "")
    if kind != "BlockStored":
        return None
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ProtocolError("block_size must be a positive int")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(is_strict_int(t) for t in tokens):
        raise ProtocolError("token_ids must be a list of ints")
    parent = fields.get("parent_block_hash")
    parents = () if parent is None else _hash_list([parent], "parent_block_hash")
    return BlockStored(
        block_hashes=_hash_list(fields.get("block_hashes"), "block_hashes"),
        parent_block_hash=parents[0] if parents else None,
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=medium or "",
    )


def decode_batch(payload: bytes | memoryview) -> tuple[float, list[WireEvent]]:
    """The ``(ts, events)`` of a ``KVEventBatch`` payload (vLLM's or ours).

    Raises:
        ProtocolError: not msgpack, an extension type, or not a batch of well-formed events.
    """
    try:
        batch = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext, timestamp=0
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ...)
        raise ProtocolError(f"event batch is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ProtocolError("an event batch is an array [ts, [events], ...]")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise ProtocolError("an event batch's ts must be a finite number")
    events = [event for event in map(_from_map, batch[1]) if event is not None]
    return float(ts), events
