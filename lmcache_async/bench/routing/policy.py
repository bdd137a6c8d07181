"""The routing policies the benchmark compares: a router over a KV index's matches.

- ``round-robin``: the workers in turn, the index unread;
- ``gpu-events``: the worker whose GPU tier (vLLM's own KV cache) matches the most of the
  prompt: what a router learns from vLLM's own events alone;
- ``all-tiers``: the worker matching the most on its GPU or CPU tier, our connector's
  host blocks included.

Ties (a prompt no worker holds, above all) go round robin, so new prefixes are spread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

from lmcache_async.bench.routing.indexer import TierMatch
from lmcache_async.bench.routing.options import POLICIES
from lmcache_async.errors import InvalidInputError

__all__ = ["MatchSource", "Router"]

_SCORES: Final[Mapping[str, Callable[[TierMatch], int]]] = {
    "round-robin": lambda match: 0,
    "gpu-events": lambda match: match.gpu,
    "all-tiers": lambda match: match.cpu,  # cumulative: GPU or CPU
}


class MatchSource(Protocol):
    """What a router reads: one worker's match for a prompt (a :class:`DynamoIndexer`)."""

    async def match(self, token_ids: Sequence[int], worker_id: int) -> TierMatch: ...


class Router:
    """Chooses a worker for each prompt by ``policy`` (one of :data:`POLICIES`).

    Raises:
        InvalidInputError: an unknown policy, or no worker.
    """

    def __init__(self, policy: str, workers: Sequence[int]) -> None:
        if policy not in POLICIES:
            raise InvalidInputError(f"policy must be one of {', '.join(POLICIES)}: {policy!r}")
        if not workers:
            raise InvalidInputError("a router needs at least one worker")
        self.policy = policy
        self.workers = tuple(workers)
        self._score = _SCORES[policy]
        self._turn = 0

    def choose(self, matches: Mapping[int, TierMatch]) -> int:
        """The worker with the best score; among equals the next in turn (a worker
        missing from ``matches`` matches nothing)."""
        scores = [self._score(matches.get(worker, TierMatch())) for worker in self.workers]
        best = max(scores)
        count = len(self.workers)
        for step in range(count):
            position = (self._turn + step) % count
            if scores[position] == best:
                if scores.count(best) > 1:
                    self._turn = (position + 1) % count
                return self.workers[position]
        raise AssertionError("unreachable: the best score is one of the scores")

    async def route(
        self, index: MatchSource, tokens: Sequence[int]
    ) -> tuple[int, dict[int, TierMatch]]:
        """Ask ``index`` for every worker's match of ``tokens`` and choose; returns the
        worker and the matches (read for round robin too, for the record).

        Raises:
            Exception: whatever ``index.match`` raises.
        """
        matches = {worker: await index.match(tokens, worker) for worker in self.workers}
        return self.choose(matches), matches
