"""Chunk keys: prefix-chained hashes of token chunks.

Tokens are cut into chunks of ``chunk_size``; chunk ``i`` gets the key
``h_i = H(tokens_i || h_{i-1})`` where ``tokens_i`` are the chunk's tokens as little-endian
int32 and ``h_0`` is a seed that binds the :class:`Namespace` (model, weights revision, KV
layout, tenant). ``H`` is blake3 (default) or xxh3-128, both producing :data:`DIGEST_SIZE`
bytes: a real hash, never Python's ``hash()``, so every process and host computes the same
key for the same tokens.

The link ``h_{i-1}`` comes after the tokens so that hashing a chunk's tokens does not wait
for the key before it: the blake3 chain in C (:mod:`lmcache_async._native`, built with the
package when a C compiler is there) hashes the whole 1 KiB blocks of many chunks at once,
one per vector lane, then folds in the links in order. Without it the blake3 package
computes the same keys, chunk after chunk, about three times slower.

Segment keys for blending (:class:`~lmcache_async.segments.SegmentHasher`) live in
:mod:`lmcache_async.segments`; token input checks (:func:`token_array`, :func:`check_mask`)
live in :mod:`lmcache_async.tokens` and are re-exported here.
"""

from __future__ import annotations

import collections
import enum
import functools
import operator
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import blake3
import numpy as np
import numpy.typing as npt
import torch
import xxhash

from lmcache_async.errors import InvalidInputError
from lmcache_async.tokens import (
    TOKEN_BYTES,
    Tokens,
    check_mask,
    is_strict_int,
    token_array,
    token_bytes,
)

