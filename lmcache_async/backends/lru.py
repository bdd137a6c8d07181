"""The walk over a lookup's leading keys in a tier's LRU index (an ``OrderedDict``): each
key held is moved to the end, the newest. In C when the package's extension was built
(:mod:`lmcache_async.keys._native`): a lookup's 128 keys (a 32k-token prompt) then cost half
the Python loop's time, and far less when the interpreter is cold, as it is between a
serving engine's requests. The Python loops are the fallback, and what the C must do."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from types import ModuleType
from typing import Final, TypeVar

__all__ = ["held_prefix_count", "held_prefix_values"]

_V = TypeVar("_V")


def held_prefix_count_py(index: collections.OrderedDict[bytes, _V], keys: Sequence[bytes]) -> int:
    n = 0
    for key in keys:
        if key not in index:
            break
        index.move_to_end(key)
        n += 1
    return n


def held_prefix_values_py(
    index: collections.OrderedDict[bytes, _V], keys: Sequence[bytes]
) -> list[_V]:
    out: list[_V] = []
    for key in keys:
        value = index.get(key)
        if value is None:
            break
        index.move_to_end(key)
        out.append(value)
    return out


_native: ModuleType | None
try:
    from lmcache_async.keys import _native
except ImportError:  # built without a C compiler
    _native = None

held_prefix_count: Final = held_prefix_count_py if _native is None else _native.held_prefix_count
"""How many leading keys an index holds; each is made its newest."""
held_prefix_values: Final = held_prefix_values_py if _native is None else _native.held_prefix_values
"""The values of the leading keys an index holds; each is made its newest."""
