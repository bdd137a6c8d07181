"""Erasure epochs: the rule that makes an erasure final.

Whatever lands in a tier or a pin (a store's commit, a read promoted into the CPU tier, a
prefetch's pins, a write behind the stores) was read or reserved at some moment before it
lands, often with awaits between. Such work takes a :meth:`ErasureEpochs.mark` when it
begins, and where it lands it asks :meth:`ErasureEpochs.erased_since` of each key's tenant:
a tenant whose erasure began after the mark, or is still under way, gets nothing of that
work. So nothing read, reserved or queued before an erasure lands after it, and nothing
lands while it runs; work begun after the erasure returned is not affected.

The epoch is one counter for every tenant (one increment per erasure start and end), so a
mark is a plain int and a check is two dictionary lookups. Everything runs on one event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_async.tenancy.tenants import TAG_BYTES

__all__ = ["ErasureEpochs"]


class ErasureEpochs:
    """The erasure epochs of one set of tiers, by tenant tag."""

    __slots__ = ("_clock", "_ended_at", "_last_end", "_running")

    def __init__(self) -> None:
        self._clock = 0
        self._last_end = 0
        self._ended_at: dict[bytes, int] = {}
        self._running: dict[bytes, int] = {}

    def mark(self) -> int:
        """A mark to hand to :meth:`erased_since` when the work begun now lands."""
        return self._clock

    def begin(self, tag: bytes) -> None:
        """An erasure of the tenant with ``tag`` begins: from now until :meth:`end`,
        nothing of the tenant lands, whatever its mark."""
        self._clock += 1
        self._running[tag] = self._running.get(tag, 0) + 1

    def end(self, tag: bytes) -> None:
        """The erasure :meth:`begin` announced is over (done or failed): work marked
        before now never lands; work marked from now on does."""
        self._clock += 1
        self._ended_at[tag] = self._last_end = self._clock
        left = self._running.get(tag, 0) - 1
        if left > 0:
            self._running[tag] = left
        else:
            self._running.pop(tag, None)

    def erased_since(self, key: bytes, mark: int) -> bool:
        """Whether the tenant of ``key`` (its first :data:`TAG_BYTES` bytes) is being
        erased, or was erased after ``mark`` was taken."""
        tag = key[:TAG_BYTES]
        return tag in self._running or self._ended_at.get(tag, 0) > mark

    def intact(self, keys: Sequence[bytes], mark: int) -> int:
        """How many leading ``keys`` no erasure since ``mark`` reached (a prefix ends at
        the first key one did)."""
        if not self._running and mark >= self._last_end:
            return len(keys)  # no erasure since the mark: the common case, no key looked at
        for i, key in enumerate(keys):
            if self.erased_since(key, mark):
                return i
        return len(keys)
