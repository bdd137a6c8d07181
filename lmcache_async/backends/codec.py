"""Payload codecs for the slow tiers (disk, Redis): none, zstd, lz4 and lossy int8.

Every function here is pure (no I/O, no shared state), so the tiers can run them in worker
threads. A codec turns one contiguous CPU tensor of KV data (fp16, bf16 or fp32) into the
payload bytes stored for a chunk, and :func:`decode` turns those bytes back into a tensor of
a shape and dtype the caller already knows from the chunk's header.

Lossless codecs (``none``, ``zstd``, ``lz4``) round-trip bit-exactly, NaN payloads included.
``int8`` quantizes symmetrically per channel (the last dimension), one fp32 scale per
channel, and bounds the per-element error by :func:`max_int8_error`.

Bytes that fail to decode (corrupt, truncated, trailing garbage, a header that does not
describe the requested tensor) raise :class:`~lmcache_async.errors.IntegrityError`; a
decode never returns data of the wrong size. The compressed frames carry no content
checksum of their own: the chunk record's checksum over the stored payload (see
:mod:`.record`; for an encrypted record, its authentication tag) already covers them, and
lz4's would cost more than the decompression.
"""

from __future__ import annotations

import enum
import math
import operator
import struct
import types
from collections.abc import Sequence
from typing import Final

import lz4.frame  # type: ignore[import-untyped]
import numpy as np
import torch
import zstandard

from ..errors import IntegrityError, InvalidInputError

__all__ = [
    "INT8_FORMAT_VERSION",
    "LZ4_LEVEL",
    "ZSTD_LEVEL",
    "Codec",
    "decode",
    "encode",
    "max_int8_error",
]

ZSTD_LEVEL: Final = 1
"""zstd level: the fastest standard level; higher levels gain little on KV data."""

LZ4_LEVEL: Final = 0
"""lz4 frame level 0: the fast (non-HC) compressor."""

INT8_FORMAT_VERSION: Final = 1
"""Version byte written in every int8 payload header."""

_INT8_MAGIC: Final = b"LMQ8"
# magic, format version, source dtype code, number of dimensions, reserved (zero).
_INT8_HEAD: Final = struct.Struct("<4sBBBB")
_INT8_MAX_NDIM: Final = 32
_INT8_QMAX: Final = 127

