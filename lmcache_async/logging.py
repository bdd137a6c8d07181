"""Logging setup for applications built on lmcache_async.

The library only *emits* structured events (``structlog.get_logger(__name__)``, constant
snake_case event names, key/value fields); it never configures logging on import. An
application (the ``lmcache-async`` CLI, a serving engine) calls :func:`configure_logging`
once to choose the level, the output format and the stream. Records from the standard
library's ``logging`` (third-party packages) are rendered the same way, so one process
writes one consistent log.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import structlog
from structlog.typing import Processor

from lmcache_async.config import LOG_FORMATS, LOG_LEVELS
from lmcache_async.errors import ConfigError

__all__ = ["configure_logging", "get_logger"]


# Name of the root handler configure_logging installs, so a second call replaces it.
_HANDLER_NAME: Final = "lmcache_async"


class _NamedWriteLogger(structlog.WriteLogger):
    """A WriteLogger that knows the name it was created with (for the ``logger`` key)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    """Logger factory: ``structlog.get_logger(__name__)`` passes the name through here."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        name = args[0] if args and isinstance(args[0], str) else ""
        return _NamedWriteLogger(self._file, name)


def configure_logging(
    level: str = "INFO",
    fmt: str = "console",
    stream: TextIO | None = None,
    *,
    cache_loggers: bool = False,
) -> None:
    """Route structlog and standard-library logs to ``stream`` in one format.

    Each record carries an ISO-8601 UTC ``timestamp``, ``level``, ``logger`` (the module
    name) and ``event``, plus the event's key/value fields. ``"console"`` renders aligned
    human-readable lines (coloured only when ``stream`` is a terminal); ``"json"`` renders
    one JSON object per line. Structlog events are rendered and written directly (no
    ``logging.LogRecord`` on the way, and calls below ``level`` are no-ops); records from
    the standard library's ``logging`` (third-party packages) go through a root handler
    that renders them the same way. Calling it again replaces the previous setup (it never
    stacks handlers). The configuration is structlog's and the root logger's own global
    state, which belongs to the application.

    Args:
        level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR`` (any case); events below it
            are dropped before any processing.
        fmt: ``"console"`` or ``"json"``.
        stream: where records go; ``sys.stderr`` when None.
        cache_loggers: let each structlog logger freeze its configuration on first use
            (faster; a long-running application that configures logging once, before it
            logs, should pass True). Loggers cached this way ignore a later call.

    Raises:
        ConfigError: ``field="log_level"`` or ``field="log_format"`` for an invalid value.
    """
    level_name = str(level).upper()
    if level_name not in LOG_LEVELS:
        allowed = ", ".join(repr(name) for name in LOG_LEVELS)
        raise ConfigError("log_level", f"expected one of {allowed}, got {level!r}")
    if fmt not in LOG_FORMATS:
        allowed = ", ".join(repr(name) for name in LOG_FORMATS)
        raise ConfigError("log_format", f"expected one of {allowed}, got {fmt!r}")
    out: TextIO = _CurrentStderr() if stream is None else stream  # type: ignore[assignment]

    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    render: list[Processor]
    if fmt == "json":
        render = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        render = [structlog.dev.ConsoleRenderer(colors=_is_tty(out))]

    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.stdlib.ExtraAdder(),
                stamp,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level_name)

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_logger_name,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.StackInfoRenderer(),
            *render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_name),
        logger_factory=_NamedWriteLoggerFactory(out),
        cache_logger_on_first_use=cache_loggers,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger named ``name`` (pass ``__name__``), typed as configured here."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write, so that replacing it
    (a test harness capturing output, a daemon redirecting it) never leaves logging bound
    to a closed stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
