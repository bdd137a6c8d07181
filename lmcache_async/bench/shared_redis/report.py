"""The shared-Redis benchmark's figures: each phase's time to first token and hits, B's
Redis hit over A's own warm hit, whether A and B generate the same tokens, and what B's
and A's sidecars counted; and the text table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lmcache_async.bench import format_finite, format_table, percentiles
from lmcache_async.bench.shared_redis.options import PHASES, RATIO_GOAL, SharedRedisOptions

__all__ = ["Answer", "counter_deltas", "format_shared_redis", "summarise"]

_COUNTERS = (
    "lmcache_async_promises_total",
    "lmcache_async_promised_tokens_total",
    "lmcache_async_promises_cut_short_total",
    "lmcache_async_promoted_chunks_total",
    "lmcache_async_lookup_hit_tokens_total",
    "lmcache_async_retrieved_tokens_total",
    "lmcache_async_tier_read_errors_total",
    "lmcache_async_timed_out_requests_total",
)
"""Sidecar counters reported by phase (a request's figures are in ``requests`` and
``request_latency_seconds``, by operation)."""


class Answer(NamedTuple):
    """One request as it went."""

    prefix: int
    seconds: float
    """Time to first token."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens vLLM did not compute (the connector's hits: its prefix cache is off)."""
    token_ids: tuple[int, ...]
    """The tokens generated."""


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the sidecar counted between two metric reads: the counters of
    :data:`_COUNTERS`, each operation's request count and its mean latency in ms."""
    deltas = {
        name.removeprefix("lmcache_async_").removesuffix("_total"): after.get(name, 0.0)
        - before.get(name, 0.0)
        for name in _COUNTERS
    }
    prefix = "lmcache_async_request_latency_seconds_count{"
    for key, count in after.items():
        if not key.startswith(prefix):
            continue
        op = key[len(prefix) :].partition('op="')[2].partition('"')[0]
        calls = count - before.get(key, 0.0)
        total_key = key.replace("_count{", "_sum{")
        seconds = after.get(total_key, 0.0) - before.get(total_key, 0.0)
        if calls:
            deltas[f"{op}_calls"] = calls
            deltas[f"{op}_mean_ms"] = seconds / calls * 1000
    return deltas


def summarise(
    options: SharedRedisOptions,
    answers: Mapping[str, Sequence[Answer]],
    counters: Mapping[str, Mapping[str, float]],
    *,
    redis_wait_s: float,
    redis_keys: int,
    idle_wait_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The results: the settings, each phase's figures, the ratios, whether A's warm and
    B's tokens match, the seconds each phase waited for both hosts to be idle
    (:mod:`~.quiet`), the sidecars' counters by phase and any problem."""
    phases = {name: _phase(answers.get(name, ())) for name in PHASES if name in answers}
    warm = phases.get("a-warm", {}).get("ttft_ms", {}).get("mean", math.nan)
    ratios = {name: figures["ttft_ms"]["mean"] / warm for name, figures in phases.items()}
    same = _same_tokens(answers.get("a-warm", ()), answers.get("b-redis", ()))
    results = {
        "options": options.as_dict(),
        "phases": phases,
        "over_a_warm": ratios,
        "goal": RATIO_GOAL,
        "same_tokens_a_warm_b": same,
        "same_tokens_a_cold_b": _same_tokens(answers.get("a-cold", ()), answers.get("b-redis", ())),
        "redis_wait_s": redis_wait_s,
        "redis_keys": redis_keys,
        "idle_wait_s": dict(idle_wait_s or {}),
        "sidecar_counters": {name: dict(values) for name, values in counters.items()},
    }
    results["problems"] = _problems(options, phases, results)
    return results


def _phase(answers: Sequence[Answer]) -> dict[str, Any]:
    ttft = percentiles([a.seconds * 1000 for a in answers], (50, 90))
    prompt = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens for a in answers)
    return {
        "requests": len(answers),
        "ttft_ms": {"mean": ttft["mean"], "p50": ttft["p50"], "p90": ttft["p90"]},
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else math.nan,
        "answers": [a._asdict() for a in answers],
    }


def _same_tokens(first: Sequence[Answer], second: Sequence[Answer]) -> bool | None:
    """Whether each prompt generated the same tokens in both (None: nothing to compare)."""
    tokens = {a.prefix: a.token_ids for a in first}
    pairs = [(tokens[a.prefix], a.token_ids) for a in second if a.prefix in tokens]
    if not pairs or any(not x or not y for x, y in pairs):
        return None
    return all(x == y for x, y in pairs)


def _problems(
    options: SharedRedisOptions, phases: Mapping[str, Any], results: Mapping[str, Any]
) -> list[str]:
    problems: list[str] = []
    for name in ("a-warm", "b-redis", "b-warm"):
        figures = phases.get(name)
        if figures is None:
            continue
        expected = options.prefix_tokens * figures["requests"]
        if figures["cached_tokens"] < expected:
            problems.append(f"{name}: {figures['cached_tokens']} of {expected} prefix tokens hit")
    cold = phases.get("a-cold")
    if cold is not None and cold["cached_tokens"]:
        problems.append(f"a-cold: {cold['cached_tokens']} tokens hit (the caches were not empty)")
    if results["same_tokens_a_warm_b"] is False:
        problems.append("A's warm hit and B's Redis hit generated different tokens")
    return problems


def format_shared_redis(results: Mapping[str, Any]) -> str:
    """The results as a table and a few lines."""
    options = results["options"]
    rows = []
    for name, figures in results["phases"].items():
        ttft = figures["ttft_ms"]
        rows.append(
            [
                name,
                str(figures["requests"]),
                format_finite(ttft["mean"], ".1f"),
                format_finite(ttft["p50"], ".1f"),
                format_finite(ttft["p90"], ".1f"),
                format_finite(results["over_a_warm"][name], ".2f") + "x",
                f"{figures['cached_tokens']}/{figures['prompt_tokens']}",
            ]
        )
    header = ["phase", "requests", "mean ms", "p50 ms", "p90 ms", "/ a-warm", "cached/prompt"]
    ratio = results["over_a_warm"].get("b-redis", math.nan)
    verdict = "met" if ratio <= results["goal"] else "missed"
    lines = [
        f"two hosts through one Redis: {options['prefixes']} prompts of "
        f"{options['prefix_tokens']}+{options['suffix_tokens']} tokens, chunk "
        f"{options['chunk_size']}, {options['max_tokens']} tokens generated; each host "
        f"warmed up first on {options['warmup_prompts']} prompts of its own, twice",
        format_table(header, rows),
        f"B from Redis / A warm: {format_finite(ratio, '.2f')}x (goal <= {results['goal']}x: "
        f"{verdict}); A cold / A warm: "
        f"{format_finite(results['over_a_warm'].get('a-cold', math.nan), '.2f')}x",
        f"same tokens A warm vs B: {results['same_tokens_a_warm_b']}; A cold vs B: "
        f"{results['same_tokens_a_cold_b']}",
        f"A's writes in Redis after {results['redis_wait_s']:.2f} s ({results['redis_keys']} keys)",
    ]
    if results["idle_wait_s"]:
        waits = ", ".join(f"{k} {v:.1f} s" for k, v in results["idle_wait_s"].items())
        lines.append(f"each phase began once both hosts were idle, after: {waits}")
    for name, counts in results["sidecar_counters"].items():
        shown = ", ".join(f"{k} {v:.4g}" for k, v in counts.items() if v)
        lines.append(f"sidecar {name}: {shown or 'nothing'}")
    lines += [f"problem: {p}" for p in results["problems"]]
    return "\n".join(lines)
