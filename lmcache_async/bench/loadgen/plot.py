"""A PNG of a load run: each request's latencies and the hit rate over time."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_async import InvalidInputError

__all__ = ["check_plotting", "write_plot"]


def _points(
    times: Sequence[float], values: Sequence[float | None]
) -> tuple[list[float], list[float]]:
    """The (time, value) pairs whose value is present and positive (a log axis)."""
    xs: list[float] = []
    ys: list[float] = []
    for t, v in zip(times, values, strict=True):
        if v is not None and math.isfinite(v) and v > 0:
            xs.append(t)
            ys.append(v)
    return xs, ys


def check_plotting() -> None:
    """Fail early, before a run, when :func:`write_plot` could not draw.

    Raises:
        InvalidInputError: matplotlib is not installed (the ``bench`` extra).
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInputError("--plot needs matplotlib: pip install 'lmcache-async[bench]'")


def write_plot(results: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw latency and hit rate over the run as a PNG at ``path``.

    Top: every request's latency of each step (log scale). Bottom: the hit rate (prefix
    hit tokens over prompt tokens; against vLLM, the tokens the connector loaded) of the
    requests started in each time bin, and the running hit rate. Works on the results of
    :func:`~lmcache_async.bench.loadgen.run_load` and on their JSON read back.

    Raises:
        InvalidInputError: matplotlib is not installed (the ``bench`` extra).
        OSError: the file cannot be written.
    """
    check_plotting()
    from matplotlib.figure import Figure  # noqa: PLC0415  (optional, and slow to import)

    samples = results["samples"]
    times: list[float] = [float(t) for t in samples["t"]]
    fig = Figure(figsize=(9.0, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    operations = list(results["latency_ms"])
    for op in operations:
        xs, ys = _points(times, samples[f"{op}_ms"])
        if xs:
            top.scatter(xs, ys, s=9, alpha=0.6, label=op, marker="o" if op != "request" else "x")
    top.set_yscale("log")
    top.set_ylabel("latency (ms)")
    top.grid(True, which="both", alpha=0.3)
    if times:
        top.legend(loc="upper left", fontsize="small", ncols=len(operations))

    duration = max([results["wall_seconds"], *times, 1e-3])
    width = max(duration / 40.0, 0.25)
    bins = int(duration // width) + 1
    hits = [0.0] * bins
    prompts = [0.0] * bins
    for t, hit, prompt in zip(times, samples["hit_tokens"], samples["prompt_tokens"], strict=True):
        index = min(int(t // width), bins - 1)
        hits[index] += hit or 0
        prompts[index] += prompt or 0
    centres = [(i + 0.5) * width for i in range(bins) if prompts[i] > 0]
    rates = [100.0 * hits[i] / prompts[i] for i in range(bins) if prompts[i] > 0]
    bottom.bar(centres, rates, width=width * 0.9, alpha=0.5, label=f"per {width:.2g} s")
    # Samples are in finishing order; the running rate follows the start times.
    order = sorted(range(len(times)), key=times.__getitem__)
    running_hits = running_prompts = 0.0
    running: list[float] = []
    for i in order:
        running_hits += samples["hit_tokens"][i] or 0
        running_prompts += samples["prompt_tokens"][i] or 0
        running.append(100.0 * running_hits / running_prompts if running_prompts else 0.0)
    if times:
        ordered = [times[i] for i in order]
        bottom.plot(ordered, running, color="black", linewidth=1.2, label="since start")
        bottom.legend(loc="lower right", fontsize="small")
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("hit rate (%)")
    bottom.set_xlabel("seconds since start")
    bottom.grid(True, alpha=0.3)
    fig.suptitle(
        f"lmcache-async bench: {results['workload']} against {results['target']}, "
        f"{results['requests']} requests"
    )
    fig.savefig(path, format="png", dpi=100)
