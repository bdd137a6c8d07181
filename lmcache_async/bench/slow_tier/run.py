"""A whole slow-tier run: the model, Redis behind two slow links, three vLLM engines, the
two measurements and their figures."""

from __future__ import annotations

import contextlib
import statistics
import sys
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread

from lmcache_async.bench.slow_tier.measure import (
    CONFIGURATIONS,
    DECODE_PROMPT_TOKENS,
    Prompts,
    decode_during_load,
    decode_figures,
    ttft_rounds,
)
from lmcache_async.bench.slow_tier.options import SlowTierOptions, redis_address
from lmcache_async.bench.throttle import ThrottleProxy
from lmcache_async.bench.tiers.local import local_redis, tempfile_directory
from lmcache_async.bench.tiny_llama import build_tiny_llama
from lmcache_async.bench.vllm_target import (
    VllmSettings,
    VllmTarget,
    check_vllm,
    open_vllm,
    read_model,
)
from lmcache_async.config import EngineConfig
from lmcache_async.errors import InvalidInputError

__all__ = ["run_slow_tier_bench", "summarise"]

FILL_BYTES_PER_S: Final = 1e9
"""The link's rate while the prompts are written to Redis (not part of any figure)."""

_CPU_STAGING_GB: Final = 0.25
"""Host memory of each connector's engine: staging only (its CPU tier keeps nothing)."""

_READ_TIMEOUT: Final = 120.0
"""Seconds a Redis call may take: a prompt read through the slow link is one call of
seconds (the engine's default, 2 s, would count the tier as failing)."""

_FILL_TIMEOUT: Final = 120.0
"""Seconds writing one prompt to Redis (or a warm-up request) may take."""


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(f"bench: {text}", file=stream, flush=True)


async def run_slow_tier_bench(
    options: SlowTierOptions, *, progress_stream: TextIO | None = sys.stderr
) -> dict[str, Any]:
    """Run both measurements and return every figure as plain data (see
    :mod:`lmcache_async.bench.slow_tier`). Progress goes to ``progress_stream`` (None:
    nowhere).

    Raises:
        InvalidInputError: the options are invalid, vLLM is not installed, the model
            directory is unusable, or redis-server cannot be started.
    """
    options.validate()
    check_vllm()
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile_directory())
        model = options.model
        if model is None:
            _say(progress_stream, "building a small random-weight Llama")
            model = await anyio.to_thread.run_sync(build_tiny_llama, f"{scratch}/model")
        info = read_model(model)
        max_model_len = min(info.max_positions or 4096, 4096)
        if options.prompt_tokens >= max_model_len:
            raise InvalidInputError(
                f"prompt_tokens ({options.prompt_tokens}) must be below the model's length "
                f"({max_model_len})"
            )
        url = options.redis_url or stack.enter_context(local_redis(scratch))
        host, port = redis_address(url)
        rate = options.link_bytes_per_s
        links = {
            name: stack.enter_context(ThrottleProxy(host, port, bytes_per_s=rate))
            for name in ("load_all", "cost_model")
        }
        prompts = Prompts(options.seed, info.vocab_size)
        cached = [prompts.draw(options.prompt_tokens) for _ in range(options.rounds)]
        load_all_cached = [prompts.draw(options.prompt_tokens) for _ in range(options.rounds)]
        slow = prompts.draw(options.prompt_tokens)
        fresh = [prompts.draw(options.prompt_tokens) for _ in range(options.rounds)]
        decoding = prompts.draw(DECODE_PROMPT_TOKENS)
        problems: list[str] = []
        started: dict[str, float] = {}

        def settings(connector: bool = True) -> VllmSettings:
            return VllmSettings(
                model=model,
                kv_cache_gb=options.kv_cache_gb,
                dtype="float32",  # the small model's, so its KV is 2 KiB a token
                executor="uni",
                connector=connector,
                max_num_batched_tokens=options.chunk_size,
                seed=options.seed,
            )

        def config(link: ThrottleProxy, **extra: Any) -> EngineConfig:
            return EngineConfig(
                chunk_size=options.chunk_size,
                local_cpu=False,
                max_local_cpu_size=_CPU_STAGING_GB,
                remote_url=link.url,
                remote_timeout=_READ_TIMEOUT,
                **extra,
            )

        async with contextlib.AsyncExitStack() as engines:

            async def start(name: str, *args: Any, **kwargs: Any) -> VllmTarget:
                _say(progress_stream, f"starting vLLM: {name}")
                target: VllmTarget = await engines.enter_async_context(
                    open_vllm(*args, max_model_len=max_model_len, **kwargs)
                )
                started[name] = target.startup_seconds
                return target

            # Told prefill is slow (1 token/s), this engine loads every hit however slow; its
            # stores wait for Redis, so the prompts it writes there are in once it answers.
            load_all = await start(
                "load_all",
                settings(),
                config(links["load_all"], wait_for_slow_tiers=True),
                connector_options={"prefill_tokens_per_s": 1, "prefetch_timeout": 60},
            )
            _say(progress_stream, "writing the cached prompts to Redis")
            links["load_all"].set_rate(FILL_BYTES_PER_S)
            for index, prompt in enumerate([*cached, *load_all_cached, slow]):
                with anyio.fail_after(_FILL_TIMEOUT):
                    stored = await load_all.generate(f"fill-{index}", prompt)
                if (stored.counts or {}).get("stored_tokens") != len(prompt):
                    problems.append(f"prompt {index} was not stored whole: {stored.counts}")
            links["load_all"].set_rate(rate)
            # The cost model measures the prefill speed; store_threshold 2 keeps the fresh
            # prompts it recomputes out of Redis (seen once), so nothing it does writes.
            cost_model = await start(
                "cost_model",
                settings(),
                config(links["cost_model"], store_threshold=2),
                connector_options={"prefetch_timeout": 60},
            )
            for index in range(2):  # its prefill speed is measured from these steps
                with anyio.fail_after(_FILL_TIMEOUT):
                    await cost_model.generate(f"warm-{index}", prompts.draw(options.prompt_tokens))
            plain = await start("no_connector", settings(connector=False), EngineConfig())

            _say(progress_stream, f"{options.rounds} rounds of time to first token")
            ttft = await ttft_rounds(
                {"cost_model": cost_model, "load_all": load_all, "no_connector": plain},
                cached,
                load_all_cached,
                fresh,
                on_round=lambda done: _say(progress_stream, f"round {done}/{options.rounds}"),
            )
            costs = (await cost_model.stats()).get("load_costs", {})
            _say(progress_stream, "decode steps during a slow load")
            decode = await decode_during_load(
                load_all, decoding, slow, tokens_before=options.decode_tokens_before
            )
    problems += _check(options, ttft, decode)
    return summarise(options, ttft, decode, costs=costs, startup=started, problems=problems)


