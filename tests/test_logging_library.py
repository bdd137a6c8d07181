"""The library as a guest in its host's process: it logs through the standard library's
``logging`` under ``lmcache_async``, says nothing below WARNING unless asked, and changes
nothing global (tests of :func:`configure_logging`, the CLI's setup, are in test_logging)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from lmcache_async.errors import ConfigError
from lmcache_async.logging import LIBRARY_LOGGER, get_logger, set_library_log_level

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT = 120.0


@pytest.fixture
def unconfigured() -> Iterator[None]:
    """structlog and the library's logger as a host that never configured them has them
    (an engine opened earlier with a ``log_level`` may have set one), put back after."""
    was_configured, saved = structlog.is_configured(), structlog.get_config()
    library = logging.getLogger(LIBRARY_LOGGER)
    level, handlers = library.level, list(library.handlers)
    structlog.reset_defaults()
    library.setLevel(logging.NOTSET)
    for handler in handlers:
        library.removeHandler(handler)
    yield
    for handler in list(library.handlers):
        library.removeHandler(handler)
    for handler in handlers:
        library.addHandler(handler)
    library.setLevel(level)
    if was_configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


# -- in this process ------------------------------------------------------------------------


@pytest.mark.usefixtures("unconfigured")
def test_below_warning_nothing_is_recorded_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("lmcache_async.test")
    log.debug("dropped_debug", n=1)
    log.info("dropped_info", n=2)
    log.warning("tier_down", tier="redis")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("lmcache_async.test", logging.WARNING, "tier_down tier=redis")
    ]


@pytest.mark.usefixtures("unconfigured")
def test_a_record_holds_the_fields_and_the_callers_place(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LIBRARY_LOGGER)
    log = get_logger("lmcache_async.test")
    log.debug("chunk_stored", tokens=512, tier="cpu", note="two words", keys=["a"])
    log.info("copied %d bytes", 4096, stage="d2h")
    (stored, copied) = caplog.records
    assert stored.getMessage() == "chunk_stored tokens=512 tier=cpu note='two words' keys=['a']"
    assert copied.getMessage() == "copied 4096 bytes stage=d2h"
    for record in caplog.records:  # a host's "%(filename)s:%(lineno)d" names this line
        assert (record.pathname, record.funcName) == (
            __file__,
            "test_a_record_holds_the_fields_and_the_callers_place",
        )


@pytest.mark.usefixtures("unconfigured")
@pytest.mark.parametrize("method", ["debug", "info", "warning", "error", "exception"])
def test_every_method_names_its_caller(caplog: pytest.LogCaptureFixture, method: str) -> None:
    caplog.set_level(logging.DEBUG, logger=LIBRARY_LOGGER)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        getattr(get_logger("lmcache_async.test"), method)("event_name", key="value")
    (record,) = caplog.records
    assert (record.pathname, record.funcName) == (__file__, "test_every_method_names_its_caller")
    assert record.getMessage() == "event_name key=value"
    if method == "exception":
        assert record.levelno == logging.ERROR
        assert record.exc_info is not None and record.exc_info[0] is RuntimeError
        assert "RuntimeError: boom" in caplog.text
    else:
        assert record.levelname == method.upper() and record.exc_info is None


@pytest.mark.usefixtures("unconfigured")
def test_capture_logs_sees_every_level_whatever_the_stdlib_level() -> None:
    log = get_logger("lmcache_async.test")
    with capture_logs() as logs:
        log.debug("small_thing", n=1)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("put_failed", tier="disk")
    assert logs == [
        {"event": "small_thing", "n": 1, "log_level": "debug"},
        {"event": "put_failed", "tier": "disk", "exc_info": True, "log_level": "error"},
    ]


@pytest.mark.usefixtures("unconfigured")
def test_log_level_sets_the_library_logger_and_nothing_else() -> None:
    root = logging.getLogger()
    before = (root.level, list(root.handlers), logging.getLogger("other").level)
    library = logging.getLogger(LIBRARY_LOGGER)
    set_library_log_level(None)
    assert library.level == logging.NOTSET
    set_library_log_level("debug")
    set_library_log_level("INFO")
    assert library.level == logging.INFO
    assert len(library.handlers) == 1  # its stderr handler, added once
    assert (root.level, list(root.handlers), logging.getLogger("other").level) == before
    with pytest.raises(ConfigError) as info:
        set_library_log_level("TRACE")
    assert info.value.field == "log_level"


@pytest.mark.usefixtures("unconfigured")
def test_the_library_handler_is_silent_where_the_host_has_one(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    set_library_log_level("DEBUG")  # pytest's handlers on the root logger are the host's
    get_logger("lmcache_async.test").debug("once", n=1)
    assert [r.getMessage() for r in caplog.records] == ["once n=1"]
    assert capsys.readouterr().err == ""


# -- in a process of their own ----------------------------------------------------------------

# An embedded engine of eight 64 KiB chunks stores three prompts of four: the CPU tier
# evicts (cpu_tier_evicted, a debug event), then the script prints the global logging state.
ENGINE_SCRIPT = """
import json, logging, sys
import anyio, structlog, torch
from lmcache_async import CacheEngine, EngineConfig, KVLayout

