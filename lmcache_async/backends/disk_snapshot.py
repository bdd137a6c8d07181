"""The body of the disk tier manifest's snapshot: the index as fixed-width columns, read in
one go.

A snapshot names every indexed key, least recently used first, with its file's size and
its payload's shape (a number in a table of the distinct shapes). The columns are arrays
of fixed-width little-endian numbers and the keys one run of bytes, so that an open reads
200k entries in a few ``numpy`` calls instead of one object at a time; the checks
(lengths, ranges, no key twice) are vectorised too. Layout of the body (each section
padded with zeros to a multiple of 8 bytes; the framing before it, with its checksum, is
:mod:`.disk_manifest`'s):

========  ======================  ==============================================
section   bytes                   holds
========  ======================  ==============================================
head      :data:`_HEAD`           snapshot id, names sum, rows, key width (0: the
                                  keys differ in length), shapes, dimensions, the
                                  identity's length
identity  identity length         the layout and cipher key it was written for
ranks     shapes x u32            each shape's number of dimensions
dims      dimensions x i64        the shapes' dimensions, one shape after another
sizes     rows x u64              each key's file size
numbers   rows x u32              each key's shape number
lengths   rows x u16              each key's length (only when the width is 0)
keys      rows x width            the keys, one after another
========  ======================  ==============================================

Anything that does not add up (a length, a range, a key twice, bytes left over) raises
:class:`ValueError`: the snapshot is then ignored and the index built from the headers.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

__all__ = ["ManifestState", "decode_snapshot", "encode_snapshot"]

_HEAD: Final = struct.Struct("<8sQQIIII")
"""Snapshot id, names sum, rows, key width, shapes, dimensions, identity length."""
_MAX_KEY: Final = 1024
"""Longest key a snapshot holds (a chunk key is 32 or 36 bytes)."""
_MAX_SHAPES: Final = 1 << 20
"""Most distinct shapes a snapshot holds (as many as the index can number)."""
_FIBONACCI: Final = np.uint64(0x9E3779B97F4A7C15)


@dataclass(slots=True)
class ManifestState:
    """What a manifest says the directory held, least recently used first: ``keys[i]``'s
    file has ``sizes[i]`` bytes and the shape ``shapes[numbers[i]]``."""

    keys: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    snapshot_id: bytes = b""
    names_sum: int = 0
    """:func:`~.disk_manifest.names_sum` of the keys' file names."""
    log_length: int = 0
    """Bytes of the log that continue this snapshot (0: no such log)."""
    log_keys: int = 0
    """Keys named by those log records."""


def encode_snapshot(
    identity: str,
    snapshot_id: bytes,
    names_sum: int,
    *,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    numbers: Sequence[int],
    shapes: Sequence[tuple[int, ...]],
) -> bytes:
    """The body of a snapshot of these entries (see the module doc).

    Raises:
        ValueError: the columns differ in length, or a key, size, number or dimension is
            out of the format's range.
    """
    rows = len(keys)
    if not rows == len(sizes) == len(numbers):
        raise ValueError("snapshot columns differ in length")
    widths = set(map(len, keys))
    width = widths.pop() if len(widths) == 1 else 0
    if (widths and (min(widths) < 1 or max(widths) > _MAX_KEY)) or not 0 <= width <= _MAX_KEY:
        raise ValueError("snapshot keys out of range")
    name = identity.encode()
    ranks = [len(shape) for shape in shapes]
    parts = [
        _HEAD.pack(snapshot_id, names_sum, rows, width, len(shapes), sum(ranks), len(name)),
        _padded(name),
        _padded(np.array(ranks, dtype="<u4").tobytes()),
        np.array([dim for shape in shapes for dim in shape], dtype="<i8").tobytes(),
        np.array(sizes, dtype="<u8").tobytes(),
        _padded(np.array(numbers, dtype="<u4").tobytes()),
    ]
    if width == 0:
        parts.append(_padded(np.array([len(key) for key in keys], dtype="<u2").tobytes()))
    parts.append(_padded(b"".join(keys)))
    return b"".join(parts)


