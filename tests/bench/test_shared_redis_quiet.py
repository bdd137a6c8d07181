"""The shared-Redis benchmark's wait for idle hosts: it finds a server's children, sees the
CPU a busy process uses, returns once the processes are idle and gives up after its bound."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from lmcache_async.bench.shared_redis import quiet

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc"),
]

_SPIN = "while True: pass"
_PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
    " stdin=subprocess.PIPE)\n"
    "print(child.pid, flush=True)\n"
    "sys.stdin.read()\n"
    "child.stdin.close()\n"
    "child.wait()\n"
)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (stdin a pipe, stdout read as text), ended after it."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait(timeout=30)


def _start(code: str, processes: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    processes.append(process)
    return process


def test_a_process_s_children_are_found(started: list[subprocess.Popen[str]]) -> None:
    parent = _start(_PARENT, started)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert quiet.descendants([parent.pid]) == {parent.pid, child}
    assert quiet.descendants([child]) == {child}


@pytest.mark.anyio
async def test_the_wait_returns_once_idle_and_gives_up_on_a_busy_process(
    started: list[subprocess.Popen[str]],
) -> None:
    busy = _start(_SPIN, started)
    idle = _start("import sys; sys.stdin.read()", started)
    with anyio.fail_after(30):
        waited = await quiet.wait_idle(lambda: [idle.pid], most=25.0)
        assert quiet.WINDOW <= waited < 25.0
        spent = quiet.cpu_ticks([busy.pid])
        waited = await quiet.wait_idle(lambda: [busy.pid, idle.pid], most=0.5)
        assert waited >= 0.5
        assert quiet.cpu_ticks([busy.pid]) > spent  # its CPU, seen in /proc, kept growing


@pytest.mark.anyio
async def test_without_proc_nothing_is_waited_for(
    started: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    busy = _start(_SPIN, started)
    monkeypatch.setattr(quiet, "_PROC", tmp_path / "missing")
    with anyio.fail_after(30):
        assert await quiet.wait_idle(lambda: [busy.pid], most=20.0) == 0.0
