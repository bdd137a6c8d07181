"""The self-describing chunk record that slow tiers store: a header, then the payload.

A record is ``prefix ‖ header ‖ payload``:

* ``prefix`` (14 bytes, little-endian): magic ``b"LMCA"``, format version (u16), header
  length (u32), xxh32 of the header bytes (u32);
* ``header``: a msgpack map with the chunk key, the layout fingerprint, payload format,
  shape, dtype, codec, stored payload length and the xxh3-64 checksum of the stored payload;
* ``payload``: the chunk's tensor bytes, encoded by the codec (``none`` = the bytes as is).

A tier given a :class:`~.cipher.RecordCipher` writes *sealed* records instead: format version
:data:`SEALED_FORMAT_VERSION`, a header that also names the cipher (``enc``), the master key's
id (``kid``) and the record's nonce (``iv``) and carries no checksum, and a payload that is
``ciphertext ‖ GCM tag`` of the (possibly compressed) payload, with ``prefix ‖ header`` as
associated data. The tag stands in for the checksum: it covers the header as well, and
checking it costs no extra pass over the payload. A sealed record read without a key, a
clear one read with a key, one sealed under another key or one that does not authenticate
is refused like a record that fails its checksum.

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
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import msgpack
import torch
import xxhash

from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.memory.pool import MemoryObj

from ..errors import ForeignRecordError, IntegrityError
from .cipher import (
    AUTH_TAG_BYTES,
    KEY_ID_BYTES,
    NONCE_BYTES,
    RecordCipher,
    SealedReader,
    SealedWriter,
)
from .codec import Codec, decode, encode

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_SIZE",
    "PayloadHasher",
    "RecordHeader",
    "RecordSpec",
    "SEALED_FORMAT_VERSION",
    "object_checksum",
    "payload_checksum",
    "payload_hasher",
    "tensor_bytes",
]

MAGIC: Final = b"LMCA"
FORMAT_VERSION: Final = 1
"""Format version of records stored in the clear."""
SEALED_FORMAT_VERSION: Final = 2
"""Format version of sealed (encrypted) records."""
_PREFIX = struct.Struct("<4sHII")
PREFIX_SIZE: Final = _PREFIX.size
_MAX_HEADER_BYTES: Final = 64 * 1024


def payload_checksum(data: bytes | memoryview) -> int:
    """The xxh3-64 checksum records carry for their stored payload bytes."""
    return int(xxhash.xxh3_64_intdigest(data))


class PayloadHasher(Protocol):
    """A checksum fed piece by piece: :meth:`intdigest` of the pieces fed in order is
    :func:`payload_checksum` of their concatenation."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


def payload_hasher() -> PayloadHasher:
    """A :class:`PayloadHasher` for a payload that arrives in pieces."""
    hasher: PayloadHasher = xxhash.xxh3_64()
    return hasher


