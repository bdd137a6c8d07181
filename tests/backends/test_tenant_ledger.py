"""The tenant ledger: accounts by tag, own-LRU victims for a quota, protection from
eviction for a tenant within its quota, erasure marks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from lmcache_async.backends.tenant_ledger import TenantLedger, check_tag
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import LINK_SIZE, ChunkKey
from lmcache_async.stats import TenantUsage
from lmcache_async.tenancy.quotas import TierQuota
from lmcache_async.tenancy.tenants import TenantLimits, tag_hex, tenant_tag

A = tenant_tag("a")
B = tenant_tag("b")
C = tenant_tag("c")  # no quota


def key(tag: bytes) -> ChunkKey:
    return ChunkKey(tag + os.urandom(LINK_SIZE))


def limits(default: int | None = None, **named: int) -> TenantLimits:
    return TenantLimits(TierQuota(MappingProxyType(named), default))


def filled(ledger: TenantLedger, tag: bytes, n: int, nbytes: int = 10) -> list[ChunkKey]:
    keys = [key(tag) for _ in range(n)]
    for k in keys:
        ledger.add(k, nbytes)
    return keys


def test_accounts_by_tag_without_any_quota() -> None:
    ledger = TenantLedger()
    assert not ledger.active
    a = filled(ledger, A, 3)
    c = filled(ledger, C, 2, nbytes=7)
    assert ledger.remove(a[1]) == 10
    assert ledger.remove(a[1]) == 0, "a second removal finds nothing"
    ledger.evicted(c[0])
    assert ledger.usage() == {
        tag_hex(A): TenantUsage(chunks=2, bytes=20),
        tag_hex(C): TenantUsage(chunks=1, bytes=7, evictions=1),
    }
    # No quota: nothing must go for a put, nothing is protected.
    assert ledger.victims(A, 10**9) == []
    assert not ledger.protected(a[0])
    assert ledger.erase(A) == [a[0], a[2]]
    assert ledger.usage()[tag_hex(A)] == TenantUsage(erased=2)


def test_readding_a_key_counts_it_once() -> None:
    ledger = TenantLedger()
    (k,) = filled(ledger, A, 1)
    ledger.add(k, 30)
    assert ledger.held(A) == 30
    assert ledger.usage()[tag_hex(A)].chunks == 1


def test_victims_are_the_tenants_own_oldest_keys() -> None:
    ledger = TenantLedger(limits(a=40))
    a = filled(ledger, A, 4)
    filled(ledger, B, 4)
    assert ledger.victims(A, 0) == []
    assert ledger.victims(A, 10) == [a[0]]
    assert ledger.victims(A, 25) == [a[0], a[1], a[2]]
    ledger.touch([a[0], a[1]])  # hits: 0 and 1 become a's newest
    assert ledger.victims(A, 20) == [a[2], a[3]]
    # Keys the tier cannot evict now are skipped.
    assert ledger.victims(A, 20, lambda k: k != a[2]) == [a[3], a[0]]
    # Larger than the quota, or not enough evictable: it cannot fit.
    assert ledger.victims(A, 41) is None
    assert ledger.victims(A, 40, lambda k: k != a[2]) is None
    # b has no quota: it loses nothing for its own puts.
    assert ledger.victims(B, 10**6) == []


def test_touch_moves_runs_of_several_tenants_and_stops_where_told() -> None:
    ledger = TenantLedger(limits(default=1000))
    a = filled(ledger, A, 3)
    b = filled(ledger, B, 2)
    ledger.touch([a[0], b[0], a[1], b[1], a[2]], 4)
    assert ledger.erase(A) == [a[2], a[0], a[1]]
    assert ledger.erase(B) == [b[0], b[1]]


def test_hits_change_nothing_without_a_quota() -> None:
    ledger = TenantLedger()
    a = filled(ledger, A, 3)
    ledger.touch([a[0]])
    ledger.touch_one(a[1])
    assert ledger.erase(A) == a, "insertion order kept: no per-hit work"


def test_a_tenant_within_its_quota_is_protected() -> None:
    ledger = TenantLedger(limits(a=30, b=10))
    a = filled(ledger, A, 3)
    b = filled(ledger, B, 3)  # over its quota (quotas shrank since a restart)
    c = filled(ledger, C, 1)
    assert ledger.protected(a[0])
    assert not ledger.protected(b[0])
    assert ledger.protected(b[0], freed=20), "back within its quota once 20 bytes go"
    assert not ledger.protected(c[0]), "no quota: never protected"
    victims, released = ledger.pick_unprotected([*a, *b, *c], 100)
    # b loses chunks only until it is within its quota again; c may lose everything.
    assert (victims, released) == ([b[0], b[1], c[0]], 30)
    victims, released = ledger.pick_unprotected([*b, *c], 15, round_to=16)
    assert (victims, released) == ([b[0]], 16)
    victims, _ = ledger.pick_unprotected([*b, *c], 100, evictable=lambda k: k != b[0])
    assert victims == [b[1], b[2], c[0]]
    # All or nothing: 30 bytes can go, not 31.
    freed: dict[bytes, int] = {}
    assert ledger.pick_unprotected([*a, *b, *c], 31, freed=freed, whole=True) == ([], 0)
    assert freed == {}
    assert ledger.pick_unprotected([*a, *b, *c], 30, freed=freed, whole=True)[1] == 30
    assert freed == {B: 20, C: 10}


def test_pick_unprotected_counts_what_was_already_chosen() -> None:
    ledger = TenantLedger(limits(a=20))
    a = filled(ledger, A, 3)  # 30 bytes: over by 10
    victims, released = ledger.pick_unprotected(a, 100, freed={A: 10})
    assert (victims, released) == ([], 0), "the 10 bytes over are already going"


def test_nothing_to_pick_when_only_protected_chunks_are_left() -> None:
    ledger = TenantLedger(limits(a=100, c=100))
    filled(ledger, A, 3)
    filled(ledger, C, 1, nbytes=5)
    assert ledger.pick_unprotected(Unwalkable(), 10) == ([], 0)


def test_tenants_under_the_default_quota_give_way_last_and_named_ones_never() -> None:
    ledger = TenantLedger(limits(default=100, a=100))
    named = filled(ledger, A, 2)  # within its own quota: never taken for another
    b = filled(ledger, B, 2)  # within the default quota
    c = filled(ledger, C, 2)
    order = [named[0], b[0], c[0], named[1], b[1], c[1]]
    assert ledger.pick_unprotected(order, 30) == ([b[0], c[0], b[1]], 30)
    assert ledger.pick_unprotected(order, 100) == ([b[0], c[0], b[1], c[1]], 40)
    assert ledger.pick_unprotected(order, 100, whole=True) == ([], 0)


class Unwalkable:
    """An LRU order that fails the test if it is walked."""

    def __iter__(self) -> Iterator[bytes]:
        raise AssertionError("walked over protected chunks")


def test_refusals_are_counted_by_tenant() -> None:
    ledger = TenantLedger(limits(a=5))
    ledger.refuse(key(A))
    ledger.refuse(key(A))
    assert (ledger.refused, ledger.refused_of(A), ledger.refused_of(B)) == (2, 2, 0)


def test_erasure_marks_tell_which_tenants_were_erased_since() -> None:
    ledger = TenantLedger()
    mark = ledger.erasures
    assert not ledger.erased_since(key(A), mark)
    ledger.mark_erased(A)
    assert ledger.erased_since(key(A), mark)
    assert not ledger.erased_since(key(B), mark)
    later = ledger.erasures
    assert not ledger.erased_since(key(A), later)
    ledger.count_erased(A, 3)
    assert ledger.usage()[tag_hex(A)].erased == 3


def test_usage_names_each_quota() -> None:
    ledger = TenantLedger(limits(default=50, a=30))
    filled(ledger, A, 1)
    filled(ledger, B, 1)
    usage = ledger.usage()
    assert (usage[tag_hex(A)].quota_bytes, usage[tag_hex(B)].quota_bytes) == (30, 50)


@pytest.mark.parametrize("tag", [b"abc", b"abcde", "abcd", None, bytearray(b"abcd")])
def test_a_bad_tag_is_refused(tag: object) -> None:
    with pytest.raises(InvalidInputError, match="tenant tag"):
        check_tag(tag)
    assert check_tag(A) == A


def test_with_the_tiers_index_and_no_quota_it_counts_and_keeps_no_key() -> None:
    """A tier that hands over its index (the CPU tier) is spared a second map of its keys
    when no quota needs one: counts and bytes per tenant only, keys found in the index."""
    index: dict[bytes, int] = {}
    ledger = TenantLedger(index=index)
    a_keys, b_keys = [key(A) for _ in range(3)], [key(B) for _ in range(2)]
    for k in [*a_keys, *b_keys]:
        index[k] = 10
        ledger.add(k, 10)
    assert all(not account.keys for account in ledger._accounts.values())
    ledger.remove(a_keys[0], 10)
    ledger.evicted(a_keys[1], 10)
    del index[a_keys[0]], index[a_keys[1]]
    assert ledger.usage()[tag_hex(A)] == TenantUsage(chunks=1, bytes=10, evictions=1)
    assert ledger.held(A) == 10
    assert ledger.erase(B) == b_keys  # in the index's order
    assert ledger.usage()[tag_hex(B)] == TenantUsage(erased=2)
    assert ledger.erase(C) == []
    ledger.clear()
    assert ledger.usage()[tag_hex(A)] == TenantUsage(evictions=1)


def test_with_a_quota_it_keeps_its_own_keys_even_given_the_index() -> None:
    index: dict[bytes, int] = {}
    ledger = TenantLedger(limits(a=100), index=index)
    a_keys = filled(ledger, A, 3)
    assert list(ledger._accounts[A].keys) == a_keys  # the LRU order a quota needs
    assert ledger.victims(A, 80) == a_keys[:1]
