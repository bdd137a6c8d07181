"""Health of the storage tiers: a monitor that probes each slow tier on an interval.

A tier reports its last known state through ``healthy()``; a failing call marks it down at
once. The monitor probes every tier each ``interval`` seconds (``check_health()``, bounded
by ``timeout``), so a tier that went down is bypassed within one interval and one that came
back is used again by itself. State changes are logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from lmcache_async.logging import get_logger

__all__ = ["HealthMonitor", "Probed"]

log = get_logger(__name__)


class Probed(Protocol):
    """What the monitor needs of a tier (every storage backend is one)."""

    name: str

    def healthy(self) -> bool: ...

    async def check_health(self) -> bool: ...


class HealthMonitor:
    """Probes ``tiers`` every ``interval`` seconds; each probe may take ``timeout`` seconds."""

    def __init__(self, tiers: Sequence[Probed], *, interval: float, timeout: float) -> None:
        self._tiers = list(tiers)
        self._interval = interval
        self._timeout = timeout
        self._state = {tier.name: True for tier in self._tiers}
        self.checks = 0

    def status(self) -> dict[str, bool]:
        """Each monitored tier's state as of its last probe or call."""
        return {tier.name: tier.healthy() for tier in self._tiers}

    async def check_once(self) -> dict[str, bool]:
        """Probe every tier now (concurrently); returns the new states."""

        async def probe(tier: Probed) -> None:
            ok = False
            with anyio.move_on_after(self._timeout):
                try:
                    ok = await tier.check_health()
                except Exception as exc:
                    log.debug("tier_probe_failed", tier=tier.name, error=repr(exc))
            if ok != self._state[tier.name]:
                if ok:
                    log.info("tier_up", tier=tier.name)
                else:
                    log.warning("tier_down", tier=tier.name)
            self._state[tier.name] = ok

        async with anyio.create_task_group() as tg:
            for tier in self._tiers:
                tg.start_soon(probe, tier)
        self.checks += 1
        return dict(self._state)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe forever (until cancelled), one round every interval."""
        task_status.started()
        while True:
            await self.check_once()
            await anyio.sleep(self._interval)
