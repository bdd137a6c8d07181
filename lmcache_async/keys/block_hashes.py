"""A serving engine's block hashes as chain input: checked against their token offsets and
encoded so that no block hash is ever hashed as a chunk of tokens is.

:meth:`ChunkHasher.spans_from_hashes <lmcache_async.keys.chunks.ChunkHasher.spans_from_hashes>`
chains the encodings as it chains token chunks, ``h_i = H(enc(hashes[i]) || h_{i-1})``.

A block hash is bounded: bytes of at most :data:`MAX_BLOCK_HASH_BYTES`, an int that fits in
:data:`BLOCK_HASH_INT_BYTES` signed bytes. Serving engines' hashes are far smaller (vLLM's
are 32 bytes of SHA-256, or a 64-bit int); the bound keeps a hostile caller from making
every chain link hash a megabyte, and every refusal names the size, never the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int

__all__ = ["BLOCK_HASH_INT_BYTES", "MAX_BLOCK_HASH_BYTES", "encode_block_hashes"]

MAX_BLOCK_HASH_BYTES: Final = 64
"""Longest block hash given as bytes (a SHA-512 digest; vLLM's SHA-256 ones are 32)."""

BLOCK_HASH_INT_BYTES: Final = 32
"""An int block hash is encoded in this many signed little-endian bytes: it must fit."""

_INT_HASH_TAG: Final = b"\x01"
_BYTES_HASH_TAG: Final = b"\x02"


def encode_block_hashes(
    hashes: Sequence[int | bytes], offsets: Sequence[int], chunk_size: int
) -> tuple[list[bytes], int]:
    """Each block hash as its chain link hashes it, and the number of tokens they cover.

    ``hashes[i]`` covers tokens ``[offsets[i-1], offsets[i])`` (``offsets`` are end
    offsets, strictly increasing and positive). Every block must hold exactly
    ``chunk_size`` tokens except the last (at most ``chunk_size``).

    Raises:
        InvalidInputError: mismatched lengths, bad offsets, a block of the wrong size, or a
            hash that is neither int nor bytes, bytes longer than
            :data:`MAX_BLOCK_HASH_BYTES`, or an int that does not fit in
            :data:`BLOCK_HASH_INT_BYTES` signed bytes.
    """
    for name, value in (("hashes", hashes), ("offsets", offsets)):
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
            raise InvalidInputError(f"{name} must be a sequence, got {type(value).__name__}")
    if len(hashes) != len(offsets):
        raise InvalidInputError(
            f"got {len(hashes)} hashes but {len(offsets)} offsets; they must match"
        )
    count = len(offsets)
    previous = 0
    for index, end in enumerate(offsets):
        if not is_strict_int(end):
            raise InvalidInputError(f"offsets[{index}] must be an int, got {type(end).__name__}")
        size = end - previous
        if size <= 0:
            raise InvalidInputError(
                f"offsets must be positive and strictly increasing: offsets[{index}] = "
                f"{end} after {previous}"
            )
        if size > chunk_size or (size != chunk_size and index != count - 1):
            raise InvalidInputError(
                f"hashes[{index}] covers {size} tokens; every block must hold exactly "
                f"chunk_size={chunk_size} tokens, except the last (at most chunk_size)"
            )
        previous = end
    return [_encode_block_hash(i, h) for i, h in enumerate(hashes)], previous


def _encode_block_hash(index: int, value: int | bytes) -> bytes:
    """A block hash as its chain link hashes it. Every encoding is one byte longer than a
    multiple of 4 (bytes are padded with zeros after their stated length) while a chunk
    of int32 tokens is a multiple of 4 long: a block hash and a chunk of tokens never feed
    ``H`` the same input, so they never share a key."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) > MAX_BLOCK_HASH_BYTES:
            raise InvalidInputError(
                f"hashes[{index}] is {len(value)} bytes long; a block hash is at most "
                f"{MAX_BLOCK_HASH_BYTES} bytes"
            )
        padding = bytes(-len(value) % 4)
        return _BYTES_HASH_TAG + len(value).to_bytes(8, "little") + bytes(value) + padding
    if not is_strict_int(value):
        raise InvalidInputError(
            f"hashes[{index}] must be an int or bytes, got {type(value).__name__}"
        )
    try:
        return _INT_HASH_TAG + value.to_bytes(BLOCK_HASH_INT_BYTES, "little", signed=True)
    except OverflowError:
        # The size, not the value: a huge int has more digits than str() may write.
        raise InvalidInputError(
            f"hashes[{index}], an int of {value.bit_length()} bits, does not fit in "
            f"{BLOCK_HASH_INT_BYTES} signed bytes"
        ) from None
