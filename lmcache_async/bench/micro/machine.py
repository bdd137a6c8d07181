"""How much of the machine's CPU time other work took while a run was measured.

On a machine with few cores, other processes slow torch's OpenMP copies (the raw and
plain baselines) far more than the engine's own copy threads: on two shared cores a raw
gather was seen to go from 23 ms to 250 ms and back within a second, with no engine in
the process. A run's ratios are only worth comparing when little else ran beside it.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Final

__all__ = ["CpuSample", "cpu_sample", "other_work"]

_PROC_STAT: Final = "/proc/stat"


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds so far: the machine's busy and stolen time, this process's own."""

    wall: float
    busy: float
    steal: float
    own: float


def cpu_sample() -> CpuSample | None:
    """The machine's CPU seconds now, from ``/proc/stat``; None where it cannot be read
    (not Linux)."""
    try:
        with open(_PROC_STAT, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...; guest time is inside user.
    ticks = [int(value) for value in fields[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSample(
        wall=time.perf_counter(),
        busy=(ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / hz,
        steal=ticks[7] / hz,
        own=usage.ru_utime + usage.ru_stime,
    )


def other_work(before: CpuSample | None, after: CpuSample | None) -> dict[str, float] | None:
    """The share of all the CPUs' time between two samples that other processes kept
    busy (``other_share``) and that the hypervisor took (``steal_share``); None without
    samples."""
    if before is None or after is None:
        return None
    capacity = (after.wall - before.wall) * (os.cpu_count() or 1)
    if capacity <= 0:
        return None
    other = (after.busy - before.busy) - (after.own - before.own)
    return {
        "other_share": max(other, 0.0) / capacity,
        "steal_share": (after.steal - before.steal) / capacity,
    }
