"""Admission: sightings per chunk in bounded memory, held-back chunks returned once seen
enough, layer keys counted by their chunk, and the runs of a store admitted."""

from __future__ import annotations

import pytest

from lmcache_async.backends.admission import (
    MAX_TRACKED_CHUNKS,
    MIN_TRACKED_CHUNKS,
    Admission,
    Held,
    adjacent_runs,
    admission_capacity,
)
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey, ChunkSpan

CHUNK = 16


def spans(n: int, first: int = 0) -> list[ChunkSpan]:
    keys = [ChunkKey(bytes([i + 1]) * DIGEST_SIZE) for i in range(first, first + n)]
    return [
        ChunkSpan(i * CHUNK, (i + 1) * CHUNK, key, keys[i - first - 1] if i > first else None)
        for i, key in zip(range(first, first + n), keys, strict=True)
    ]


TIERS = ("disk",)


def test_a_store_is_the_first_sighting_and_a_lookup_the_next() -> None:
    admission = Admission(2, capacity=100)
    chunks = spans(3)
    assert admission.admit(chunks, TIERS) == [False, False, False]
    assert [admission.sightings(s.key) for s in chunks] == [1, 1, 1]
    assert admission.admit(chunks, TIERS) == [False, False, False]  # no new sighting
    assert [admission.sightings(s.key) for s in chunks] == [1, 1, 1]
    due = admission.sighted([s.key for s in chunks])
    assert [held.span for held in due] == chunks
    assert all(held.tiers == TIERS for held in due)  # each held back once
    assert admission.sighted([s.key for s in chunks]) == []  # written already
    assert admission.admit(chunks, TIERS) == [True, True, True]
    stats = admission.stats()
    assert (stats.admitted_chunks, stats.held_back_chunks, stats.tracked_chunks) == (3, 6, 3)


def test_lookups_before_a_store_admit_it_at_once() -> None:
    admission = Admission(3, capacity=100)
    chunks = spans(2)
    assert admission.sighted([s.key for s in chunks]) == []
    assert admission.sighted([chunks[0].key]) == []
    assert admission.sighted([chunks[0].key]) == []
    assert admission.admit(chunks, TIERS) == [True, False]  # seen 3 times, and once


def test_a_chunk_the_cpu_tier_cannot_hold_is_admitted() -> None:
    admission = Admission(2, capacity=100)
    assert admission.admit(spans(3), TIERS, holdable=[True, False, True]) == [False, True, False]
    assert admission.admit_runs(spans(3), TIERS, holdable=[False, False, True]) == [(0, 2)]
    assert admission.admit_runs(spans(4, first=5), TIERS) == []
    assert admission.admit_runs(spans(1, first=5), TIERS, holdable=[False]) == [(0, 1)]


def test_layer_keys_count_as_their_chunk() -> None:
    admission = Admission(2, capacity=100)
    chunk = spans(1)[0]
    layers = [
        ChunkSpan(chunk.start, chunk.end, chunk.key.with_layer(i), chunk.parent) for i in range(3)
    ]
    for span in layers:  # a layerwise store puts each layer
        assert admission.admit([span], TIERS) == [False]
    assert admission.sightings(chunk.key) == 1
    due = admission.sighted([chunk.key])
    assert sorted(held.layer for held in due) == [0, 1, 2]


def test_the_least_recently_seen_are_forgotten_past_the_capacity() -> None:
    admission = Admission(2, capacity=4)
    chunks = spans(6)
    admission.sighted([s.key for s in chunks[:4]])
    admission.sighted([chunks[0].key])  # seen twice, and most recently
    admission.sighted([s.key for s in chunks[4:]])
    assert len(admission) == 4
    assert [admission.sightings(s.key) for s in chunks] == [2, 0, 0, 1, 1, 1]


def test_released_chunks_are_not_returned() -> None:
    admission = Admission(2, capacity=100)
    chunks = spans(3)
    admission.admit(chunks, TIERS)
    admission.release([chunks[1].key])
    assert [held.span for held in admission.sighted([s.key for s in chunks])] == [
        chunks[0],
        chunks[2],
    ]


def test_adjacent_runs_split_at_gaps_tiers_and_missing_payloads() -> None:
    chunks = spans(5)
    held = [Held.of(s, TIERS) for s in chunks[:4]] + [Held.of(chunks[4], ("redis",))]
    held = sorted(held, key=Held.order)
    marker = object()
    objs = [marker, marker, None, marker, marker]
    runs = adjacent_runs(held, objs)  # type: ignore[arg-type]
    assert [[item.span for item, _ in run] for run in runs] == [
        chunks[:2],
        [chunks[3]],
        [chunks[4]],
    ]


def test_capacity_follows_the_cpu_tier_within_bounds() -> None:
    assert admission_capacity(10 * 1024, 1024) == MIN_TRACKED_CHUNKS
    assert admission_capacity(10_000 * 1024, 1024) == 80_000
    assert admission_capacity(1 << 40, 1024) == MAX_TRACKED_CHUNKS


@pytest.mark.parametrize(
    "kwargs", [{"threshold": 0, "capacity": 1}, {"threshold": 2, "capacity": 0}]
)
def test_bad_settings_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidInputError):
        Admission(kwargs["threshold"], capacity=kwargs["capacity"])