def decode_snapshot(body: bytes | memoryview, identity: str) -> ManifestState | None:
    """The entries of a snapshot body (checksum already checked); None if it was written
    for another identity (layout or cipher key).

    Raises:
        ValueError: the body is malformed (see the module doc).
    """
    if len(body) < _HEAD.size:
        raise ValueError("snapshot head is truncated")
    snapshot_id, names_sum, rows, width, nshapes, ndims, name_length = _HEAD.unpack_from(body)
    if width > _MAX_KEY or nshapes > _MAX_SHAPES or name_length > len(body):
        raise ValueError("snapshot head out of range")
    reader = _Reader(body, _HEAD.size)
    if reader.take(name_length, "u1").tobytes() != identity.encode():
        return None
    ranks = reader.take(nshapes, "<u4")
    dims = reader.take(ndims, "<i8")
    if int(ranks.sum(dtype=np.uint64)) != ndims or (ndims and int(dims.min()) < 0):
        raise ValueError("snapshot shapes malformed")
    sizes = reader.take(rows, "<u8")
    numbers = reader.take(rows, "<u4")
    if rows and int(numbers.max()) >= nshapes:
        raise ValueError("snapshot shape numbers out of range")
    keys = _keys(reader, rows, width)
    if reader.offset != len(body):
        raise ValueError("snapshot has bytes after its keys")
    dim_list = dims.tolist()
    ends = np.cumsum(ranks, dtype=np.int64).tolist()
    shapes = [
        tuple(dim_list[end - rank : end]) for end, rank in zip(ends, ranks.tolist(), strict=True)
    ]
    return ManifestState(keys, _ints(sizes), _ints(numbers), shapes, snapshot_id, names_sum)


class _Reader:
    """Consecutive arrays of a body, each padded to 8 bytes."""

    __slots__ = ("body", "offset")

    def __init__(self, body: bytes | memoryview, offset: int) -> None:
        self.body = body
        self.offset = offset

    def take(self, count: int, dtype: Any) -> np.ndarray[Any, Any]:
        """The next ``count`` items of ``dtype``.

        Raises:
            ValueError: the body ends before them.
        """
        dtype = np.dtype(dtype)
        end = self.offset + count * dtype.itemsize
        if end > len(self.body):
            raise ValueError("snapshot is truncated")
        out = np.frombuffer(self.body, dtype=dtype, count=count, offset=self.offset)
        self.offset = end + -end % 8
        return out


def _keys(reader: _Reader, rows: int, width: int) -> list[bytes]:
    """The key column, checked: every key once.

    Raises:
        ValueError: truncated, a length out of range, or a key twice.
    """
    if width:
        keys_array = reader.take(rows, f"V{width}")
        keys: list[bytes] = keys_array.tolist()
        if rows < 2:
            return keys
        if width % 8:  # a layer key's 36 bytes: padded with zeros to whole words
            padded = np.zeros((rows, width + -width % 8), dtype=np.uint8)
            padded[:, :width] = np.frombuffer(keys_array, dtype=np.uint8).reshape(rows, width)
            _check_distinct_words(keys, padded.view("<u8"), rows)
        else:
            _check_distinct_words(keys, np.frombuffer(keys_array, dtype="<u8"), rows)
        return keys
    lengths = reader.take(rows, "<u2")
    if rows and int(lengths.min()) < 1:
        raise ValueError("snapshot key lengths out of range")
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if rows else 0
    blob = reader.take(total, "u1").tobytes()
    starts = (ends - lengths).tolist()
    keys = [blob[start:end] for start, end in zip(starts, ends.tolist(), strict=True)]
    _check_distinct(keys)
    return keys


def _check_distinct_words(keys: list[bytes], words: np.ndarray[Any, Any], rows: int) -> None:
    """:func:`_check_distinct` of keys whose bytes are ``words`` (8-byte words, a whole
    number per key), hashed into buckets first: only the keys that share a bucket with
    another (about a tenth of them) are compared whole.

    Raises:
        ValueError: a key twice.
    """
    bits = min(max(rows.bit_length() + 3, 10), 24)
    # A key folded into one word (its words xor-ed: the tenant's tag is shared, the rest
    # differs), then spread over 2**bits buckets (Fibonacci hashing).
    folds = np.bitwise_xor.reduce(words.reshape(rows, -1), axis=1)
    buckets = ((folds * _FIBONACCI) >> np.uint64(64 - bits)).astype(np.intp)
    shared = np.bincount(buckets, minlength=1 << bits)[buckets] > 1
    _check_distinct([keys[i] for i in np.flatnonzero(shared).tolist()])


def _check_distinct(keys: list[bytes]) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError("snapshot names a key twice")


def _ints(column: np.ndarray[Any, Any]) -> list[int]:
    """A column as a list of ints; one shared int when they are all equal (full chunks of
    one codec: one size, one shape)."""
    if column.size and bool((column == column[0]).all()):
        return [int(column[0])] * column.size
    out: list[int] = column.tolist()
    return out


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 8)
