"""The ``lmcache-async`` command line.

Subcommands:

- ``bench`` — the embedded multi-round chat load run on an in-process engine (default;
  ``--target sidecar`` or ``--target vllm --model DIR`` for the others), or with
  ``--micro`` the copy / lookup / hashing micro-benchmarks, with ``--gpu`` the
  GPU copy and layerwise-overlap benchmark;
- ``check-config [FILE]`` — load the engine configuration (file, then
  ``LMCACHE_ASYNC_*`` environment variables) and print the effective settings as YAML;
- ``serve --listen URL [--config FILE.yaml] [--KEY VALUE ...]`` — run the sidecar cache
  server until SIGTERM or SIGINT (flags named after configuration keys override them);
- ``events --connect URL [--json] [--count N]`` — print a sidecar's KV events live;
- ``ctl {freeze on|off, hot-cache on|off, clear, health} [--url URL]`` and
  ``stats [--url URL] [--json] [--interval S]`` — administer a running sidecar.

Exit codes: 0 success, 1 the run finished but found errors, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from typing import Any, Final

import yaml

from lmcache_async.config import LOG_FORMATS, LOG_LEVELS, EngineConfig
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.logging import configure_logging

__all__ = ["build_parser", "main"]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

_DEFAULT_BENCH_LOG_LEVEL: Final = "WARNING"
_DEFAULT_SERVE_LOG_LEVEL: Final = "INFO"
# Configuration keys ``serve`` does not take as flags: logging has its own global options.
_SERVE_SKIPPED_KEYS: Final = frozenset({"log_level", "log_format"})


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lmcache-async`` (exposed for documentation and tests)."""
    # Imported here so that ``check-config`` does not pay for torch.
    from lmcache_async.bench import DTYPES  # noqa: PLC0415
    from lmcache_async.bench.loadgen import ARRIVALS, TARGETS, LoadOptions  # noqa: PLC0415
    from lmcache_async.bench.micro import MicroOptions  # noqa: PLC0415
    from lmcache_async.bench.vllm_target import VLLM_EXECUTORS  # noqa: PLC0415
    from lmcache_async.bench.workloads import WORKLOADS  # noqa: PLC0415

    emb = LoadOptions()
    mic = MicroOptions()
    parser = argparse.ArgumentParser(
        prog="lmcache-async",
        description="lmcache_async: an asyncio-native KV-cache engine for LLM serving.",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help=f"log level (default {_DEFAULT_BENCH_LOG_LEVEL} for bench)",
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="console")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

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
        "--gpu",
        action="store_true",
        help="store/retrieve D2H and H2D GB/s with KV caches on the GPU next to a plain pinned "
        "copy_, and layerwise retrieve overlapped with a simulated compute",
    )
    bench.add_argument(
        "--redis-url", default=None, help="--tiers: this Redis (default: start a redis-server)"
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
        "python tests/integrations/tiny_llama.py DIR",
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

    check = sub.add_parser(
        "check-config",
        help="validate a configuration and print the effective settings",
        description="Load the engine configuration (FILE, else $LMCACHE_ASYNC_CONFIG_FILE, "
        "then LMCACHE_ASYNC_* variables) and print it as YAML.",
    )
    check.add_argument("file", nargs="?", default=None, metavar="FILE")
    _add_serve_parser(sub)
    _add_admin_parsers(sub)
    return parser


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the sidecar cache server",
        description="Run the cache's storage tiers in this process, serving "
        "RemoteCacheEngine clients over ZeroMQ, until SIGTERM or SIGINT. Every "
        "configuration key is also a flag (--max-local-cpu-size 2 --local-disk /path) that "
        "overrides the file and the environment.",
    )
    serve.add_argument(
        "--listen",
        default=None,
        metavar="URL",
        help="ipc://PATH or tcp://HOST:PORT (default: ipc://TMPDIR/lmcache-async-sidecar-UID.sock)",
    )
    serve.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a tcp bind beyond loopback (use with --curve-secret-key-file)",
    )
    serve.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        help="CURVE secret key (a zmq certificate or the z85 key): encrypt the traffic and "
        "refuse clients without the server's public key",
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between client heartbeats (default 1)",
    )
    serve.add_argument(
        "--client-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="drop a silent client's transactions and pins after this (default: 5 heartbeats)",
    )
    serve.add_argument(
        "--events",
        default=None,
        metavar="URL",
        help="publish KV events (chunks stored / removed) on a PUB socket at this ipc:// or "
        "tcp:// URL (see lmcache-async events)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any free port)",
    )
    namespace = serve.add_argument_group("namespace (default: fixed by the first client's hello)")
    namespace.add_argument("--model-name", default=None)
    namespace.add_argument("--revision", default=None)
    namespace.add_argument("--tenant", default=None)
    namespace.add_argument(
        "--layout", default=None, metavar="JSON", help="KVLayout.to_dict() as JSON"
    )
    keys = serve.add_argument_group("configuration keys (override --config)")
    for name in EngineConfig.field_names():
        if name not in _SERVE_SKIPPED_KEYS:
            keys.add_argument(
                "--" + name.replace("_", "-"), dest="key_" + name, metavar="VALUE", default=None
            )


