"""Which benchmark the flags of ``lmcache-async bench`` run, and what it prints."""

from __future__ import annotations

import argparse
from typing import Any

from lmcache_async.cli.bench import modes
from lmcache_async.cli.bench.modes import Outcome
from lmcache_async.cli.common import EXIT_FAILED, EXIT_OK
from lmcache_async.config import EngineConfig

__all__ = ["run_bench"]


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags choose, print its summary and write ``--json``;
    exit 1 when it ran but found errors, 2 when no sidecar answers at ``--url``.

    Raises:
        ConfigError: the engine refuses the configuration.
        InvalidInputError: the options are invalid.
        OSError: a result file cannot be written.
    """
    from lmcache_async.bench import write_json  # noqa: PLC0415

    outcome = _run_mode(args, _engine_config(args))
    if isinstance(outcome, int):
        return outcome
    if args.json:
        write_json(args.json, outcome.results)
    if not args.quiet:
        print(outcome.summary)
    return EXIT_FAILED if outcome.failed else EXIT_OK


def _run_mode(args: argparse.Namespace, config: EngineConfig) -> Outcome | int:
    """The outcome of the benchmark the flags choose, or the exit status it failed with."""
    if args.trace or args.trace_generate:
        return modes.trace(args, config)
    if args.tiers:
        return modes.tiers(args)
    if args.redis:
        return modes.redis(args, config)
    if args.scale:
        return modes.scale(args, config)
    if args.vllm_slow_tier:
        return modes.slow_tier(args)
    if args.routing:
        return modes.routing(args)
    if args.shared_redis:
        return modes.shared_redis(args)
    if args.sidecar:
        return modes.sidecar(args, config)
    if args.gpu:
        return modes.gpu(args, config)
    if args.micro:
        return modes.micro(args, config)
    return modes.load(args, config)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration of ``--config`` with ``--chunk-size`` and ``--cache-gb``.

    Raises:
        ConfigError: the file or an override is invalid.
    """
    overrides: dict[str, Any] = {}
    if args.chunk_size is not None:
        overrides["chunk_size"] = args.chunk_size
    if args.cache_gb is not None:
        overrides["max_local_cpu_size"] = args.cache_gb
    return EngineConfig.load(args.config, **overrides)
