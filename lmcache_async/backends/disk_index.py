"""The disk tier's index: which chunks it holds, their sizes and shapes, least recently
used first.

The index lives in memory, on the event loop, and is the tier's truth for lookups (a
lookup reads no file once the index is complete). :meth:`DiskIndex.admit` plans the room a
batch of writes needs within the capacity, evicting the oldest entries, and within the
tenants' quotas (a :class:`~.tenant_ledger.TenantLedger`, whose accounts the index keeps
in step). It is filled at open in the background (:mod:`.disk_fill`) while it already
serves: :meth:`DiskIndex.begin_fill` to :meth:`DiskIndex.end_fill`.

*Entries are small*: each chunk costs its key (plain bytes), one ``OrderedDict`` slot and
one int packing the file's size, its shape's number in a table of the distinct shapes
(:class:`ShapeTable`: full chunks share one tuple) and a stamp that changes whenever the
key is indexed again, so that a read can tell whether the entry it began with is still
the key's entry (:meth:`DiskIndex.settle`). Entries the fill found have no stamp (a key is
found once), so equal ones share one int. Without a quota the ledger keeps no copy of the
keys (it counts, and finds a tenant's keys in this index when it is erased).

*While the fill runs* the index also keeps which keys were dropped (evicted, removed,
found corrupt: never brought back by a batch of the fill read before) and which were used
(put or hit: the most recent when the fill ends, after everything it found).
"""

from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import Final

import anyio
import anyio.to_thread

from lmcache_async.logging import get_logger
from lmcache_async.tenancy.tenants import TAG_BYTES, TenantLimits, tag_hex

from ..errors import IntegrityError
from .disk_file import ReadStatus, RecordFiles
from .disk_scan import erase_prefix
from .lru import held_prefix_count
from .tenant_ledger import TenantLedger

__all__ = ["DiskEntry", "DiskIndex", "ShapeTable"]

log = get_logger(__name__)

DiskEntry = int
"""An index entry: ``size << 40 | shape number << 20 | stamp`` (see the module doc)."""

_STAMP_BITS: Final = 20
_SHAPE_SHIFT: Final = _STAMP_BITS
_SIZE_SHIFT: Final = 40
_FIELD_MASK: Final = (1 << 20) - 1
_SHARED_VALUES: Final = 4096
"""Distinct entries found by the fill that share their int (full chunks of one codec
without compression have one size and shape: one int for all of them)."""


class ShapeTable:
    """The distinct payload shapes of an index, numbered: one tuple per shape."""

    __slots__ = ("_numbers", "shapes")

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self._numbers: dict[tuple[int, ...], int] = {}

    def number(self, shape: tuple[int, ...]) -> int:
        """The number of ``shape`` (given one the first time it is seen).

        Raises:
            IntegrityError: more distinct shapes than an entry can number (no layout has
                that many).
        """
        number = self._numbers.get(shape)
        if number is None:
            number = len(self.shapes)
            if number > _FIELD_MASK:
                raise IntegrityError("more distinct record shapes than the index can hold")
            shape = tuple(int(dim) for dim in shape)
            self.shapes.append(shape)
            self._numbers[shape] = number
        return number


class _Fill:
    """What the index keeps while it is being filled."""

    __slots__ = ("dropped", "used")

    def __init__(self) -> None:
        self.dropped: set[bytes] = set()
        """Keys dropped since the fill began: no batch of the fill brings them back."""
        self.used: dict[bytes, None] = {}
        """Keys put or hit since the fill began, least recently used first."""