def _serve(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    import anyio  # noqa: PLC0415

    from lmcache_async.config import ENV_PREFIX  # noqa: PLC0415
    from lmcache_async.layouts import KVLayout  # noqa: PLC0415
    from lmcache_async.rpc.server import (  # noqa: PLC0415
        DEFAULT_HEARTBEAT_INTERVAL,
        SidecarNamespace,
        SidecarServer,
        SidecarSettings,
        default_endpoint,
        load_curve_secret_key,
        serve,
    )

    # Flag values are text: parse them by each key's type, as environment variables are.
    given = {
        ENV_PREFIX + name.upper(): getattr(args, "key_" + name)
        for name in EngineConfig.field_names()
        if name not in _SERVE_SKIPPED_KEYS and getattr(args, "key_" + name) is not None
    }
    config = EngineConfig.load(args.config, **EngineConfig.env_overrides(given))
    namespace = None
    if args.model_name is not None or args.layout is not None:
        if args.model_name is None or args.layout is None:
            raise ConfigError("namespace", "--model-name and --layout go together")
        try:
            layout = KVLayout.from_dict(json.loads(args.layout))
        except ValueError as exc:
            raise ConfigError("layout", str(exc)) from None
        namespace = SidecarNamespace(args.model_name, layout, args.revision, args.tenant)
    curve = None
    if args.curve_secret_key_file is not None:
        curve = load_curve_secret_key(args.curve_secret_key_file)
    heartbeat = args.heartbeat_interval
    settings = SidecarSettings(
        listen=default_endpoint() if args.listen is None else args.listen,
        config=config,
        namespace=namespace,
        heartbeat_interval=DEFAULT_HEARTBEAT_INTERVAL if heartbeat is None else heartbeat,
        client_timeout=args.client_timeout,
        allow_remote=args.allow_remote,
        curve_secret_key=curve,
        events=args.events,
        metrics_port=args.metrics_port,
    )

    def ready(server: SidecarServer) -> None:
        print(f"lmcache-async serve: listening on {server.endpoint}", flush=True)
        if server.publisher is not None:
            print(f"lmcache-async serve: KV events on {server.publisher.endpoint}", flush=True)
        if server.metrics is not None:
            print(f"lmcache-async serve: metrics on {server.metrics.url}", flush=True)

    async def run() -> None:
        await serve(settings, on_ready=ready)

    anyio.run(run)
    return EXIT_OK


def _add_admin_parsers(sub: Any) -> None:
    def add_url(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--url", default=None, help="the sidecar (default: its default ipc path)")
        cmd.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS")
        cmd.add_argument(
            "--curve-public-key-file", metavar="FILE", help="the CURVE sidecar's public key"
        )

    events = sub.add_parser(
        "events",
        help="print a sidecar's KV events live",
        description="Subscribe to the KV events (chunks stored / removed) a sidecar publishes "
        "(serve --events URL) and print one line per event until Ctrl-C or SIGTERM.",
    )
    events.add_argument("--connect", required=True, metavar="URL", help="the publisher's URL")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument("--count", type=int, default=None, metavar="N", help="stop after N")
    events.add_argument("--topic", default="kv")
    ctl = sub.add_parser(
        "ctl",
        help="switch or query a running sidecar",
        description="freeze on|off, hot-cache on|off, clear, health. Exit 1 when the sidecar "
        "does not answer within --timeout, refuses, or (health) is unhealthy.",
    )
    ctl.add_argument("action", choices=("freeze", "hot-cache", "clear", "health"))
    ctl.add_argument("state", nargs="?", choices=("on", "off"))
    add_url(ctl)
    stats = sub.add_parser(
        "stats",
        help="print a running sidecar's stats",
        description="Tiers, pool usage, hit rate, throughput and latency percentiles.",
    )
    add_url(stats)
    stats.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    stats.add_argument(
        "--interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="measure throughput over this interval (default: since the server started)",
    )


def _events(args: argparse.Namespace) -> int:
    import anyio  # noqa: PLC0415

    from lmcache_async.rpc.events import ReceivedEvent, format_event, tail_events  # noqa: PLC0415

    if args.count is not None and args.count < 1:
        raise InvalidInputError(f"--count must be >= 1, got {args.count}")

    def show(received: ReceivedEvent) -> None:
        print(format_event(received, as_json=args.json), flush=True)

    anyio.run(lambda: tail_events(args.connect, show, topic=args.topic.encode(), count=args.count))
    return EXIT_OK


def _admin(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    import anyio  # noqa: PLC0415

    from lmcache_async.errors import LMCacheAsyncError  # noqa: PLC0415
    from lmcache_async.rpc import admin  # noqa: PLC0415
    from lmcache_async.rpc.server import default_endpoint  # noqa: PLC0415

    if args.command == "ctl" and (args.state is None) != (args.action in ("clear", "health")):
        raise InvalidInputError(
            f"ctl {args.action} takes {'on|off' if args.state is None else 'no state'}"
        )
    key = None
    if args.curve_public_key_file is not None:
        key = admin.load_curve_public_key(args.curve_public_key_file)
    url = default_endpoint() if args.url is None else args.url

    async def run(client: admin.AdminClient) -> tuple[str, bool]:
        if args.command == "stats":
            reply = await client.stats()
            if args.json:
                return json.dumps(reply, indent=2, default=repr), True
            previous = None
            if args.interval:
                previous = reply
                await anyio.sleep(args.interval)
                reply = await client.stats()
            return admin.format_stats(reply, previous=previous, interval=args.interval), True
        if args.action == "health":
            reply = await client.health()
            return admin.format_health(reply), bool(reply.get("healthy"))
        if args.action == "clear":
            return f"cleared {await client.clear()} chunks", True
        on = args.state == "on"
        if args.action == "freeze":
            return f"freeze {'on' if await client.freeze(on) else 'off'}", True
        return f"hot cache {'on' if await client.set_hot_cache(on) else 'off'}", True

    with admin.AdminClient(url, timeout=args.timeout, server_public_key=key) as client:
        try:
            text, ok = anyio.run(run, client)
        except LMCacheAsyncError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
    print(text)
    return EXIT_OK if ok else EXIT_FAILED


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = EngineConfig.load(args.file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return EXIT_OK


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = {}
    if args.chunk_size is not None:
        overrides["chunk_size"] = args.chunk_size
    if args.cache_gb is not None:
        overrides["max_local_cpu_size"] = args.cache_gb
    return EngineConfig.load(args.config, **overrides)


def _run_sidecar_bench(run: Any, config: EngineConfig) -> dict[str, Any]:
    """Run the async sidecar benchmark to completion."""
    import anyio  # noqa: PLC0415

    result: dict[str, Any] = anyio.run(functools.partial(run, None, config))
    return result


def _bench(args: argparse.Namespace) -> int:
    from lmcache_async.bench import write_json  # noqa: PLC0415

    config = _engine_config(args)
    results: dict[str, Any]
    if args.tiers:
        import anyio  # noqa: PLC0415

        from lmcache_async.bench.tiers import format_tiers, run_tiers_bench  # noqa: PLC0415

        results = anyio.run(functools.partial(run_tiers_bench, redis_url=args.redis_url))
        summary = format_tiers(results)
        failed = False
    elif args.sidecar:
        from lmcache_async.bench.sidecar import format_sidecar, run_sidecar_bench  # noqa: PLC0415

        results = _run_sidecar_bench(run_sidecar_bench, config)
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
        results = run_gpu_bench(gpu, config)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` when None); return the exit code.

    Usage and configuration errors print ``error: ...`` to stderr and return 2; they do not
    raise.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad usage
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        default_level = (
            _DEFAULT_SERVE_LOG_LEVEL if args.command == "serve" else _DEFAULT_BENCH_LOG_LEVEL
        )
        configure_logging(level=args.log_level or default_level, fmt=args.log_format)
        if args.command == "check-config":
            return _check_config(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "events":
            return _events(args)
        if args.command in ("ctl", "stats"):
            return _admin(args)
        return _bench(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
