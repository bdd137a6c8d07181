"""The self-describing chunk record that slow tiers store: a header, then the payload.

A record is ``prefix ‖ header ‖ payload``:

* ``prefix`` (14 bytes, little-endian): magic ``b"LMCA"``, format version (u16), header
  length (u32), xxh32 of the header bytes (u32);
* ``header``: a msgpack map with the chunk key, the layout fingerprint, payload format,
  shape, dtype, codec, stored payload length and the xxh3-64 checksum of the stored payload;
* ``payload``: the chunk's tensor bytes, encoded by the codec (``none`` = the bytes as is).

The disk tier writes one record per file and the Redis tier one record per value, so a
reader always sees a whole record or none. :meth:`RecordSpec.parse` checks every field
against what the reader expects; anything that does not match raises
:class:`~lmcache_async.errors.IntegrityError`, which tiers turn into a miss plus a deletion.
Nothing here does I/O; encoding and verification of large payloads belong in worker threads.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import torch
import xxhash

from ..errors import IntegrityError
from ..keys import DIGEST_SIZE
from ..memory import MemoryObj
from .codec import Codec, decode, encode

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_SIZE",
    "RecordHeader",
    "RecordSpec",
    "object_checksum",
    "payload_checksum",
    "tensor_bytes",
]

MAGIC: Final = b"LMCA"
FORMAT_VERSION: Final = 1
_PREFIX = struct.Struct("<4sHII")
PREFIX_SIZE: Final = _PREFIX.size
_MAX_HEADER_BYTES: Final = 64 * 1024


def payload_checksum(data: bytes | memoryview) -> int:
    """The xxh3-64 checksum records carry for their stored payload bytes."""
    return int(xxhash.xxh3_64_intdigest(data))


def object_checksum(obj: MemoryObj) -> int:
    """The checksum of ``obj``'s payload bytes, computed once and kept on the object."""
    if obj.checksum is None:
        obj.checksum = payload_checksum(tensor_bytes(obj.tensor))
    return obj.checksum


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included)."""
    if not tensor.is_contiguous():
        raise IntegrityError("payload tensor is not contiguous")
    array: Any = tensor.view(torch.uint8).reshape(-1).numpy()
    return memoryview(array).cast("B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """What a record says about its payload."""

    key: bytes
    fingerprint: str
    fmt: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    length: int
    checksum: int

    def to_bytes(self) -> bytes:
        """``prefix ‖ header``: everything that precedes the payload."""
        body: bytes = msgpack.packb(
            {
                "key": bytes(self.key),
                "fp": self.fingerprint,
                "fmt": self.fmt,
                "shape": list(self.shape),
                "dtype": self.dtype,
                "codec": self.codec,
                "len": self.length,
                "sum": self.checksum,
            },
            use_bin_type=True,
        )
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), xxhash.xxh32_intdigest(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> tuple[RecordHeader, int]:
        """Parse the header at the start of ``data``; returns it and the payload offset.

        Raises:
            IntegrityError: bad magic, unknown version, truncated or corrupt header.
        """
        view = memoryview(data)
        if len(view) < PREFIX_SIZE:
            raise IntegrityError(f"record of {len(view)} bytes is shorter than its prefix")
        magic, version, length, header_sum = _PREFIX.unpack_from(view)
        if magic != MAGIC:
            raise IntegrityError("record has a bad magic number")
        if version != FORMAT_VERSION:
            raise IntegrityError(f"record format version {version}, expected {FORMAT_VERSION}")
        if length > _MAX_HEADER_BYTES or PREFIX_SIZE + length > len(view):
            raise IntegrityError("record header is truncated")
        body = view[PREFIX_SIZE : PREFIX_SIZE + length]
        if xxhash.xxh32_intdigest(body) != header_sum:
            raise IntegrityError("record header checksum mismatch")
        try:
            fields: Any = msgpack.unpackb(body, raw=False, strict_map_key=True)
            header = cls(
                key=bytes(fields["key"]),
                fingerprint=str(fields["fp"]),
                fmt=str(fields["fmt"]),
                shape=tuple(int(dim) for dim in fields["shape"]),
                dtype=str(fields["dtype"]),
                codec=str(fields["codec"]),
                length=int(fields["len"]),
                checksum=int(fields["sum"]),
            )
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            raise IntegrityError(f"record header is malformed: {exc}") from exc
        return header, PREFIX_SIZE + length


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """What a tier expects of its records: one engine's layout, dtype and codec.

    ``shape_of(n)`` is the payload shape of a chunk of ``n`` tokens (``1 ≤ n ≤ max_tokens``);
    a record whose shape is not one of those is refused. Keys of one layer (layerwise
    stores) carry ``layer_fmt`` payloads of ``layer_shape_of(n)`` instead.
    """

    fingerprint: str
    fmt: str
    dtype: torch.dtype
    max_tokens: int
    shape_of: Callable[[int], tuple[int, ...]]
    codec: Codec = Codec.NONE
    layer_fmt: str | None = None
    layer_shape_of: Callable[[int], tuple[int, ...]] | None = None

    def _expected(self, key: bytes) -> tuple[str, Callable[[int], tuple[int, ...]]]:
        """Payload format and shape function for ``key`` (a layer key is longer)."""
        if len(key) > DIGEST_SIZE and self.layer_fmt and self.layer_shape_of is not None:
            return self.layer_fmt, self.layer_shape_of
        return self.fmt, self.shape_of

    def encode(self, key: bytes, obj: MemoryObj) -> tuple[bytes, bytes | memoryview]:
        """The header bytes and the (possibly compressed) payload of ``obj`` under ``key``.

        The payload is a view on ``obj``'s memory when the codec is ``none``: keep a
        reference on ``obj`` until it is written. Runs in a worker thread for large chunks.
        """
        if self.codec is Codec.NONE:
            payload: bytes | memoryview = tensor_bytes(obj.tensor)
            checksum = object_checksum(obj)
        else:
            payload = encode(self.codec, obj.tensor)
            checksum = payload_checksum(payload)
        header = RecordHeader(
            key=bytes(key),
            fingerprint=self.fingerprint,
            fmt=self._expected(key)[0],
            shape=tuple(obj.shape),
            dtype=_dtype_name(obj.dtype),
            codec=str(self.codec),
            length=len(payload),
            checksum=checksum,
        )
        return header.to_bytes(), payload

    def check_header(self, header: RecordHeader, key: bytes) -> None:
        """Raise IntegrityError unless ``header`` describes a chunk of ``key`` for this spec."""
        if header.key != bytes(key):
            raise IntegrityError("record belongs to another key")
        if header.fingerprint != self.fingerprint:
            raise IntegrityError("record was written for another KV layout")
        fmt, shape_of = self._expected(key)
        if header.fmt != fmt or header.dtype != _dtype_name(self.dtype):
            raise IntegrityError("record has another payload format or dtype")
        if not header.shape or not self._shape_ok(header.shape, shape_of):
            raise IntegrityError(f"record shape {header.shape} does not fit the layout")
        try:
            Codec(header.codec)
        except ValueError as exc:
            raise IntegrityError(f"record uses an unknown codec {header.codec!r}") from exc

    def _shape_ok(self, shape: tuple[int, ...], shape_of: Callable[[int], tuple[int, ...]]) -> bool:
        full = shape_of(self.max_tokens)
        if len(shape) != len(full):
            return False
        # Exactly one dimension (the token one) may differ from a full chunk's shape.
        tokens = [n for n, (a, b) in enumerate(zip(shape, full, strict=True)) if a != b]
        if not tokens:
            return True
        return len(tokens) == 1 and shape == shape_of(shape[tokens[0]])

    def raw_size(self, header: RecordHeader) -> int:
        """Size in bytes of the decoded payload tensor."""
        return math.prod(header.shape) * self.dtype.itemsize

    def verify_payload(self, header: RecordHeader, payload: bytes | memoryview) -> None:
        """Raise IntegrityError if ``payload`` is not the bytes ``header`` promises."""
        if len(payload) != header.length:
            raise IntegrityError(
                f"record payload is {len(payload)} bytes, its header says {header.length}"
            )
        if payload_checksum(payload) != header.checksum:
            raise IntegrityError("record payload checksum mismatch")

    def decode_into(
        self, header: RecordHeader, payload: bytes | memoryview, out: torch.Tensor
    ) -> None:
        """Decode a verified payload into ``out`` (shape ``header.shape``, this dtype).

        Raises:
            IntegrityError: the payload does not decode to exactly that tensor.
        """
        codec = Codec(header.codec)
        if codec is Codec.NONE:
            if len(payload) != out.numel() * out.element_size():
                raise IntegrityError("record payload does not fill its tensor")
            tensor_bytes(out)[:] = payload
            return
        decode(codec, payload, shape=header.shape, dtype=self.dtype, out=out)

    def parse(self, data: bytes | memoryview, key: bytes) -> tuple[RecordHeader, memoryview]:
        """Check a whole record read back for ``key``; returns its header and payload view.

        Raises:
            IntegrityError: any field, the length or the checksum does not match.
        """
        header, offset = RecordHeader.from_bytes(data)
        self.check_header(header, key)
        payload = memoryview(data)[offset:]
        self.verify_payload(header, payload)
        return header, payload
