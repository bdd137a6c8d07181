"""The hash ``H`` of seeds and chunk keys, and the chain that links chunk keys.

``H`` is blake3 (default) or xxh3-128, both producing :data:`LINK_SIZE` (16) bytes: a real
hash, never Python's ``hash()``, so every process and host computes the same key for the
same input. The chain is ``h_i = H(piece_i || h_{i-1})`` over the pieces of some bytes (a
chunk's tokens as little-endian int32, for :class:`~lmcache_async.keys.chunks.ChunkHasher`);
the key digest of piece ``i`` is ``tag || h_i`` (:data:`DIGEST_SIZE` bytes), the tenant's tag
put ahead of the whole 128-bit link, which alone is chained.

The link ``h_{i-1}`` comes after the piece so that hashing a piece does not wait for the
key before it: the blake3 chain in C (:mod:`lmcache_async.keys._native`, built with the
package when a C compiler is there) hashes the whole 1 KiB blocks of many pieces at once,
one per vector lane, then folds in the links in order. Without it the blake3 package
computes the same keys, piece after piece, about three times slower.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final

import blake3
import numpy as np
import xxhash

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.digests import DIGEST_SIZE, LINK_SIZE, split_digests
from lmcache_async.tenancy.tenants import TAG_BYTES

__all__ = [
    "NATIVE_CHAIN",
    "ChainFunction",
    "HashAlgorithm",
    "as_algorithm",
    "chain_function",
    "hash_function",
    "with_tag",
]


class HashAlgorithm(enum.StrEnum):
    """The hash ``H`` used for seeds and chunk keys."""

    BLAKE3 = "blake3"
    XXH3_128 = "xxh3_128"


def _blake3(data: bytes) -> bytes:
    return blake3.blake3(data).digest(length=LINK_SIZE)


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def hash_function(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """One-shot ``H``: bytes in, :data:`LINK_SIZE` bytes out."""
    if algorithm is HashAlgorithm.BLAKE3:
        return _blake3
    return _xxh3_128


def as_algorithm(algorithm: HashAlgorithm | str) -> HashAlgorithm:
    """``algorithm`` as a :class:`HashAlgorithm` (a member, or its value).

    Raises:
        InvalidInputError: ``algorithm`` names no known hash.
    """
    try:
        return HashAlgorithm(algorithm)
    except ValueError:
        choices = ", ".join(a.value for a in HashAlgorithm)
        raise InvalidInputError(
            f"unknown hash algorithm {algorithm!r}; expected one of {choices}"
        ) from None


def _chain_blake3_py(prev: bytes, data: memoryview, step: int, tag: bytes = b"") -> list[bytes]:
    """``h_i = blake3(data[(i-1)*step : i*step] || h_{i-1})`` with the blake3 package, each
    returned as ``tag || h_i``."""
    hasher = blake3.blake3()
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    out: list[bytes] = []
    append = out.append
    for offset in range(0, len(data), step):
        reset()
        update(data[offset : offset + step])
        update(prev)
        prev = digest(LINK_SIZE)
        append(tag + prev)
    return out


ChainFunction = Callable[[bytes, memoryview, int, bytes], list[bytes]]
"""``chain(h_0, data, step, tag)``: ``tag || h_i`` for each ``step``-byte piece of
``data``, where ``h_i = H(piece_i || h_{i-1})`` is :data:`LINK_SIZE` bytes and ``h_0`` the
seed (the chain links the untagged ``h_i``; ``tag`` is empty or :data:`TAG_BYTES` bytes)."""
_native_chain: ChainFunction | None
try:
    from lmcache_async.keys._native import blake3_chain as _native_chain
except ImportError:  # the package was built without a C compiler
    _native_chain = None

NATIVE_CHAIN: Final = _native_chain is not None
"""Whether blake3 keys are chained in C (see the module docstring)."""

_chain_blake3: Final[ChainFunction] = (
    _native_chain if _native_chain is not None else _chain_blake3_py
)
"""``h_i = blake3(data[(i-1)*step : i*step] || h_{i-1})`` for every piece of ``data``."""


def _chain_xxh3(prev: bytes, data: memoryview, step: int, tag: bytes = b"") -> list[bytes]:
    """``h_i = xxh3_128(data[(i-1)*step : i*step] || h_{i-1})`` for every piece of ``data``,
    each returned as ``tag || h_i``."""
    xxh3, join = xxhash.xxh3_128_digest, b"".join
    out: list[bytes] = []
    append = out.append
    for offset in range(0, len(data), step):
        prev = xxh3(join((data[offset : offset + step], prev)))
        append(prev)
    return with_tag(out, tag) if tag else out


def with_tag(links: list[bytes], tag: bytes) -> list[bytes]:
    """``tag || link`` for each of ``links`` (:data:`LINK_SIZE` bytes each): the key
    digests of a chain's links. Written into one buffer and cut again in C, half the time
    of a concatenation per digest.

    Raises:
        InvalidInputError: ``tag`` is not :data:`TAG_BYTES` bytes.
    """
    if len(tag) != TAG_BYTES:
        raise InvalidInputError(f"a tenant tag is {TAG_BYTES} bytes, got {len(tag)}")
    if not links:
        return []
    rows = np.empty((len(links), DIGEST_SIZE), dtype=np.uint8)
    rows[:, :TAG_BYTES] = np.frombuffer(tag, dtype=np.uint8)
    rows[:, TAG_BYTES:] = np.frombuffer(b"".join(links), dtype=np.uint8).reshape(-1, LINK_SIZE)
    return split_digests(rows.data)


def chain_function(algorithm: HashAlgorithm) -> ChainFunction:
    """The chain under ``algorithm``: ``chain(h_0, data, step, tag)`` returns ``tag || h_1,
    tag || h_2, ...`` for the ``step``-byte pieces of ``data`` (the last one may be
    shorter); see :data:`ChainFunction`."""
    if algorithm is HashAlgorithm.BLAKE3:
        return _chain_blake3
    return _chain_xxh3
