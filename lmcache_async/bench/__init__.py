"""Benchmarks behind ``lmcache-async bench``.

Each job lives in its own module so that importing this package stays cheap:

- :mod:`lmcache_async.bench.loadgen` (with :mod:`~lmcache_async.bench.workloads`) — the
  load generator: multi-round chat, long-document QA and random workloads against an
  embedded engine, a sidecar or vLLM (``make run``);
- :mod:`lmcache_async.bench.micro` — copy, lookup and hashing micro-benchmarks measured
  next to plain-torch baselines;
- :mod:`lmcache_async.bench.tiers` — disk and Redis tier throughput next to plain file
  writes and pipelined redis-py;
- :mod:`lmcache_async.bench.scale` — the CPU, disk and Redis tiers at growing N chunks:
  open time, time to a first RAM hit, the disk index next to a names-only walk, and the
  growth of a 1k-token request's store / lookup / retrieve;
- :mod:`lmcache_async.bench.sidecar` — store/retrieve through a sidecar next to
  in-process, and lookup round trips over ipc;
- :mod:`lmcache_async.bench.gpu` — D2H/H2D copies next to a plain pinned copy, and the
  layerwise overlap (``scripts/gpu_check.sh`` on a GPU machine);
- :mod:`lmcache_async.bench.slow_tier` — vLLM with a prefix only in Redis behind a slow
  link (:mod:`~lmcache_async.bench.throttle`, a bandwidth-limiting TCP proxy): the cost
  model's TTFT next to loading everything, recomputing everything and no connector, and
  another request's decode steps during the load. :mod:`~lmcache_async.bench.tiny_llama`
  builds the small random-weight model it (and the ``vllm`` target) runs;
- :mod:`lmcache_async.bench.routing` — two ``vllm serve`` with the connector behind a
  KV-aware router (NVIDIA Dynamo's indexer): hit rate and time to first token of round
  robin, routing by vLLM's own KV events and routing by every tier's;
- :mod:`lmcache_async.bench.shared_redis` — two hosts (a sidecar and ``vllm serve`` each)
  sharing one Redis: a prompt only the other host saw, next to that host's warm hit;
- :mod:`lmcache_async.bench.trace` — a production trace (Mooncake's JSONL) replayed against
  an embedded engine, a sidecar or vLLM: the hit rate served next to an unbounded cache's
  and a block LRU's of the same capacity, and a capacity sweep.

The plain-torch copies the micro and GPU benchmarks measure the engine against live in
:mod:`lmcache_async.bench.baselines`. This module holds the small helpers they all share:
dtype names, latency percentiles, GB/s, numbers and plain text tables, progress display
and JSON output.

May import: everything (the top floor, with ``cli``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, Final, TextIO

import torch

from lmcache_async.errors import InvalidInputError

__all__ = [
    "DTYPES",
    "EVERY_TIER_WAITED",
    "Progress",
    "format_finite",
    "format_table",
    "gbps",
    "parse_dtype",
    "percentiles",
    "plain_data",
    "write_json",
]

DTYPES: Final[Mapping[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""KV dtypes the benchmarks accept, by name."""

EVERY_TIER_WAITED: Final[Mapping[str, Any]] = {
    "store_location": None,
    "retrieve_locations": None,
    "wait_for_slow_tiers": True,
    "store_threshold": 1,
    "use_layerwise": False,
    "remove_after_retrieve": False,
    "tenant_quotas": None,
}
"""Engine settings under which a measured store reaches every tier, and returns once each
holds its chunks, and a retrieve leaves them there, whatever the user's configuration
says (``EngineConfig.replace(**EVERY_TIER_WAITED, ...)``)."""


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of :data:`DTYPES`).

    Raises:
        InvalidInputError: ``name`` is not a known dtype name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        allowed = ", ".join(DTYPES)
        raise InvalidInputError(f"unknown dtype {name!r}; expected one of {allowed}") from None


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank-interpolated percentiles of ``values`` as ``{"p50": ..., ...}``.

    Also returns ``count`` and ``mean``. An empty sequence gives ``nan`` for every
    statistic (and ``count`` 0) rather than raising, so a run without a given operation
    still reports.
    """
    out: dict[str, float] = {"count": float(len(values))}
    if not values:
        out["mean"] = math.nan
        for q in qs:
            out[f"p{q:g}"] = math.nan
        return out
    ordered = sorted(values)
    out["mean"] = sum(ordered) / len(ordered)
    last = len(ordered) - 1
    for q in qs:
        pos = last * q / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, last)
        frac = pos - lo
        out[f"p{q:g}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * frac
    return out


def gbps(nbytes: int, seconds: float) -> float:
    """``nbytes`` over ``seconds`` in GB/s (10^9 bytes per second); ``nan`` for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def format_finite(value: float, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``-`` when it is not finite."""
    return "-" if not math.isfinite(value) else format(value, spec)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render rows of strings as an aligned plain-text table (first column left-aligned)."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def _jsonable(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], results: Mapping[str, Any]) -> None:
    """Write ``results`` to ``path`` as indented JSON (NaN and infinities become null).

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(results), f, indent=2, sort_keys=False)
        f.write("\n")


def plain_data(value: Any) -> Any:
    """``value`` as JSON-friendly Python data (dataclasses and named tuples to dicts)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in fields(value)}
    as_dict = getattr(value, "_asdict", None)
    if callable(as_dict):
        return {k: plain_data(v) for k, v in as_dict().items()}
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


class Progress:
    """Progress on a stream: a tqdm bar when tqdm is importable, else a line a second."""

    def __init__(self, total: float, stream: TextIO) -> None:
        self._stream = stream
        self._total = total
        self._bar: Any = None
        try:
            from tqdm import tqdm  # noqa: PLC0415  (optional dependency)
        except ImportError:
            return
        self._bar = tqdm(
            total=round(total, 1),
            file=stream,
            unit="s",
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}",
            desc="bench",
            leave=False,
        )

    def update(self, elapsed: float, text: str) -> None:
        """Show ``elapsed`` seconds of the total and a short status ``text``."""
        if self._bar is not None:
            self._bar.n = round(min(elapsed, self._total), 1)
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()
        else:
            print(f"bench {elapsed:5.1f}/{self._total:.0f} s  {text}", file=self._stream)

    def close(self) -> None:
        """Remove the bar (the fallback printed lines stay)."""
        if self._bar is not None:
            self._bar.close()
