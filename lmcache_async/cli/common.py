"""What every ``lmcache-async`` command shares: exit codes and default log levels."""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_BENCH_LOG_LEVEL",
    "DEFAULT_SERVE_LOG_LEVEL",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

DEFAULT_BENCH_LOG_LEVEL: Final = "WARNING"
DEFAULT_SERVE_LOG_LEVEL: Final = "INFO"