def _check(options: SlowTierOptions, ttft: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    """What makes a figure meaningless: a configuration that did not do what it stands
    for, or a decoding request that ended before the load."""
    problems = []
    whole = (options.prompt_tokens - 1) // options.chunk_size * options.chunk_size
    for index, counts in enumerate(ttft["counts"]["load_all"]):
        if (counts or {}).get("loaded_tokens", 0) < whole:
            problems.append(f"load_all round {index} did not load the prompt: {counts}")
    for index, counts in enumerate(ttft["counts"]["recompute_all"]):
        if (counts or {}).get("external_tokens", 0):
            problems.append(f"recompute_all round {index} found tokens cached: {counts}")
    if (decode["counts"] or {}).get("loaded_tokens", 0) < whole:
        problems.append(f"the slow request did not load its prompt: {decode['counts']}")
    if decode["decoding_finished"]:
        problems.append("the decoding request ran out of tokens before the load was over")
    return problems


def summarise(
    options: SlowTierOptions,
    ttft: dict[str, Any],
    decode: dict[str, Any],
    *,
    costs: dict[str, Any],
    startup: dict[str, float],
    problems: list[str],
) -> dict[str, Any]:
    """The results: every time and count, the medians, the ratios and the decode
    figures."""
    seconds: dict[str, list[float]] = ttft["seconds"]
    medians = {name: statistics.median(seconds[name]) for name in CONFIGURATIONS}
    better = min(medians["load_all"], medians["recompute_all"])
    return {
        "options": options.as_dict(),
        "ttft": {
            "median_ms": {name: value * 1000 for name, value in medians.items()},
            "ratios": {
                "cost_model_over_better": medians["cost_model"] / better,
                "cost_model_over_recompute_all": medians["cost_model"] / medians["recompute_all"],
                "cost_model_over_load_all": medians["cost_model"] / medians["load_all"],
                "load_all_over_recompute_all": medians["load_all"] / medians["recompute_all"],
                "cost_model_over_no_connector": medians["cost_model"] / medians["no_connector"],
            },
            "runs_ms": {name: [v * 1000 for v in seconds[name]] for name in CONFIGURATIONS},
            "loaded_tokens": {
                name: [(c or {}).get("loaded_tokens", 0) for c in ttft["counts"][name]]
                for name in ("cost_model", "load_all")
            },
            "load_costs": costs,
        },
        "decode": {
            **decode_figures(decode),
            "loaded_tokens": (decode["counts"] or {}).get("loaded_tokens", 0),
        },
        "startup_s": startup,
        "problems": problems,
    }
