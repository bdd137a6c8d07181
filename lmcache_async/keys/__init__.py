"""Chunk keys: what a prompt's tokens become so that every process and host finds its KV.

Token input checked and turned into int32 bytes (:mod:`.tokens`), the prefix-chained hashes
of chunks and their namespace (:mod:`.chunks`, :mod:`.hashing`, the C chain in
``_native.c``), digests sent instead of tokens and their memo (:mod:`.digests`,
:mod:`.digest_memo`), a serving engine's own block hashes (:mod:`.block_hashes`), the key
input of a request on the wire (:mod:`.key_input`) and CacheBlend segments
(:mod:`.segments`). ``_native`` also holds the CPU tier's walk over an index's leading keys.

May import: the ground floor (``config``, ``errors``, ``events``, ``stats``, ``health``,
``logging``, ``tenancy``). Never the other data-model packages or anything above them.
"""

from __future__ import annotations

from lmcache_async.keys.chunks import (
    DIGEST_SIZE,
    NATIVE_CHAIN,
    ChunkHasher,
    ChunkKey,
    ChunkSpan,
    DigestFrames,
    DigestGuess,
    DigestProbe,
    HashAlgorithm,
    Namespace,
    Tokens,
    check_mask,
    split_digests,
    token_array,
)

__all__ = [
    "DIGEST_SIZE",
    "NATIVE_CHAIN",
    "ChunkHasher",
    "ChunkKey",
    "ChunkSpan",
    "DigestFrames",
    "DigestGuess",
    "DigestProbe",
    "HashAlgorithm",
    "Namespace",
    "Tokens",
    "check_mask",
    "split_digests",
    "token_array",
]
