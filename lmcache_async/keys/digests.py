"""Digests as bytes: their size, a wire frame of them cut into keys, recent frames kept.

Every chunk key's digest is :data:`DIGEST_SIZE` bytes, whatever the hash algorithm: the
tenant's :data:`~lmcache_async.tenancy.tenants.TAG_BYTES`-byte tag, then the
:data:`LINK_SIZE`-byte link of the key chain (a seed is one such link too). A lookup's wire
frame carries the digests of a prompt one after another. Chunk keys and the
chain that makes them live in :mod:`lmcache_async.keys.chunks`, which re-exports these names.
"""

from __future__ import annotations

import collections
from typing import Final, TypeVar

import numpy as np
import xxhash

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.tenancy.tenants import TAG_BYTES

__all__ = ["DIGEST_SIZE", "LINK_SIZE", "DigestFrames", "lru_put", "split_digests"]

LINK_SIZE: Final = 16
"""Size in bytes of a link ``h_i`` of the key chain and of its seed ``h_0``: what ``H``
produces (128 bits, whatever the algorithm)."""

DIGEST_SIZE: Final = TAG_BYTES + LINK_SIZE
"""Size in bytes of every key digest: the tenant's tag, then the chain's link."""

_DIGEST_ITEM: Final = np.dtype(f"V{DIGEST_SIZE}")

_Entry = TypeVar("_Entry")
_Key = TypeVar("_Key")


def lru_put(
    table: collections.OrderedDict[_Key, _Entry], capacity: int, key: _Key, value: _Entry
) -> None:
    """Put ``value`` in an LRU ``table`` as its newest entry, the oldest going beyond
    ``capacity`` (the helper of :class:`DigestFrames` and of the digest memo)."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)


def split_digests(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The digests in ``data``, a concatenation of :data:`DIGEST_SIZE`-byte digests (as a
    lookup's wire frame carries them), each a bytes object of its own.

    Raises:
        InvalidInputError: ``data`` is not contiguous memory, or its length is not a
            multiple of :data:`DIGEST_SIZE`.
    """
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidInputError("the digests must be contiguous bytes")
    if view.nbytes % DIGEST_SIZE:
        raise InvalidInputError(
            f"{view.nbytes} bytes of digests are not a multiple of {DIGEST_SIZE}"
        )
    # As fixed-size void items numpy cuts the bytes in one C loop: a quarter of the
    # time of slicing them once per digest (128 times for a 32k-token prompt).
    digests: list[bytes] = np.frombuffer(view.cast("B"), dtype=_DIGEST_ITEM).tolist()
    return digests


class DigestFrames:
    """:func:`split_digests` for frames that come again: the keys of the last
    ``capacity`` frames cut, found by the frame's bytes (an xxh3 fingerprint, then a
    comparison). A sidecar's client asks about one prompt several times; its frame is then
    neither cut again nor are its 128 digests hashed again (the keys keep their cached
    hashes), which is most of what the CPU tier's dict spends on a lookup. Each call
    returns a list of its own. For one thread (the engine's event loop).
    """

    __slots__ = ("_capacity", "_frames")

    def __init__(self, capacity: int) -> None:
        if not is_strict_int(capacity) or capacity <= 0:
            raise InvalidInputError(f"capacity must be a positive int, got {capacity!r}")
        self._capacity = capacity
        self._frames: collections.OrderedDict[int, tuple[bytes, list[bytes]]] = (
            collections.OrderedDict()
        )

    def split(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """As :func:`split_digests` (and raising as it does)."""
        view = memoryview(data)
        if not view.c_contiguous or view.nbytes % DIGEST_SIZE:
            return split_digests(view)  # refused there, with the reason
        view = view.cast("B")
        fingerprint = xxhash.xxh3_64_intdigest(view)
        entry = self._frames.get(fingerprint)
        if entry is not None and len(entry[0]) == len(view) and entry[0].startswith(view):
            self._frames.move_to_end(fingerprint)
            return list(entry[1])
        keys = split_digests(view)
        lru_put(self._frames, self._capacity, fingerprint, (view.tobytes(), keys))
        return list(keys)

    def __len__(self) -> int:
        return len(self._frames)
