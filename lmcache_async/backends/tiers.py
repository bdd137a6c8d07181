"""The tiers a storage manager routes to: which are enabled, in what order, and which of
them the configuration names for writes and for reads.

Tier names are the backends' ``name`` (``"cpu"``, ``"disk"``, ``"redis"``); a location
list given by a caller is checked against the enabled tiers here, so that a typo is an
error at once instead of a silent miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ..errors import InvalidInputError
from ..stats import TierStats
from .base import StorageBackend
from .cpu import CPUBackend

__all__ = ["TIER_ORDER", "TierSet"]

TIER_ORDER: Final = ("cpu", "disk", "redis")
"""Tiers from the fastest to the slowest: the order reads try them in."""


class TierSet:
    """The CPU tier and the slow tiers (fastest first) behind it, by name.

    ``store_to`` and ``read_from`` are the enabled tiers among the configured store and
    retrieve locations (``wanted_*``; None: all), in :data:`TIER_ORDER`.
    """

    def __init__(
        self,
        cpu: CPUBackend,
        slow: Sequence[StorageBackend] = (),
        *,
        wanted_store: tuple[str, ...] | None = None,
        wanted_read: tuple[str, ...] | None = None,
    ) -> None:
        self.cpu = cpu
        self.slow: tuple[StorageBackend, ...] = tuple(slow)
        self._by_name: dict[str, StorageBackend] = {cpu.name: cpu}
        self._by_name.update((tier.name, tier) for tier in self.slow)
        self.store_to = self._enabled(wanted_store)
        self.read_from = self._enabled(wanted_read)

    def _enabled(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        return tuple(
            name
            for name in TIER_ORDER
            if name in self._by_name and (wanted is None or name in wanted)
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The enabled tiers: the CPU tier, then the slow tiers fastest first."""
        return tuple(self._by_name)

    def check_locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...]:
        """The enabled tiers among ``locations`` (all enabled tiers for None), in tier order.

        Raises:
            InvalidInputError: a location names no enabled tier (``name`` says which
                argument it came in).
        """
        if locations is None:
            return self.names
        if isinstance(locations, str):
            locations = [locations]
        for location in locations:
            if location not in self._by_name:
                raise InvalidInputError(
                    f"{name}: {location!r} is not an enabled tier (enabled: {list(self.names)})"
                )
        return tuple(tier for tier in TIER_ORDER if tier in locations)

    def tier(self, name: str) -> StorageBackend:
        """The enabled tier called ``name``.

        Raises:
            InvalidInputError: no enabled tier has that name.
        """
        self.check_locations([name], "location")
        return self._by_name[name]

    def readable(self, names: Sequence[str]) -> list[StorageBackend]:
        """The slow tiers among ``names`` that are healthy now, fastest first."""
        return [tier for tier in self.slow if tier.name in names and tier.healthy()]

    def stats(self) -> dict[str, TierStats]:
        return {name: tier.stats() for name, tier in self._by_name.items()}

    def health(self) -> dict[str, bool]:
        return {name: tier.healthy() for name, tier in self._by_name.items()}