__all__ = [
    "DIGEST_SIZE",
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

DIGEST_SIZE: Final = 16
"""Size in bytes of every key digest, whatever the algorithm."""

_DIGEST_ITEM: Final = np.dtype(f"V{DIGEST_SIZE}")

_LAYER_BYTES: Final = 4
_MAX_LAYERS: Final = 1 << (8 * _LAYER_BYTES)

_HASH_INT_BYTES: Final = 32
_NAMESPACE_DOMAIN: Final = b"lmcache_async/namespace/v1\x00"
_NONE_TAG: Final = b"\x00"
_STR_TAG: Final = b"\x01"
_INT_HASH_TAG: Final = b"\x01"
_BYTES_HASH_TAG: Final = b"\x02"
_KEY_TEXT: Final = re.compile(r"([0-9a-f]{32})(?:@L(0|[1-9][0-9]*))?")


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
        _put(self._frames, self._capacity, fingerprint, (view.tobytes(), keys))
        return list(keys)

    def __len__(self) -> int:
        return len(self._frames)


class HashAlgorithm(enum.StrEnum):
    """The hash ``H`` used for seeds and chunk keys."""

    BLAKE3 = "blake3"
    XXH3_128 = "xxh3_128"


def _blake3(data: bytes) -> bytes:
    return blake3.blake3(data).digest(length=DIGEST_SIZE)


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _hash_function(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """One-shot ``H``: bytes in, :data:`DIGEST_SIZE` bytes out."""
    if algorithm is HashAlgorithm.BLAKE3:
        return _blake3
    return _xxh3_128


def _as_algorithm(algorithm: HashAlgorithm | str) -> HashAlgorithm:
    try:
        return HashAlgorithm(algorithm)
    except ValueError:
        choices = ", ".join(a.value for a in HashAlgorithm)
        raise InvalidInputError(
            f"unknown hash algorithm {algorithm!r}; expected one of {choices}"
        ) from None


class ChunkKey(bytes):
    """The key of one chunk: a :data:`DIGEST_SIZE`-byte digest, optionally for one layer.

    A key *is* its bytes: the digest, followed for a layer key by the layer number as 4
    little-endian bytes. It hashes and compares like those bytes, so a tier's index can be
    probed with a bare digest, with no key object built per chunk on the lookup path.
    Immutable. :meth:`to_str` is the one stable text form (32 lowercase hex characters,
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
        """The stable text form: ``"<32 hex chars>"`` or ``"<32 hex chars>@L<layer>"``."""
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
                f"not a chunk key: {text!r:.80} (expected 32 lowercase hex chars, "
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
        for name in ("revision", "tenant_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"Namespace {name} must be None or a str, got {value!r}")
        self._encode()

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
        """``h_0``: :data:`DIGEST_SIZE` bytes, the same in every process for equal fields.

        Raises:
            InvalidInputError: ``algorithm`` is not a :class:`HashAlgorithm` (or its value).
        """
        return _hash_function(_as_algorithm(algorithm))(self._encode())


def _chain_blake3_py(prev: bytes, data: memoryview, step: int) -> list[bytes]:
    """``h_i = blake3(data[(i-1)*step : i*step] || h_{i-1})`` with the blake3 package."""
    hasher = blake3.blake3()
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    out: list[bytes] = []
    append = out.append
    for offset in range(0, len(data), step):
        reset()
        update(data[offset : offset + step])
        update(prev)
        prev = digest(DIGEST_SIZE)
        append(prev)
    return out


_ChainFunction = Callable[[bytes, memoryview, int], list[bytes]]
_native_chain: _ChainFunction | None
try:
    from lmcache_async._native import blake3_chain as _native_chain
except ImportError:  # the package was built without a C compiler
    _native_chain = None

NATIVE_CHAIN: Final = _native_chain is not None
"""Whether blake3 keys are chained in C (see the module docstring)."""

_chain_blake3: Final[_ChainFunction] = (
    _native_chain if _native_chain is not None else _chain_blake3_py
)
"""``h_i = blake3(data[(i-1)*step : i*step] || h_{i-1})`` for every piece of ``data``."""


def _chain_xxh3(prev: bytes, data: memoryview, step: int) -> list[bytes]:
    """``h_i = xxh3_128(data[(i-1)*step : i*step] || h_{i-1})`` for every piece of ``data``."""
    xxh3, join = xxhash.xxh3_128_digest, b"".join
    out: list[bytes] = []
    append = out.append
    for offset in range(0, len(data), step):
        prev = xxh3(join((data[offset : offset + step], prev)))
        append(prev)
    return out


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


def _encode_block_hash(index: int, value: int | bytes) -> bytes:
    """A block hash as its chain link hashes it. Every encoding is one byte longer than a
    multiple of 4 (bytes are padded with zeros after their stated length) while a chunk
    of int32 tokens is a multiple of 4 long: a block hash and a chunk of tokens never feed
    ``H`` the same input, so they never share a key."""
    if isinstance(value, (bytes, bytearray)):
        padding = bytes(-len(value) % 4)
        return _BYTES_HASH_TAG + len(value).to_bytes(8, "little") + bytes(value) + padding
    if not is_strict_int(value):
        raise InvalidInputError(
            f"hashes[{index}] must be an int or bytes, got {type(value).__name__}"
        )
    try:
        return _INT_HASH_TAG + value.to_bytes(_HASH_INT_BYTES, "little", signed=True)
    except OverflowError:
        raise InvalidInputError(
            f"hashes[{index}] does not fit in {_HASH_INT_BYTES} signed bytes: {value}"
        ) from None


_MemoKey = tuple[str, int]
"""A memo entry's key: the form the tokens are in (a dtype, or a list), and a fast hash of
them."""

_INT32_TAG: Final = "<i4"  # the hashed form's dtype (see TOKEN_BYTES)
_LIST_TAG: Final = "list"
_MEMO_LISTS: Final = 8
"""Prompts a memo keeps as lists, at most (see :class:`_DigestMemo`)."""
_LIST_SAME_ITEMS: Final = 64
"""Leading items of a probed list that must be the very objects of the remembered copy
before the two are compared on the caller's thread (see :meth:`_DigestMemo.get_list`)."""


def _raw_tokens(tokens: Tokens) -> npt.NDArray[np.integer] | None:
    """A 1-D integer tensor or ndarray as an ndarray on the same memory (no conversion,
    no copy), or None for anything else (a list, a device tensor, strided memory)."""
    if isinstance(tokens, torch.Tensor):
        try:
            array = tokens.numpy()  # only a plain CPU tensor has a view as an ndarray
        except (TypeError, RuntimeError):
            return None
    elif isinstance(tokens, np.ndarray):
        array = tokens
    else:
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu" or not array.flags.c_contiguous:
        return None
    return array


class _ArrayInterface:
    """An object numpy can view through its ``__array_interface__`` (and keeps alive as
    the view's base): a view of memory that holds no reference to its owner."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, object]) -> None:
        self.__array_interface__ = interface


class _TensorView:
    """A probed tensor's token memory as an ndarray, and what the tensor was then; and
    the memo key its tokens had when last probed (see :meth:`ChunkHasher.guess`)."""

    __slots__ = ("array", "data", "dtype", "memo_key", "pointer", "ref", "shape", "stride")

    def __init__(self, tensor: torch.Tensor, array: npt.NDArray[np.integer]) -> None:
        self.dtype = tensor.dtype
        self.ref = weakref.ref(tensor)
        self.array = np.asarray(_ArrayInterface(array.__array_interface__))
        self.data = self.array.data.cast("B")  # the same memory as bytes
        self.pointer = tensor.data_ptr()
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.memo_key: _MemoKey | None = None

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the viewed tensor, alive, and still lies where it did."""
        return (
            self.ref() is tensor
            and tensor.dtype is self.dtype
            and tensor.is_cpu
            and tensor.data_ptr() == self.pointer
            and tensor.shape == self.shape
            and tensor.stride() == self.stride
        )


class _TensorViews:
    """Views of the token memory of recently probed CPU tensors, by tensor.

    ``Tensor.numpy()`` costs 15-20 µs more than checking a remembered view when torch's
    code is out of the CPU's caches, as it is between a serving engine's requests, and one
    prompt tensor is often asked about again (a lookup, then its retrieve, then its store).
    A view is used again only while its tensor lies where it did: the same object, still
    alive, on the CPU, with the same dtype, data pointer, shape and strides. A view holds
    no reference to the tensor and is read only while the caller holds the tensor; the
    entry of a collected tensor is never used again, and goes as the oldest does.
    """

    __slots__ = ("_capacity", "_lock", "_views")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._views: dict[int, _TensorView] = {}
        self._lock = threading.Lock()

    def known(self, tensor: torch.Tensor) -> _TensorView | None:
        """``tensor``'s view if one was made and the tensor still lies where it did."""
        entry = self._views.get(id(tensor))
        return entry if entry is not None and entry.fits(tensor) else None

    def view(self, tensor: torch.Tensor) -> _TensorView | None:
        """``tensor``'s view (made now if needed): its tokens as a 1-D integer ndarray on
        its memory; None when they are not that (see :func:`_raw_tokens`)."""
        entry = self.known(tensor)
        if entry is not None:
            return entry
        array = _raw_tokens(tensor)
        if array is None:
            return None
        key = id(tensor)
        entry = _TensorView(tensor, array)
        with self._lock:  # other threads probe too
            self._views.pop(key, None)
            while len(self._views) >= self._capacity:
                del self._views[next(iter(self._views))]  # the oldest
            self._views[key] = entry
        return entry


_Entry = TypeVar("_Entry")
_Key = TypeVar("_Key")


class _DigestMemo:
    """The chained digests of recently hashed long prompts.

    A serving engine asks about the same prompt several times (a lookup from the
    scheduler, a retrieve, a store after prefill), and hashing a long prompt costs far more
    than recognising it. An entry is found by a fast hash of the token bytes and used only
    if the stored bytes are equal to the new ones, so a hit is exact by construction.
    A prompt that came as, say, int64 is also remembered in that form, so asking again
    with the same tensor spares its conversion to int32 as well. One that came as a list
    is remembered as a copy of the list, in a table of its own: a list holds 8 bytes a
    token and keeps its int objects alive, several times the bytes of the other forms, so
    fewer of them are kept (``list_capacity``).
    """

    __slots__ = ("_capacity", "_entries", "_list_capacity", "_lists", "_lock")

    def __init__(self, capacity: int, list_capacity: int) -> None:
        self._capacity = capacity
        self._list_capacity = list_capacity
        self._entries: collections.OrderedDict[_MemoKey, tuple[bytes, list[bytes]]] = (
            collections.OrderedDict()
        )
        self._lists: collections.OrderedDict[_MemoKey, tuple[list[int], list[bytes]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # digests() may run on worker threads too

    def get(self, fingerprint: _MemoKey, data: bytes | memoryview) -> list[bytes] | None:
        """The digests remembered for ``data`` (bytes, or a view of bytes: compared in
        place, one memcmp, where ``==`` on a view goes item by item)."""
        entry = self.peek(fingerprint)
        if entry is None or not self.confirm(fingerprint, entry, data):
            return None
        return list(entry[1])

    def peek(self, fingerprint: _MemoKey) -> tuple[bytes, list[bytes]] | None:
        """The entry under ``fingerprint``, not compared with anything (nor made newest).
        An entry is never changed: it may be read outside the lock."""
        with self._lock:
            return self._entries.get(fingerprint)

    def confirm(
        self, fingerprint: _MemoKey, entry: tuple[bytes, list[bytes]], data: bytes | memoryview
    ) -> bool:
        """Whether ``data`` equals the bytes of ``entry`` (from :meth:`peek`); if so, the
        entry becomes the newest."""
        if len(entry[0]) != len(data) or not entry[0].startswith(data):
            return False
        with self._lock:
            if self._entries.get(fingerprint) is entry:
                self._entries.move_to_end(fingerprint)
        return True

    def put(self, fingerprint: _MemoKey, data: bytes, digests: list[bytes]) -> None:
        with self._lock:
            _put(self._entries, self._capacity, fingerprint, (data, list(digests)))

    def get_list(self, fingerprint: _MemoKey, tokens: list[int]) -> list[bytes] | None:
        """The digests remembered for a list equal to ``tokens``.

        The remembered copy holds the objects of the list it was made from, so the same
        list, or a copy of it, compares equal by identity, item after item, in about a
        microsecond per thousand tokens. A list of equal values in other int objects
        (built anew, say by ``tolist()``) compares value by value, ten times slower:
        unless its first items are the copy's very objects it is not compared here, and
        is left to the hashing (which converts it and finds its int32 form remembered).
        """
        entry = self.peek_list(fingerprint, tokens)
        if entry is None or not self.confirm_list(fingerprint, entry, tokens):
            return None
        return list(entry[1])

    def peek_list(
        self, fingerprint: _MemoKey, tokens: list[int]
    ) -> tuple[list[int], list[bytes]] | None:
        """The list entry under ``fingerprint`` if its copy is as long as ``tokens`` and
        starts with the very objects ``tokens`` does (see :meth:`get_list`); the rest is
        not compared. An entry is never changed: it may be read outside the lock."""
        with self._lock:
            entry = self._lists.get(fingerprint)
        if entry is None:
            return None
        stored, head = entry[0], _LIST_SAME_ITEMS
        if len(stored) != len(tokens) or not all(map(operator.is_, tokens[:head], stored[:head])):
            return None
        return entry

    def confirm_list(
        self, fingerprint: _MemoKey, entry: tuple[list[int], list[bytes]], tokens: list[int]
    ) -> bool:
        """Whether ``tokens`` equal the copy of ``entry`` (from :meth:`peek_list`); if so,
        the entry becomes the newest."""
        if tokens != entry[0]:
            return False
        with self._lock:
            if self._lists.get(fingerprint) is entry:
                self._lists.move_to_end(fingerprint)
        return True

    def put_list(self, fingerprint: _MemoKey, copy: list[int], digests: list[bytes]) -> None:
        with self._lock:
            _put(self._lists, self._list_capacity, fingerprint, (copy, list(digests)))


def _put(
    table: collections.OrderedDict[_Key, _Entry], capacity: int, key: _Key, value: _Entry
) -> None:
    """Put ``value`` in an LRU ``table`` as its newest entry, the oldest going beyond
    ``capacity``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)


@dataclass(frozen=True, slots=True)
class DigestProbe:
    """What :meth:`ChunkHasher.probe` found: the remembered digests, or None; on a miss,
    what the hashing that follows reuses (the int32 token bytes when they were converted,
    and the memo entries to fill)."""

    digests: list[bytes] | None
    data: memoryview | None = None
    entries: tuple[tuple[_MemoKey, bytes], ...] = ()
    list_key: _MemoKey | None = None
    """A list's memo key, when the list is long enough to be remembered."""


class DigestGuess:
    """What :meth:`ChunkHasher.guess` found: the digests of ``num_tokens`` tokens that are
    most likely the ones asked about (the memo's own: read them, never change them), and
    the exact comparison that tells."""

    __slots__ = ("_compare", "digests", "num_tokens")

    def __init__(
        self, digests: Sequence[bytes], num_tokens: int, compare: Callable[[], bool]
    ) -> None:
        self.digests = digests
        self.num_tokens = num_tokens
        self._compare = compare

    def confirm(self) -> bool:
        """Whether the tokens now equal those the digests were made of: read in full and
        compared with the remembered copy (about 10 µs for 32k tokens)."""
        return self._compare()


class ChunkHasher:
    """Cuts tokens into chunks of ``chunk_size`` and chains their hashes.

    ``h_0 = namespace.seed(algorithm)``, ``h_i = H(tokens_i || h_{i-1})`` with ``tokens_i``
    as little-endian int32, so the key of a chunk depends on every token before it and keys
    of a prefix are the first keys of any longer sequence. Safe to share between threads.

    ``memo_size`` > 0 remembers the digests of that many recent prompts of at least
    ``memo_min_tokens`` tokens, so asking again about the same long prompt (lookup, then
    retrieve, then store) costs a comparison instead of a re-hash.

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
        "_memo_min_bytes",
        "_namespace",
        "_seed",
        "_tensor_views",
    )

    def __init__(
        self,
        namespace: Namespace,
        *,
        chunk_size: int,
        algorithm: HashAlgorithm = HashAlgorithm.BLAKE3,
        memo_size: int = 0,
        memo_min_tokens: int = 4096,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(f"namespace must be a Namespace, got {namespace!r:.80}")
        if not is_strict_int(chunk_size) or chunk_size <= 0:
            raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self._algorithm = _as_algorithm(algorithm)
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._seed = namespace.seed(self._algorithm)
        self._hash = _hash_function(self._algorithm)
        self._chain = _chain_blake3 if self._algorithm is HashAlgorithm.BLAKE3 else _chain_xxh3
        if not is_strict_int(memo_size) or memo_size < 0:
            raise InvalidInputError(f"memo_size must be an int >= 0, got {memo_size!r}")
        # Two entries a prompt at most: its int32 form and the form it came in.
        self._memo = _DigestMemo(2 * memo_size, min(memo_size, _MEMO_LISTS)) if memo_size else None
        self._memo_min_bytes = memo_min_tokens * TOKEN_BYTES
        self._tensor_views = _TensorViews(memo_size) if memo_size else None

    def remembered(self, tokens: Tokens) -> list[bytes] | None:
        """The digests of ``tokens`` if the memo holds them, else None (see :meth:`probe`).

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        return self.probe(tokens).digests

    def probe(self, tokens: Tokens) -> DigestProbe:
        """Look for the digests of ``tokens`` in the memo. Cheap for tensors and arrays (no
        hashing), and for a list that is, or is a copy of, a remembered list (other lists
        are not compared: see :meth:`_DigestMemo.get_list`). Bytes equal to a remembered
        prompt's are valid tokens, and so are the items of a list equal to a remembered
        one; others may be checked only by the hashing that follows a miss, which takes
        the probe (:meth:`digests`) so as to do nothing twice.

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        memo = self._memo
        if memo is None:
            return DigestProbe(None)
        if type(tokens) is list:
            return self._probe_list(memo, tokens)
        seen: _TensorView | None = None
        if isinstance(tokens, torch.Tensor) and self._tensor_views is not None:
            seen = self._tensor_views.view(tokens)
            array = None if seen is None else seen.array
        elif isinstance(tokens, np.ndarray):
            array = _raw_tokens(tokens)
        else:
            return DigestProbe(None)
        if array is None:  # a device tensor or strided memory: converted (and checked) first
            data, _ = token_bytes(tokens)
            digests, entries = self._recall_int32(data)
            return DigestProbe(digests, data, entries)
        if len(array) * TOKEN_BYTES < self._memo_min_bytes:
            return DigestProbe(None)
        # Only bytes that are equal to a remembered prompt's (which passed the checks of
        # token_array) are used, so a hit needs neither the conversion nor the checks.
        view = array.data.cast("B") if seen is None else seen.data
        tag = array.dtype.str
        key = (tag, xxhash.xxh3_64_intdigest(view))
        if seen is not None:
            seen.memo_key = key  # what the tensor is guessed to hold when asked again
        digests = memo.get(key, view)
        if digests is not None:
            return DigestProbe(digests)
        raw = (key, view.tobytes())  # what a miss remembers: copied only then
        if tag == _INT32_TAG:
            return DigestProbe(None, None, (raw,))  # an int32 form is the hashed form
        data, _ = token_bytes(tokens)
        digests, entries = self._recall_int32(data)
        if digests is not None:
            memo.put(*raw, digests)
        return DigestProbe(digests, data, (raw, *entries))

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
        if memo is None:
            return None
        if type(tokens) is list:
            key = self._list_key(tokens)
            copied = None if key is None else memo.peek_list(key, tokens)
            if key is None or copied is None:
                return None
            compare = functools.partial(memo.confirm_list, key, copied, tokens)
            return DigestGuess(copied[1], len(tokens), compare)
        if not isinstance(tokens, torch.Tensor) or self._tensor_views is None:
            return None
        seen = self._tensor_views.known(tokens)
        key = None if seen is None else seen.memo_key
        entry = None if key is None else memo.peek(key)
        if seen is None or key is None or entry is None:
            return None
        compare = functools.partial(memo.confirm, key, entry, seen.data)
        return DigestGuess(entry[1], len(seen.array), compare)

    def _list_key(self, tokens: list[int]) -> _MemoKey | None:
        """A list's memo key (its length and three items), or None when it is too short to
        be remembered or an item cannot be hashed (invalid: the conversion refuses it)."""
        count = len(tokens)
        if not count or count * TOKEN_BYTES < self._memo_min_bytes:
            return None
        try:
            return (_LIST_TAG, hash((count, tokens[0], tokens[count >> 1], tokens[-1])))
        except TypeError:
            return None

    def _probe_list(self, memo: _DigestMemo, tokens: list[int]) -> DigestProbe:
        """:meth:`probe` for a list: found by its length and three items, then compared."""
        key = self._list_key(tokens)
        if key is None:
            return DigestProbe(None)
        digests = memo.get_list(key, tokens)
        return DigestProbe(digests, list_key=None if digests is not None else key)

    def _recall_int32(
        self, data: memoryview
    ) -> tuple[list[bytes] | None, tuple[tuple[_MemoKey, bytes], ...]]:
        """The memo's digests of int32 token bytes (compared in place), or None and the
        entry a miss fills, its bytes copied only then (none when the memo takes none)."""
        memo = self._memo
        if memo is None or len(data) < self._memo_min_bytes:
            return None, ()
        key = (_INT32_TAG, xxhash.xxh3_64_intdigest(data))
        digests = memo.get(key, data)
        if digests is not None:
            return digests, ()
        return None, ((key, data.tobytes()),)

    def _all_digests(self, data: memoryview) -> list[bytes]:
        """Digests of every chunk of ``data`` (token bytes), from the memo when it has them."""
        digests, entries = self._recall_int32(data)
        return digests if digests is not None else self._remember(data, entries)

    def _remember(self, data: memoryview, entries: Sequence[tuple[_MemoKey, bytes]]) -> list[bytes]:
        """Hash ``data`` (int32 token bytes) and remember the digests under ``entries``."""
        digests = self._chain(self._seed, data, self._chunk_size * TOKEN_BYTES)
        if self._memo is not None:
            for key, content in entries:
                self._memo.put(key, content, digests)
        return digests

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
        for name, value in (("hashes", hashes), ("offsets", offsets)):
            if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
                raise InvalidInputError(f"{name} must be a sequence, got {type(value).__name__}")
        if len(hashes) != len(offsets):
            raise InvalidInputError(
                f"got {len(hashes)} hashes but {len(offsets)} offsets; they must match"
            )
        chunk_size = self._chunk_size
        count = len(offsets)
        previous = 0
        for index, end in enumerate(offsets):
            if not is_strict_int(end):
                raise InvalidInputError(
                    f"offsets[{index}] must be an int, got {type(end).__name__}"
                )
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
        encoded = [_encode_block_hash(i, h) for i, h in enumerate(hashes)]
        num_tokens = previous
        start = check_mask(mask, num_tokens, chunk_size)
        num_chunks = count
        if not save_unfull_chunk and num_tokens % chunk_size:
            num_chunks -= 1
        first = start // chunk_size
        if start >= num_tokens or first >= num_chunks:
            return []
        hash_function = self._hash
        prev = self._seed
        digests: list[bytes] = []
        for item in encoded[:num_chunks]:
            prev = hash_function(item + prev)
            digests.append(prev)
        return _build_spans(digests, first, num_tokens, chunk_size)
