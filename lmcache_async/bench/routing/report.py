"""The routing benchmark's figures: each policy's requests summed up (hit rate, where the
hits came from, time to first token beside round robin's), and the text table."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lmcache_async.bench import format_finite, format_table, percentiles
from lmcache_async.bench.routing.options import POLICIES, CacheSizes, RoutingOptions
from lmcache_async.bench.routing.server import PrefixHits

__all__ = ["PolicyRun", "Served", "format_routing", "summarise"]


class Served(NamedTuple):
    """One request as it went: where, how fast, and what the index expected there."""

    prefix: int
    worker: int
    seconds: float
    """Time to first token."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the server did not compute (its prefix cache's or the connector's)."""
    indexed_tokens: int
    """Prompt tokens the index said the chosen worker held, on its GPU or CPU tier."""


class PolicyRun(NamedTuple):
    """What one policy's run left: its requests, and the servers' hit counters over them."""

    served: Sequence[Served]
    hits: PrefixHits
    """Summed over both servers, from before the first request to after the last."""
    startup_s: float
    """Seconds the two servers took to start (side by side)."""
    load_average: float | None = None
    """The machine's 1-minute load average after the last request (None: unknown): the
    times are only worth comparing between runs on an equally busy machine."""


def summarise(
    options: RoutingOptions, sizes: CacheSizes, runs: Mapping[str, PolicyRun]
) -> dict[str, Any]:
    """The results: the settings, the cache sizes, each policy's figures (its requests
    too) and any problem that makes a figure meaningless."""
    policies = {name: _policy(run) for name, run in runs.items()}
    baseline = policies.get("round-robin", {}).get("ttft_ms", {}).get("mean", math.nan)
    for figures in policies.values():
        figures["mean_over_round_robin"] = figures["ttft_ms"]["mean"] / baseline
    return {
        "options": options.as_dict(),
        "sizes": sizes._asdict(),
        "policies": policies,
        "problems": _problems(policies),
    }


def _policy(run: PolicyRun) -> dict[str, Any]:
    served = run.served
    prompt = sum(s.prompt_tokens for s in served)
    cached = sum(s.cached_tokens for s in served)
    ttft = percentiles([s.seconds * 1000 for s in served], (50, 90))
    hits = percentiles([s.seconds * 1000 for s in served if s.cached_tokens], (50,))
    misses = percentiles([s.seconds * 1000 for s in served if not s.cached_tokens], (50,))
    return {
        "requests": len(served),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": _share(cached, prompt),
        "vllm_cache_tokens": run.hits.local,
        "cpu_tier_tokens": run.hits.external,
        "vllm_cache_share": _share(run.hits.local, prompt),
        "cpu_tier_share": _share(run.hits.external, prompt),
        "ttft_ms": {
            "mean": ttft["mean"],
            "p50": ttft["p50"],
            "p90": ttft["p90"],
            "hit_p50": hits["p50"],
            "miss_p50": misses["p50"],
        },
        "index_right": _share(
            sum(s.indexed_tokens == s.cached_tokens for s in served), len(served)
        ),
        "requests_per_worker": {
            str(worker): count
            for worker, count in sorted(Counter(s.worker for s in served).items())
        },
        "startup_s": run.startup_s,
        "load_average": run.load_average,
        "served": [
            {
                "prefix": s.prefix,
                "worker": s.worker,
                "ttft_ms": s.seconds * 1000,
                "cached_tokens": s.cached_tokens,
                "indexed_tokens": s.indexed_tokens,
            }
            for s in served
        ],
    }


def _share(part: float, whole: float) -> float:
    return part / whole if whole else math.nan


def _problems(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Counters that disagree with the responses, or a CPU tier never used."""
    problems = []
    for name, figures in policies.items():
        counted = figures["vllm_cache_tokens"] + figures["cpu_tier_tokens"]
        if counted != figures["cached_tokens"]:
            problems.append(
                f"{name}: the servers counted {counted} cached prompt tokens, the responses "
                f"{figures['cached_tokens']}"
            )
    if policies and not any(figures["cpu_tier_tokens"] for figures in policies.values()):
        problems.append("no policy loaded anything from a CPU tier: the connector was not in play")
    return problems


def format_routing(results: Mapping[str, Any]) -> str:
    """One row per policy: hit rate and its sources, how often the index was right, the
    time to first token and its ratio to round robin's; then any problem."""
    options, sizes = results["options"], results["sizes"]
    policies = results["policies"]
    rows, medians = [], []
    for name in POLICIES:
        figures = policies.get(name)
        if figures is None:
            continue
        ttft = figures["ttft_ms"]
        load = figures.get("load_average")
        medians.append(
            f"{name} {format_finite(ttft['hit_p50'], '.0f')} / "
            f"{format_finite(ttft['miss_p50'], '.0f')}"
            + ("" if load is None else f" (load average {load:.1f})")
        )
        rows.append(
            [
                name,
                str(figures["requests"]),
                _percent(figures["hit_rate"]),
                _percent(figures["vllm_cache_share"]),
                _percent(figures["cpu_tier_share"]),
                _percent(figures["index_right"]),
                format_finite(ttft["mean"], ".1f"),
                format_finite(ttft["p90"], ".1f"),
                _times(figures["mean_over_round_robin"]),
            ]
        )
    lines = [
        f"KV-aware routing over two vLLM servers, each with its own CPU tier: "
        f"{options['requests']} requests one at a time, each one of {options['prefixes']} "
        f"prefixes of {options['prefix_tokens']} tokens and {options['suffix_tokens']} of "
        f"its own; vLLM's KV cache holds {options['vllm_cache_prefixes']} prefixes "
        f"({sizes['vllm_blocks']} blocks of {options['block_size']}), each CPU tier "
        f"{options['cpu_tier_prefixes']} ({sizes['cpu_tier_gb'] * 1024:.0f} MiB)",
        format_table(
            [
                "policy",
                "requests",
                "hit rate",
                "vLLM cache",
                "CPU tier",
                "index right",
                "mean TTFT ms",
                "p90 TTFT ms",
                "mean / round robin",
            ],
            rows,
        ),
        "hit rate: prompt tokens not computed, found in vLLM's own cache or loaded from the "
        "CPU tier; index right: requests whose server held what the index said",
        "median TTFT of a hit / a miss, ms: " + "; ".join(medians),
    ]
    lines += [f"problem: {problem}" for problem in results.get("problems", [])]
    return "\n".join(lines)


def _percent(value: float) -> str:
    return format_finite(value * 100, ".1f") + "%" if math.isfinite(value) else "-"


def _times(value: float) -> str:
    return format_finite(value, ".2f") + "x" if math.isfinite(value) else "-"
