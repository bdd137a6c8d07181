"""The argument parser of ``lmcache-async``: the global options and every subcommand."""

from __future__ import annotations

import argparse

from lmcache_async.cli.admin import add_admin_parsers
from lmcache_async.cli.bench import add_bench_parser
from lmcache_async.cli.check_config import add_check_config_parser
from lmcache_async.cli.common import DEFAULT_BENCH_LOG_LEVEL
from lmcache_async.cli.serve import add_serve_parser
from lmcache_async.config import LOG_FORMATS, LOG_LEVELS

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lmcache-async`` (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="lmcache-async",
        description="lmcache_async: an asyncio-native KV-cache engine for LLM serving.",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help=f"log level (default {DEFAULT_BENCH_LOG_LEVEL} for bench)",
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="console")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_bench_parser(sub)
    add_check_config_parser(sub)
    add_serve_parser(sub)
    add_admin_parsers(sub)
    return parser
