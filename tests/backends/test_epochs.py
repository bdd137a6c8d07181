"""ErasureEpochs: work marked before an erasure of its tenant, or landing while one runs,
lands nothing of that tenant; work marked after the erasure ended, and other tenants'
work, is not touched."""

from __future__ import annotations

from lmcache_async.backends.epochs import ErasureEpochs
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

A, B = tenant_tag("a"), tenant_tag("b")


def key(tag: bytes, n: int) -> bytes:
    return tag + bytes([n]) * TAG_BYTES


def test_work_marked_before_or_during_an_erasure_is_refused_and_after_it_is_not() -> None:
    epochs = ErasureEpochs()
    before = epochs.mark()
    assert epochs.intact([key(A, 1), key(B, 1)], before) == 2
    epochs.begin(A)
    during = epochs.mark()
    assert epochs.erased_since(key(A, 1), during), "nothing lands while it runs"
    assert not epochs.erased_since(key(B, 1), before)
    epochs.end(A)
    after = epochs.mark()
    for mark in (before, during):
        assert epochs.erased_since(key(A, 1), mark)
        assert epochs.intact([key(A, 1), key(A, 2)], mark) == 0
        assert epochs.intact([key(B, 1), key(A, 1), key(B, 2)], mark) == 1
    assert not epochs.erased_since(key(A, 1), after)
    assert epochs.intact([key(A, 1), key(B, 1)], after) == 2


def test_two_erasures_of_one_tenant_overlapping_refuse_until_both_end() -> None:
    epochs = ErasureEpochs()
    epochs.begin(A)
    epochs.begin(A)
    epochs.end(A)
    assert epochs.erased_since(key(A, 1), epochs.mark()), "the other is still running"
    epochs.end(A)
    assert not epochs.erased_since(key(A, 1), epochs.mark())
