"""The one check of how a request names its chunks: tokens, or block hashes with offsets.

The embedded engine, the sidecar client and the scheduler's lookup client all take either
``tokens`` or the serving engine's block ``hashes`` with their end ``offsets``; this module
holds the rule and its messages, so every caller refuses the same input the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int

__all__ = ["check_key_input", "check_sequence"]


def check_sequence(name: str, value: object) -> Sequence[Any]:
    """``value`` itself, when it is a sequence of items (not text or bytes).

    Raises:
        InvalidInputError: it is not.
    """
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise InvalidInputError(f"{name} must be a sequence, got {type(value).__name__}")
    return value


def check_key_input(
    tokens: object | None, hashes: object | None, offsets: object | None
) -> list[int] | None:
    """Check that a request gives tokens, or hashes with offsets (not both, not neither).

    Returns the offsets as a list of ints when keyed by hashes, None when keyed by tokens
    (the tokens themselves are checked where they are converted).

    Raises:
        InvalidInputError: both or neither given, offsets without hashes, hashes without
            offsets, offsets that are not a sequence of ints, or hashes that are not a
            sequence.
    """
    if hashes is None:
        if tokens is None:
            raise InvalidInputError("tokens (or hashes with offsets) are required")
        if offsets is not None:
            raise InvalidInputError("offsets go with hashes, not with tokens")
        return None
    if tokens is not None:
        raise InvalidInputError("pass either tokens or hashes, not both")
    if offsets is None:
        raise InvalidInputError("hashes need offsets (the end token offset of each hash)")
    check_sequence("hashes", hashes)
    ends = list(check_sequence("offsets", offsets))
    for index, end in enumerate(ends):
        if not is_strict_int(end):
            raise InvalidInputError(f"offsets[{index}] must be an int, got {end!r:.40}")
    return ends
