"""A PNG of a capacity sweep: hit rate against the tier's capacity."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lmcache_async.bench.loadgen.plot import check_plotting
from lmcache_async.bench.trace.report import format_bytes, format_tokens
from lmcache_async.errors import InvalidInputError

__all__ = ["write_sweep_plot"]


def write_sweep_plot(results: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the block LRU's hit rate (and the engine's, where it was replayed) against the
    capacity in tokens, with the unbounded cache's as a line, as a PNG at ``path``.

    Raises:
        InvalidInputError: matplotlib is not installed, or the results have no sweep.
        OSError: the file cannot be written.
    """
    check_plotting()
    sweep = results["sweep"]
    if not sweep:
        raise InvalidInputError("--plot draws a capacity sweep: give --capacities")
    from matplotlib.figure import Figure  # noqa: PLC0415  (optional, and slow to import)
    from matplotlib.ticker import NullFormatter  # noqa: PLC0415

    tier = "disk" if results["capacities"].get("disk") is not None else "cpu"
    rows = sorted(sweep, key=lambda row: row["capacity_tokens"])
    tokens = [row["capacity_tokens"] for row in rows]
    fig = Figure(figsize=(8.0, 5.0), layout="constrained")
    axes = fig.subplots()
    lru = [(t, row["lru_hit_rate"]) for t, row in zip(tokens, rows, strict=True)]
    lru = [(t, 100.0 * rate) for t, rate in lru if rate is not None]
    if lru:
        axes.plot(*zip(*lru, strict=True), marker="o", label="block LRU (hash ids)")
    served = [
        (t, 100.0 * row["served"]["hit_rate"])
        for t, row in zip(tokens, rows, strict=True)
        if row.get("served") and row["served"]["hit_rate"] is not None
    ]
    if served:
        axes.plot(*zip(*served, strict=True), marker="x", linestyle="--", label="served")
    unbounded = results["bounds"]["unbounded"]["hit_rate"]
    if unbounded is not None:
        axes.axhline(100.0 * unbounded, color="grey", linestyle=":", label="unbounded cache")
    axes.set_xscale("log")
    # Ticks at the capacities swept: tokens below, their KV bytes above.
    per_token = results["layout"]["token_bytes"]
    axes.set_xticks(tokens, labels=[format_tokens(t) for t in tokens])
    axes.xaxis.set_minor_formatter(NullFormatter())
    top = axes.secondary_xaxis("top")
    top.set_xticks(tokens, labels=[format_bytes(t * per_token) for t in tokens])
    top.xaxis.set_minor_formatter(NullFormatter())
    top.tick_params(axis="x", labelsize="small")
    top.set_xlabel("KV bytes of the capacity")
    axes.set_xlabel(f"{tier} tier capacity (tokens)")
    axes.set_ylabel("hit rate (% of prompt tokens)")
    axes.set_ylim(0, 105)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    fig.suptitle(
        f"{os.path.basename(results['trace']['path'])}: {results['trace']['requests']} "
        f"requests, {per_token} B of KV per token"
    )
    fig.savefig(path, format="png", dpi=100)
