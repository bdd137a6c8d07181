"""Waiting, before each phase, until both hosts' processes are idle.

After each step vLLM's worker keeps polling the queue its next step comes from for a second
(vLLM's ``SpinCondition``, ``busy_loop_s``), using a whole core. Two hosts share this
machine's cores where a deployment gives each its own machine, so a phase started on B
right after A's would run beside A's poll, and only that phase (A's warm hits follow A's
own requests): B's reads from Redis would be timed with a core fewer than A's warm hits.
Each phase therefore starts once every process of both hosts (sidecars, servers and the
servers' children) has used no more than :data:`IDLE_TICKS` of CPU over :data:`WINDOW`
seconds; what that took is reported.

The CPU times come from Linux's ``/proc``; elsewhere nothing is waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import anyio

__all__ = ["IDLE_TICKS", "MOST_WAIT", "WINDOW", "cpu_ticks", "descendants", "wait_idle"]

WINDOW: Final = 0.2
"""Seconds over which the processes must stay idle."""
IDLE_TICKS: Final = 2
"""Clock ticks (``SC_CLK_TCK``, 10 ms on Linux) the processes may use in a window."""
MOST_WAIT: Final = 10.0
"""Seconds waited at most; a phase then starts anyway (the report says how long it was)."""

_PROC: Final = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name, or None when the
    process is gone (or there is no ``/proc``)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every live process below them."""
    parents: dict[int, list[int]] = {}
    try:
        entries = [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        entries = []
    for pid in entries:
        fields = _stat_fields(pid)
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(parents.get(pid, ()))
    return found


def cpu_ticks(pids: Iterable[int]) -> int:
    """User and system CPU time of ``pids`` so far, in clock ticks (gone ones count 0)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


async def wait_idle(
    roots: Callable[[], Iterable[int]],
    *,
    window: float = WINDOW,
    idle_ticks: int = IDLE_TICKS,
    most: float = MOST_WAIT,
) -> float:
    """Wait until the processes under ``roots()`` use at most ``idle_ticks`` of CPU over
    ``window`` seconds, or ``most`` seconds have passed; returns the seconds waited. Returns
    at once where ``/proc`` does not exist."""
    began = time.perf_counter()
    if not _PROC.is_dir():
        return 0.0
    with anyio.move_on_after(most):
        while True:
            pids = descendants(roots())
            before = cpu_ticks(pids)
            await anyio.sleep(window)
            if cpu_ticks(pids) - before <= idle_ticks:
                break
    return time.perf_counter() - began
