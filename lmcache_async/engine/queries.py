"""The engine's questions: how much of a prompt is cached, pinned or prefetched for its
load. One group of :class:`~lmcache_async.engine.CacheEngine`'s public methods, over the
lookups and the key input of its parts."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from lmcache_async.engine.client import Promise, check_promise_wait
from lmcache_async.keys.tokens import Tokens, is_strict_int

from ..errors import InvalidInputError
from .parts import EngineBase

__all__ = ["Queries"]


class Queries(EngineBase):
    """Lookups, pins and prefetches of a running engine."""

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
        """Number of prefix tokens (from token 0) whose KV is cached in any tier for
        ``tenant`` (default: the engine's ``tenant``).

        The prefix may begin in the CPU tier and continue on disk or in Redis;
        ``search_range`` limits the tiers asked (default: ``retrieve_locations``). With
        ``pin=True`` and a ``lookup_id`` the chunks in the CPU tier are pinned (never
        evicted) until :meth:`lookup_unpin`, a :meth:`retrieve` with the same id, or
        ``pin_timeout``. Raises InvalidInputError for bad input.
        """
        self._check_open()
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        locations = self.check_locations(search_range, "search_range")
        keys, ends, num_tokens = await self._parts.keys.lookup_keys(tokens, hashes, offsets, tenant)
        return await self._parts.lookups.lookup(
            keys, ends, num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    async def lookup_digests(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        search_range: Sequence[str] | None = None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`lookup`, for a prompt of ``num_tokens`` tokens whose chunk digests
        (``hasher_for(tenant)``'s ``digests``, one per chunk, the last maybe short) were
        computed by the caller, e.g. a sidecar client: no tokens cross the wire.
        ``digests`` may also come as their concatenation (bytes or a view, as a wire frame
        holds them).

        Raises:
            InvalidInputError: ``num_tokens`` is not an int >= 0, the number of digests is
                not that of its chunks, a digest is not ``DIGEST_SIZE`` bytes or not
                ``tenant``'s, or as :meth:`lookup`.
        """
        self._check_open()
        locations = self.check_locations(search_range, "search_range")
        keys = self._parts.keys.digest_keys(
            digests, num_tokens, lookup_id=lookup_id, pin=pin, tenant=tenant
        )
        return await self._parts.lookups.lookup(
            keys, [], num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    def lookup_digests_now(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        tenant: str | None = None,
    ) -> int | None:
        """:meth:`lookup_digests` over the configured tiers, answered without waiting when
        the CPU tier can answer it alone; None (nothing done) when disk or Redis must be
        asked, the engine is layerwise or unhealthy: then await :meth:`lookup_digests`.
        A socket reader on the event loop's callbacks answers most lookups this way.

        Raises:
            InvalidInputError: as :meth:`lookup_digests`.
        """
        self._check_open()
        keys = self._parts.keys.digest_keys(
            digests, num_tokens, lookup_id=lookup_id, pin=pin, tenant=tenant
        )
        return self._parts.lookups.now(keys, [], num_tokens, lookup_id=lookup_id, pin=pin)

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
        """Look up a prompt (of ``tenant``, as :meth:`lookup`) and start loading its hits
        from disk or Redis into host memory.

        Returns the prefix tokens cached (as :meth:`lookup`) at once; the loading runs in
        the background, and a later :meth:`retrieve` with the same ``lookup_id`` waits for
        it and is served from what it loaded (pinned until then, or ``pin_timeout``).
        Raises InvalidInputError for bad input.
        """
        self._check_open()
        if lookup_id is None:
            raise InvalidInputError("prefetch needs a lookup_id")
        locations = self.check_locations(search_range, "search_range")
        keys, ends, num_tokens = await self._parts.keys.lookup_keys(tokens, hashes, offsets, tenant)
        return await self._parts.lookups.prefetch(
            keys, ends, num_tokens, lookup_id=lookup_id, locations=locations
        )

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
        """How many prompt tokens (from token 0) a load under ``lookup_id`` can count on:
        only chunks in host memory, pinned for the id, are promised.

        The first call pins the CPU tier's part of the cached prefix and, when the cost
        model finds more of it worth loading than recomputing (the serving engine
        computes ``prefill_tokens_per_s``; it has ``computed_tokens`` of the prompt
        already), starts reading that from disk or Redis into host memory, checksums
        verified, and answers ``pending`` (after waiting up to ``wait`` seconds for that
        reading to end: a scheduler that asks again only at its next step may rather
        wait a few milliseconds now). Ask again with the same arguments until an
        answer is not pending; ``finish=True`` stops the reading and promises what has
        arrived. A corrupt or vanished chunk ends the promise before it (it is a miss,
        counted). The pins last until the :meth:`retrieve` with the same id,
        :meth:`lookup_unpin` or ``pin_timeout``.

        Raises:
            InvalidInputError: bad key input, ``computed_tokens`` not an int >= 0,
                ``prefill_tokens_per_s`` not a number > 0, ``wait`` not a number in
                [0, 60].
        """
        self._check_open()
        wait = check_promise_wait(wait)
        if lookup_id is None:
            raise InvalidInputError("promise needs a lookup_id")
        if not is_strict_int(computed_tokens) or computed_tokens < 0:
            raise InvalidInputError(f"computed_tokens must be an int >= 0, got {computed_tokens!r}")
        if prefill_tokens_per_s is not None and (
            isinstance(prefill_tokens_per_s, bool)
            or not isinstance(prefill_tokens_per_s, int | float)
            or not math.isfinite(prefill_tokens_per_s)
            or prefill_tokens_per_s <= 0
        ):
            raise InvalidInputError(
                f"prefill_tokens_per_s must be a number > 0, got {prefill_tokens_per_s!r}"
            )
        keys, ends, num_tokens = await self._parts.keys.lookup_keys(tokens, hashes, offsets, tenant)
        return await self._parts.promises.promise(
            keys,
            ends,
            num_tokens,
            lookup_id=lookup_id,
            locations=None,
            computed_tokens=computed_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
            finish=bool(finish),
            wait=wait,
        )

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release the pins taken by :meth:`lookup` or :meth:`promise` for ``lookup_id``
        (no-op if none); a promise's reading under way stops."""
        self.lookup_unpin_now(lookup_id)

    def lookup_unpin_now(self, lookup_id: Hashable) -> None:
        """:meth:`lookup_unpin`, which never waits: for a socket reader on the event loop's
        callbacks."""
        self._check_open()
        self._parts.promises.forget(lookup_id)
        self._parts.manager.unpin(lookup_id)
