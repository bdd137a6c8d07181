"""What a slow tier counts as it serves, kept on the event loop and reported in its
:class:`~lmcache_async.stats.TierStats`."""

from __future__ import annotations

from dataclasses import dataclass

from ..stats import TierStats

__all__ = ["TierCounters"]


@dataclass(slots=True)
class TierCounters:
    """``hits`` and ``misses``: keys the tier's gets were asked for, found or not;
    ``puts``: chunks it added; ``corrupt``: entries found corrupt (and deleted);
    ``errors``: calls that failed (a full disk, a server that did not answer)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    corrupt: int = 0
    errors: int = 0

    def got(self, asked: int, found: int) -> None:
        """Count a get of ``asked`` keys that found ``found`` of them."""
        self.hits += found
        self.misses += asked - found

    def stats(
        self, name: str, *, chunks: int, nbytes: int, evictions: int, healthy: bool
    ) -> TierStats:
        """A snapshot of the tier called ``name``, with what it holds now."""
        return TierStats(
            name=name,
            chunks=chunks,
            bytes=nbytes,
            hits=self.hits,
            misses=self.misses,
            puts=self.puts,
            evictions=evictions,
            healthy=healthy,
            corrupt=self.corrupt,
            errors=self.errors,
        )
