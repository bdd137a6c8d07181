"""The ``lmcache-async`` command line.

Subcommands:

- ``bench`` — the embedded multi-round chat load run on an in-process engine (default),
  or with ``--micro`` the copy / lookup / hashing micro-benchmarks;
- ``check-config [FILE]`` — load the engine configuration (file, then
  ``LMCACHE_ASYNC_*`` environment variables) and print the effective settings as YAML.

Exit codes: 0 success, 1 the run finished but found errors, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lmcache-async`` (exposed for documentation and tests)."""
    # Imported here so that ``check-config`` does not pay for torch.
    from lmcache_async.bench import DTYPES  # noqa: PLC0415
    from lmcache_async.bench.embedded import EmbeddedOptions  # noqa: PLC0415
    from lmcache_async.bench.micro import MicroOptions  # noqa: PLC0415

    emb = EmbeddedOptions()
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
        help="run the embedded load benchmark (or --micro)",
        description="Multi-round chat load on an embedded engine with real KV tensors, or "
        "with --micro the copy/lookup/hashing micro-benchmarks.",
    )
    bench.add_argument("--micro", action="store_true", help="run the micro-benchmarks")
    bench.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    bench.add_argument("--seed", type=int, default=emb.seed)
    bench.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress and no summary")

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

    load = bench.add_argument_group("embedded load run")
    load.add_argument("--duration", type=float, default=emb.duration, metavar="SECONDS")
    load.add_argument("--users", type=int, default=emb.users)
    load.add_argument("--system-prompt-tokens", type=int, default=emb.system_prompt_tokens)
    load.add_argument("--turn-tokens", type=int, default=emb.turn_tokens)
    load.add_argument("--max-context-tokens", type=int, default=emb.max_context_tokens)
    load.add_argument("--concurrency", type=int, default=emb.concurrency)
    load.add_argument(
        "--verify-every",
        type=int,
        default=emb.verify_every,
        metavar="N",
        help="check every N-th retrieve bit for bit (0: never)",
    )

    micro = bench.add_argument_group("micro-benchmarks (--micro)")
    micro.add_argument("--tokens", type=int, default=mic.tokens, help="tokens per copy")
    micro.add_argument("--lookup-tokens", type=int, default=mic.lookup_tokens)
    micro.add_argument("--repeat", type=int, default=mic.repeat, help="measured copy runs")

    check = sub.add_parser(
        "check-config",
        help="validate a configuration and print the effective settings",
        description="Load the engine configuration (FILE, else $LMCACHE_ASYNC_CONFIG_FILE, "
        "then LMCACHE_ASYNC_* variables) and print it as YAML.",
    )
    check.add_argument("file", nargs="?", default=None, metavar="FILE")
    return parser


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


def _bench(args: argparse.Namespace) -> int:
    from lmcache_async.bench import write_json  # noqa: PLC0415

    config = _engine_config(args)
    results: dict[str, Any]
    if args.micro:
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
        from lmcache_async.bench.embedded import (  # noqa: PLC0415
            EmbeddedOptions,
            format_summary,
            run_embedded,
        )

        options = EmbeddedOptions(
            seed=args.seed,
            duration=args.duration,
            users=args.users,
            system_prompt_tokens=args.system_prompt_tokens,
            turn_tokens=args.turn_tokens,
            max_context_tokens=args.max_context_tokens,
            concurrency=args.concurrency,
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_size=args.head_size,
            dtype=args.dtype,
            block_size=args.block_size,
            verify_every=args.verify_every,
            progress=not args.quiet,
        )
        options.validate()
        results = run_embedded(options, config)
        summary = format_summary(results)
        failed = bool(results["errors_total"] or results["verify_failures"])
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
        configure_logging(
            level=args.log_level or _DEFAULT_BENCH_LOG_LEVEL, fmt=args.log_format, stream=sys.stderr
        )
        if args.command == "check-config":
            return _check_config(args)
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
