"""Block hashes are bounded: bytes of at most MAX_BLOCK_HASH_BYTES, an int that fits in
BLOCK_HASH_INT_BYTES signed bytes; a refusal names the size, never the value (a huge int
has more digits than ``str()`` may write)."""

from __future__ import annotations

import pytest

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.block_hashes import (
    BLOCK_HASH_INT_BYTES,
    MAX_BLOCK_HASH_BYTES,
    encode_block_hashes,
)

CHUNK = 4
INT_BITS = 8 * BLOCK_HASH_INT_BYTES


@pytest.mark.parametrize(
    "value",
    [
        b"\1" * MAX_BLOCK_HASH_BYTES,
        b"",
        (1 << (INT_BITS - 1)) - 1,
        -(1 << (INT_BITS - 1)),
    ],
    ids=["longest-bytes", "empty-bytes", "largest-int", "smallest-int"],
)
def test_block_hashes_up_to_the_bounds_are_encoded(value: int | bytes) -> None:
    encoded, tokens = encode_block_hashes([value, 7], [CHUNK, 2 * CHUNK], CHUNK)
    assert tokens == 2 * CHUNK
    assert len(encoded) == 2 and encoded[0] != encoded[1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"\1" * (MAX_BLOCK_HASH_BYTES + 1), f"{MAX_BLOCK_HASH_BYTES + 1} bytes long"),
        (b"\1" * 100_000, "100000 bytes long"),
        (1 << (INT_BITS - 1), f"{INT_BITS} bits"),
        (1 << 800_000, "800001 bits"),  # 240,000 digits: str() of it raises ValueError
        (-(1 << 800_000), "800001 bits"),
    ],
    ids=["bytes-past-max", "bytes-100000", "int-past-max", "int-100000-bytes", "negative-int"],
)
def test_an_oversized_block_hash_is_invalid_input_naming_its_size(
    value: int | bytes, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message) as raised:
        encode_block_hashes([7, value], [CHUNK, 2 * CHUNK], CHUNK)
    assert "hashes[1]" in str(raised.value)
    assert len(str(raised.value)) < 200
