"""``lmcache-async check-config``: load a configuration and print the effective settings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from lmcache_async.cli.common import EXIT_OK, EXIT_USAGE
from lmcache_async.config import EngineConfig
from lmcache_async.errors import ConfigError

__all__ = ["add_check_config_parser", "run_check_config"]


def add_check_config_parser(sub: Any) -> None:
    """Add ``check-config`` to the subcommands ``sub``."""

    check = sub.add_parser(
        "check-config",
        help="validate a configuration and print the effective settings",
        description="Load the engine configuration (FILE, else $LMCACHE_ASYNC_CONFIG_FILE, "
        "then LMCACHE_ASYNC_* variables) and print it as YAML.",
    )
    check.add_argument("file", nargs="?", default=None, metavar="FILE")


def run_check_config(args: argparse.Namespace) -> int:
    """Print the effective configuration as YAML, or the error (exit 2)."""
    try:
        config = EngineConfig.load(args.file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return EXIT_OK
