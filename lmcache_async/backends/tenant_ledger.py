"""One tier's accounts by tenant: what each tenant holds, in its own LRU order, and the
rules of its quota (:class:`~lmcache_async.tenancy.tenants.TenantLimits`).

A tier tells its ledger every chunk it adds and every chunk it drops; the ledger never
touches the tier's index or memory, it only answers which keys must go: :meth:`victims`
(a tenant's own oldest chunks, so that a put keeps it within its quota) and
:meth:`pick_unprotected` (the tier's oldest chunks that may go to make room for anyone).
A tenant *within* its quota is protected: its chunks are never evicted for another
tenant. A tenant with no quota is never protected, and one over its quota (quotas shrank
since a restart) only until it is back within it. Tenants under the default quota
(``"*"``) are as many as there are names, more than any tier holds: when nothing else can
make room, their oldest chunks go, and only the tenants named in the quotas (whose sum the
config keeps within the tier) are never evicted for another.

Without any quota (:attr:`TenantLedger.active` False) a put or a removal costs one
dictionary update and a hit costs nothing: the per-tenant LRU order is kept only while
some quota can use it. A tier that hands the ledger its own index (``index``: the CPU
tier's) is spared the ledger's copy of it too: without a quota the ledger then counts
each tenant's chunks and bytes, keeps no key, and finds a tenant's keys in the index when
it is erased. Everything runs on the tier's event loop.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Collection, Iterable, Sequence

from lmcache_async.tenancy.tenants import TAG_BYTES, TenantLimits, tag_hex

from ..errors import InvalidInputError
from ..stats import TenantUsage
from .epochs import ErasureEpochs
from .lru import held_prefix_count

__all__ = ["KeyFilter", "TenantLedger", "check_tag"]

KeyFilter = Callable[[bytes], bool]
"""Asked of a key: whether the tier can evict that chunk now (not pinned, not in use)."""


_tag_of = operator.itemgetter(slice(0, TAG_BYTES))
"""A key's tenant tag."""


def check_tag(tag: object) -> bytes:
    """``tag`` if it is a tenant tag (:data:`~lmcache_async.tenancy.tenants.TAG_BYTES` bytes).

    Raises:
        InvalidInputError: it is not.
    """
    if not isinstance(tag, bytes) or len(tag) != TAG_BYTES:
        raise InvalidInputError(f"a tenant tag is {TAG_BYTES} bytes, got {tag!r:.80}")
    return bytes(tag)


class _Account:
    """One tenant's chunks in one tier: key → bytes, least recently used first (or only
    their count, in a ledger that keeps no keys); and the bytes pinned for it that the
    tier does not hold."""

    __slots__ = (
        "bytes",
        "counted_chunks",
        "erased",
        "evictions",
        "keys",
        "pinned",
        "pins_refused",
        "refused",
    )

    def __init__(self) -> None:
        self.keys: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.counted_chunks = 0
        """Chunks held, in a ledger that keeps no keys (``keys`` stays empty there)."""
        self.bytes = 0
        self.pinned = 0
        self.evictions = 0
        self.erased = 0
        self.refused = 0
        self.pins_refused = 0

    @property
    def chunks(self) -> int:
        """Chunks the tenant holds in the tier."""
        return self.counted_chunks + len(self.keys)

    @property
    def counted(self) -> int:
        """What the tenant's quota counts: its chunks and its pins outside the tier."""
        return self.bytes + self.pinned


