"""Tests for the slow-tier payload codecs (lmcache_async.backends.codec)."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_async.backends.codec import (
    INT8_FORMAT_VERSION,
    Codec,
    decode,
    encode,
    max_int8_error,
)
from lmcache_async.errors import IntegrityError, InvalidInputError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LOSSLESS = [Codec.NONE, Codec.ZSTD, Codec.LZ4]
SHAPES = [(), (0,), (1,), (3, 0), (0, 5), (7, 13), (2, 3, 129), (4, 1, 8, 16)]
BITS_DTYPE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers, for bit-exact comparison (NaN payloads too)."""
    return tensor.view(BITS_DTYPE[tensor.dtype])


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def all_bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern (fp16/bf16), or random 32-bit patterns plus specials (fp32)."""
    if dtype != torch.float32:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    gen = torch.Generator().manual_seed(1)
    patterns = torch.randint(-(2**31), 2**31, (50_000,), generator=gen, dtype=torch.int64)
    specials = torch.tensor(
        [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0, 1, 0x807FFFFF]
    )
    return torch.cat([patterns, specials]).to(torch.int32).view(torch.float32)


def int8_payload_size(shape: tuple[int, ...]) -> int:
    channels = shape[-1] if shape else 1
    numel = 1
    for d in shape:
        numel *= d
    return 8 + 8 * len(shape) + 4 * channels + numel


# --- Codec names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("none", Codec.NONE),
        ("zstd", Codec.ZSTD),
        ("LZ4", Codec.LZ4),
        (" Int8 ", Codec.INT8),
        (Codec.ZSTD, Codec.ZSTD),
    ],
)
def test_parse_accepts_names(value: str, expected: Codec) -> None:
    assert Codec.parse(value) is expected


@pytest.mark.parametrize("value", ["gzip", "", "zstd3", 3, None])
def test_parse_rejects_unknown_names_listing_choices(value: object) -> None:
    with pytest.raises(InvalidInputError) as info:
        Codec.parse(value)  # type: ignore[arg-type]
    message = str(info.value)
    for name in ("'none'", "'zstd'", "'lz4'", "'int8'"):
        assert name in message


def test_encode_rejects_unknown_codec_name() -> None:
    with pytest.raises(InvalidInputError, match="unknown codec 'brotli'"):
        encode("brotli", torch.zeros(4, dtype=torch.float16))
    with pytest.raises(InvalidInputError, match="unknown codec"):
        decode("brotli", b"", shape=(0,), dtype=torch.float16)


def test_lossless_property() -> None:
    assert [c.lossless for c in Codec] == [True, True, True, False]
    assert str(Codec.ZSTD) == "zstd"


# --- Lossless round trips ------------------------------------------------------------------


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_lossless_round_trip_is_bit_exact(
    codec: Codec, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = random_tensor(shape, dtype)
    payload = encode(codec, tensor)
    result = decode(codec, payload, shape=shape, dtype=dtype)
    assert result.shape == tensor.shape
    assert result.dtype == dtype
    assert torch.equal(bits(result), bits(tensor))


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_round_trip_keeps_every_bit_pattern(codec: Codec, dtype: torch.dtype) -> None:
    """NaN payloads, signalling NaNs, infinities, -0.0 and subnormals survive unchanged."""
    tensor = all_bit_patterns(dtype)
    assert bool(torch.isnan(tensor).any())
    assert bool(torch.isinf(tensor).any())
    payload = encode(codec, tensor)
    out = torch.empty_like(tensor)
    result = decode(codec, payload, shape=tensor.shape, dtype=dtype, out=out)
    assert result is out
    assert torch.equal(bits(result), bits(tensor))


@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_payload_sizes(codec: Codec) -> None:
    zeros = torch.zeros(64, 1024, dtype=torch.float16)
    payload = encode(codec, zeros)
    if codec is Codec.NONE:
        assert len(payload) == zeros.numel() * 2
    else:
        assert len(payload) < zeros.numel() * 2 // 50


def test_none_encode_is_a_read_only_view_without_copy() -> None:
    tensor = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    view = encode(Codec.NONE, tensor)
    assert isinstance(view, memoryview)
    assert view.readonly
    assert bytes(view) == tensor.view(torch.uint8).numpy().tobytes()
    tensor[0] = -3.0
    assert bytes(view) == tensor.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("codec", list(Codec))
def test_decode_accepts_bytes_bytearray_and_memoryview(codec: Codec) -> None:
    tensor = random_tensor((3, 8), torch.float16)
    payload = bytes(encode(codec, tensor))
    expected = decode(codec, payload, shape=(3, 8), dtype=torch.float16)
    for data in (bytearray(payload), memoryview(payload), memoryview(bytearray(payload))):
        result = decode(codec, data, shape=torch.Size([3, 8]), dtype=torch.float16)
        assert torch.equal(bits(result), bits(expected))


@pytest.mark.parametrize("codec", list(Codec))
def test_decode_writes_into_a_view_of_a_larger_buffer(codec: Codec) -> None:
    """``out`` may be a slice of a pool buffer; bytes outside it stay untouched."""
    tensor = random_tensor((4, 16), torch.bfloat16)
    pool = torch.full((3, 4, 16), 7.0, dtype=torch.bfloat16)
    result = decode(codec, encode(codec, tensor), shape=(4, 16), dtype=torch.bfloat16, out=pool[1])
    assert result.data_ptr() == pool[1].data_ptr()
    assert bool((pool[0] == 7.0).all())
    assert bool((pool[2] == 7.0).all())
    if codec.lossless:
        assert torch.equal(bits(pool[1]), bits(tensor))


def test_concurrent_use_from_threads_is_exact() -> None:
    tensors = [random_tensor((32, 128), DTYPES[i % 3], seed=i) for i in range(24)]

    def round_trip(i: int) -> bool:
        codec = LOSSLESS[i % 3]
        tensor = tensors[i]
        result = decode(codec, encode(codec, tensor), shape=tensor.shape, dtype=tensor.dtype)
        return torch.equal(bits(result), bits(tensor))

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert all(pool.map(round_trip, range(len(tensors))))


# --- int8 ----------------------------------------------------------------------------------


def test_int8_payload_exact_bytes() -> None:
    tensor = torch.tensor([[127.0, -254.0], [3.4, 0.0]], dtype=torch.float32)
    payload = encode(Codec.INT8, tensor)
    expected = (
        b"LMQ8"
        + bytes([INT8_FORMAT_VERSION, 3, 2, 0])
        + struct.pack("<2Q", 2, 2)
        + struct.pack("<2f", 1.0, 2.0)
        + struct.pack("<4b", 127, -127, 3, 0)
    )
    assert payload == expected
    result = decode(Codec.INT8, payload, shape=(2, 2), dtype=torch.float32)
    assert result.tolist() == [[127.0, -254.0], [3.0, 0.0]]
    # Half a step of the coarser channel (scale 2.0), plus fp32 slack.
    assert 1.0 <= max_int8_error(tensor) < 1.0 + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_payload_size_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(shape, dtype)
    payload = encode(Codec.INT8, tensor)
    assert len(payload) == int8_payload_size(shape)
    result = decode(Codec.INT8, payload, shape=shape, dtype=dtype)
    assert result.shape == tensor.shape
    assert result.dtype == dtype


def assert_within_bound(tensor: torch.Tensor) -> float:
    """Round-trip ``tensor`` through int8; assert the error bound; return the max error."""
    bound = max_int8_error(tensor)
    result = decode(Codec.INT8, encode(Codec.INT8, tensor), shape=tensor.shape, dtype=tensor.dtype)
    error = (result.double() - tensor.double()).abs().max().item() if tensor.numel() else 0.0
    assert error <= bound, (error, bound)
    return error


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_bounded_on_random_normal_data(dtype: torch.dtype) -> None:
    tensor = random_tensor((2, 16, 8, 128), dtype, seed=3)
    error = assert_within_bound(tensor)
    # The bound is not slack: the measured error reaches a large part of it (for bf16 the
    # final rounding into bf16 is as coarse as the int8 step, and rarely adds up with it).
    assert error > 0.4 * max_int8_error(tensor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_bounded_on_heavy_tailed_data(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    # Student-t with 1.5 degrees of freedom: a few huge outliers per channel.
    normal = torch.randn(4096, 64, generator=gen)
    chi = torch.distributions.Chi2(torch.tensor(1.5)).sample((4096, 64))
    tensor = (normal / torch.sqrt(chi / 1.5)).clamp(-6e4, 6e4).to(dtype)
    assert float(tensor.float().abs().max()) > 100.0
    assert_within_bound(tensor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_quantizes_each_channel_with_its_own_scale(dtype: torch.dtype) -> None:
    tensor = random_tensor((256, 4), torch.float32, seed=7)
    tensor[:, 0] *= 1000.0
    tensor[:, 1] = 0.0
    tensor[:, 2] *= 1e-3
    tensor = tensor.to(dtype)
    assert_within_bound(tensor)
    result = decode(Codec.INT8, encode(Codec.INT8, tensor), shape=tensor.shape, dtype=dtype)
    assert bool((result[:, 1] == 0).all())
    small = tensor[:, 2].double()
    small_step = small.abs().max().item() / 127
    small_error = (result[:, 2].double() - small).abs().max().item()
    # The small channel's error follows its own scale, not the large channel's.
    assert small_error <= small_step, (small_error, small_step)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_all_zero_tensor_is_exact(dtype: torch.dtype) -> None:
    tensor = torch.zeros(8, 32, dtype=dtype)
    assert max_int8_error(tensor) == 0.0
    assert assert_within_bound(tensor) == 0.0


@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [
        (torch.float16, 6.0e-8),
        (torch.float16, 65504.0),
        (torch.bfloat16, 1.0e-39),
        (torch.bfloat16, 3.0e38),
        (torch.float32, 1.0e-43),
        (torch.float32, 1.0e-39),
        (torch.float32, 3.4e38),
    ],
)
def test_int8_error_bounded_at_the_dtype_extremes(dtype: torch.dtype, magnitude: float) -> None:
    """Subnormal channels (whose fp32 scale would underflow) and values near the max."""
    gen = torch.Generator().manual_seed(11)
    tensor = (torch.rand(64, 3, generator=gen, dtype=torch.float64) * 2 - 1) * magnitude
    tensor[0] = magnitude
    tensor = tensor.to(dtype)
    assert_within_bound(tensor)
    result = decode(Codec.INT8, encode(Codec.INT8, tensor), shape=tensor.shape, dtype=dtype)
    assert bool(torch.isfinite(result).all())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_int8_rejects_non_finite_values(value: float) -> None:
    tensor = torch.ones(4, 4, dtype=torch.float16)
    tensor[2, 1] = value
    with pytest.raises(InvalidInputError, match="finite"):
        encode(Codec.INT8, tensor)
    with pytest.raises(InvalidInputError, match="finite"):
        max_int8_error(tensor)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(0, 9),
    channels=st.integers(1, 9),
    values=st.lists(
        st.floats(-6e4, 6e4, allow_nan=False, allow_infinity=False, width=32),
        min_size=81,
        max_size=81,
    ),
)
def test_int8_error_bound_holds_for_any_finite_values(
    dtype: torch.dtype, rows: int, channels: int, values: list[float]
) -> None:
    flat = torch.tensor(values[: rows * channels], dtype=torch.float32)
    assert_within_bound(flat.reshape(rows, channels).to(dtype))


# --- Corrupt, truncated and mismatched payloads ---------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_every_truncation_raises_integrity_error(codec: Codec) -> None:
    tensor = random_tensor((3, 5), torch.float16)
    payload = bytes(encode(codec, tensor))
    for length in range(len(payload)):
        with pytest.raises(IntegrityError):
            decode(codec, payload[:length], shape=(3, 5), dtype=torch.float16)


@pytest.mark.parametrize("codec", list(Codec))
def test_trailing_bytes_raise_integrity_error(codec: Codec) -> None:
    tensor = random_tensor((3, 5), torch.float32)
    payload = bytes(encode(codec, tensor))
    with pytest.raises(IntegrityError):
        decode(codec, payload + b"\x00", shape=(3, 5), dtype=torch.float32)


@pytest.mark.parametrize("codec", list(Codec))
def test_payload_for_another_size_raises_integrity_error(codec: Codec) -> None:
    payload = encode(codec, random_tensor((4, 8), torch.float16))
    with pytest.raises(IntegrityError):
        decode(codec, payload, shape=(4, 9), dtype=torch.float16)
    with pytest.raises(IntegrityError):
        decode(codec, payload, shape=(4, 8), dtype=torch.float32)


def test_int8_header_must_match_shape_and_dtype_exactly() -> None:
    payload = encode(Codec.INT8, random_tensor((4, 8), torch.float16))
    with pytest.raises(IntegrityError, match="dtype"):
        decode(Codec.INT8, payload, shape=(4, 8), dtype=torch.bfloat16)
    with pytest.raises(IntegrityError, match="dimensions"):
        decode(Codec.INT8, payload, shape=(32,), dtype=torch.float16)
    with pytest.raises(IntegrityError, match="shape"):
        decode(Codec.INT8, payload, shape=(8, 4), dtype=torch.float16)


def test_compressed_payload_declaring_a_huge_size_is_rejected_before_decoding() -> None:
    big = torch.zeros(1 << 20, dtype=torch.float16)
    for codec in (Codec.ZSTD, Codec.LZ4):
        with pytest.raises(IntegrityError, match="declares"):
            decode(codec, encode(codec, big), shape=(16,), dtype=torch.float16)


def patch(payload: bytes | memoryview, offset: int, new: bytes) -> bytes:
    data = bytearray(payload)
    data[offset : offset + len(new)] = new
    return bytes(data)


@pytest.mark.parametrize(
    ("offset", "new", "match"),
    [
        (0, b"LMQ9", "magic"),
        (4, bytes([INT8_FORMAT_VERSION + 1]), "version"),
        (5, bytes([9]), "dtype"),
        (7, b"\x01", "header"),
        (24, struct.pack("<f", float("nan")), "scale"),
        (24, struct.pack("<f", -1.0), "scale"),
        (24, struct.pack("<f", float("inf")), "scale"),
        (33, struct.pack("<b", -128), "-128"),
    ],
)
def test_int8_corrupt_header_fields_raise(offset: int, new: bytes, match: str) -> None:
    payload = encode(Codec.INT8, random_tensor((2, 2), torch.float16))
    with pytest.raises(IntegrityError, match=match):
        decode(Codec.INT8, patch(payload, offset, new), shape=(2, 2), dtype=torch.float16)


@settings(max_examples=300, deadline=None)
@given(
    codec=st.sampled_from([Codec.ZSTD, Codec.LZ4]),
    dtype=st.sampled_from(DTYPES),
    position=st.floats(0.0, 1.0, exclude_max=True),
    flip=st.integers(1, 255),
)
def test_compressed_byte_flips_raise_or_keep_the_size(
    codec: Codec, dtype: torch.dtype, position: float, flip: int
) -> None:
    """A corrupted byte raises IntegrityError or decodes to a tensor of the right size.

    Frames carry no content checksum (the record's checksum covers the stored payload), so
    a flip inside the compressed data may decode to other values, never to other sizes.
    """
    tensor = random_tensor((16, 64), dtype, seed=2)
    payload = bytearray(encode(codec, tensor))
    index = int(position * len(payload))
    payload[index] ^= flip
    out = torch.zeros_like(tensor)
    try:
        result = decode(codec, payload, shape=(16, 64), dtype=dtype, out=out)
    except IntegrityError:
        return
    assert result is out


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4])
def test_compressed_frame_headers_are_checked(codec: Codec) -> None:
    tensor = random_tensor((16, 64), torch.float16)
    payload = bytes(encode(codec, tensor))
    # The frame's magic number is its first four bytes.
    with pytest.raises(IntegrityError, match="does not decode"):
        decode(codec, patch(payload, 0, b"\x00"), shape=(16, 64), dtype=torch.float16)
    # A payload of the same size from another codec is not a valid frame either.
    other = Codec.LZ4 if codec is Codec.ZSTD else Codec.ZSTD
    with pytest.raises(IntegrityError):
        decode(codec, encode(other, tensor), shape=(16, 64), dtype=torch.float16)
    with pytest.raises(IntegrityError):
        decode(codec, encode(Codec.NONE, tensor), shape=(16, 64), dtype=torch.float16)


SHAPE_STRATEGY = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@settings(max_examples=400, deadline=None)
@given(
    codec=st.sampled_from(list(Codec)),
    dtype=st.sampled_from(DTYPES),
    shape=SHAPE_STRATEGY,
    data=st.binary(max_size=200),
    use_out=st.booleans(),
)
def test_random_bytes_never_escape_as_another_error(
    codec: Codec, dtype: torch.dtype, shape: tuple[int, ...], data: bytes, use_out: bool
) -> None:
    out = torch.empty(shape, dtype=dtype) if use_out else None
    try:
        result = decode(codec, data, shape=shape, dtype=dtype, out=out)
    except IntegrityError:
        return
    assert tuple(result.shape) == shape
    assert result.dtype == dtype
    if out is not None:
        assert result is out


@settings(max_examples=300, deadline=None)
@given(
    codec=st.sampled_from(list(Codec)),
    dtype=st.sampled_from(DTYPES),
    shape=SHAPE_STRATEGY,
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=4))),
    cut=st.none() | st.integers(0, 10_000),
)
def test_mangled_valid_payloads_never_escape_as_another_error(
    codec: Codec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    edits: list[tuple[int, bytes]],
    cut: int | None,
) -> None:
    payload = bytearray(encode(codec, random_tensor(shape, dtype)))
    for offset, new in edits:
        if payload:
            at = offset % len(payload)
            payload[at : at + len(new)] = new
    if cut is not None:
        del payload[cut % (len(payload) + 1) :]
    try:
        result = decode(codec, payload, shape=shape, dtype=dtype)
    except IntegrityError:
        return
    assert tuple(result.shape) == shape
    assert result.dtype == dtype


# --- Bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(4, 4, dtype=torch.float16).t(),
        torch.zeros(4, dtype=torch.float16, device="meta"),
    ],
    ids=["float64", "int32", "non-contiguous", "not-cpu"],
)
@pytest.mark.parametrize("codec", list(Codec))
def test_encode_rejects_unsupported_tensors(codec: Codec, tensor: torch.Tensor) -> None:
    with pytest.raises(InvalidInputError):
        encode(codec, tensor)


def test_encode_rejects_non_tensors() -> None:
    with pytest.raises(InvalidInputError, match=r"torch\.Tensor"):
        encode(Codec.ZSTD, b"abc")  # type: ignore[arg-type]


def test_decode_rejects_bad_arguments() -> None:
    payload = encode(Codec.NONE, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(InvalidInputError, match="non-negative"):
        decode(Codec.NONE, payload, shape=(-4,), dtype=torch.float16)
    with pytest.raises(InvalidInputError, match="ints"):
        decode(Codec.NONE, payload, shape=(2.0,), dtype=torch.float16)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="ints"):
        decode(Codec.NONE, payload, shape=(True,), dtype=torch.float16)
    with pytest.raises(InvalidInputError, match="dtype"):
        decode(Codec.NONE, payload, shape=(2,), dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="bytes-like"):
        decode(Codec.NONE, "abcdefgh", shape=(4,), dtype=torch.float16)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="out is"):
        decode(Codec.NONE, payload, shape=(4,), dtype=torch.float16, out=torch.empty(5))
    with pytest.raises(InvalidInputError, match="contiguous"):
        out = torch.empty(2, 4, dtype=torch.float16)[:, :2]
        decode(Codec.NONE, payload, shape=(2, 2), dtype=torch.float16, out=out)
