"""Stored events keep what they must: the put's keys, and its tokens by reference where
they can never change (the engine's own int32 conversion), else a copy; nothing at all
when events are off. Either way an event carries the exact token ids of the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_async.backends.tier_events import StoredEvent, TierEvents
from lmcache_async.events import EventBuffer, KVEvent, PendingEvent
from lmcache_async.keys.chunks import ChunkHasher, ChunkSpan, Namespace, token_array
from lmcache_async.keys.tokens import Tokens, tokens_fixed

CHUNK = 4


def events(enabled: bool = True) -> TierEvents:
    return TierEvents(EventBuffer(100, enabled=enabled), chunk_size=CHUNK)


def spans_of(tokens: np.ndarray) -> list[ChunkSpan]:
    return ChunkHasher(Namespace("m", "layout"), chunk_size=CHUNK).array_spans(tokens)


def built(stored: StoredEvent, medium: str = "cpu") -> KVEvent:
    pending = stored.to(medium)
    assert isinstance(pending, PendingEvent)
    return pending.build()


def caller_inputs() -> list[tuple[str, Tokens]]:
    ids = list(range(100, 110))
    return [
        ("list", list(ids)),
        ("int64 array", np.array(ids, dtype=np.int64)),
        ("int32 array", np.array(ids, dtype=np.int32)),
        ("int64 tensor", torch.tensor(ids, dtype=torch.int64)),
        ("int32 tensor", torch.tensor(ids, dtype=torch.int32)),
        ("strided int32 array", np.arange(100, 120, dtype=np.int32)[::2]),
    ]


@pytest.mark.parametrize(("what", "given"), caller_inputs(), ids=[w for w, _ in caller_inputs()])
def test_an_event_carries_the_stored_tokens_however_the_caller_changes_them(
    what: str, given: Tokens
) -> None:
    expected = [int(t) for t in given]
    array = token_array(given)
    spans = spans_of(array)
    stored = events().stored(spans, array)
    pending = stored.to("cpu")
    # The caller reuses its buffer (or list) before anybody takes the events.
    if isinstance(given, list):
        given[:] = [7] * len(given)
    elif isinstance(given, torch.Tensor):
        given.fill_(7)
    else:
        given[:] = 7
    assert pending is not None
    event = pending.build()
    assert list(event.token_ids) == expected
    assert event.block_hashes == tuple(span.key.digest for span in spans)
    assert built(stored, "disk").token_ids == event.token_ids


def test_the_engines_own_conversion_is_kept_by_reference() -> None:
    """A list (and any dtype conversion) becomes int32 memory nobody else can write: the
    event keeps that array, no copy; the caller's own int32 memory is copied."""
    for given in ([5, 6, 7, 8, 9, 10, 11, 12, 13], np.arange(9, dtype=np.int64)):
        array = token_array(given)
        assert tokens_fixed(array)
        stored = events().stored(spans_of(array), array)
        assert stored._tokens is not None and np.shares_memory(stored._tokens, array)
        assert list(built(stored).token_ids) == [int(t) for t in given]
        assert stored.nbytes >= array.nbytes  # the whole array is held
    mine = np.arange(9, dtype=np.int32)
    array = token_array(mine)
    assert not tokens_fixed(array)
    stored = events().stored(spans_of(array), array)
    assert stored._tokens is not None and not np.shares_memory(stored._tokens, mine)


def test_a_small_part_of_a_long_array_is_copied_rather_than_holding_it_all() -> None:
    array = token_array(list(range(10 * CHUNK)))
    spans = spans_of(array)[-1:]  # the last chunk only: a tenth of the array
    stored = events().stored(spans, array)
    assert stored._tokens is not None and not np.shares_memory(stored._tokens, array)
    assert list(built(stored).token_ids) == list(range(9 * CHUNK, 10 * CHUNK))
    assert stored.nbytes < array.nbytes + 200 + 100


def test_an_event_keeps_the_keys_not_the_spans() -> None:
    array = token_array(list(range(3 * CHUNK)))
    spans = spans_of(array)
    stored = events().stored(spans[1:], array)
    assert stored._keys == tuple(span.key for span in spans[1:])
    event = built(stored)
    assert event.parent_block_hash == spans[0].key.digest
    assert list(event.token_ids) == list(range(CHUNK, 3 * CHUNK))


def test_events_off_keep_nothing_and_record_nothing() -> None:
    off = events(enabled=False)
    array = token_array(list(range(2 * CHUNK)))
    spans = spans_of(array)
    stored = off.stored(spans, array)
    assert stored.to("cpu") is None
    assert (stored._keys, stored._tokens) == ((), None)
    off.removed([span.key for span in spans], "cpu")
    off.cleared()
    assert len(off.buffer) == 0 and off.buffer.take() == []
