"""The one interface a caller of the cache uses, embedded or through a sidecar.

:class:`~lmcache_async.CacheEngine` (in this process) and
:class:`~lmcache_async.RemoteCacheEngine` (a sidecar's client) both satisfy
:class:`KVCacheClient`; :class:`~lmcache_async.SyncCacheEngine` wraps either. Code that only
stores, looks up and loads KV (the load generator, the transformers helpers, the vLLM
connector) is written against this Protocol and runs on both.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import Tokens

__all__ = ["MAX_PROMISE_WAIT", "KVCacheClient", "Promise", "check_promise_wait"]

MAX_PROMISE_WAIT: Final = 60.0
"""The longest ``wait`` a promise takes (seconds)."""


def check_promise_wait(wait: object) -> float:
    """``wait`` as the seconds a promise may wait for its reads, checked.

    Raises:
        InvalidInputError: not a number in [0, :data:`MAX_PROMISE_WAIT`].
    """
    if (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not math.isfinite(wait)
        or not 0 <= wait <= MAX_PROMISE_WAIT
    ):
        raise InvalidInputError(f"wait must be a number of seconds in [0, 60], got {wait!r}")
    return float(wait)


@dataclass(frozen=True, slots=True)
class Promise:
    """What a scheduler may count on for a request.

    ``tokens``: prompt prefix tokens (from token 0) verified in host memory and pinned for
    the lookup id. ``pending``: a prefetch is still bringing lower-tier hits into host
    memory; ask again (the count may then grow).
    """

    tokens: int
    pending: bool


@runtime_checkable
class KVCacheClient(Protocol):
    """Store, look up and load the KV of token prefixes.

    Every call raises :class:`~lmcache_async.errors.InvalidInputError` for bad input
    (nothing stored) and :class:`~lmcache_async.errors.EngineClosedError` once closed; a
    cache that cannot serve (unhealthy, unreachable) answers with misses, never an error.

    Every call about a prompt takes ``tenant``: whose KV it is (None: the client's own
    tenant, given when it was opened). The tenant is bound into the chunk keys, so a
    tenant's requests find only that tenant's KV.
    """

    async def store(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        store_location: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> int:
        """Copy the KV of ``tokens`` out of ``kv_caches``, as it stands on ``stream``
        (default: the current stream of their device) when called; returns the tokens
        cached from the first stored chunk on."""
        ...

    async def retrieve(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        retrieve_locations: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> torch.Tensor:
        """Load the cached run of chunks into ``kv_caches``, ahead of what is queued on
        ``stream`` (default: the current stream of their device) next; returns the bool
        CPU mask of the tokens written."""
        ...

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
        tenant: str | None = None,
    ) -> int:
        """Number of prefix tokens cached (pinned for ``lookup_id`` with ``pin=True``)."""
        ...

    async def prefetch(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
        tenant: str | None = None,
    ) -> int:
        """Look up and start loading the hits of the slow tiers into host memory."""
        ...

    async def promise(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        tenant: str | None = None,
        computed_tokens: int = 0,
        prefill_tokens_per_s: float | None = None,
        finish: bool = False,
        wait: float = 0.0,
    ) -> Promise:
        """The prompt tokens verified in host memory for a load under ``lookup_id``
        (pinned), and whether a prefetch still runs (ask again; ``wait``: seconds to wait
        for it first)."""
        ...

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release the pins taken for ``lookup_id``."""
        ...

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all)."""
        ...

    def is_healthy(self) -> bool:
        """Whether the cache can serve now."""
        ...

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        ...

    async def aclose(self) -> None:
        """Release everything the client holds."""
        ...
