"""``lmcache-async bench``: its flags, and which benchmark they run.

Without a mode flag it runs the load generator (:mod:`lmcache_async.bench.loadgen`);
``--micro``, ``--tiers``, ``--sidecar``, ``--gpu``, ``--vllm-slow-tier``, ``--routing``,
``--shared-redis`` and ``--scale`` run the other benchmarks.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from lmcache_async.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from lmcache_async.config import EngineConfig

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` and its flags to the subcommands ``sub``."""
    # Imported here so that ``check-config`` does not pay for torch.
    from lmcache_async.bench import DTYPES  # noqa: PLC0415
    from lmcache_async.bench.loadgen import ARRIVALS, TARGETS, LoadOptions  # noqa: PLC0415
    from lmcache_async.bench.micro import MicroOptions  # noqa: PLC0415
    from lmcache_async.bench.routing.options import RoutingOptions  # noqa: PLC0415
    from lmcache_async.bench.scale.options import TIERS, ScaleOptions  # noqa: PLC0415
    from lmcache_async.bench.shared_redis.options import SharedRedisOptions  # noqa: PLC0415
    from lmcache_async.bench.slow_tier.options import SlowTierOptions  # noqa: PLC0415
    from lmcache_async.bench.vllm_target import VLLM_EXECUTORS  # noqa: PLC0415
    from lmcache_async.bench.workloads import WORKLOADS  # noqa: PLC0415

    emb = LoadOptions()
    mic = MicroOptions()
    sto = SlowTierOptions()
    rto = RoutingOptions()
    sco = ScaleOptions()
    sro = SharedRedisOptions()
    bench = sub.add_parser(
        "bench",
        help="run the load generator (or --micro)",
        description="A workload (multi-round chat, long-document QA or random prompts) "
        "against an embedded engine or a sidecar, with real KV tensors, or against vLLM with "
        "the connector (time to first token); or with --micro the copy/lookup/hashing "
        "micro-benchmarks.",
    )
    bench.add_argument("--micro", action="store_true", help="run the micro-benchmarks")
    bench.add_argument(
        "--tiers",
        action="store_true",
        help="disk and Redis put/get GB/s next to raw file and redis-py I/O of the same bytes",
    )
    bench.add_argument(
        "--sidecar",
        action="store_true",
        help="store/retrieve GB/s through a sidecar next to in-process, lookup round trips",
    )
    bench.add_argument(
        "--curve",
        action="store_true",
        help="--sidecar: also run the work through a sidecar under CURVE with an allow-list, "
        "beside the plain one",
    )
    bench.add_argument(
        "--gpu",
        action="store_true",
        help="store/retrieve D2H and H2D GB/s with KV caches on the GPU next to a plain pinned "
        "copy_, and layerwise retrieve overlapped with a simulated compute",
    )
    bench.add_argument(
        "--vllm-slow-tier",
        action="store_true",
        help="vLLM with a prompt only Redis holds behind a slow link: time to first token of "
        "the cost model next to loading everything, recomputing everything and no connector; "
        "another request's decode steps during a slow load next to its steps before",
    )
    bench.add_argument(
        "--routing",
        action="store_true",
        help="two vLLM servers, each with its own CPU tier, behind a KV-aware router (NVIDIA "
        "Dynamo's indexer): hit rate and time to first token of round robin, routing by "
        "vLLM's own KV events and routing by every tier's",
    )
    bench.add_argument(
        "--shared-redis",
        action="store_true",
        help="two hosts (a sidecar and vLLM each) sharing one Redis: time to first token of "
        "host B on prompts only host A saw (read from Redis) next to A's own warm hit",
    )
    bench.add_argument(
        "--scale",
        action="store_true",
        help="the CPU, disk and Redis tiers at growing N chunks: open time, time to a first "
        "RAM hit, the disk index next to a names-only walk, store/lookup/retrieve p50",
    )
    bench.add_argument(
        "--redis-url",
        default=None,
        help="--tiers, --vllm-slow-tier: this Redis (default: start a redis-server)",
    )
    bench.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    bench.add_argument("--seed", type=int, default=emb.seed)
    bench.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress and no summary")
    bench.add_argument("--plot", metavar="PATH.png", help="draw latency and hit rate over time")

    shape = bench.add_argument_group("model shape")
    shape.add_argument("--layers", type=int, default=emb.num_layers)
    shape.add_argument("--kv-heads", type=int, default=emb.num_kv_heads)
    shape.add_argument("--head-size", type=int, default=emb.head_size)
    shape.add_argument("--dtype", choices=tuple(DTYPES), default=emb.dtype)
    shape.add_argument("--block-size", type=int, default=emb.block_size)
    shape.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default: the config's)"
    )
    shape.add_argument(
        "--cache-gb",
        type=float,
        default=None,
        help="host cache size in GB (default: the config's max_local_cpu_size)",
    )

    load = bench.add_argument_group("load run")
    load.add_argument("--workload", choices=WORKLOADS, default=emb.workload)
    load.add_argument(
        "--target",
        choices=TARGETS,
        default=emb.target,
        help="embedded: an engine in this process; sidecar: lmcache-async serve at --url; "
        "vllm: vLLM on --model with the lmcache_async connector",
    )
    load.add_argument(
        "--url",
        default=None,
        help="the sidecar's ipc:// or tcp:// URL (with --target vllm: the connector's cache)",
    )
    load.add_argument("--model-name", default=emb.model_name, help="the cache namespace")
    load.add_argument("--duration", type=float, default=emb.duration, metavar="SECONDS")
    load.add_argument("--concurrency", type=int, default=emb.concurrency, help="in flight")
    load.add_argument(
        "--rate",
        type=float,
        default=emb.rate,
        metavar="REQ_PER_S",
        help="request arrival rate (0: as fast as --concurrency allows)",
    )
    load.add_argument("--arrival", choices=ARRIVALS, default=emb.arrival)
    load.add_argument("--users", type=int, default=emb.users, help="multi-round-chat")
    load.add_argument("--system-prompt-tokens", type=int, default=emb.system_prompt_tokens)
    load.add_argument("--turn-tokens", type=int, default=emb.turn_tokens)
    load.add_argument("--max-context-tokens", type=int, default=emb.max_context_tokens)
    load.add_argument("--documents", type=int, default=emb.documents, help="long-doc-qa")
    load.add_argument("--questions", type=int, default=emb.questions, help="per document")
    load.add_argument("--document-tokens", type=int, default=emb.document_tokens)
    load.add_argument("--question-tokens", type=int, default=emb.question_tokens)
    load.add_argument("--min-prompt-tokens", type=int, default=emb.min_prompt_tokens, help="random")
    load.add_argument("--max-prompt-tokens", type=int, default=emb.max_prompt_tokens, help="random")
    load.add_argument(
        "--verify-every",
        type=int,
        default=emb.verify_every,
        metavar="N",
        help="check every N-th retrieve bit for bit (0: never)",
    )

    vllm = bench.add_argument_group("vLLM target (--target vllm)")
    vllm.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory (nothing is downloaded); a small random one: "
        "python -m lmcache_async.bench.tiny_llama DIR",
    )
    vllm.add_argument(
        "--max-tokens", type=int, default=emb.max_tokens, help="tokens generated per request"
    )
    vllm.add_argument(
        "--kv-cache-gb", type=float, default=emb.kv_cache_gb, help="vLLM's paged KV memory (GiB)"
    )
    vllm.add_argument(
        "--vllm-dtype", default=emb.vllm_dtype, help="model dtype in vLLM (auto: the config's)"
    )
    vllm.add_argument(
        "--vllm-executor",
        choices=VLLM_EXECUTORS,
        default=emb.vllm_executor,
        help="mp: vLLM's worker in its own process (vLLM's default); uni: in the engine core "
        "process (starts faster)",
    )
    vllm.add_argument(
        "--no-connector",
        action="store_true",
        help="plain vLLM without the cache: a baseline time to first token",
    )

    slow = bench.add_argument_group(
        "vLLM with a slow Redis tier (--vllm-slow-tier; also takes --model, --chunk-size)"
    )
    slow.add_argument("--rounds", type=int, default=sto.rounds, help="time-to-first-token rounds")
    slow.add_argument(
        "--link-mb-per-s",
        type=float,
        default=sto.link_bytes_per_s / 1e6,
        help="the rate of the link between the connector and Redis (MB/s, each way)",
    )
    slow.add_argument(
        "--prompt-tokens", type=int, default=sto.prompt_tokens, help="tokens of each prompt"
    )

    routing = bench.add_argument_group(
        "KV-aware routing (--routing; also takes --model, --seed, --chunk-size)"
    )
    routing.add_argument(
        "--prefixes", type=int, default=rto.prefixes, help="shared prefixes the requests repeat"
    )
    routing.add_argument(
        "--prefix-tokens", type=int, default=rto.prefix_tokens, help="tokens of each prefix"
    )
    routing.add_argument(
        "--requests", type=int, default=rto.requests, help="requests of each policy, in turn"
    )
    routing.add_argument(
        "--vllm-cache-prefixes",
        type=int,
        default=None,
        help="prefixes vLLM's own KV cache holds (default: a quarter of --prefixes)",
    )
    routing.add_argument(
        "--cpu-tier-prefixes",
        type=int,
        default=None,
        help="prefixes each server's CPU tier holds (default: 60%% of --prefixes)",
    )
    routing.add_argument(
        "--work-dir",
        default=None,
        metavar="DIR",
        help="--routing: where the model and the servers' and indexers' logs go; --scale: "
        "where the disk directories go, kept and used again by a later run (default: a "
        "temporary directory, removed after)",
    )

    shared = bench.add_argument_group(
        "two hosts through Redis (--shared-redis; also takes --model, --seed, --chunk-size, "
        "--work-dir)"
    )
    shared.add_argument(
        "--shared-prefixes", type=int, default=sro.prefixes, help="prompts sent in each phase"
    )
    shared.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=sro.prefix_tokens,
        help="cached tokens of each prompt (whole chunks)",
    )
    shared.add_argument(
        "--shared-max-tokens",
        type=int,
        default=sro.max_tokens,
        help="tokens generated per request (A's warm and B's are compared)",
    )

    scale = bench.add_argument_group("tiers at growing N (--scale; also takes --work-dir, --seed)")
    scale.add_argument(
        "--scale-sizes",
        default=",".join(map(str, sco.sizes)),
        metavar="N,N,...",
        help="chunks each tier holds, one size after the other (10k: ten thousand)",
    )
    scale.add_argument(
        "--scale-tiers", default=",".join(sco.tiers), metavar="TIER,...", help=f"of {TIERS}"
    )
    scale.add_argument(
        "--scale-requests", type=int, default=sco.requests, help="requests timed at each size"
    )

    micro = bench.add_argument_group("micro-benchmarks (--micro)")
    micro.add_argument("--tokens", type=int, default=mic.tokens, help="tokens per copy")
    micro.add_argument("--lookup-tokens", type=int, default=mic.lookup_tokens)
    micro.add_argument("--repeat", type=int, default=mic.repeat, help="measured copy runs")

    gpu = bench.add_argument_group("GPU benchmark (--gpu; also takes --tokens and --repeat)")
    gpu.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else the CPU path), cuda, cuda:N or cpu",
    )


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


