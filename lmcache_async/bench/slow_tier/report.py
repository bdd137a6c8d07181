"""The slow-tier benchmark's results as text: each figure beside its baseline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_async.bench import format_finite, format_table
from lmcache_async.bench.slow_tier.measure import CONFIGURATIONS

__all__ = ["format_slow_tier"]

_LABELS = {
    "cost_model": "cost model",
    "recompute_all": "recompute everything",
    "load_all": "load everything",
    "no_connector": "no connector",
}


def format_slow_tier(results: Mapping[str, Any]) -> str:
    """Two tables: the time-to-first-token medians of the four configurations with the
    cost model's ratio to each, and the decoding request's steps during the slow load
    beside its steps before it; then what the cost model decided, and any problem."""
    options = results["options"]
    ttft = results["ttft"]
    medians = ttft["median_ms"]
    rate = options["link_bytes_per_s"] / 1e6
    lines = [
        f"vLLM, a {options['prompt_tokens']}-token prompt only Redis holds, behind a "
        f"{rate:g} MB/s link: time to first token, median of {options['rounds']} rounds",
        format_table(
            ["configuration", "ms", "cost model / this"],
            [
                [
                    _LABELS[name],
                    format_finite(medians[name], ".1f"),
                    "-"
                    if name == "cost_model"
                    else format_finite(medians["cost_model"] / medians[name], ".2f") + "x",
                ]
                for name in CONFIGURATIONS
            ],
        ),
        f"cost model / the better of loading and recomputing everything: "
        f"{format_finite(ttft['ratios']['cost_model_over_better'], '.2f')}x; "
        f"load everything / recompute everything: "
        f"{format_finite(ttft['ratios']['load_all_over_recompute_all'], '.2f')}x",
        _decisions(ttft),
        "",
    ]
    decode = results["decode"]
    before, during = decode["before"], decode["during"]
    lines += [
        f"decode steps of another request while {decode['loaded_tokens']} tokens load "
        f"through the link ({decode['load_s'] * 1000:.0f} ms), beside its steps before",
        format_table(
            ["steps", "count", "median ms", "longest ms", "longest gap ms"],
            [
                [
                    "before the load",
                    str(before["steps"]),
                    format_finite(before["median_ms"], ".2f"),
                    format_finite(before["longest_ms"], ".2f"),
                    "",
                ],
                [
                    "during the load",
                    str(during["steps"]),
                    format_finite(during["median_ms"], ".2f"),
                    format_finite(during["longest_ms"], ".2f"),
                    format_finite(during["longest_gap_ms"], ".2f"),
                ],
            ],
        ),
    ]
    lines += [f"problem: {problem}" for problem in results.get("problems", [])]
    return "\n".join(lines)


def _decisions(ttft: Mapping[str, Any]) -> str:
    """What the cost model loaded each round, and the inputs of its decisions."""
    costs = ttft.get("load_costs") or {}
    redis = (costs.get("tiers") or {}).get("redis") or {}
    throughput = redis.get("throughput_bytes_per_s")
    prefill = costs.get("prefill_tokens_per_s")
    return (
        f"cost model loaded {ttft['loaded_tokens']['cost_model']} tokens "
        f"(declined {dict(costs.get('declined_tokens') or {})}); "
        f"Redis measured at {_number(throughput, 1e-6, '.1f')} MB/s, "
        f"prefill at {_number(prefill, 1.0, '.0f')} tokens/s"
    )


def _number(value: float | None, scale: float, spec: str) -> str:
    return "-" if value is None else format_finite(value * scale, spec)