def object_checksum(obj: MemoryObj) -> int:
    """The checksum of ``obj``'s payload bytes, computed once and kept on the object."""
    if obj.checksum is None:
        obj.checksum = payload_checksum(obj.data)
    return obj.checksum


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included)."""
    if not tensor.is_contiguous():
        raise IntegrityError("payload tensor is not contiguous")
    array: Any = tensor.view(torch.uint8).reshape(-1).numpy()
    return memoryview(array).cast("B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_prefix(view: memoryview) -> tuple[bytes, int, int, int]:
    """The fields of a record's prefix: magic, version, header length, header checksum.

    Raises:
        IntegrityError: too short, bad magic, unknown version, a header over its limit.
    """
    if len(view) < PREFIX_SIZE:
        raise IntegrityError(f"record of {len(view)} bytes is shorter than its prefix")
    fields: tuple[bytes, int, int, int] = _PREFIX.unpack_from(view)
    magic, version, length, _ = fields
    if magic != MAGIC:
        raise IntegrityError("record has a bad magic number")
    if version not in (FORMAT_VERSION, SEALED_FORMAT_VERSION):
        raise IntegrityError(
            f"record format version {version}, expected {FORMAT_VERSION} or {SEALED_FORMAT_VERSION}"
        )
    if length > _MAX_HEADER_BYTES:
        raise IntegrityError("record header is truncated")
    return fields


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """What a record says about its payload.

    A sealed record names its ``cipher`` (``""``: stored in the clear), the ``key_id`` of
    the master key and its ``nonce``, and has no ``checksum`` (0). ``raw``, of a sealed
    header parsed from a record, is the ``prefix ‖ header`` bytes its payload authenticates.
    """

    key: bytes
    fingerprint: str
    fmt: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    length: int
    checksum: int
    cipher: str = ""
    key_id: bytes = b""
    nonce: bytes = b""
    raw: bytes = field(default=b"", compare=False, repr=False)

    @property
    def sealed(self) -> bool:
        """Whether the payload is encrypted."""
        return bool(self.cipher)

    def to_bytes(self) -> bytes:
        """``prefix ‖ header``: everything that precedes the payload."""
        fields: dict[str, Any] = {
            "key": bytes(self.key),
            "fp": self.fingerprint,
            "fmt": self.fmt,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "codec": self.codec,
            "len": self.length,
        }
        if self.sealed:
            fields.update(enc=self.cipher, kid=bytes(self.key_id), iv=bytes(self.nonce))
            version = SEALED_FORMAT_VERSION
        else:
            fields["sum"] = self.checksum
            version = FORMAT_VERSION
        body: bytes = msgpack.packb(fields, use_bin_type=True)
        return _PREFIX.pack(MAGIC, version, len(body), xxhash.xxh32_intdigest(body)) + body

    @staticmethod
    def size_from_prefix(prefix: bytes | memoryview) -> int:
        """How many bytes ``prefix ‖ header`` take, from a record's first
        :data:`PREFIX_SIZE` bytes (a reader streaming a record learns here how much to
        read before :meth:`from_bytes`).

        Raises:
            IntegrityError: bad magic, unknown version, or a header over its limit.
        """
        return PREFIX_SIZE + int(_check_prefix(memoryview(prefix))[2])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> tuple[RecordHeader, int]:
        """Parse the header at the start of ``data``; returns it and the payload offset.

        Raises:
            IntegrityError: bad magic, unknown version, truncated or corrupt header.
        """
        view = memoryview(data)
        _, version, length, header_sum = _check_prefix(view)
        if PREFIX_SIZE + length > len(view):
            raise IntegrityError("record header is truncated")
        body = view[PREFIX_SIZE : PREFIX_SIZE + length]
        if xxhash.xxh32_intdigest(body) != header_sum:
            raise IntegrityError("record header checksum mismatch")
        try:
            fields: Any = msgpack.unpackb(body, raw=False, strict_map_key=True)
            sealed = version == SEALED_FORMAT_VERSION
            header = cls(
                key=bytes(fields["key"]),
                fingerprint=str(fields["fp"]),
                fmt=str(fields["fmt"]),
                shape=tuple(int(dim) for dim in fields["shape"]),
                dtype=str(fields["dtype"]),
                codec=str(fields["codec"]),
                length=int(fields["len"]),
                checksum=0 if sealed else int(fields["sum"]),
                cipher=str(fields["enc"]) if sealed else "",
                key_id=bytes(fields["kid"]) if sealed else b"",
                nonce=bytes(fields["iv"]) if sealed else b"",
                raw=bytes(view[: PREFIX_SIZE + length]) if sealed else b"",
            )
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            raise IntegrityError(f"record header is malformed: {exc}") from exc
        if sealed and (
            not header.cipher
            or len(header.key_id) != KEY_ID_BYTES
            or len(header.nonce) != NONCE_BYTES
        ):
            raise IntegrityError("sealed record header is malformed")
        return header, PREFIX_SIZE + length


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """What a tier expects of its records: one engine's layout, dtype and codec.

    ``shape_of(n)`` is the payload shape of a chunk of ``n`` tokens (``1 ≤ n ≤ max_tokens``);
    a record whose shape is not one of those is refused. Keys of one layer (layerwise
    stores) carry ``layer_fmt`` payloads of ``layer_shape_of(n)`` instead. With a
    ``cipher`` records are sealed, and only records sealed under its key are accepted.
    """

    fingerprint: str
    fmt: str
    dtype: torch.dtype
    max_tokens: int
    shape_of: Callable[[int], tuple[int, ...]]
    codec: Codec = Codec.NONE
    layer_fmt: str | None = None
    layer_shape_of: Callable[[int], tuple[int, ...]] | None = None
    cipher: RecordCipher | None = None

    def _expected(self, key: bytes) -> tuple[str, Callable[[int], tuple[int, ...]]]:
        """Payload format and shape function for ``key`` (a layer key is longer)."""
        if len(key) > DIGEST_SIZE and self.layer_fmt and self.layer_shape_of is not None:
            return self.layer_fmt, self.layer_shape_of
        return self.fmt, self.shape_of

    def encode(self, key: bytes, obj: MemoryObj) -> tuple[bytes, bytes | memoryview]:
        """The header bytes and the (possibly compressed) payload of ``obj`` under ``key``.

        The payload is a view on ``obj``'s memory when the codec is ``none`` and there is no
        cipher: keep a reference on ``obj`` until it is written. With a cipher it is new
        bytes, ``ciphertext ‖ tag``, and no checksum is computed. Runs in a worker thread
        for large chunks.
        """
        payload = self._payload(obj)
        if self.cipher is None:
            return self._clear_header(key, obj, payload), payload
        head, nonce = self._sealed_header(self.cipher, key, obj, payload)
        return head, self.cipher.seal(key, nonce, payload, head)

    def encode_deferred(
        self, key: bytes, obj: MemoryObj
    ) -> tuple[bytes, bytes | memoryview | SealedWriter]:
        """As :meth:`encode`, except that a sealed payload is a :class:`~.cipher.SealedWriter`
        that encrypts it only as it is written, a piece at a time (for files: no buffer of
        the whole sealed payload). Keep a reference on ``obj`` until it is written."""
        payload = self._payload(obj)
        if self.cipher is None:
            return self._clear_header(key, obj, payload), payload
        head, nonce = self._sealed_header(self.cipher, key, obj, payload)
        return head, self.cipher.writer(key, nonce, payload, head)

    def _payload(self, obj: MemoryObj) -> bytes | memoryview:
        if self.codec is Codec.NONE:
            return obj.data
        return encode(self.codec, obj.tensor)

    def _clear_header(self, key: bytes, obj: MemoryObj, payload: bytes | memoryview) -> bytes:
        checksum = object_checksum(obj) if self.codec is Codec.NONE else payload_checksum(payload)
        return self._header(key, obj, len(payload), checksum=checksum).to_bytes()

    def _sealed_header(
        self, cipher: RecordCipher, key: bytes, obj: MemoryObj, payload: bytes | memoryview
    ) -> tuple[bytes, bytes]:
        """A sealed record's header bytes, and its fresh nonce."""
        nonce = cipher.new_nonce()
        head = self._header(
            key,
            obj,
            len(payload) + AUTH_TAG_BYTES,
            checksum=0,
            cipher=cipher.name,
            key_id=cipher.key_id,
            nonce=nonce,
        )
        return head.to_bytes(), nonce

    def _header(self, key: bytes, obj: MemoryObj, length: int, **fields: Any) -> RecordHeader:
        """The header of ``obj``'s record under ``key``: ``length`` payload bytes, and
        ``fields`` (checksum, or the seal's cipher, key id and nonce)."""
        return RecordHeader(
            key=bytes(key),
            fingerprint=self.fingerprint,
            fmt=self._expected(key)[0],
            shape=tuple(obj.shape),
            dtype=_dtype_name(obj.dtype),
            codec=str(self.codec),
            length=length,
            **fields,
        )

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
        self._check_seal(header)

    def _check_seal(self, header: RecordHeader) -> RecordCipher | None:
        """This spec's cipher, if ``header`` is sealed under its key; None if both are in
        the clear; IntegrityError for any other combination."""
        cipher = self.cipher
        if cipher is None:
            if header.sealed:
                raise ForeignRecordError("record is encrypted and this tier has no key")
            return None
        if not header.sealed:
            raise ForeignRecordError("record is stored in the clear and this tier encrypts")
        if header.cipher != cipher.name:
            raise IntegrityError(f"record uses an unknown cipher {header.cipher!r}")
        if header.key_id != cipher.key_id:
            raise ForeignRecordError("record was encrypted under another key")
        return cipher

    def _shape_ok(self, shape: tuple[int, ...], shape_of: Callable[[int], tuple[int, ...]]) -> bool:
        full = shape_of(self.max_tokens)
        if len(shape) != len(full):
            return False
        # Exactly one dimension (the token one) may differ from a full chunk's shape.
        tokens = [n for n, (a, b) in enumerate(zip(shape, full, strict=True)) if a != b]
        if not tokens:
            return True
        return len(tokens) == 1 and shape == shape_of(shape[tokens[0]])

    @property
    def max_record_bytes(self) -> int:
        """The longest record this spec can read back: the largest header, and a full
        chunk's payload with room for what a codec may add to incompressible data and a
        seal's tag. A longer value is not one of its records."""
        raw = math.prod(self.shape_of(self.max_tokens)) * self.dtype.itemsize
        if self.layer_shape_of is not None:
            raw = max(raw, math.prod(self.layer_shape_of(self.max_tokens)) * self.dtype.itemsize)
        return PREFIX_SIZE + _MAX_HEADER_BYTES + raw + raw // 64 + 4096 + AUTH_TAG_BYTES

    def raw_size(self, header: RecordHeader) -> int:
        """Size in bytes of the decoded payload tensor."""
        return math.prod(header.shape) * self.dtype.itemsize

    def verify_checksum(self, header: RecordHeader, checksum: int) -> None:
        """Raise IntegrityError unless ``checksum`` (of a clear record's payload, computed
        as it arrived: :func:`payload_hasher`) is the one ``header`` carries."""
        if header.sealed or checksum != header.checksum:
            raise IntegrityError("record payload checksum mismatch")

    def verify_payload(self, header: RecordHeader, payload: bytes | memoryview) -> None:
        """Raise IntegrityError if ``payload`` is not the bytes ``header`` promises.

        A sealed payload is only measured here: its tag is checked as it is decrypted
        (:meth:`decode_into`, :meth:`sealed_reader`), which is where it must be anyway.
        """
        if len(payload) != header.length:
            raise IntegrityError(
                f"record payload is {len(payload)} bytes, its header says {header.length}"
            )
        if header.sealed:
            return
        if payload_checksum(payload) != header.checksum:
            raise IntegrityError("record payload checksum mismatch")

    def decode_into(
        self, header: RecordHeader, payload: bytes | memoryview, out: torch.Tensor
    ) -> None:
        """Decode a verified payload into ``out`` (shape ``header.shape``, this dtype); a
        sealed one is authenticated and decrypted first (straight into ``out`` when it is
        not compressed).

        Raises:
            IntegrityError: the payload does not decode to exactly that tensor, or a sealed
                one does not authenticate under this spec's cipher.
        """
        codec = Codec(header.codec)
        cipher = self._check_seal(header)
        if cipher is not None:
            if codec is Codec.NONE:
                dest = tensor_bytes(out)
                cipher.open_into(header.key, header.nonce, payload, _aad(header), dest)
                return
            if len(payload) < AUTH_TAG_BYTES:
                raise IntegrityError("sealed payload is shorter than its tag")
            plain = memoryview(bytearray(len(payload) - AUTH_TAG_BYTES))
            cipher.open_into(header.key, header.nonce, payload, _aad(header), plain)
            payload = plain
        if codec is Codec.NONE:
            if len(payload) != out.numel() * out.element_size():
                raise IntegrityError("record payload does not fill its tensor")
            tensor_bytes(out)[:] = payload
            return
        decode(codec, payload, shape=header.shape, dtype=self.dtype, out=out)

    def sealed_reader(self, header: RecordHeader, out: torch.Tensor) -> SealedReader:
        """A reader that decrypts the uncompressed sealed payload of ``header`` into
        ``out`` as the payload's bytes are fed to it (a file read piece by piece).

        Raises:
            IntegrityError: the header is not sealed under this spec's cipher, or its
                payload does not fill ``out``.
        """
        cipher = self._check_seal(header)
        if cipher is None or Codec(header.codec) is not Codec.NONE:
            raise IntegrityError("record payload is not sealed and uncompressed")
        dest = tensor_bytes(out)
        if header.length != len(dest) + AUTH_TAG_BYTES:
            raise IntegrityError("record payload does not fill its tensor")
        return cipher.reader(header.key, header.nonce, _aad(header), dest)

    def parse(self, data: bytes | memoryview, key: bytes) -> tuple[RecordHeader, memoryview]:
        """Check a whole record read back for ``key``; returns its header and payload view
        (of a sealed record: the ciphertext, authenticated only by :meth:`decode_into`).

        Raises:
            IntegrityError: any field, the length or the checksum does not match.
        """
        header, offset = RecordHeader.from_bytes(data)
        self.check_header(header, key)
        payload = memoryview(data)[offset:]
        self.verify_payload(header, payload)
        return header, payload


def _aad(header: RecordHeader) -> bytes:
    """What a sealed payload authenticates: the ``prefix ‖ header`` bytes it was read with."""
    return header.raw or header.to_bytes()