def _run_sidecar_bench(run: Any, config: EngineConfig, *, curve: bool) -> dict[str, Any]:
    """Run the async sidecar benchmark to completion."""
    import anyio  # noqa: PLC0415

    from lmcache_async.bench.sidecar import SidecarBenchOptions  # noqa: PLC0415

    options = SidecarBenchOptions(curve=curve)
    result: dict[str, Any] = anyio.run(functools.partial(run, options, config))
    return result


def _run_slow_tier_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--vllm-slow-tier`` with the flags' settings.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM is not installed.
    """
    import anyio  # noqa: PLC0415

    from lmcache_async.bench.slow_tier import SlowTierOptions, run_slow_tier_bench  # noqa: PLC0415

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
    stream = None if args.quiet else sys.stderr
    result: dict[str, Any] = anyio.run(
        functools.partial(run_slow_tier_bench, options, progress_stream=stream)
    )
    return result


def _run_routing_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--routing`` with the flags' settings.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM or Dynamo's indexer is missing.
        ServerError, IndexerError: a server or the indexer failed.
    """
    import anyio  # noqa: PLC0415

    from lmcache_async.bench.routing import RoutingOptions, run_routing_bench  # noqa: PLC0415

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
    stream = None if args.quiet else sys.stderr
    result: dict[str, Any] = anyio.run(
        functools.partial(run_routing_bench, options, progress_stream=stream)
    )
    return result