{host_setup}
root = logging.getLogger()
before = [root.level, [repr(h) for h in root.handlers]]
layout = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
)
config = EngineConfig(
    chunk_size=64, max_local_cpu_size=8 * 65536 / 1024**3, log_level={log_level!r}
)
kv = layout.allocate_kv_caches(num_blocks=16)

async def main():
    async with CacheEngine.open(config, layout, model_name="m") as engine:
        for i in range(3):
            await engine.store(torch.arange(i * 256, i * 256 + 256), kv_caches=kv,
                               slot_mapping=torch.arange(256))
        assert engine.stats().tiers["cpu"].evictions > 0

anyio.run(main)
after = [root.level, [repr(h) for h in root.handlers]]
print(json.dumps({{"root_before": before, "root_after": after,
                  "structlog_configured": structlog.is_configured()}}))
"""


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=cwd,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


def _state(stdout: str) -> dict[str, object]:
    state: dict[str, object] = json.loads(stdout.splitlines()[-1])
    assert state["root_after"] == state["root_before"]
    assert state["structlog_configured"] is False
    return state


@pytest.mark.subprocess
def test_the_readme_embedded_example_prints_nothing(tmp_path: Path) -> None:
    section = README.read_text().split("## Embedded use", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "no python block under 'Embedded use' in README.md"
    done = _run(match.group(1), tmp_path)
    assert (done.stdout, done.stderr) == ("", "")


@pytest.mark.subprocess
def test_a_host_logging_at_debug_sees_the_engines_debug_lines(tmp_path: Path) -> None:
    host_setup = textwrap.dedent(
        """
        logging.basicConfig(
            level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s"
        )
        """
    )
    done = _run(ENGINE_SCRIPT.format(host_setup=host_setup, log_level=None), tmp_path)
    assert done.stderr == ""
    state = _state(done.stdout)
    assert state["root_before"] == [logging.DEBUG, ["<StreamHandler <stdout> (NOTSET)>"]]
    lines = done.stdout.splitlines()
    assert any(line.startswith("INFO lmcache_async.engine.face engine_started ") for line in lines)
    assert any(
        line.startswith("DEBUG lmcache_async.backends.cpu cpu_tier_evicted chunks=")
        for line in lines
    )


@pytest.mark.subprocess
def test_log_level_in_the_config_shows_debug_lines_without_host_setup(tmp_path: Path) -> None:
    done = _run(ENGINE_SCRIPT.format(host_setup="", log_level="debug"), tmp_path)
    state = _state(done.stdout)
    assert state["root_before"] == [logging.WARNING, []]
    assert len(done.stdout.splitlines()) == 1  # the script's own line only
    lines = done.stderr.splitlines()
    assert any(line.startswith("INFO:lmcache_async.engine.face:engine_started ") for line in lines)
    assert any(
        line.startswith("DEBUG:lmcache_async.backends.cpu:cpu_tier_evicted chunks=")
        for line in lines
    )


@pytest.mark.subprocess
def test_without_setup_or_log_level_an_evicting_engine_says_nothing(tmp_path: Path) -> None:
    done = _run(ENGINE_SCRIPT.format(host_setup="", log_level=None), tmp_path)
    _state(done.stdout)
    assert len(done.stdout.splitlines()) == 1
    assert done.stderr == ""
