"""Each benchmark of ``lmcache-async bench``: its options from the flags, its run, its summary.

Every function imports its benchmark when called, so that the CLI's other commands do not
pay for torch or vLLM.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import anyio

from lmcache_async.cli.common import EXIT_FAILED, EXIT_USAGE
from lmcache_async.config import EngineConfig

__all__ = [
    "Outcome",
    "gpu",
    "load",
    "micro",
    "redis",
    "routing",
    "scale",
    "shared_redis",
    "sidecar",
    "slow_tier",
    "tiers",
    "trace",
]


@dataclass(frozen=True)
class Outcome:
    """What a benchmark that ran leaves: its figures, their summary, whether it found errors."""

    results: dict[str, Any]
    summary: str
    failed: bool


def _progress(args: argparse.Namespace) -> TextIO | None:
    """Where a benchmark shows its progress: stderr, or nowhere under ``--quiet``."""
    return None if args.quiet else sys.stderr


def _with_servers(
    run: Callable[[], Awaitable[dict[str, Any]]],
    summary: Callable[[dict[str, Any]], str],
    failures: tuple[type[BaseException], ...],
) -> Outcome | int:
    """Run a benchmark that starts servers: one that fails to start or answer (one of
    ``failures``) is said on stderr and exits 1."""
    try:
        results = anyio.run(run)
    except failures as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return Outcome(results, summary(results), bool(results["problems"]))


def tiers(args: argparse.Namespace) -> Outcome:
    """``--tiers``: disk and Redis throughput next to raw I/O of the same bytes."""
    from lmcache_async.bench.tiers import format_tiers, run_tiers_bench  # noqa: PLC0415

    results = anyio.run(functools.partial(run_tiers_bench, redis_url=args.redis_url))
    return Outcome(results, format_tiers(results), failed=False)


def redis(args: argparse.Namespace, config: EngineConfig) -> Outcome:
    """``--redis``: a request's chunks only in Redis, embedded and through a sidecar, next
    to a plain socket; a fresh engine's first store next to its steady state.

    Raises:
        InvalidInputError: a setting is invalid, or no redis-server to start.
    """
    from lmcache_async.bench.redis import (  # noqa: PLC0415
        RedisBenchOptions,
        format_redis,
        run_redis_bench,
    )

    chunk_tokens = args.chunk_size
    options = RedisBenchOptions(
        chunks=args.redis_chunks,
        chunk_tokens=RedisBenchOptions().chunk_tokens if chunk_tokens is None else chunk_tokens,
        rounds=args.redis_rounds,
        seed=args.seed,
        redis_url=args.redis_url,
    )
    options.validate()  # bad settings are usage errors before anything starts
    run = functools.partial(run_redis_bench, options, config, progress_stream=_progress(args))
    results = anyio.run(run)
    return Outcome(results, format_redis(results), bool(results["problems"]))


def scale(args: argparse.Namespace, config: EngineConfig) -> Outcome:
    """``--scale``: the tiers at growing N chunks.

    Raises:
        InvalidInputError: a setting is invalid.
    """
    from lmcache_async.bench import scale as bench  # noqa: PLC0415

    options = bench.ScaleOptions(
        sizes=bench.parse_sizes(args.scale_sizes),
        tiers=tuple(tier.strip() for tier in args.scale_tiers.split(",")),
        requests=args.scale_requests,
        seed=args.seed,
        work_dir=args.work_dir,
    )
    options.validate()  # bad settings are usage errors before anything starts
    run = functools.partial(bench.run_scale_bench, options, config, progress_stream=_progress(args))
    results = anyio.run(run)
    return Outcome(results, bench.format_scale(results), bool(results["problems"]))


def slow_tier(args: argparse.Namespace) -> Outcome:
    """``--vllm-slow-tier``: vLLM with a prompt only a slow Redis holds.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM is not installed.
    """
    from lmcache_async.bench.slow_tier import (  # noqa: PLC0415
        SlowTierOptions,
        format_slow_tier,
        run_slow_tier_bench,
    )

    options = SlowTierOptions(
        rounds=args.rounds,
        prompt_tokens=args.prompt_tokens,
        link_bytes_per_s=args.link_mb_per_s * 1e6,
        chunk_size=args.chunk_size or SlowTierOptions().chunk_size,
        model=args.model,
        redis_url=args.redis_url,
        seed=args.seed,
    )
    options.validate()  # bad settings are usage errors before anything starts
    run = functools.partial(run_slow_tier_bench, options, progress_stream=_progress(args))
    results = anyio.run(run)
    return Outcome(results, format_slow_tier(results), bool(results["problems"]))


def routing(args: argparse.Namespace) -> Outcome | int:
    """``--routing``: two vLLM servers behind a KV-aware router.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM or Dynamo's indexer is missing.
    """
    import httpx  # noqa: PLC0415

    from lmcache_async.bench.routing import (  # noqa: PLC0415
        RoutingOptions,
        format_routing,
        run_routing_bench,
    )
    from lmcache_async.bench.routing.indexer import IndexerError  # noqa: PLC0415
    from lmcache_async.bench.routing.server import ServerError  # noqa: PLC0415

    options = RoutingOptions(
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        requests=args.requests,
        seed=args.seed,
        vllm_cache_prefixes=args.vllm_cache_prefixes,
        cpu_tier_prefixes=args.cpu_tier_prefixes,
        chunk_size=args.chunk_size or RoutingOptions().chunk_size,
        model=args.model,
        work_dir=args.work_dir,
    )
    options.validate()  # bad settings are usage errors before anything starts
    run = functools.partial(run_routing_bench, options, progress_stream=_progress(args))
    return _with_servers(run, format_routing, (ServerError, IndexerError, httpx.HTTPError))


def shared_redis(args: argparse.Namespace) -> Outcome | int:
    """``--shared-redis``: two hosts sharing one Redis.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM is missing.
    """
    import httpx  # noqa: PLC0415

    from lmcache_async.bench.routing.server import ServerError  # noqa: PLC0415
    from lmcache_async.bench.shared_redis import (  # noqa: PLC0415
        SharedRedisOptions,
        format_shared_redis,
        run_shared_redis_bench,
    )

    options = SharedRedisOptions(
        prefixes=args.shared_prefixes,
        prefix_tokens=args.shared_prefix_tokens,
        max_tokens=args.shared_max_tokens,
        seed=args.seed,
        chunk_size=args.chunk_size or SharedRedisOptions().chunk_size,
        model=args.model,
        work_dir=args.work_dir,
    )
    options.validate()  # bad settings are usage errors before anything starts
    run = functools.partial(run_shared_redis_bench, options, progress_stream=_progress(args))
    return _with_servers(run, format_shared_redis, (ServerError, httpx.HTTPError))


def sidecar(args: argparse.Namespace, config: EngineConfig) -> Outcome:
    """``--sidecar``: store/retrieve through a sidecar next to in-process."""
    from lmcache_async.bench.sidecar import (  # noqa: PLC0415
        SidecarBenchOptions,
        format_sidecar,
        run_sidecar_bench,
    )

    options = SidecarBenchOptions(curve=args.curve)
    results: dict[str, Any] = anyio.run(functools.partial(run_sidecar_bench, options, config))
    return Outcome(results, format_sidecar(results), bool(results.get("problems")))


def gpu(args: argparse.Namespace, config: EngineConfig) -> Outcome:
    """``--gpu``: D2H and H2D with KV caches on the GPU next to a plain pinned copy.

    Raises:
        InvalidInputError: a setting is invalid.
    """
    from lmcache_async.bench import write_json  # noqa: PLC0415
    from lmcache_async.bench.gpu import GpuOptions, format_gpu, run_gpu_bench  # noqa: PLC0415

    options = GpuOptions(
        seed=args.seed,
        tokens=args.tokens,
        repeat=args.repeat,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        device=args.device,
    )
    options.validate()
    # The figures so far are saved after each part: a later hang loses none of them.
    checkpoint = functools.partial(write_json, args.json) if args.json else None
    results = run_gpu_bench(options, config, checkpoint=checkpoint)
    return Outcome(results, format_gpu(results), bool(results["problems"]))


def micro(args: argparse.Namespace, config: EngineConfig) -> Outcome:
    """``--micro``: the copy, lookup and hashing micro-benchmarks.

    Raises:
        InvalidInputError: a setting is invalid.
    """
    from lmcache_async.bench.micro import MicroOptions, format_micro, run_micro  # noqa: PLC0415

    options = MicroOptions(
        seed=args.seed,
        tokens=args.tokens,
        lookup_tokens=args.lookup_tokens,
        repeat=args.repeat,
        overhead_tokens=min(MicroOptions().overhead_tokens, args.tokens),
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
    )
    options.validate()
    results = run_micro(options, config)
    return Outcome(results, format_micro(results), bool(results["problems"]))


def load(args: argparse.Namespace, config: EngineConfig) -> Outcome | int:
    """The load generator: a workload against an embedded engine, a sidecar or vLLM.

    Raises:
        InvalidInputError: a setting is invalid.
    """
    from lmcache_async.bench.loadgen import (  # noqa: PLC0415
        LoadOptions,
        check_plotting,
        format_summary,
        run_load,
        write_plot,
    )
    from lmcache_async.errors import ProtocolError, TierUnavailableError  # noqa: PLC0415

    options = LoadOptions(
        workload=args.workload,
        target=args.target,
        url=args.url,
        model_name=args.model_name,
        seed=args.seed,
        duration=args.duration,
        concurrency=LoadOptions().concurrency if args.concurrency is None else args.concurrency,
        rate=args.rate,
        arrival=args.arrival,
        users=args.users,
        system_prompt_tokens=args.system_prompt_tokens,
        turn_tokens=args.turn_tokens,
        max_context_tokens=args.max_context_tokens,
        documents=args.documents,
        questions=args.questions,
        document_tokens=args.document_tokens,
        question_tokens=args.question_tokens,
        min_prompt_tokens=args.min_prompt_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        verify_every=args.verify_every,
        store_ahead=args.store_ahead,
        progress=not args.quiet,
        model=args.model,
        max_tokens=args.max_tokens,
        kv_cache_gb=args.kv_cache_gb,
        vllm_dtype=args.vllm_dtype,
        vllm_executor=args.vllm_executor,
        connector=not args.no_connector,
    )
    options.validate()
    options.make_workload()  # bad sizes are usage errors before anything starts
    if args.plot:
        check_plotting()
    try:
        results = run_load(options, config)
    except (TierUnavailableError, ProtocolError) as exc:  # no usable sidecar at --url
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    failed = bool(results["errors_total"] or results.get("verify_failures"))
    if args.plot:
        write_plot(results, args.plot)
    return Outcome(results, format_summary(results), failed)


def trace(args: argparse.Namespace, config: EngineConfig) -> Outcome | int:
    """``--trace``: a production trace replayed against a target, beside its bounds;
    ``--trace-generate``: a synthetic trace written first (and alone, without ``--trace``).

    Raises:
        InvalidInputError: a setting is invalid, or a line of the trace is bad.
        OSError: the trace cannot be read or written.
    """
    from lmcache_async.bench.loadgen import check_plotting  # noqa: PLC0415
    from lmcache_async.bench.trace import (  # noqa: PLC0415
        TraceOptions,
        format_trace,
        generate_trace,
        parse_capacities,
        run_trace,
        write_sweep_plot,
    )
    from lmcache_async.errors import (  # noqa: PLC0415
        InvalidInputError,
        ProtocolError,
        TierUnavailableError,
    )

    block_size = args.trace_block_size
    if args.trace_generate:
        path, requests = args.trace_generate, args.trace_requests
        ids = generate_trace(path, requests=requests, seed=args.seed, block_size=block_size)
        wrote = f"wrote {path}: {requests} requests, {ids} hash ids of {block_size} tokens"
        if not args.trace:
            generated = {"path": path, "requests": requests, "hash_ids": ids}
            return Outcome({"generated": generated}, wrote, failed=False)
        if not args.quiet:
            print(wrote, file=sys.stderr)
    if args.chunk_size is not None and args.chunk_size != block_size:
        raise InvalidInputError(
            f"--chunk-size {args.chunk_size} differs from --trace-block-size {block_size}: the "
            "engine's chunk is the trace's block"
        )
    options = TraceOptions(
        path=args.trace,
        block_size=block_size,
        limit=args.limit,
        target=args.target,
        url=args.url,
        model_name=args.model_name,
        seed=args.seed,
        concurrency=1 if args.concurrency is None else args.concurrency,
        speed=args.speed,
        cpu_tokens=args.trace_cpu_tokens,
        disk_tokens=args.trace_disk_tokens,
        capacities=parse_capacities(args.capacities) if args.capacities else (),
        sweep_replay=args.sweep_replay,
        vocab_size=args.trace_vocab,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        kv_block_size=args.block_size,
        verify_every=args.verify_every,
        store_ahead=args.store_ahead,
        beside_embedded=args.beside_embedded,
        progress=not args.quiet,
        work_dir=args.work_dir,
        model=args.model,
        max_tokens=args.max_tokens,
        kv_cache_gb=args.kv_cache_gb,
        vllm_dtype=args.vllm_dtype,
        vllm_executor=args.vllm_executor,
        connector=not args.no_connector,
    )
    options.validate()  # bad settings are usage errors before anything starts
    if args.plot:
        check_plotting()
        if not options.capacities:
            raise InvalidInputError("--plot with --trace draws a capacity sweep: give --capacities")
    try:
        results = run_trace(options, config, progress_stream=_progress(args))
    except (TierUnavailableError, ProtocolError) as exc:  # no usable sidecar
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        write_sweep_plot(results, args.plot)
    failed = bool(results["errors_total"] or results["verify_failures"])
    return Outcome(results, format_trace(results), failed)
