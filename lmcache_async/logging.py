"""Logging: how the library emits events, and how an application sets up their output.

A library is a guest in its host's process. Every module logs through :func:`get_logger`
(``log = get_logger(__name__)``): structlog's calls (constant snake_case event names,
key/value fields) that become records of the standard library's ``logging`` under the
``lmcache_async`` logger, so the host's levels and handlers decide what is shown and
where. With nothing configured, Python's last-resort handler writes WARNING and above to
stderr, and a debug call costs a level check. Where structlog itself is configured (by the
application, by :func:`configure_logging`, or by a test's ``structlog.testing.capture_logs``)
the events go through that configuration instead.

The library never changes its host's global logging state on import or when an engine
opens: :func:`set_library_log_level` (an engine's ``log_level``) sets the ``lmcache_async``
logger's level only. An application (the ``lmcache-async`` CLI) calls
:func:`configure_logging` once to choose the level, the format and the stream.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import structlog
from structlog.typing import EventDict, Processor

from lmcache_async.config_values import LOG_FORMATS, LOG_LEVELS
from lmcache_async.errors import ConfigError

__all__ = [
    "LIBRARY_LOGGER",
    "LibraryLogger",
    "configure_logging",
    "get_logger",
    "set_library_log_level",
]

LIBRARY_LOGGER: Final = "lmcache_async"
"""The standard-library logger every module's logger is a child of."""

# Name of the root handler configure_logging installs, so a second call replaces it.
_HANDLER_NAME: Final = "lmcache_async"
# Name of the handler set_library_log_level adds to the library's logger, so it is added once.
_FALLBACK_HANDLER_NAME: Final = "lmcache_async_stderr"

# Frames between the standard library's logging call and the code that called a
# LibraryLogger method: structlog's two _proxy_to_logger, its level method, ours. With it the
# records' file, line and function are the caller's (tests/test_logging_library.py pins it).
_STACKLEVEL: Final = 5


def get_logger(name: str) -> LibraryLogger:
    """The logger of module ``name`` (pass ``__name__``); see :class:`LibraryLogger`."""
    return LibraryLogger(name)


class LibraryLogger:
    """A module's logger: structlog's calling convention, the standard library's levels and
    handlers.

    ``log.info("chunk_stored", tokens=512)`` becomes a ``logging`` record of
    ``logging.getLogger(name)`` whose message is ``chunk_stored tokens=512`` (exceptions and
    stacks are left to the handler's formatter). A call below that logger's effective level
    returns after one level check. Once structlog is configured (an application's own
    structlog setup, :func:`configure_logging`, ``structlog.testing.capture_logs``), every
    call goes through structlog's configuration, as ``structlog.get_logger(name)`` would.
    """

    __slots__ = ("_bound", "_configured", "_stdlib")

    def __init__(self, name: str) -> None:
        self._stdlib = logging.getLogger(name)
        self._bound = structlog.stdlib.BoundLogger(self._stdlib, _STDLIB_PROCESSORS, {})
        # A lazy proxy: it reads structlog's configuration when it is called.
        self._configured: Any = structlog.get_logger(name)

    @property
    def name(self) -> str:
        return self._stdlib.name

    def debug(self, event: str, *args: Any, **fields: Any) -> None:
        if structlog.is_configured():
            self._configured.debug(event, *args, **fields)
        elif self._stdlib.isEnabledFor(logging.DEBUG):
            self._bound.debug(event, *args, **fields)

    def info(self, event: str, *args: Any, **fields: Any) -> None:
        if structlog.is_configured():
            self._configured.info(event, *args, **fields)
        elif self._stdlib.isEnabledFor(logging.INFO):
            self._bound.info(event, *args, **fields)

    def warning(self, event: str, *args: Any, **fields: Any) -> None:
        if structlog.is_configured():
            self._configured.warning(event, *args, **fields)
        elif self._stdlib.isEnabledFor(logging.WARNING):
            self._bound.warning(event, *args, **fields)

    def error(self, event: str, *args: Any, **fields: Any) -> None:
        if structlog.is_configured():
            self._configured.error(event, *args, **fields)
        elif self._stdlib.isEnabledFor(logging.ERROR):
            self._bound.error(event, *args, **fields)

    def exception(self, event: str, *args: Any, **fields: Any) -> None:
        """Log at ERROR with the exception being handled (``exc_info`` may name another)."""
        if structlog.is_configured():
            self._configured.exception(event, *args, **fields)
        elif self._stdlib.isEnabledFor(logging.ERROR):
            fields.setdefault("exc_info", True)
            self._bound.error(event, *args, **fields)


def _to_stdlib_call(_logger: Any, _method: str, event_dict: EventDict) -> Any:
    """Last processor: the arguments of the ``logging.Logger`` call, the message rendered
    as ``event key=value ...``."""
    exc_info = event_dict.pop("exc_info", None)
    stack_info = bool(event_dict.pop("stack_info", False))
    message = str(event_dict.pop("event", ""))
    if event_dict:
        message += " " + " ".join(f"{key}={_text(value)}" for key, value in event_dict.items())
    return (message,), {"exc_info": exc_info, "stack_info": stack_info, "stacklevel": _STACKLEVEL}


def _text(value: object) -> str:
    if isinstance(value, str) and value and not any(char.isspace() for char in value):
        return value
    return repr(value)


_STDLIB_PROCESSORS: Final[tuple[Processor, ...]] = (
    structlog.stdlib.PositionalArgumentsFormatter(),
    _to_stdlib_call,
)


def set_library_log_level(level: str | None) -> None:
    """Set the level of the library's own logger, ``lmcache_async``; nothing when None.

    Only that logger changes: the root logger, its handlers and other libraries' loggers
    are the host's. While no handler is configured on the way of a record (the host set up
    no logging), a handler the library's logger gets once writes its records to stderr, so
    that a level below WARNING is seen; it is silent wherever the host has handlers.

    Raises:
        ConfigError: ``field="log_level"`` for an invalid level.
    """
    if level is None:
        return
    library = logging.getLogger(LIBRARY_LOGGER)
    library.setLevel(_level_name(level))
    if not any(handler.get_name() == _FALLBACK_HANDLER_NAME for handler in library.handlers):
        library.addHandler(_StderrWhileUnconfigured())


class _StderrWhileUnconfigured(logging.Handler):
    """Writes a record to the current ``sys.stderr`` in ``logging.basicConfig``'s format
    unless another handler gets it too: Python's last resort, at the library's level."""

    def __init__(self) -> None:
        super().__init__()
        self.set_name(_FALLBACK_HANDLER_NAME)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if self._handled_elsewhere(record):
            return
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)

    def _handled_elsewhere(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


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
    """Route structlog and standard-library logs to ``stream`` in one format: an
    application's choice (the CLI's), never the library's.

    Each record carries an ISO-8601 UTC ``timestamp``, ``level``, ``logger`` (the module
    name) and ``event``, plus the event's key/value fields. ``"console"`` renders aligned
    human-readable lines (coloured only when ``stream`` is a terminal); ``"json"`` renders
    one JSON object per line. Structlog events, the library's included (structlog is
    configured from then on), are rendered and written directly (no
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
    level_name = _level_name(level)
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


def _level_name(level: str) -> str:
    """``level`` upper-cased; ConfigError(field="log_level") unless it is in LOG_LEVELS."""
    level_name = str(level).upper()
    if level_name not in LOG_LEVELS:
        allowed = ", ".join(repr(name) for name in LOG_LEVELS)
        raise ConfigError("log_level", f"expected one of {allowed}, got {level!r}")
    return level_name


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
