"""Chunk keys: prefix-chained hashes of token chunks.

Tokens are cut into chunks of ``chunk_size``; chunk ``i`` gets the key
``h_i = H(tokens_i || h_{i-1})`` where ``tokens_i`` are the chunk's tokens as little-endian
int32 and ``h_0`` is a seed that binds the :class:`Namespace` (model, weights revision, KV
layout, tenant). ``H`` is blake3 (default) or xxh3-128, both producing :data:`LINK_SIZE`
(16) bytes: a real hash, never Python's ``hash()``, so every process and host computes the
same key for the same tokens. A chunk's key is the tenant's
:data:`~lmcache_async.tenancy.tenants.TAG_BYTES`-byte tag followed by ``h_i``
(:data:`DIGEST_SIZE` = 32 bytes, :mod:`lmcache_async.tenancy.tenants`), so every tier can tell
whose a chunk is from its key; the chain links the untagged ``h_i``, all 128 bits of it.

Segment keys for blending (:class:`~lmcache_async.keys.segments.SegmentHasher`) live in
:mod:`lmcache_async.keys.segments`. Re-exported here from the modules they live in:
:class:`HashAlgorithm` and :data:`NATIVE_CHAIN` from :mod:`lmcache_async.keys.hashing`, where
``H`` and the chain are (the chain in C where the package was built with it); token input
checks (:func:`token_array`, :func:`check_mask`) from :mod:`lmcache_async.keys.tokens`;
:data:`DIGEST_SIZE`, :func:`split_digests` and :class:`DigestFrames` from
:mod:`lmcache_async.keys.digests`; the memo's :class:`DigestProbe` and :class:`DigestGuess`
from :mod:`lmcache_async.keys.digest_memo`, where the hasher's digest memo lives. Block hashes
are encoded for the chain in :mod:`lmcache_async.keys.block_hashes`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.block_hashes import encode_block_hashes
from lmcache_async.keys.digest_memo import DigestGuess, DigestProbe, MemoKey, TokenMemo
from lmcache_async.keys.digests import DIGEST_SIZE, LINK_SIZE, DigestFrames, split_digests
from lmcache_async.keys.hashing import (
    NATIVE_CHAIN,
    HashAlgorithm,
    as_algorithm,
    chain_function,
    hash_function,
    with_tag,
)
from lmcache_async.keys.tokens import (
    TOKEN_BYTES,
    Tokens,
    check_mask,
    is_strict_int,
    token_array,
    token_bytes,
)
from lmcache_async.tenancy.tenants import check_tenant, tenant_tag

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
    "LINK_SIZE",
    "Namespace",
    "Tokens",
    "check_mask",
    "split_digests",
    "token_array",
]

_LAYER_BYTES: Final = 4
_MAX_LAYERS: Final = 1 << (8 * _LAYER_BYTES)

_NAMESPACE_DOMAIN: Final = b"lmcache_async/namespace/v1\x00"
_NONE_TAG: Final = b"\x00"
_STR_TAG: Final = b"\x01"
_KEY_HEX: Final = 2 * DIGEST_SIZE
_KEY_TEXT: Final = re.compile(f"([0-9a-f]{{{_KEY_HEX}}})(?:@L(0|[1-9][0-9]*))?")


class ChunkKey(bytes):
    """The key of one chunk: a :data:`DIGEST_SIZE`-byte digest, optionally for one layer.

    A key *is* its bytes: the digest, followed for a layer key by the layer number as 4
    little-endian bytes. It hashes and compares like those bytes, so a tier's index can be
    probed with a bare digest, with no key object built per chunk on the lookup path.
    Immutable. :meth:`to_str` is the one stable text form (64 lowercase hex characters,
    plus ``@L<layer>`` for a layer key) used for file names and Redis keys.

    Raises:
        InvalidInputError: ``digest`` is not :data:`DIGEST_SIZE` bytes, or ``layer`` is not
            ``None`` or an int in ``[0, 2**32)``.
    """

    __slots__ = ()

    def __new__(cls, digest: bytes, layer: int | None = None) -> ChunkKey:
        if type(digest) is not bytes or len(digest) != DIGEST_SIZE:
            raise InvalidInputError(
                f"ChunkKey digest must be {DIGEST_SIZE} bytes, got {digest!r:.80}"
            )
        if layer is None:
            return super().__new__(cls, digest)
        if not is_strict_int(layer) or not 0 <= layer < _MAX_LAYERS:
            raise InvalidInputError(
                f"ChunkKey layer must be None or a non-negative int, got {layer!r}"
            )
        return super().__new__(cls, digest + layer.to_bytes(_LAYER_BYTES, "little"))

    def __reduce__(self) -> tuple[type[ChunkKey], tuple[bytes, int | None]]:
        # bytes' own protocol would rebuild from the raw bytes, which __new__ refuses for a
        # layer key.
        return (ChunkKey, (self.digest, self.layer))

    @property
    def digest(self) -> bytes:
        """The chunk's digest (without the layer)."""
        return bytes(self[:DIGEST_SIZE])

    @property
    def layer(self) -> int | None:
        """The layer of a layer key, ``None`` for a whole-chunk key."""
        if len(self) == DIGEST_SIZE:
            return None
        return int.from_bytes(self[DIGEST_SIZE:], "little")

    def to_str(self) -> str:
        """The stable text form: ``"<64 hex chars>"`` or ``"<64 hex chars>@L<layer>"``."""
        layer = self.layer
        if layer is None:
            return self[:DIGEST_SIZE].hex()
        return f"{self[:DIGEST_SIZE].hex()}@L{layer}"

    @classmethod
    def from_str(cls, text: str) -> ChunkKey:
        """Parse the form written by :meth:`to_str` (and only that form).

        Raises:
            InvalidInputError: ``text`` is not exactly such a string (upper-case hex, signs,
                leading zeros in the layer or surrounding whitespace are refused, so that
                every key has one text form).
        """
        if not isinstance(text, str):
            raise InvalidInputError(f"ChunkKey text must be a str, got {type(text).__name__}")
        match = _KEY_TEXT.fullmatch(text)
        if match is None:
            raise InvalidInputError(
                f"not a chunk key: {text!r:.80} (expected {_KEY_HEX} lowercase hex chars, "
                "optionally followed by '@L<layer>')"
            )
        layer = match.group(2)
        return cls(bytes.fromhex(match.group(1)), None if layer is None else int(layer))

    def with_layer(self, layer: int) -> ChunkKey:
        """This key's digest for one layer.

        Raises:
            InvalidInputError: ``layer`` is not a non-negative int.
        """
        return ChunkKey(self.digest, layer)

    def __str__(self) -> str:
        return self.to_str()

    def __repr__(self) -> str:
        return f"ChunkKey({self.to_str()!r})"


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk of a request: tokens ``[start, end)``, its key and its parent's key.

    ``parent`` is the key of the previous chunk in the chain (``None`` for the first chunk,
    and for segment keys, which have no chain).

    Raises:
        InvalidInputError: the range is empty or negative, or the keys are not ChunkKeys.
    """

    start: int
    end: int
    key: ChunkKey
    parent: ChunkKey | None

    def __post_init__(self) -> None:
        if not (
            is_strict_int(self.start) and is_strict_int(self.end) and 0 <= self.start < self.end
        ):
            raise InvalidInputError(
                f"ChunkSpan needs ints 0 <= start < end, got [{self.start!r}, {self.end!r})"
            )
        if not isinstance(self.key, ChunkKey):
            raise InvalidInputError(f"ChunkSpan key must be a ChunkKey, got {self.key!r:.80}")
        if self.parent is not None and not isinstance(self.parent, ChunkKey):
            raise InvalidInputError(
                f"ChunkSpan parent must be a ChunkKey or None, got {self.parent!r:.80}"
            )

    @property
    def num_tokens(self) -> int:
        """``end - start``."""
        return self.end - self.start


# Spans are built in bulk from digests that are valid by construction. The dataclass
# __init__ of a frozen class costs about as much as hashing the chunk, so the hot path
# fills the slots directly instead.
_new_object = object.__new__
_set_span_start: Final = ChunkSpan.__dict__["start"].__set__
_set_span_end: Final = ChunkSpan.__dict__["end"].__set__
_set_span_key: Final = ChunkSpan.__dict__["key"].__set__
_set_span_parent: Final = ChunkSpan.__dict__["parent"].__set__


def _new_key(digest: bytes) -> ChunkKey:
    return bytes.__new__(ChunkKey, digest)


def _new_span(start: int, end: int, key: ChunkKey, parent: ChunkKey | None) -> ChunkSpan:
    span: ChunkSpan = _new_object(ChunkSpan)
    _set_span_start(span, start)
    _set_span_end(span, end)
    _set_span_key(span, key)
    _set_span_parent(span, parent)
    return span


def _encode_field(name: str, value: str | None) -> bytes:
    if value is None:
        return _NONE_TAG
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"Namespace {name} is not valid unicode: {exc}") from None
    return _STR_TAG + len(data).to_bytes(8, "little") + data


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a key is bound to: keys from different namespaces never collide.

    ``layout_fingerprint`` describes the KV layout (dtype, layers, heads, head size, format,
    TP world size and rank); ``revision`` fingerprints the weights; ``tenant_salt`` keeps
    tenants' caches apart.

    Raises:
        InvalidInputError: ``model_name`` or ``layout_fingerprint`` is not a non-empty str,
            ``revision`` or ``tenant_salt`` is neither None nor a str, or a field cannot be
            encoded as UTF-8.
    """

    model_name: str
    layout_fingerprint: str
    revision: str | None = None
    tenant_salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("model_name", "layout_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidInputError(f"Namespace {name} must be a non-empty str, got {value!r}")
        if self.revision is not None and not isinstance(self.revision, str):
            raise InvalidInputError(
                f"Namespace revision must be None or a str, got {self.revision!r}"
            )
        check_tenant(self.tenant_salt, field="Namespace tenant_salt")
        self._encode()

    @property
    def tag(self) -> bytes:
        """The tenant tag every key of this namespace starts with."""
        return tenant_tag(self.tenant_salt)

    def with_tenant(self, tenant: str | None) -> Namespace:
        """This namespace for another tenant (``tenant_salt``).

        Raises:
            InvalidInputError: ``tenant`` is not a valid tenant name.
        """
        if tenant == self.tenant_salt:
            return self
        return Namespace(self.model_name, self.layout_fingerprint, self.revision, tenant)

    def _encode(self) -> bytes:
        """Unambiguous encoding: a domain tag, then each field tagged and length-prefixed."""
        return _NAMESPACE_DOMAIN + b"".join(
            (
                _encode_field("model_name", self.model_name),
                _encode_field("layout_fingerprint", self.layout_fingerprint),
                _encode_field("revision", self.revision),
                _encode_field("tenant_salt", self.tenant_salt),
            )
        )

    def seed(self, algorithm: HashAlgorithm = HashAlgorithm.BLAKE3) -> bytes:
        """``h_0``: :data:`LINK_SIZE` bytes, the same in every process for equal fields.

        Raises:
            InvalidInputError: ``algorithm`` is not a :class:`HashAlgorithm` (or its value).
        """
        return hash_function(as_algorithm(algorithm))(self._encode())


def _build_spans(
    digests: list[bytes], first: int, num_tokens: int, chunk_size: int
) -> list[ChunkSpan]:
    """Spans for chunks ``first..len(digests)-1``; chunk ``k`` covers ``[k*cs, (k+1)*cs)``."""
    new, new_key = _new_object, bytes.__new__
    set_start, set_end, set_key, set_parent = (
        _set_span_start,
        _set_span_end,
        _set_span_key,
        _set_span_parent,
    )
    parent = _new_key(digests[first - 1]) if first else None
    spans: list[ChunkSpan] = []
    append = spans.append
    start = first * chunk_size
    for digest in digests[first:]:
        # _new_key and _new_span inlined: this loop runs once per chunk.
        key = new_key(ChunkKey, digest)
        end = min(start + chunk_size, num_tokens)
        span: ChunkSpan = new(ChunkSpan)
        set_start(span, start)
        set_end(span, end)
        set_key(span, key)
        set_parent(span, parent)
        append(span)
        parent = key
        start = end
    return spans


class ChunkHasher:
    """Cuts tokens into chunks of ``chunk_size`` and chains their hashes.

    ``h_0 = namespace.seed(algorithm)``, ``h_i = H(tokens_i || h_{i-1})`` with ``tokens_i``
    as little-endian int32, so the key of a chunk depends on every token before it and keys
    of a prefix are the first keys of any longer sequence. Safe to share between threads.

    ``memo_size`` > 0 remembers the digests of that many recent prompts of at least
    ``memo_min_tokens`` tokens (``memo_max_bytes`` of tokens and digests in all), so asking
    again about the same long prompt (lookup, then retrieve, then store) costs a
    comparison instead of a re-hash.

    Raises:
        InvalidInputError: ``chunk_size`` is not a positive int, ``namespace`` is not a
            :class:`Namespace`, or ``algorithm`` is unknown.
    """

    __slots__ = (
        "_algorithm",
        "_chain",
        "_chunk_size",
        "_hash",
        "_memo",
        "_namespace",
        "_seed",
        "_tag",
    )

    def __init__(
        self,
        namespace: Namespace,
        *,
        chunk_size: int,
        algorithm: HashAlgorithm = HashAlgorithm.BLAKE3,
        memo_size: int = 0,
        memo_min_tokens: int = 4096,
        memo_max_bytes: int = 64 << 20,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(f"namespace must be a Namespace, got {namespace!r:.80}")
        if not is_strict_int(chunk_size) or chunk_size <= 0:
            raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self._algorithm = as_algorithm(algorithm)
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._seed = namespace.seed(self._algorithm)
        self._tag = namespace.tag
        self._hash = hash_function(self._algorithm)
        self._chain = chain_function(self._algorithm)
        if not is_strict_int(memo_size) or memo_size < 0:
            raise InvalidInputError(f"memo_size must be an int >= 0, got {memo_size!r}")
        self._memo = TokenMemo(memo_size, memo_min_tokens, memo_max_bytes) if memo_size else None

    def remembered(self, tokens: Tokens) -> list[bytes] | None:
        """The digests of ``tokens`` if the memo holds them, else None (see :meth:`probe`).

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        return self.probe(tokens).digests

    def probe(self, tokens: Tokens) -> DigestProbe:
        """Look for the digests of ``tokens`` in the memo. Cheap for tensors and arrays (no
        hashing), and for a list that is, or is a copy of, a remembered list (other lists
        are not compared: see :mod:`lmcache_async.keys.digest_memo`). Bytes equal to a
        remembered prompt's are valid tokens, and so are the items of a list equal to a
        remembered one; others may be checked only by the hashing that follows a miss,
        which takes the probe (:meth:`digests`) so as to do nothing twice.

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        memo = self._memo
        return DigestProbe(None) if memo is None else memo.probe(tokens)

    def guess(self, tokens: Tokens) -> DigestGuess | None:
        """The digests the memo holds for what are most likely ``tokens``, found without
        reading them: the same tensor object, lying where it did when it was last probed,
        or a list as long as a remembered one that starts with its very objects and has
        its middle and last items. None when there is nothing to go on.

        A guess is not a hit: the tokens may have changed in place since. A caller may
        start work with its digests (send a lookup), must compare with
        :meth:`DigestGuess.confirm`, and may use that work only when it confirms; else it
        asks :meth:`probe` or :meth:`digests`.
        """
        memo = self._memo
        return None if memo is None else memo.guess(tokens)

    def _all_digests(self, data: memoryview) -> list[bytes]:
        """Digests of every chunk of ``data`` (token bytes), from the memo when it has them."""
        memo = self._memo
        if memo is None:
            return self._keys_of(data)
        digests, entries = memo.recall_int32(data)
        return digests if digests is not None else self._remember(data, entries)

    def _remember(self, data: memoryview, entries: Sequence[tuple[MemoKey, bytes]]) -> list[bytes]:
        """Hash ``data`` (int32 token bytes) and remember the digests under ``entries``."""
        digests = self._keys_of(data)
        if self._memo is not None:
            self._memo.remember(entries, digests)
        return digests

    def _keys_of(self, data: memoryview) -> list[bytes]:
        """The tagged key digests of every chunk of ``data`` (int32 token bytes)."""
        return self._chain(self._seed, data, self._chunk_size * TOKEN_BYTES, self._tag)

    @property
    def tag(self) -> bytes:
        """The tenant tag every key of this hasher starts with."""
        return self._tag

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (only the last chunk of a sequence may be shorter)."""
        return self._chunk_size

    @property
    def algorithm(self) -> HashAlgorithm:
        """The hash ``H``."""
        return self._algorithm

    @property
    def namespace(self) -> Namespace:
        """The namespace bound into every key through the seed."""
        return self._namespace

    @property
    def seed(self) -> bytes:
        """``h_0``: the namespace's seed under this hasher's algorithm. Two hashers with
        the same seed, chunk size and algorithm give the same keys."""
        return self._seed

    def __repr__(self) -> str:
        return (
            f"ChunkHasher({self._namespace!r}, chunk_size={self._chunk_size}, "
            f"algorithm={self._algorithm.value!r})"
        )

    def digests(self, tokens: Tokens, *, probe: DigestProbe | None = None) -> list[bytes]:
        """The chained digests of every chunk of ``tokens`` (the last one may be short).

        ``probe``: what :meth:`probe` found for these same tokens, when the caller looked
        already; its conversion and memo look-ups are not done again.

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        if probe is None:
            probe = self.probe(tokens)
        if probe.digests is not None:
            return probe.digests
        if probe.list_key is not None and self._memo is not None:
            # The memo keeps a copy (the caller may change its list later), and the copy is
            # what is hashed, so the two agree whatever the caller does meanwhile.
            copy = list(tokens)
            digests = self._all_digests(token_bytes(copy)[0])
            self._memo.put_list(probe.list_key, copy, digests)
            return digests
        data = probe.data if probe.data is not None else token_bytes(tokens)[0]
        if not probe.entries:  # not probed (a list, a short prompt): the int32 memo only
            return self._all_digests(data)
        return self._remember(data, probe.entries)

    def spans(
        self,
        tokens: Tokens,
        *,
        mask: torch.Tensor | None = None,
        save_unfull_chunk: bool = True,
    ) -> list[ChunkSpan]:
        """One span per chunk at or after the mask's start.

        Chunks before the mask start are hashed (the chain needs them) but not returned;
        the trailing short chunk is dropped when ``save_unfull_chunk`` is False.

        Raises:
            InvalidInputError: ``tokens`` or ``mask`` are invalid (see :func:`token_array`,
                :func:`check_mask`).
        """
        return self.array_spans(token_array(tokens), mask=mask, save_unfull_chunk=save_unfull_chunk)

    def array_spans(
        self,
        tokens: npt.NDArray[np.int32],
        *,
        mask: torch.Tensor | None = None,
        save_unfull_chunk: bool = True,
    ) -> list[ChunkSpan]:
        """:meth:`spans` of tokens already converted by :func:`token_array` (they are not
        checked again).

        Raises:
            InvalidInputError: ``mask`` is invalid (see :func:`check_mask`).
        """
        data, num_tokens = tokens.data.cast("B"), len(tokens)
        chunk_size = self._chunk_size
        start = check_mask(mask, num_tokens, chunk_size)
        num_chunks = -(-num_tokens // chunk_size) if save_unfull_chunk else num_tokens // chunk_size
        first = start // chunk_size
        if start >= num_tokens or first >= num_chunks:
            return []
        digests = self._all_digests(data)[:num_chunks]
        return _build_spans(digests, first, num_tokens, chunk_size)

    def spans_from_hashes(
        self,
        hashes: Sequence[int | bytes],
        offsets: Sequence[int],
        *,
        mask: torch.Tensor | None = None,
        save_unfull_chunk: bool = True,
    ) -> list[ChunkSpan]:
        """Spans keyed from the serving engine's own block hashes instead of tokens.

        ``hashes[i]`` covers tokens ``[offsets[i-1], offsets[i])`` (``offsets`` are end
        offsets, strictly increasing and positive; ``offsets[-1]`` is the token count). Every
        block must hold exactly ``chunk_size`` tokens except the last (at most
        ``chunk_size``). Keys chain as ``h_i = H(enc(hashes[i]) || h_{i-1})`` where an int
        is encoded as a tag byte and 32 bytes little-endian signed, and bytes as a tag byte,
        an 8-byte length, the bytes and zeros up to a multiple of 4 (so that no block hash
        is encoded as long as a chunk of tokens). The mask, if any, has length
        ``offsets[-1]``.

        Raises:
            InvalidInputError: mismatched lengths, bad offsets, a block of the wrong size,
                a hash that is neither int nor bytes or does not fit, or a bad mask.
        """
        chunk_size = self._chunk_size
        encoded, num_tokens = encode_block_hashes(hashes, offsets, chunk_size)
        start = check_mask(mask, num_tokens, chunk_size)
        num_chunks = len(encoded)
        if not save_unfull_chunk and num_tokens % chunk_size:
            num_chunks -= 1
        first = start // chunk_size
        if start >= num_tokens or first >= num_chunks:
            return []
        hash_once = self._hash
        prev = self._seed
        digests: list[bytes] = []
        for item in encoded[:num_chunks]:
            prev = hash_once(item + prev)
            digests.append(prev)
        return _build_spans(with_tag(digests, self._tag), first, num_tokens, chunk_size)