_DTYPE_CODES: Final = types.MappingProxyType(
    {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
)
# Half the relative spacing of each dtype's representable values (unit roundoff), and
# half its smallest subnormal: what one rounding into the dtype can add to an error.
_UNIT_ROUNDOFF: Final = types.MappingProxyType(
    {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
)
_HALF_SUBNORMAL: Final = types.MappingProxyType(
    {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float32: 2.0**-150}
)
# Slack for the fp32 arithmetic of quantizing and dequantizing: a few fp32 roundings of
# values no larger than the channel's max |x| (relative), and of subnormal scales and
# products (absolute), each with a safety factor of two.
_FP32_SLACK: Final = 2.0**-21
_FP32_SUBNORMAL_SLACK: Final = 2.0**-147


class Codec(enum.StrEnum):
    """How a chunk's payload is encoded on a slow tier."""

    NONE = "none"
    ZSTD = "zstd"
    LZ4 = "lz4"
    INT8 = "int8"

    @classmethod
    def parse(cls, value: str | Codec) -> Codec:
        """Return the codec named by ``value`` (case-insensitive, surrounding spaces ignored).

        Raises:
            InvalidInputError: ``value`` names no codec; the message lists the valid ones.
        """
        if isinstance(value, Codec):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        choices = ", ".join(repr(c.value) for c in cls)
        raise InvalidInputError(f"unknown codec {value!r}; valid codecs are {choices}")

    @property
    def lossless(self) -> bool:
        """Whether :func:`decode` returns bit-exactly what :func:`encode` was given."""
        return self is not Codec.INT8


def encode(codec: Codec | str, tensor: torch.Tensor) -> bytes | memoryview:
    """Return the payload bytes of ``tensor`` under ``codec``.

    Args:
        codec: the encoding to apply.
        tensor: a contiguous CPU tensor of dtype float16, bfloat16 or float32, any shape.
            For ``int8`` the last dimension is the channel (a 0-d tensor is one channel)
            and every value must be finite.

    Returns:
        For ``none``, a read-only memoryview of the tensor's own bytes (no copy: it keeps
        the tensor's storage alive and sees later writes to it). Otherwise new bytes.

    Raises:
        InvalidInputError: the tensor is not a contiguous CPU fp16/bf16/fp32 tensor, or
            (``int8``) holds NaN or infinity, or has more than 32 dimensions.
    """
    codec = Codec.parse(codec)
    _check_tensor(tensor, "tensor")
    if codec is Codec.INT8:
        return _encode_int8(tensor)
    raw = _byte_view(tensor)
    if codec is Codec.NONE:
        return raw.toreadonly()
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        return compressor.compress(raw)
    compressed: bytes = lz4.frame.compress(
        raw, compression_level=LZ4_LEVEL, store_size=True, content_checksum=False
    )
    return compressed


def decode(
    codec: Codec | str,
    data: bytes | bytearray | memoryview,
    *,
    shape: Sequence[int] | torch.Size,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a payload written by :func:`encode` into a tensor of ``shape`` and ``dtype``.

    Args:
        codec: the encoding the payload was written with.
        data: the payload bytes (a C-contiguous buffer).
        shape: the tensor's shape, as recorded with the chunk.
        dtype: float16, bfloat16 or float32, as recorded with the chunk.
        out: a contiguous CPU tensor of exactly ``shape`` and ``dtype`` to write into (for
            example a memory-pool buffer); a new tensor is allocated when omitted. On an
            error its contents are unspecified.

    Returns:
        ``out`` when given, else a new contiguous CPU tensor.

    Raises:
        InvalidInputError: bad ``shape``/``dtype``/``out``, or ``data`` is not a buffer.
        IntegrityError: the payload does not decode (a malformed frame or header), is
            truncated, has trailing bytes, declares another size, or (``int8``) its header
            does not describe a tensor of ``shape`` and ``dtype``. Damage that leaves a
            well-formed frame of the right size is for the record checksum to catch.
    """
    codec = Codec.parse(codec)
    dims = _check_shape(shape)
    if dtype not in _DTYPE_CODES:
        raise InvalidInputError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    if out is None:
        out = torch.empty(dims, dtype=dtype)
    else:
        _check_tensor(out, "out")
        if tuple(out.shape) != dims or out.dtype != dtype:
            raise InvalidInputError(
                f"out is {tuple(out.shape)} {out.dtype}, expected {dims} {dtype}"
            )
    buf = _as_byte_buffer(data)
    if codec is Codec.INT8:
        _decode_int8(buf, out)
        return out
    target = _byte_view(out)
    expected = len(target)
    if codec is Codec.NONE:
        if len(buf) != expected:
            raise IntegrityError(f"raw payload is {len(buf)} bytes, expected {expected}")
        target[:] = buf
        return out
    decompress = _zstd_decompress if codec is Codec.ZSTD else _lz4_decompress
    target[:] = decompress(buf, expected)
    return out


def max_int8_error(tensor: torch.Tensor) -> float:
    """Return the largest absolute error ``int8`` may add to any element of ``tensor``.

    The bound per channel ``c`` with ``a = max|x[..., c]|`` and ``scale = a / 127`` is
    ``scale / 2`` (rounding to the nearest step) plus the fp32 arithmetic's few roundings
    and one rounding of the result into the tensor's dtype; this returns the maximum over
    channels. It is 0.0 for an empty or all-zero tensor.

    Raises:
        InvalidInputError: as :func:`encode` with ``int8``.
    """
    _check_tensor(tensor, "tensor")
    amax = _channel_amax(tensor)
    if amax.numel() == 0:
        return 0.0
    top = float(amax.max().item())
    if top == 0.0:
        return 0.0
    roundoff = _UNIT_ROUNDOFF[tensor.dtype]
    quantization = top / _INT8_QMAX / 2
    arithmetic = top * _FP32_SLACK + _FP32_SUBNORMAL_SLACK
    output = top * roundoff * (1 + _FP32_SLACK) + _HALF_SUBNORMAL[tensor.dtype]
    return quantization + arithmetic + output


def _check_tensor(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODES:
        raise InvalidInputError(
            f"{name} dtype must be float16, bfloat16 or float32, got {tensor.dtype}"
        )
    if tensor.device.type != "cpu":
        raise InvalidInputError(f"{name} must be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise InvalidInputError(f"{name} must be contiguous")


def _check_shape(shape: Sequence[int] | torch.Size) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError as exc:
        raise InvalidInputError(f"shape must be a sequence of ints, got {shape!r}") from exc
    try:
        if any(isinstance(d, bool) for d in dims):
            raise TypeError("bool")
        ints = tuple(operator.index(d) for d in dims)
    except TypeError as exc:
        raise InvalidInputError(f"shape must hold ints, got {shape!r}") from exc
    if any(d < 0 for d in ints):
        raise InvalidInputError(f"shape must hold non-negative ints, got {shape!r}")
    return ints


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 memoryview aliasing a contiguous CPU tensor's bytes (no copy)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    # ndarray.data is the array's own buffer, typed as a memoryview.
    return flat.numpy().data


def _as_byte_buffer(data: object) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidInputError(f"data must be a bytes-like object, got {type(data)}") from exc
    if not view.c_contiguous:
        raise InvalidInputError("data must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _zstd_decompress(buf: memoryview, expected: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(buf)
        if declared != expected:
            raise IntegrityError(f"zstd frame declares {declared} bytes, expected {expected}")
        raw = zstandard.ZstdDecompressor().decompress(
            buf, max_output_size=expected, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"zstd payload does not decode: {exc}") from exc
    if len(raw) != expected:
        raise IntegrityError(f"zstd payload decoded to {len(raw)} bytes, expected {expected}")
    return raw


def _lz4_decompress(buf: memoryview, expected: int) -> bytes:
    try:
        info = lz4.frame.get_frame_info(buf)
        if info.get("content_size") != expected:
            raise IntegrityError(
                f"lz4 frame declares {info.get('content_size')} bytes, expected {expected}"
            )
        context = lz4.frame.create_decompression_context()
        raw: bytes
        raw, consumed, complete = lz4.frame.decompress_chunk(context, buf, max_length=expected)
    except RuntimeError as exc:
        raise IntegrityError(f"lz4 payload does not decode: {exc}") from exc
    if not complete or consumed != len(buf):
        raise IntegrityError("lz4 payload is truncated or has trailing bytes")
    if len(raw) != expected:
        raise IntegrityError(f"lz4 payload decoded to {len(raw)} bytes, expected {expected}")
    return raw


def _channels(shape: Sequence[int]) -> int:
    return shape[-1] if shape else 1


def _channel_amax(tensor: torch.Tensor) -> torch.Tensor:
    """Per-channel max |x| in fp32, shape ``(C,)``; raises on non-finite input."""
    channels = _channels(tensor.shape)
    if tensor.numel() == 0:
        return torch.zeros(channels, dtype=torch.float32)
    rows = tensor.detach().reshape(-1, channels)
    # max(amax, -amin) spares the pass that would materialise |x|; NaN propagates through.
    amax = torch.maximum(rows.amax(dim=0), rows.amin(dim=0).neg()).to(torch.float32)
    if not bool(torch.isfinite(amax).all()):
        raise InvalidInputError("int8 needs finite values; the tensor holds NaN or infinity")
    return amax


def _encode_int8(tensor: torch.Tensor) -> bytes:
    """Header, then C little-endian fp32 scales, then numel int8 values (row-major)."""
    if tensor.dim() > _INT8_MAX_NDIM:
        raise InvalidInputError(f"int8 supports at most {_INT8_MAX_NDIM} dimensions")
    channels = _channels(tensor.shape)
    amax = _channel_amax(tensor)
    scale = amax / _INT8_QMAX
    # Round the scale up where fp32 rounded it down (or underflowed it to a subnormal or
    # zero), so 127 steps always reach the channel's max and no code has to be clipped.
    short = scale * _INT8_QMAX < amax
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    head = _INT8_HEAD.pack(
        _INT8_MAGIC, INT8_FORMAT_VERSION, _DTYPE_CODES[tensor.dtype], tensor.dim(), 0
    )
    dims = struct.pack(f"<{tensor.dim()}Q", *tensor.shape)
    scales = scale.numpy().astype("<f4").tobytes()
    if tensor.numel() == 0:
        return b"".join((head, dims, scales))
    rows = tensor.detach().reshape(-1, channels)
    # An all-zero channel has scale 0; dividing by 1 keeps its codes at 0. The division
    # promotes fp16/bf16 rows to fp32 (exactly) in the same pass. The clamp only matters
    # if denormals are flushed to zero, which would turn a tiny scale into a zero divisor.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = rows.div(divisor).round_().clamp_(-_INT8_QMAX, _INT8_QMAX).to(torch.int8)
    return b"".join((head, dims, scales, codes.numpy().tobytes()))


def _decode_int8(buf: memoryview, out: torch.Tensor) -> None:
    if len(buf) < _INT8_HEAD.size:
        raise IntegrityError(f"int8 payload of {len(buf)} bytes is shorter than its header")
    magic, version, dtype_code, ndim, reserved = _INT8_HEAD.unpack_from(buf)
    if magic != _INT8_MAGIC or reserved != 0:
        raise IntegrityError("int8 payload has a bad magic number or header")
    if version != INT8_FORMAT_VERSION:
        raise IntegrityError(f"int8 payload has format version {version}")
    if dtype_code != _DTYPE_CODES[out.dtype]:
        raise IntegrityError(f"int8 payload was written for dtype code {dtype_code}")
    if ndim != out.dim():
        raise IntegrityError(f"int8 payload has {ndim} dimensions, expected {out.dim()}")
    offset = _INT8_HEAD.size
    dims_size = 8 * ndim
    if len(buf) < offset + dims_size:
        raise IntegrityError("int8 payload is truncated inside its header")
    dims = struct.unpack_from(f"<{ndim}Q", buf, offset)
    if dims != tuple(out.shape):
        raise IntegrityError(f"int8 payload is for shape {dims}, expected {tuple(out.shape)}")
    offset += dims_size
    channels = _channels(out.shape)
    numel = math.prod(out.shape)
    expected = offset + 4 * channels + numel
    if len(buf) != expected:
        raise IntegrityError(f"int8 payload is {len(buf)} bytes, expected {expected}")
    scale = torch.from_numpy(
        np.frombuffer(buf, dtype="<f4", count=channels, offset=offset).astype(np.float32)
    )
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise IntegrityError("int8 payload has a negative or non-finite scale")
    if numel == 0:
        return
    offset += 4 * channels
    codes = np.frombuffer(buf, dtype=np.int8, count=numel, offset=offset)
    if bool((codes == -_INT8_QMAX - 1).any()):
        raise IntegrityError("int8 payload holds code -128, which the encoder never writes")
    values = torch.from_numpy(codes.astype(np.float32)).view(-1, channels).mul_(scale)
    out.view(-1, channels).copy_(values)
