"""Tests for configure_logging: JSON and console output, levels, reconfiguration."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from lmcache_async.errors import ConfigError
from lmcache_async.logging import configure_logging, get_logger

# Leave structlog and the root logger as they were for the other tests.
pytestmark = pytest.mark.usefixtures("restore_logging")


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_output_is_one_object_per_event() -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    log = get_logger("lmcache_async.test")
    log.info("chunk_stored", req_id="r1", tokens=512, bytes=1 << 20)
    log.warning("tier_down", tier="redis")

    first, second = _records(out)
    assert first["event"] == "chunk_stored"
    assert (first["req_id"], first["tokens"], first["bytes"]) == ("r1", 512, 1 << 20)
    assert first["level"] == "info"
    assert first["logger"] == "lmcache_async.test"
    assert isinstance(first["timestamp"], str)
    assert str(first["timestamp"]).endswith("Z")
    assert (second["event"], second["tier"], second["level"]) == ("tier_down", "redis", "warning")


def test_module_level_structlog_logger_follows_configuration() -> None:
    log = structlog.get_logger("lmcache_async.somewhere")  # as modules create it at import
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", "json", stream=first)
    log.info("first_event", n=1)
    configure_logging("INFO", "json", stream=second)
    log.info("second_event", n=2)
    assert [r["event"] for r in _records(first)] == ["first_event"]
    assert [r["event"] for r in _records(second)] == ["second_event"]
    assert _records(second)[0]["logger"] == "lmcache_async.somewhere"


def test_level_filters_events() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    log = get_logger("lmcache_async.test")
    log.debug("dropped_debug")
    log.info("dropped_info")
    log.error("kept_error", code=3)
    assert [(r["event"], r["code"]) for r in _records(out)] == [("kept_error", 3)]
    assert logging.getLogger().level == logging.WARNING


def test_stdlib_records_use_the_same_format() -> None:
    out = io.StringIO()
    configure_logging("DEBUG", "json", stream=out)
    logging.getLogger("thirdparty").info("hello %s", "world")
    (record,) = _records(out)
    assert record["event"] == "hello world"
    assert record["logger"] == "thirdparty"
    assert record["level"] == "info"


def test_exception_is_rendered_in_json() -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    log = get_logger("lmcache_async.test")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("put_failed", tier="disk")
    (record,) = _records(out)
    assert record["event"] == "put_failed"
    assert "RuntimeError: boom" in str(record["exception"])


def test_console_output_contains_event_and_fields_without_colors() -> None:
    out = io.StringIO()
    configure_logging("INFO", "console", stream=out)
    get_logger("lmcache_async.test").info("engine_started", chunk_size=256)
    text = out.getvalue()
    assert "engine_started" in text
    assert "chunk_size=256" in text
    assert "lmcache_async.test" in text
    assert "\x1b[" not in text  # StringIO is not a tty: no ANSI colour codes


def test_reconfiguring_does_not_stack_handlers() -> None:
    before = len(logging.getLogger().handlers)
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", "json", stream=first)
    configure_logging("INFO", "console", stream=second)
    assert len(logging.getLogger().handlers) == before + 1
    get_logger("lmcache_async.test").info("only_once")
    assert first.getvalue() == ""
    assert second.getvalue().count("only_once") == 1


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", "json")
    get_logger("lmcache_async.test").info("to_stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err.splitlines()[-1])["event"] == "to_stderr"


@pytest.mark.parametrize("level", ["TRACE", "", "warn", "CRITICAL"])
def test_bad_level_raises(level: str) -> None:
    with pytest.raises(ConfigError) as info:
        configure_logging(level, "json", stream=io.StringIO())
    assert info.value.field == "log_level"


def test_bad_format_raises() -> None:
    with pytest.raises(ConfigError) as info:
        configure_logging("INFO", "xml", stream=io.StringIO())
    assert info.value.field == "log_format"


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_output_is_coloured_on_a_terminal() -> None:
    out = _FakeTerminal()
    configure_logging("INFO", "console", stream=out)
    get_logger("lmcache_async.test").info("engine_started")
    assert "engine_started" in out.getvalue()
    assert "\x1b[" in out.getvalue()


def test_debug_level_and_positional_arguments() -> None:
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    get_logger("lmcache_async.test").debug("copied %d bytes", 4096, stage="d2h")
    (record,) = _records(out)
    assert (record["event"], record["stage"], record["level"]) == (
        "copied 4096 bytes",
        "d2h",
        "debug",
    )


def test_cached_loggers_emit() -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out, cache_loggers=True)
    log = get_logger("lmcache_async.cached")
    log.info("first", n=1)
    log.debug("dropped")
    log.info("second", n=2)
    assert [(r["event"], r["n"]) for r in _records(out)] == [("first", 1), ("second", 2)]
