from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

_V = TypeVar("_V")

SOURCE_HASH: str
"""SHA-256 of the C sources this module was compiled from (setup.py's ``source_hash``)."""

def blake3_chain(
    seed: bytes, data: bytes | memoryview, step: int, tag: bytes = ..., /
) -> list[bytes]: ...
def held_prefix_count(index: OrderedDict[bytes, _V], keys: Sequence[bytes], /) -> int: ...
def held_prefix_values(index: OrderedDict[bytes, _V], keys: Sequence[bytes], /) -> list[_V]: ...
