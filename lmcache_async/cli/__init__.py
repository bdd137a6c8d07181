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
- ``ctl {freeze on|off, hot-cache on|off, clear, erase --tenant T, health} [--url URL]``
  and ``stats [--url URL] [--json] [--interval S] [--by-tenant]`` — administer a running
  sidecar.

Exit codes: 0 success, 1 the run finished but found errors, 2 bad usage or configuration.

One module per command group (:mod:`~.bench`, :mod:`~.serve`, :mod:`~.admin` for
``events``, ``ctl`` and ``stats``, :mod:`~.check_config`), :mod:`~.parser` putting their
flags together; :func:`main` picks the command. ``python -m lmcache_async.cli`` runs it too.

May import: everything (the top floor, with ``bench``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lmcache_async.cli.admin import run_admin, run_events
from lmcache_async.cli.bench import run_bench
from lmcache_async.cli.check_config import run_check_config
from lmcache_async.cli.common import (
    DEFAULT_BENCH_LOG_LEVEL,
    DEFAULT_SERVE_LOG_LEVEL,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
)
from lmcache_async.cli.parser import build_parser
from lmcache_async.cli.serve import run_serve
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.logging import configure_logging

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


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
            DEFAULT_SERVE_LOG_LEVEL if args.command == "serve" else DEFAULT_BENCH_LOG_LEVEL
        )
        configure_logging(level=args.log_level or default_level, fmt=args.log_format)
        if args.command == "check-config":
            return run_check_config(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "events":
            return run_events(args)
        if args.command in ("ctl", "stats"):
            return run_admin(args)
        return run_bench(args)
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
