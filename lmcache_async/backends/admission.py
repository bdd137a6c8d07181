"""Store admission: a chunk goes to the slow tiers only once its prefix was seen enough.

Writing every stored chunk to disk and Redis spends their bandwidth and space on prompts
seen once. With ``store_threshold`` N, :class:`Admission` counts *sightings* per chunk: a
lookup of a prompt is one sighting of each of its chunks (:meth:`Admission.sighted`), and
a store is one for a chunk never sighted before (a store without any lookup, as through
the plain API, sees its chunks once). A store puts every chunk into the CPU tier as
before; a chunk seen fewer than N times is *held back* from the slow tiers
(:meth:`Admission.admit`), and when a later lookup brings it to N sightings while the CPU
tier still holds it, the storage manager writes it behind to the slow tiers then. N = 1
admits everything at once (nothing is counted).

Memory is bounded: at most ``capacity`` chunks are counted, the least recently seen
forgotten first (an ordered dict, about 250 bytes a chunk; a held-back chunk also keeps
its span). :func:`admission_capacity` sizes it from the CPU tier: eight times the chunks
it holds, between :data:`MIN_TRACKED_CHUNKS` and :data:`MAX_TRACKED_CHUNKS`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Final, NamedTuple

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.keys.digests import DIGEST_SIZE
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.memory.pool import MemoryObj

from ..errors import InvalidInputError
from ..stats import AdmissionStats

__all__ = [
    "MAX_TRACKED_CHUNKS",
    "MIN_TRACKED_CHUNKS",
    "Admission",
    "Held",
    "adjacent_runs",
    "admission_capacity",
]

MIN_TRACKED_CHUNKS: Final = 4096
MAX_TRACKED_CHUNKS: Final = 1 << 18
"""The most chunks counted (about 64 MiB of counts), however large the CPU tier."""
_TRACKED_PER_CPU_CHUNK: Final = 8


def admission_capacity(cpu_bytes: int, chunk_bytes: int) -> int:
    """Chunks to count for a CPU tier of ``cpu_bytes`` holding chunks of ``chunk_bytes``:
    more than it holds (prompts are looked up before they are stored, and seen again
    after they left it), within fixed bounds."""
    held = cpu_bytes // max(chunk_bytes, 1)
    return max(MIN_TRACKED_CHUNKS, min(MAX_TRACKED_CHUNKS, _TRACKED_PER_CPU_CHUNK * held))


class Held(NamedTuple):
    """A stored chunk (one layer's, for a layerwise store) kept from the slow tiers.

    :meth:`order` sorts them by the tiers they want, their layer and their place in the
    prompt: sorted, adjacent ones follow each other (:func:`adjacent_runs`).
    """

    tiers: tuple[str, ...]
    """The slow tiers its store wanted."""
    layer: int
    """The key's layer; -1 for a whole-chunk key."""
    start: int
    span: ChunkSpan

    @classmethod
    def of(cls, span: ChunkSpan, tiers: tuple[str, ...]) -> Held:
        layer = span.key.layer
        return cls(tiers, -1 if layer is None else layer, span.start, span)

    def order(self) -> tuple[tuple[str, ...], int, int]:
        return (self.tiers, self.layer, self.start)


def adjacent_runs(
    ordered: Sequence[Held], objs: Sequence[MemoryObj | None]
) -> list[list[tuple[Held, MemoryObj]]]:
    """The runs of sorted held chunks that follow each other (same tiers and layer, each
    starting where the last ended), paired with their payloads; a chunk without one
    (``None``: gone from the CPU tier) is left out and ends its run. One slow-tier write
    and one KV event per run."""
    runs: list[list[tuple[Held, MemoryObj]]] = []
    last: Held | None = None
    for item, obj in zip(ordered, objs, strict=True):
        if obj is None:
            last = None
            continue
        if (
            last is None
            or item.tiers != last.tiers
            or item.layer != last.layer
            or item.start != last.span.end
        ):
            runs.append([])
        runs[-1].append((item, obj))
        last = item
    return runs


class _Entry:
    __slots__ = ("count", "held")

    def __init__(self) -> None:
        self.count = 1
        self.held: list[Held] | None = None


def _digest(key: bytes) -> bytes:
    """The chunk a key names (a layer key's digest without the layer)."""
    return key if len(key) == DIGEST_SIZE else bytes(key[:DIGEST_SIZE])


class Admission:
    """Sightings per chunk and the chunks held back from the slow tiers.

    Raises (constructor):
        InvalidInputError: ``threshold`` or ``capacity`` is not an int >= 1.
    """

    def __init__(self, threshold: int, *, capacity: int) -> None:
        for name, value in (("threshold", threshold), ("capacity", capacity)):
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        self._threshold = threshold
        self._capacity = capacity
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self.admitted = 0
        self.held_back = 0
        self.written_behind = 0
        """Held-back chunks the storage manager wrote behind (it counts them)."""

    @property
    def threshold(self) -> int:
        return self._threshold

    def __len__(self) -> int:
        return len(self._entries)

    def sightings(self, key: bytes) -> int:
        """How many times the chunk of ``key`` was seen (0: not counted now)."""
        entry = self._entries.get(_digest(key))
        return 0 if entry is None else entry.count

    def _new(self, digest: bytes) -> _Entry:
        entries = self._entries
        entry = entries[digest] = _Entry()
        if len(entries) > self._capacity:
            entries.popitem(last=False)
        return entry

    def sighted(self, keys: Sequence[bytes]) -> list[Held]:
        """One sighting of each chunk of ``keys`` (a lookup of a prompt); returns the
        held-back chunks that now reach the threshold, for the caller to write behind
        (they are no longer held back)."""
        entries = self._entries
        threshold = self._threshold
        due: list[Held] = []
        for key in keys:
            digest = _digest(key)
            entry = entries.get(digest)
            if entry is None:
                self._new(digest)
                continue
            entries.move_to_end(digest)
            entry.count += 1
            if entry.held is not None and entry.count >= threshold:
                due.extend(entry.held)
                entry.held = None
        return due

    def admit(
        self,
        spans: Sequence[ChunkSpan],
        tiers: tuple[str, ...],
        *,
        holdable: Sequence[bool] | None = None,
    ) -> list[bool]:
        """Whether each stored chunk of ``spans`` goes to the slow ``tiers`` now: seen at
        least ``threshold`` times (a chunk never seen counts its first sighting here), or
        not ``holdable`` (the CPU tier does not keep it: it cannot wait there). Those that
        do not are held back, to be returned by :meth:`sighted`."""
        entries = self._entries
        threshold = self._threshold
        out: list[bool] = []
        for index, span in enumerate(spans):
            digest = _digest(span.key)
            entry = entries.get(digest)
            if entry is None:
                entry = self._new(digest)
            else:
                entries.move_to_end(digest)
            admitted = entry.count >= threshold or (holdable is not None and not holdable[index])
            if not admitted:
                if entry.held is None:
                    entry.held = []
                if all(held.span.key != span.key for held in entry.held):  # stored twice
                    entry.held.append(Held.of(span, tiers))
            out.append(admitted)
        kept = sum(out)
        self.admitted += kept
        self.held_back += len(out) - kept
        return out

    def admit_runs(
        self,
        spans: Sequence[ChunkSpan],
        tiers: tuple[str, ...],
        *,
        holdable: Sequence[bool] | None = None,
    ) -> list[tuple[int, int]]:
        """:meth:`admit`, as the index ranges ``[start, stop)`` of ``spans`` admitted."""
        runs: list[tuple[int, int]] = []
        start: int | None = None
        admitted = self.admit(spans, tiers, holdable=holdable)
        for index, ok in enumerate(admitted):
            if ok and start is None:
                start = index
            elif not ok and start is not None:
                runs.append((start, index))
                start = None
        if start is not None:
            runs.append((start, len(admitted)))
        return runs

    def release(self, keys: Sequence[bytes]) -> None:
        """Chunks of ``keys`` left the CPU tier: there is nothing left to write behind."""
        entries = self._entries
        for key in keys:
            entry = entries.get(_digest(key))
            if entry is not None and entry.held is not None:
                remaining = [held for held in entry.held if held.span.key != key]
                entry.held = remaining or None

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            threshold=self._threshold,
            tracked_chunks=len(self._entries),
            capacity=self._capacity,
            admitted_chunks=self.admitted,
            held_back_chunks=self.held_back,
            written_behind_chunks=self.written_behind,
        )