class TenantLedger:
    """The accounts of one tier's tenants, by tag, and the quotas of ``limits``.

    Sizes are whatever the tier counts (payload bytes in the CPU tier, file bytes on
    disk); a quota bounds their sum per tenant. ``index``: the tier's own keys, oldest
    first; without a quota the ledger then keeps none of its own (see the module doc):
    the tier never adds a key it holds, and tells the size of each chunk it drops.
    """

    __slots__ = ("_accounts", "_epochs", "_index", "_limits", "active", "refused")

    def __init__(
        self, limits: TenantLimits | None = None, *, index: Collection[bytes] | None = None
    ) -> None:
        self._limits = limits if limits is not None else TenantLimits(None)
        self.active = self._limits.active
        """Whether some tenant has a quota here (else nothing is ever protected)."""
        self._index = None if self.active else index
        self._accounts: dict[bytes, _Account] = {}
        self._epochs = ErasureEpochs()
        self.refused = 0
        """Chunks the tier did not store because of a quota (all tenants)."""

    # -- what the tier holds ------------------------------------------------------------

    def add(self, key: bytes, nbytes: int) -> None:
        """Account a chunk the tier now holds, as its tenant's most recent."""
        tag = key[:TAG_BYTES]
        account = self._accounts.get(tag)
        if account is None:
            account = self._accounts[tag] = _Account()
        if self._index is not None:
            account.counted_chunks += 1
            account.bytes += nbytes
            return
        previous = account.keys.pop(key, 0)
        account.keys[key] = nbytes
        account.bytes += nbytes - previous

    def add_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """:meth:`add` of each of ``keys`` (of ``sizes`` bytes), in order: a tier filling
        its index. A ledger that keeps no keys counts a batch of one tenant at once."""
        if self._index is not None:
            tags = set(map(_tag_of, keys))
            if len(tags) == 1:
                account = self._account(tags.pop())
                account.counted_chunks += len(keys)
                account.bytes += sum(sizes)
                return
        for key, nbytes in zip(keys, sizes, strict=True):
            self.add(key, nbytes)

    def remove(self, key: bytes, nbytes: int = 0) -> int:
        """Forget a chunk the tier dropped; returns its bytes (0 if it was not accounted).
        ``nbytes``: its size, for a ledger that keeps no keys."""
        account = self._accounts.get(key[:TAG_BYTES])
        if account is None:
            return 0
        if self._index is not None:
            account.counted_chunks -= 1
            account.bytes -= nbytes
            return nbytes
        held = account.keys.pop(key, None)
        if held is None:
            return 0
        account.bytes -= held
        return held

    def evicted(self, key: bytes, nbytes: int = 0) -> None:
        """Forget a chunk the tier evicted, and count the eviction for its tenant.
        ``nbytes``: its size, for a ledger that keeps no keys."""
        account = self._accounts.get(key[:TAG_BYTES])
        if account is None:
            return
        if self._index is not None:
            account.counted_chunks -= 1
            account.bytes -= nbytes
            account.evictions += 1
        elif key in account.keys:
            account.bytes -= account.keys.pop(key)
            account.evictions += 1

    def erase(self, tag: bytes) -> list[bytes]:
        """Forget every chunk of the tenant and count them as erased; returns their keys
        (the tier drops them), least recently used first while a quota is active, else in
        the order they were added (a ledger that keeps no keys: the index's order)."""
        account = self._accounts.get(tag)
        if account is None:
            return []
        if self._index is not None:
            keys = [key for key in self._index if key[:TAG_BYTES] == tag] if account.chunks else []
        else:
            keys = list(account.keys)
        account.keys.clear()
        account.counted_chunks = 0
        account.bytes = 0
        account.erased += len(keys)
        return keys

    def count_erased(self, tag: bytes, chunks: int) -> None:
        """Count ``chunks`` more erased for the tenant (files the tier had not indexed)."""
        if chunks:
            self._account(tag).erased += chunks

    def clear(self) -> None:
        """Forget every chunk held (the tier was cleared); the counts stay."""
        for account in self._accounts.values():
            account.keys.clear()
            account.counted_chunks = 0
            account.bytes = 0

    def touch(self, keys: Sequence[bytes], count: int | None = None) -> None:
        """The first ``count`` keys (all by default), all held, were hit: each becomes its
        tenant's most recent. Nothing is done when no quota is active."""
        if not self.active:
            return
        end = len(keys) if count is None else count
        accounts = self._accounts
        i = 0
        while i < end:
            account = accounts.get(keys[i][:TAG_BYTES])
            if account is None:
                i += 1
                continue
            run = keys if i == 0 and end == len(keys) else keys[i:end]
            # A lookup's keys are usually all one tenant's: one walk in C moves them all.
            i += held_prefix_count(account.keys, run) or 1

    def touch_one(self, key: bytes) -> None:
        """:meth:`touch` of one key."""
        if self.active:
            account = self._accounts.get(key[:TAG_BYTES])
            if account is not None and key in account.keys:
                account.keys.move_to_end(key)

    # -- quotas -------------------------------------------------------------------------

    def limit(self, tag: bytes) -> int | None:
        """The tenant's quota in bytes, None when it has none."""
        return self._limits.limit(tag)

    def victims(
        self, tag: bytes, incoming_bytes: int, evictable: KeyFilter | None = None
    ) -> list[bytes] | None:
        """The tenant's own least recently used keys that must go for ``incoming_bytes``
        more to fit in its quota (``[]``: they fit, or it has no quota), skipping keys
        ``evictable`` refuses; None when they cannot fit (larger than the quota, or too
        little of it can be evicted now). Nothing is forgotten here: the tier evicts
        them and calls :meth:`evicted`."""
        if not self.active:
            return []
        limit = self._limits.limit(tag)
        if limit is None:
            return []
        if incoming_bytes > limit:
            return None
        account = self._accounts.get(tag)
        excess = (account.counted if account is not None else 0) + incoming_bytes - limit
        if account is None or excess <= 0:
            return []
        out: list[bytes] = []
        for key, nbytes in account.keys.items():  # oldest first
            if evictable is not None and not evictable(key):
                continue
            out.append(key)
            excess -= nbytes
            if excess <= 0:
                return out
        return None

    def protected(self, key: bytes, freed: int = 0, *, default_too: bool = True) -> bool:
        """Whether the chunk's tenant is within its quota (with ``freed`` of its bytes
        already chosen to go): then the chunk is never evicted for another tenant. With
        ``default_too`` False only tenants named in the quotas count."""
        if not self.active:
            return False
        tag = key[:TAG_BYTES]
        limit = self._limits.limit(tag)
        if limit is None or not (default_too or self._limits.named(tag)):
            return False
        account = self._accounts.get(tag)
        return account is None or account.counted - freed <= limit

    def pick_unprotected(
        self,
        oldest_first: Iterable[bytes],
        needed: int,
        *,
        evictable: KeyFilter | None = None,
        round_to: int = 1,
        freed: dict[bytes, int] | None = None,
        whole: bool = False,
    ) -> tuple[list[bytes], int]:
        """Keys of ``oldest_first`` (the tier's LRU order) to evict until ``needed`` bytes
        are released, skipping protected chunks and those ``evictable`` refuses; with the
        bytes they release (each key's accounted bytes, rounded up to a multiple of
        ``round_to``: a pool's whole pages). When not enough can go: what can, or with
        ``whole`` nothing. ``freed``: bytes by tag already chosen to go (updated with
        what is returned). Nothing is forgotten here.
        """
        if self.active:
            bound = self._unprotected_bound(round_to)
            if bound == 0 or (whole and bound < needed):
                return [], 0  # only protected chunks would be left: no walk over them
        taken = dict(freed) if freed else {}
        out: list[bytes] = []
        pick = functools.partial(
            self._pick, evictable=evictable, round_to=round_to, taken=taken, out=out
        )
        released = pick(oldest_first, needed, default_too=True)
        if released < needed and self._limits.has_default:
            # Not enough without them: tenants under the default quota give way too.
            chosen = set(out)
            rest = (key for key in oldest_first if key not in chosen)
            released += pick(rest, needed - released, default_too=False)
        if whole and released < needed:
            return [], 0
        if freed is not None:
            freed.update(taken)
        return out, released

    def _pick(
        self,
        oldest_first: Iterable[bytes],
        needed: int,
        *,
        evictable: KeyFilter | None,
        round_to: int,
        taken: dict[bytes, int],
        out: list[bytes],
        default_too: bool,
    ) -> int:
        """One pass of :meth:`pick_unprotected`: appends to ``out``, returns the bytes."""
        released = 0
        for key in oldest_first:
            if released >= needed:
                break
            if evictable is not None and not evictable(key):
                continue
            tag = key[:TAG_BYTES]
            if self.protected(key, taken.get(tag, 0), default_too=default_too):
                continue
            account = self._accounts.get(tag)
            nbytes = account.keys.get(key, 0) if account is not None else 0
            taken[tag] = taken.get(tag, 0) + nbytes
            released += -(-nbytes // round_to) * round_to
            out.append(key)
        return released

    def refuse(self, key: bytes) -> None:
        """Count a chunk the tier did not store because of a quota."""
        self._account(key[:TAG_BYTES]).refused += 1
        self.refused += 1

    # -- pins outside the tier (prefetched payloads pinned for a lookup) --------------------

    def charge_pin(self, tag: bytes, nbytes: int) -> None:
        """Count ``nbytes`` pinned for the tenant that the tier does not hold (its quota
        counts them, as :meth:`victims` then makes room for them)."""
        self._account(tag).pinned += nbytes

    def release_pin(self, tag: bytes, nbytes: int) -> None:
        """The pin :meth:`charge_pin` counted has ended."""
        account = self._accounts.get(tag)
        if account is not None:
            account.pinned = max(0, account.pinned - nbytes)

    def refuse_pins(self, tag: bytes, chunks: int) -> None:
        """Count ``chunks`` of the tenant not pinned because its quota was full."""
        if chunks:
            self._account(tag).pins_refused += chunks

    def _unprotected_bound(self, round_to: int) -> int:
        """An upper bound on what :meth:`pick_unprotected` can release: the (rounded)
        bytes of the tenants not protected now."""
        total = 0
        for tag, account in self._accounts.items():
            limit = self._limits.limit(tag)
            if limit is None or account.counted > limit or not self._limits.named(tag):
                total += account.bytes + len(account.keys) * (round_to - 1)
        return total

    def _account(self, tag: bytes) -> _Account:
        account = self._accounts.get(tag)
        if account is None:
            account = self._accounts[tag] = _Account()
        return account

    # -- erasure epochs (a write that waited must not bring back an erased chunk) --------

    @property
    def erasures(self) -> int:
        """A mark to hand to :meth:`erased_since` later (:meth:`.epochs.ErasureEpochs.mark`)."""
        return self._epochs.mark()

    def mark_erased(self, tag: bytes) -> None:
        """Record that the tenant was erased now."""
        self._epochs.begin(tag)
        self._epochs.end(tag)

    def erased_since(self, key: bytes, mark: int) -> bool:
        """Whether the key's tenant was erased after :attr:`erasures` was ``mark``."""
        return self._epochs.erased_since(key, mark)

    # -- figures ------------------------------------------------------------------------

    def usage(self) -> dict[str, TenantUsage]:
        """Usage by tag (:func:`~lmcache_async.tenancy.tenants.tag_hex`) of every tenant seen."""
        return {
            tag_hex(tag): TenantUsage(
                chunks=account.chunks,
                bytes=account.bytes,
                evictions=account.evictions,
                erased=account.erased,
                quota_bytes=self._limits.limit(tag),
                pinned_bytes=account.pinned,
                pins_refused=account.pins_refused,
            )
            for tag, account in self._accounts.items()
        }

    def refused_of(self, tag: bytes) -> int:
        """Chunks of the tenant the tier did not store because of a quota."""
        account = self._accounts.get(tag)
        return account.refused if account is not None else 0

    def held(self, tag: bytes) -> int:
        """Bytes the tenant holds."""
        account = self._accounts.get(tag)
        return account.bytes if account is not None else 0
