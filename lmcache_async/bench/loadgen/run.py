"""A whole load run: open the target, drive the workload, collect the results."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

import anyio

from lmcache_async import EngineConfig, InvalidInputError
from lmcache_async.bench.loadgen.driver import max_in_flight, timed_run
from lmcache_async.bench.loadgen.options import VLLM_OPERATIONS, LoadOptions
from lmcache_async.bench.loadgen.results import load_results, vllm_results
from lmcache_async.bench.loadgen.runner import CacheRunner, OnRequest, VllmRunner
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.loadgen.targets import open_target
from lmcache_async.bench.vllm_target import open_vllm, read_model
from lmcache_async.logging import get_logger

__all__ = ["run_load", "run_load_async"]

log = get_logger(__name__)


async def run_load_async(
    options: LoadOptions,
    config: EngineConfig,
    *,
    progress_stream: TextIO | None = None,
    on_request: OnRequest | None = None,
) -> dict[str, Any]:
    """Run the workload against the target and return every figure as plain data.

    Args:
        options: the workload, target and model shape.
        config: the embedded engine's configuration (its ``chunk_size`` cuts the chunks);
            a sidecar has its own. With target ``vllm``, the connector's configuration.
        progress_stream: where progress goes when ``options.progress``; stderr when None.
        on_request: told of each request that ended, with the run's tally (a test drives
            faults from it); True from it starts no more requests. It runs on the event
            loop and must not block.

    Raises:
        InvalidInputError: the options are invalid, or the sidecar serves another
            namespace; with target ``vllm``, the workload's prompts do not fit the model.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
    """
    options.validate()
    stream = sys.stderr if progress_stream is None else progress_stream
    if options.target == "vllm":
        return await _run_vllm(options, config, stream, on_request)
    workload = options.make_workload()
    layout = options.layout()
    tally = Tally()
    async with open_target(options, config, layout) as target:
        in_flight = max_in_flight(options, workload)
        runner = CacheRunner(
            options,
            layout,
            target,
            slots=in_flight,
            max_prompt_tokens=workload.max_prompt_tokens,
            tally=tally,
            on_request=on_request,
        )
        wall = await timed_run(options, workload, runner, in_flight, tally=tally, stream=stream)
        stats = await target.stats()
        tally.count_engine_errors(stats)
        finish = await target.finish()
        chunk_size = target.chunk_size
    return load_results(
        options,
        config,
        workload,
        layout=layout,
        tally=tally,
        wall=wall,
        stats=stats,
        finish=finish,
        chunk_size=chunk_size,
        in_flight=in_flight,
    )


async def _run_vllm(
    options: LoadOptions, config: EngineConfig, stream: TextIO, on_request: OnRequest | None
) -> dict[str, Any]:
    """The workload against vLLM (see :func:`run_load_async`)."""
    model = read_model(options.model)
    # Prompt tokens must be token ids of the model.
    options = dataclasses.replace(options, vocab_size=min(options.vocab_size, model.vocab_size))
    settings = options.vllm_settings()
    workload = options.make_workload()
    max_model_len = workload.max_prompt_tokens + options.max_tokens
    if model.max_positions is not None and max_model_len > model.max_positions:
        raise InvalidInputError(
            f"prompts of up to {workload.max_prompt_tokens} tokens plus {options.max_tokens} "
            f"generated exceed the model's max_position_embeddings ({model.max_positions}): "
            "lower the workload's prompt lengths"
        )
    tally = Tally(operations=VLLM_OPERATIONS)
    sidecar_url = options.url if options.connector else None
    async with open_vllm(
        settings, config, max_model_len=max_model_len, sidecar_url=sidecar_url
    ) as target:
        in_flight = max_in_flight(options, workload)
        runner = VllmRunner(target, tally, on_request)
        wall = await timed_run(options, workload, runner, in_flight, tally=tally, stream=stream)
        try:
            stats = await target.stats()
        except Exception as exc:  # the statistics are a report, not the measurement
            log.warning("bench_vllm_stats_failed", error=repr(exc))
            stats = {}
        run = {
            "model": model.path,
            "vocab_size": model.vocab_size,
            "max_model_len": max_model_len,
            "startup_seconds": target.startup_seconds,
            "warmup_seconds": target.warmup_seconds,
            "connector": (
                "none" if not options.connector else "sidecar" if sidecar_url else "embedded"
            ),
        }
        chunk_size = target.chunk_size
    return vllm_results(
        options,
        config,
        workload,
        tally=tally,
        wall=wall,
        stats=stats,
        run=run,
        chunk_size=chunk_size,
        in_flight=in_flight,
    )


def run_load(
    options: LoadOptions, config: EngineConfig, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_load_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid, or the sidecar serves another
            namespace.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
    """

    async def main() -> dict[str, Any]:
        return await run_load_async(options, config, progress_stream=progress_stream)

    return anyio.run(main)
