"""A layout as plain data: its fields by name, kind and dtype by value, for a wire
handshake or a file (:meth:`KVLayout.to_dict <lmcache_async.layouts.KVLayout.to_dict>`),
and back (:meth:`KVLayout.from_dict <lmcache_async.layouts.KVLayout.from_dict>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts.kinds import SUPPORTED_DTYPES, PagedLayout, dtype_name

__all__ = ["layout_args", "layout_dict"]


def layout_dict(layout: PagedLayout) -> dict[str, str | int | bool]:
    """Every field of ``layout`` as plain data (kind and dtype by name; ``cpu_packing``
    only when it has one)."""
    return {
        "kind": layout.kind.value,
        "num_layers": layout.num_layers,
        "block_size": layout.block_size,
        "num_kv_heads": layout.num_kv_heads,
        "head_size": layout.head_size,
        "dtype": dtype_name(layout.dtype),
        "hnd": layout.hnd,
        "tp_world_size": layout.tp_world_size,
        "tp_rank": layout.tp_rank,
        **({} if layout.cpu_packing is None else {"cpu_packing": layout.cpu_packing.value}),
    }


def layout_args(data: object) -> tuple[Any, ...]:
    """The fields, in order, of the layout a :meth:`KVLayout.to_dict
    <lmcache_async.layouts.KVLayout.to_dict>` mapping describes (``hnd``,
    ``tp_world_size``, ``tp_rank`` and ``cpu_packing`` may be left out), the dtype by
    value; the layout checks the other values.

    Raises:
        InvalidInputError: ``data`` is not a mapping, lacks a field, has an unknown key, or
            names an unknown dtype.
    """
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"layout: expected a mapping, got {type(data).__name__}")
    required = ("kind", "num_layers", "block_size", "num_kv_heads", "head_size", "dtype")
    known = (*required, "hnd", "tp_world_size", "tp_rank", "cpu_packing")
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise InvalidInputError(f"layout: unknown keys {unknown}; expected {list(known)}")
    missing = [key for key in required if key not in data]
    if missing:
        raise InvalidInputError(f"layout: missing keys {missing}")
    dtypes = {dtype_name(dtype): dtype for dtype in SUPPORTED_DTYPES}
    dtype = dtypes.get(data["dtype"]) if isinstance(data["dtype"], str) else None
    if dtype is None:
        raise InvalidInputError(
            f"dtype: expected one of {', '.join(dtypes)}, got {data['dtype']!r:.40}"
        )
    return (
        data["kind"],
        data["num_layers"],
        data["block_size"],
        data["num_kv_heads"],
        data["head_size"],
        dtype,
        data.get("hnd", False),
        data.get("tp_world_size", 1),
        data.get("tp_rank", 0),
        data.get("cpu_packing"),
    )