class DiskIndex:
    """Entries by key, least recently used first, and their bytes, within ``capacity``
    and the quotas of ``limits``.

    Keys are stored as plain bytes; any bytes equal to a key (a ChunkKey, a bare digest)
    finds it.
    """

    def __init__(self, capacity: int, limits: TenantLimits | None = None) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[bytes, DiskEntry] = collections.OrderedDict()
        self.ledger = TenantLedger(limits, index=self._entries)
        """The accounts by tenant of what is indexed."""
        self.shapes = ShapeTable()
        self.bytes = 0
        """Bytes of the files indexed."""
        self.evictions = 0
        """Entries evicted to make room (by :meth:`admit`, or :meth:`trim`)."""
        self._stamp = 0
        self._shared: dict[int, int] = {}  # one int for equal entries found by the fill
        self._fill: _Fill | None = None
        self._erasing: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    # -- entries ------------------------------------------------------------------------

    def entry(self, size: int, shape: tuple[int, ...]) -> DiskEntry:
        """A new entry for a file of ``size`` bytes holding a payload of ``shape``."""
        return self._pack(size, self.shapes.number(shape))

    def _pack(self, size: int, number: int) -> DiskEntry:
        self._stamp = (self._stamp + 1) & _FIELD_MASK
        return size << _SIZE_SHIFT | number << _SHAPE_SHIFT | self._stamp

    @staticmethod
    def size_of(entry: DiskEntry) -> int:
        return entry >> _SIZE_SHIFT

    @staticmethod
    def number_of(entry: DiskEntry) -> int:
        """The number of the entry's shape in :attr:`shapes`."""
        return (entry >> _SHAPE_SHIFT) & _FIELD_MASK

    def shape_of(self, entry: DiskEntry) -> tuple[int, ...]:
        return self.shapes.shapes[(entry >> _SHAPE_SHIFT) & _FIELD_MASK]

    def get(self, key: bytes) -> DiskEntry | None:
        return self._entries.get(key)

    def add(self, key: bytes, size: int, shape: tuple[int, ...]) -> DiskEntry:
        """Index a file just written, as the most recent (replacing any entry of the key:
        one the fill found meanwhile); returns its entry."""
        key = bytes(key) if type(key) is not bytes else key
        if key in self._entries:
            self._forget(key)
        entry = self.entry(size, shape)
        self._entries[key] = entry
        self.bytes += size
        self.ledger.add(key, size)
        if self._fill is not None:
            self._used(key)
        return entry

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` indexed; each becomes the most recent."""
        n = held_prefix_count(self._entries, keys)
        if n and self.ledger.active:
            self.ledger.touch(keys, n)
        if n and self._fill is not None:
            for key in keys[:n]:
                self._used(key)
        return n

    def to_write(self, keys: Sequence[bytes], since: int | None = None) -> list[int]:
        """What a put of ``keys`` must write: the position of the first occurrence of each
        key not indexed, but none of a tenant erased since the ledger's
        :attr:`~.tenant_ledger.TenantLedger.erasures` was ``since`` (when the put was
        called). Keys indexed become the most recent (a put keeps them)."""
        todo: list[int] = []
        seen: set[bytes] = set()
        ledger = self.ledger
        erased = since is not None and since != ledger.erasures
        for i, key in enumerate(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
                ledger.touch_one(key)
                if self._fill is not None:
                    self._used(key)
            elif erased and ledger.erased_since(key, since or 0):
                continue
            elif key not in seen:
                seen.add(key)
                todo.append(i)
        return todo

    def settle(self, key: bytes, entry: DiskEntry, status: ReadStatus) -> bool:
        """Account for a read of ``key`` that found ``entry``: a hit becomes the most
        recent; a file found missing or corrupt is forgotten. Either only if ``entry`` is
        still the key's entry (a write may have replaced the file meanwhile); a read error
        changes nothing. Returns whether ``key`` was forgotten."""
        if self._entries.get(key) != entry:
            return False
        if status is ReadStatus.OK:
            self._entries.move_to_end(key)
            self.ledger.touch_one(key)
            if self._fill is not None:
                self._used(key)
        elif status is not ReadStatus.ERROR:
            self._forget(key)
            return True
        return False

    def replace(self, key: bytes, entry: DiskEntry, size: int, shape: tuple[int, ...]) -> bool:
        """Give ``key`` a file of ``size`` bytes and ``shape`` in place (same LRU position),
        if ``entry`` is still its entry; whether it was."""
        if self._entries.get(key) != entry:
            return False
        self.ledger.remove(key, self.size_of(entry))
        self.bytes -= self.size_of(entry)
        self._entries[key] = self.entry(size, shape)
        self.bytes += size
        self.ledger.add(key, size)
        return True

    def pop(self, key: bytes) -> DiskEntry:
        """Forget ``key`` (which must be indexed); returns its entry."""
        return self._forget(key)

    def _forget(self, key: bytes) -> DiskEntry:
        entry = self._entries.pop(key)
        size = self.size_of(entry)
        self.bytes -= size
        self.ledger.remove(key, size)
        if self._fill is not None:
            self._fill.dropped.add(key)
            self._fill.used.pop(key, None)
        return entry

    def _used(self, key: bytes) -> None:
        used = self._fill.used  # type: ignore[union-attr]  # only called while filling
        used.pop(key, None)
        used[key] = None

    # -- capacity -----------------------------------------------------------------------

    def admit(self, keys: Sequence[bytes], sizes: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Plan writing files of ``sizes`` for ``keys``: which of them fit (their positions)
        and the keys evicted to make room, oldest first (already forgotten here).

        A file's tenant first loses its own oldest files to stay within its quota; then,
        when the capacity is short, the oldest files of tenants not within a quota go. A
        file is refused (nothing evicted for it) when it is larger than the capacity or
        than what the files before it in the batch leave of it, larger than its tenant's
        quota, or when only protected files could make room; quota refusals are counted
        in the ledger.
        """
        ledger = self.ledger
        admitted: list[int] = []
        victims: list[bytes] = []
        reserved = 0
        pending: dict[bytes, int] = {}  # bytes admitted in this batch, by tag
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if reserved + size > self.capacity:
                continue
            tag = key[:TAG_BYTES]
            own = ledger.victims(tag, pending.get(tag, 0) + size)
            if own is None:
                ledger.refuse(key)
                continue
            own_bytes = sum(self.size_of(self._entries[k]) for k in own)
            short = self.bytes - own_bytes + reserved + size - self.capacity
            room: list[bytes] = []
            if short > 0:
                room = self._room(short, tag, own_bytes)
                if not room:  # only protected files could make room
                    ledger.refuse(key)
                    continue
            for victim in own + room:
                self._evict(victim)
            victims += own + room
            reserved += size
            pending[tag] = pending.get(tag, 0) + size
            admitted.append(i)
        return admitted, victims

    def _room(self, short: int, tag: bytes, own_bytes: int) -> list[bytes]:
        """The oldest keys whose files free ``short`` bytes (none protected by a quota);
        [] when that many cannot be freed."""
        if self.ledger.active:
            room, _ = self.ledger.pick_unprotected(
                self._entries, short, freed={tag: own_bytes}, whole=True
            )
            return room
        return self._oldest(short)

    def _oldest(self, needed: int) -> list[bytes]:
        """The oldest keys whose files free ``needed`` bytes ([] when all do not)."""
        out: list[bytes] = []
        freed = 0
        for key, entry in self._entries.items():
            if freed >= needed:
                break
            out.append(key)
            freed += entry >> _SIZE_SHIFT
        return out if freed >= needed else []

    def trim(self) -> list[bytes]:
        """Evict the oldest entries until the files fit in the capacity (a fill found more
        than it holds, or the capacity shrank since the files were written); returns their
        keys (already forgotten here)."""
        if self.bytes <= self.capacity:
            return []
        victims = self._oldest(self.bytes - self.capacity)
        for key in victims:
            self._evict(key)
        return victims

    def _evict(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        size = self.size_of(entry)
        self.bytes -= size
        self.ledger.evicted(key, size)
        self.evictions += 1
        if self._fill is not None:
            self._fill.dropped.add(key)
            self._fill.used.pop(key, None)

    # -- the fill -----------------------------------------------------------------------

    @property
    def filling(self) -> bool:
        """Whether a fill runs (between :meth:`begin_fill` and :meth:`end_fill`)."""
        return self._fill is not None

    def begin_fill(self) -> None:
        """A fill begins: keep track of what is dropped and used until it ends."""
        self._fill = _Fill()

    def mark_dropped(self, keys: Sequence[bytes]) -> None:
        """Keys not indexed whose files were deleted: no batch of the fill brings them
        back (nothing to do when no fill runs)."""
        if self._fill is not None:
            self._fill.dropped.update(keys)

    def merge(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        numbers: Sequence[int],
        shapes: Sequence[tuple[int, ...]],
        *,
        since: int,
        used: bool = False,
    ) -> int:
        """Index files the fill (or a lookup while it runs) found, as the most recent so
        far: ``keys[i]`` has a file of ``sizes[i]`` bytes and the shape
        ``shapes[numbers[i]]`` (a lookup's batch may name a key twice: counted once).
        Skipped: keys indexed (a put was first: its entry is the newer), dropped since the
        fill began, or of a tenant erased since ``since`` (the ledger's
        :attr:`~.tenant_ledger.TenantLedger.erasures` when the files were listed) or being
        erased. ``used``: the files were looked up (most recent when the fill ends).
        Returns how many were indexed.

        Entries found by the fill carry no stamp (each key is found at most once per
        fill), so equal ones share one int.
        """
        base = [self.shapes.number(shape) << _SHAPE_SHIFT for shape in shapes]
        entries = self._entries
        ledger = self.ledger
        fill = self._fill
        dropped = fill.dropped if fill is not None else set()
        if used and len(set(keys)) < len(keys):  # a get may name a key twice: once here
            keys, sizes, numbers = _first_of_each(keys, sizes, numbers)
        if (
            since != ledger.erasures
            or self._erasing
            or dropped
            or not entries.keys().isdisjoint(keys)
        ):
            rows = [
                i
                for i, key in enumerate(keys)
                if key not in entries and key not in dropped and not self._erased(key, since)
            ]
            keys = [keys[i] for i in rows]
            sizes = [sizes[i] for i in rows]
            numbers = [numbers[i] for i in rows]
        before = len(entries)
        if keys and _uniform(sizes) and _uniform(numbers):  # full chunks, stored as they are
            value = sizes[0] << _SIZE_SHIFT | base[numbers[0]]
            value = self._shared.setdefault(value, value)
            entries.update(zip(keys, itertools.repeat(value)))
        elif keys:
            raw = [size << _SIZE_SHIFT | base[n] for size, n in zip(sizes, numbers, strict=True)]
            shared = self._shared if len(self._shared) < _SHARED_VALUES else {}
            values = [shared.setdefault(value, value) for value in raw]
            entries.update(zip(keys, values, strict=True))
        if len(entries) - before != len(keys):
            self._recount()  # the fill's batch named a key twice: never expected
        else:
            self.bytes += sum(sizes)
            ledger.add_many(keys, sizes)
        if used and fill is not None:
            for key in keys:
                self._used(key)
        return len(entries) - before

    def _recount(self) -> None:
        """Rebuild the bytes and the ledger's accounts from the entries (each exact)."""
        log.warning("disk_index_key_found_twice", chunks=len(self._entries))
        sizes = [entry >> _SIZE_SHIFT for entry in self._entries.values()]
        self.bytes = sum(sizes)
        self.ledger.clear()
        self.ledger.add_many(list(self._entries), sizes)

    def _erased(self, key: bytes, since: int) -> bool:
        return key[:TAG_BYTES] in self._erasing or self.ledger.erased_since(key, since)

    def end_fill(self) -> None:
        """The fill is over: what was used while it ran becomes the most recent, in the
        order it was used (after everything the fill found)."""
        fill, self._fill = self._fill, None
        if fill is None:
            return
        move = self._entries.move_to_end
        for key in fill.used:
            if key in self._entries:
                move(key)
                self.ledger.touch_one(key)

    # -- erasure, clear -----------------------------------------------------------------

    async def erase_tenant(
        self, files: RecordFiles, tag: bytes
    ) -> tuple[list[bytes], int, int, list[str]]:
        """Forget and delete every file of the tenant with ``tag``: those indexed, then any
        other record or temporary file of ``files`` whose name starts with the tag's hex
        (not indexed yet, another process's, another layout's: found by name, never by
        reading a file). The caller holds the tier's write lock; the erasure is marked in
        the ledger (see :meth:`to_write`, :meth:`merge`) even if the deletion fails.

        Returns:
            The keys that were indexed (all forgotten, their files deleted but for the
            errors), the other record files deleted, the temporary files deleted, the
            errors.
        """
        self._erasing.add(tag)
        try:
            keys = self.ledger.erase(tag)
            for key in keys:
                entry = self._entries.pop(key)
                self.bytes -= self.size_of(entry)
            paths = [files.path(key) for key in keys]
            with anyio.CancelScope(shield=True):  # the index must learn what was deleted
                others, temps, failures = await anyio.to_thread.run_sync(
                    erase_prefix, files.directory, tag_hex(tag), paths
                )
            self.ledger.count_erased(tag, others)
        finally:
            self.ledger.mark_erased(tag)
            self._erasing.discard(tag)
        return keys, others, temps, failures

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
        self.ledger.clear()

    # -- figures ------------------------------------------------------------------------

    def items(self) -> list[tuple[bytes, DiskEntry]]:
        """Every key and entry, least recently used first (a copy)."""
        return list(self._entries.items())

    def footprint(self) -> int:
        """About how many bytes of memory the index holds: its dictionary, each key, each
        distinct entry int (one weighed for all), the shapes. One pass over the entries."""
        entries = self._entries
        total = sys.getsizeof(entries) + sum(map(sys.getsizeof, self.shapes.shapes))
        if entries:
            key, entry = next(iter(entries.items()))
            distinct = len(set(map(id, entries.values())))
            total += len(entries) * sys.getsizeof(key) + distinct * sys.getsizeof(entry)
        return total


def _first_of_each(
    keys: Sequence[bytes], sizes: Sequence[int], numbers: Sequence[int]
) -> tuple[list[bytes], list[int], list[int]]:
    """The columns without the repeats of a key (the first of each kept)."""
    rows = sorted({key: i for i, key in reversed(list(enumerate(keys)))}.values())
    return [keys[i] for i in rows], [sizes[i] for i in rows], [numbers[i] for i in rows]


def _uniform(values: Sequence[int]) -> bool:
    """Whether ``values`` (not empty) are all equal: compared mostly by identity, no set."""
    return values.count(values[0]) == len(values)