def _run_shared_redis_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--shared-redis`` with the flags' settings.

    Raises:
        InvalidInputError: a setting is invalid, or vLLM is missing.
        ServerError: a server or a sidecar failed.
    """
    import anyio  # noqa: PLC0415

    from lmcache_async.bench.shared_redis import (  # noqa: PLC0415
        SharedRedisOptions,
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
    stream = None if args.quiet else sys.stderr
    result: dict[str, Any] = anyio.run(
        functools.partial(run_shared_redis_bench, options, progress_stream=stream)
    )
    return result


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags choose, print its summary and write ``--json``;
    exit 1 when it ran but found errors, 2 when no sidecar answers at ``--url``.

    Raises:
        ConfigError: the engine refuses the configuration.
        InvalidInputError: the options are invalid.
        OSError: a result file cannot be written.
    """
    from lmcache_async.bench import write_json  # noqa: PLC0415

    config = _engine_config(args)
    results: dict[str, Any]
    if args.tiers:
        import anyio  # noqa: PLC0415

        from lmcache_async.bench.tiers import format_tiers, run_tiers_bench  # noqa: PLC0415

        results = anyio.run(functools.partial(run_tiers_bench, redis_url=args.redis_url))
        summary = format_tiers(results)
        failed = False
    elif args.scale:
        import anyio  # noqa: PLC0415

        from lmcache_async.bench import scale  # noqa: PLC0415

        scaled = scale.ScaleOptions(
            sizes=scale.parse_sizes(args.scale_sizes),
            tiers=tuple(tier.strip() for tier in args.scale_tiers.split(",")),
            requests=args.scale_requests,
            seed=args.seed,
            work_dir=args.work_dir,
        )
        scaled.validate()  # bad settings are usage errors before anything starts
        stream = None if args.quiet else sys.stderr
        run = functools.partial(scale.run_scale_bench, scaled, config, progress_stream=stream)
        results = anyio.run(run)
        summary = scale.format_scale(results)
        failed = bool(results["problems"])
    elif args.vllm_slow_tier:
        results = _run_slow_tier_bench(args)
        from lmcache_async.bench.slow_tier import format_slow_tier  # noqa: PLC0415

        summary = format_slow_tier(results)
        failed = bool(results["problems"])
    elif args.routing:
        import httpx  # noqa: PLC0415

        from lmcache_async.bench.routing import format_routing  # noqa: PLC0415
        from lmcache_async.bench.routing.indexer import IndexerError  # noqa: PLC0415
        from lmcache_async.bench.routing.server import ServerError  # noqa: PLC0415

        try:
            results = _run_routing_bench(args)
        except (ServerError, IndexerError, httpx.HTTPError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        summary = format_routing(results)
        failed = bool(results["problems"])
    elif args.shared_redis:
        import httpx  # noqa: PLC0415

        from lmcache_async.bench.routing.server import ServerError  # noqa: PLC0415
        from lmcache_async.bench.shared_redis import format_shared_redis  # noqa: PLC0415

        try:
            results = _run_shared_redis_bench(args)
        except (ServerError, httpx.HTTPError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        summary = format_shared_redis(results)
        failed = bool(results["problems"])
    elif args.sidecar:
        from lmcache_async.bench.sidecar import format_sidecar, run_sidecar_bench  # noqa: PLC0415

        results = _run_sidecar_bench(run_sidecar_bench, config, curve=args.curve)
        summary = format_sidecar(results)
        failed = bool(results.get("problems"))
    elif args.gpu:
        from lmcache_async.bench.gpu import GpuOptions, format_gpu, run_gpu_bench  # noqa: PLC0415

        gpu = GpuOptions(
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
        gpu.validate()
        # The figures so far are saved after each part: a later hang loses none of them.
        checkpoint = functools.partial(write_json, args.json) if args.json else None
        results = run_gpu_bench(gpu, config, checkpoint=checkpoint)
        summary = format_gpu(results)
        failed = bool(results["problems"])
    elif args.micro:
        from lmcache_async.bench.micro import MicroOptions, format_micro, run_micro  # noqa: PLC0415

        micro = MicroOptions(
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
        micro.validate()
        results = run_micro(micro, config)
        summary = format_micro(results)
        failed = bool(results["problems"])
    else:
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
            concurrency=args.concurrency,
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
        summary = format_summary(results)
        failed = bool(results["errors_total"] or results.get("verify_failures"))
        if args.plot:
            write_plot(results, args.plot)
    if args.json:
        write_json(args.json, results)
    if not args.quiet:
        print(summary)
    return EXIT_FAILED if failed else EXIT_OK
