"""The two measurements of the slow-tier benchmark, on engines already started.

- :func:`ttft_rounds`: each round times the first token of the cost model on a prompt
  only Redis holds, of the same engine on a fresh prompt (it recomputes everything), of
  the engine that loads every hit on a prompt only Redis holds, and of vLLM without the
  connector. The two cost-model requests take turns going first.
- :func:`decode_during_load`: a request decodes; once it has its first tokens, another
  arrives whose prompt only Redis holds, behind the slow link, and is loaded. The
  decoding request's steps (the time between its tokens) while the load is under way are
  set beside its steps before it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio

from lmcache_async.bench.vllm_target import FirstToken, VllmTarget

__all__ = [
    "CONFIGURATIONS",
    "DECODE_PROMPT_TOKENS",
    "Prompts",
    "decode_during_load",
    "decode_figures",
    "engine_room",
    "ttft_rounds",
]

CONFIGURATIONS: Final = ("cost_model", "recompute_all", "load_all", "no_connector")
"""The four time-to-first-token configurations, in the order the report lists them."""

DECODE_PROMPT_TOKENS: Final = 64
"""Prompt tokens of the request that decodes during the slow load (no whole chunk: it
writes nothing to Redis while it runs)."""

_PREFILL_TOKENS: Final = 2
"""Tokens of the decoding request whose steps are not decode steps (its prefill's)."""

_REQUEST_TIMEOUT: Final = 600.0
"""Seconds one request may take before the run gives up on it."""


class Prompts:
    """Random prompts of token ids ``3 .. top - 1`` from one seeded stream."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        import torch  # noqa: PLC0415

        self._torch = torch
        self._generator = torch.Generator().manual_seed(seed)
        self._top = min(vocab_size, 1000)

    def draw(self, length: int) -> list[int]:
        """A fresh prompt of ``length`` tokens."""
        tokens: list[int] = self._torch.randint(
            3, self._top, (length,), generator=self._generator
        ).tolist()
        return tokens


async def ttft_rounds(
    engines: dict[str, VllmTarget],
    cached: Sequence[list[int]],
    load_all_cached: Sequence[list[int]],
    fresh: Sequence[list[int]],
    *,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Time the first token of each configuration, one request of each per round.

    ``engines`` maps ``cost_model``, ``load_all`` and ``no_connector`` to their engines
    (``recompute_all`` is the cost model's engine). Round ``r`` sends ``cached[r]`` (only
    Redis holds it) to the cost model, ``fresh[r]`` (held nowhere) to the cost model,
    ``load_all_cached[r]`` (only Redis) to the engine that loads everything and
    ``cached[r]`` to vLLM without the connector. ``on_round`` is told of each round done.

    Returns each configuration's times (seconds) and connector counts, in round order.
    """
    times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    counts: dict[str, list[dict[str, int] | None]] = {name: [] for name in CONFIGURATIONS}
    for index, prompt in enumerate(cached):
        prompts = {
            "cost_model": prompt,
            "recompute_all": fresh[index],
            "load_all": load_all_cached[index],
            "no_connector": prompt,
        }
        pair = ["cost_model", "recompute_all"][:: 1 if index % 2 else -1]
        for name in [*pair, "load_all", "no_connector"]:
            engine = engines["cost_model" if name == "recompute_all" else name]
            with anyio.fail_after(_REQUEST_TIMEOUT):
                result = await engine.generate(f"{name}-{index}", prompts[name])
            times[name].append(result.ttft)
            counts[name].append(result.counts)
        if on_round is not None:
            on_round(index + 1)
    return {"seconds": times, "counts": counts}


async def decode_during_load(
    engine: VllmTarget, decoding: list[int], slow: list[int], *, tokens_before: int
) -> dict[str, Any]:
    """One request decodes ``decoding`` (to the model's length, past its end token);
    once it has ``tokens_before`` tokens, ``slow`` (only Redis holds it) is sent; when
    ``slow`` has its first token the decoding request is cancelled.

    Returns the decoding request's token times and the slow request's send and first-token
    times (``time.perf_counter()`` readings) and its connector counts, and whether the
    decoding request ran out of tokens before the load was over.
    """
    arrivals: list[float] = []
    reached = anyio.Event()
    outcome: dict[str, Any] = {}

    def note(count: int) -> None:
        arrivals.append(time.perf_counter())
        if count >= tokens_before:
            reached.set()

    async def decode() -> None:
        result = await engine.generate(
            "decoding",
            decoding,
            max_tokens=engine_room(engine, len(decoding)),
            ignore_eos=True,
            on_tokens=note,
        )
        outcome["decoding_finished"] = result.output_tokens
        reached.set()

    with anyio.fail_after(_REQUEST_TIMEOUT):
        async with anyio.create_task_group() as group:
            group.start_soon(decode)
            await reached.wait()
            sent = time.perf_counter()
            first: list[float] = []
            result: FirstToken = await engine.generate(
                "slow", slow, on_tokens=lambda _: first.append(time.perf_counter())
            )
            group.cancel_scope.cancel()
    return {
        "arrivals": arrivals,
        "sent": sent,
        "first_token": first[0] if first else sent + result.ttft,
        "counts": result.counts,
        "decoding_finished": "decoding_finished" in outcome,
    }


def engine_room(engine: VllmTarget, prompt_tokens: int) -> int:
    """The most tokens a request of ``prompt_tokens`` can generate on ``engine``."""
    return max(1, engine.max_model_len - prompt_tokens - 1)


def decode_figures(run: dict[str, Any]) -> dict[str, Any]:
    """The decoding request's steps before and during the load (milliseconds): their
    count, median and longest, and during the load the longest it went without a token
    (from the slow request's send to its first token)."""
    arrivals: list[float] = run["arrivals"]
    sent, loaded = run["sent"], run["first_token"]
    before_times = [t for t in arrivals if t <= sent][_PREFILL_TOKENS:]
    before = [later - earlier for earlier, later in itertools.pairwise(before_times)]
    previous = [t for t in arrivals if t <= sent][-1:]
    inside = [t for t in arrivals if sent < t <= loaded]
    during = [later - earlier for earlier, later in itertools.pairwise(previous + inside)]
    edges = [sent, *inside, loaded]
    gap = max(later - earlier for earlier, later in itertools.pairwise(edges))
    return {
        "load_s": loaded - sent,
        "before": _steps(before),
        "during": {**_steps(during), "longest_gap_ms": gap * 1000},
    }


def _steps(durations: Sequence[float]) -> dict[str, Any]:
    if not durations:
        return {"steps": 0, "median_ms": math.nan, "longest_ms": math.nan}
    return {
        "steps": len(durations),
        "median_ms": statistics.median(durations) * 1000,
        "longest_ms": max(durations) * 1000,
    }
