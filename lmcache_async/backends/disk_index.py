"""The disk tier's index: which chunks it holds, their sizes, least recently used first.

The index lives in memory, on the event loop, and is the tier's truth for lookups (a
lookup reads no file). :meth:`DiskIndex.admit` plans the room a batch of writes needs
within the capacity, evicting the oldest entries, and within the tenants' quotas (a
:class:`~.tenant_ledger.TenantLedger`, whose accounts the index keeps in step). At open
the index is rebuilt by :func:`scan_directory` (in a worker thread) from each file's
header, size and mtime (never its payload: checksums are verified on every read instead),
each file's tenant from its key, so usage by tenant survives a restart; the scan deletes
temporary files whose writer process is gone, files whose header is bad or whose length
does not match the file, and the oldest files beyond the capacity. Files written for
another KV layout (another fingerprint) are left alone and not indexed: engines of other
models may share the directory.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.tenancy.tenants import TAG_BYTES, TenantLimits, tag_hex

from ..errors import ConfigError, ForeignRecordError, IntegrityError, InvalidInputError
from .disk_file import (
    CHUNK_SUFFIX,
    TEMP_PREFIX,
    ReadStatus,
    RecordFiles,
    read_header,
    unlink_all,
    unlink_if_same,
)
from .lru import held_prefix_count
from .record import RecordSpec
from .tenant_ledger import TenantLedger

__all__ = ["DiskEntry", "DiskIndex", "Scan", "erase_prefix", "scan_directory"]

_STALE_TEMP_SECONDS: Final = 600.0
"""A temporary file this old is a leftover even if a process with its writer's pid runs."""


@dataclass(slots=True)
class DiskEntry:
    """What the index knows of one file (compared by identity to detect replacement)."""

    size: int
    shape: tuple[int, ...]


class DiskIndex:
    """Entries by key, least recently used first, and their bytes, within ``capacity``
    and the quotas of ``limits``.

    Keys are ChunkKeys, typed as bytes so that a bare digest can probe the index.
    """

    def __init__(self, capacity: int, limits: TenantLimits | None = None) -> None:
        self.capacity = capacity
        self.ledger = TenantLedger(limits)
        """The accounts by tenant of what is indexed."""
        self._entries: collections.OrderedDict[bytes, DiskEntry] = collections.OrderedDict()
        self.bytes = 0
        """Bytes of the files indexed."""
        self.evictions = 0
        """Entries evicted to make room (by :meth:`admit`, or by the scan at open)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    async def rebuild(self, files: RecordFiles, spec: RecordSpec) -> Scan:
        """Create the directory of ``files`` if missing, check it can be written and read,
        and index the records of ``spec``'s layout in it (:func:`scan_directory`, in worker
        threads).

        Returns:
            What the scan found and cleaned up (its entries are indexed by now).

        Raises:
            ConfigError: (field ``local_disk``) the directory cannot be created, written
                or read.
        """
        directory = files.directory
        try:
            await files.prepare()
        except OSError as exc:
            raise ConfigError(
                "local_disk", f"cannot use {str(directory)!r} as a cache directory: {exc}"
            ) from exc
        try:
            scan = await anyio.to_thread.run_sync(scan_directory, directory, spec, self.capacity)
        except OSError as exc:
            raise ConfigError(
                "local_disk", f"cannot read the cache directory {str(directory)!r}: {exc}"
            ) from exc
        self.load(scan.entries)
        self.evictions += scan.evicted
        return scan

    def get(self, key: bytes) -> DiskEntry | None:
        return self._entries.get(key)

    def load(self, entries: Iterable[tuple[bytes, DiskEntry]]) -> None:
        """Index ``entries``, oldest first (a scan's result)."""
        for key, entry in entries:
            self.add(key, entry)

    def add(self, key: bytes, entry: DiskEntry) -> None:
        """Index a file just written, as the most recent."""
        self._entries[key] = entry
        self.bytes += entry.size
        self.ledger.add(key, entry.size)

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` indexed; each becomes the most recent."""
        n = held_prefix_count(self._entries, keys)
        if n and self.ledger.active:
            self.ledger.touch(keys, n)
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
        if self._entries.get(key) is not entry:
            return False
        if status is ReadStatus.OK:
            self._entries.move_to_end(key)
            self.ledger.touch_one(key)
        elif status is not ReadStatus.ERROR:
            del self._entries[key]
            self.bytes -= entry.size
            self.ledger.remove(key)
            return True
        return False

    def pop(self, key: bytes) -> DiskEntry:
        """Forget ``key`` (which must be indexed); returns its entry."""
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        self.ledger.remove(key)
        return entry

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
            own_bytes = sum(self._entries[k].size for k in own)
            short = self.bytes - own_bytes + reserved + size - self.capacity
            room: list[bytes] = []
            if short > 0:
                room, _ = ledger.pick_unprotected(
                    self._entries, short, freed={tag: own_bytes}, whole=True
                )
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

    async def erase_tenant(
        self, files: RecordFiles, tag: bytes
    ) -> tuple[list[bytes], int, int, list[str]]:
        """Forget and delete every file of the tenant with ``tag``: those indexed, then any
        other record or temporary file of ``files`` whose name starts with the tag's hex
        (another process's, another layout's: found by name, never by reading a file).
        The caller holds the tier's write lock; the erasure is marked in the ledger (see
        :meth:`to_write`) even if the deletion fails.

        Returns:
            The keys that were indexed (all forgotten, their files deleted but for the
            errors), the other record files deleted, the temporary files deleted, the
            errors.
        """
        try:
            keys = self.ledger.erase(tag)
            for key in keys:
                self.bytes -= self._entries.pop(key).size
            paths = [files.path(key) for key in keys]
            with anyio.CancelScope(shield=True):  # the index must learn what was deleted
                others, temps, failures = await anyio.to_thread.run_sync(
                    erase_prefix, files.directory, tag_hex(tag), paths
                )
            self.ledger.count_erased(tag, others)
        finally:
            self.ledger.mark_erased(tag)
        return keys, others, temps, failures

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
        self.ledger.clear()

    def _evict(self, key: bytes) -> None:
        self.bytes -= self._entries.pop(key).size
        self.ledger.evicted(key)
        self.evictions += 1


@dataclass(slots=True)
class Scan:
    entries: list[tuple[ChunkKey, DiskEntry]]
    """Indexable records, least recently used first."""
    corrupt: list[tuple[str, str]]
    """Deleted bad records: (file name, reason)."""
    removed_temps: int = 0
    foreign: int = 0
    """Records of other layouts, left alone."""
    evicted: int = 0
    """Oldest records deleted because they exceeded the capacity."""


def scan_directory(directory: Path, spec: RecordSpec, capacity: int) -> Scan:
    """Index the records under ``directory`` from their headers; clean up leftovers."""
    scan = Scan(entries=[], corrupt=[])
    found: list[tuple[int, str, ChunkKey, DiskEntry]] = []
    now = time.time()
    with os.scandir(directory) as tops:
        for top in tops:
            if top.name.startswith(TEMP_PREFIX):
                scan.removed_temps += _remove_stale_temp(top, now)
            elif _is_fanout(top.name) and top.is_dir(follow_symlinks=False):
                with os.scandir(top.path) as items:
                    for item in items:
                        if item.name.startswith(TEMP_PREFIX):
                            scan.removed_temps += _remove_stale_temp(item, now)
                        elif item.name.endswith(CHUNK_SUFFIX) and item.name.startswith(top.name):
                            _scan_record(item, spec, scan, found)
    found.sort(key=lambda row: (row[0], row[1]))
    total = sum(entry.size for _, _, _, entry in found)
    start = 0
    while total > capacity and start < len(found):
        _, name, _, entry = found[start]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / name[:2] / name)
        total -= entry.size
        start += 1
    scan.evicted = start
    scan.entries = [(key, entry) for _, _, key, entry in found[start:]]
    return scan


def erase_prefix(directory: Path, prefix: str, known: list[Path]) -> tuple[int, int, list[str]]:
    """Delete ``known``, then the record files and temporary files (writes under way)
    under ``directory`` whose key's text starts with ``prefix`` (at least two hex
    characters: one fan-out directory is listed, no file is read).

    Returns:
        Record files deleted besides ``known``, temporary files deleted, and the errors.
    """
    errors = unlink_all(known)
    records = temps = 0
    try:
        with os.scandir(directory / prefix[:2]) as items:
            names = [item.name for item in items]
    except FileNotFoundError:
        return records, temps, errors
    except OSError as exc:
        return records, temps, [*errors, str(exc)]
    for name in names:
        is_temp = name.startswith(TEMP_PREFIX)
        final = name[len(TEMP_PREFIX) :].split("-", 2)[-1] if is_temp else name
        if not (final.startswith(prefix) and final.endswith(CHUNK_SUFFIX)):
            continue
        try:
            os.unlink(directory / prefix[:2] / name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(str(exc))
            continue
        if is_temp:
            temps += 1
        else:
            records += 1
    return records, temps, errors


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _scan_record(
    item: os.DirEntry[str],
    spec: RecordSpec,
    scan: Scan,
    found: list[tuple[int, str, ChunkKey, DiskEntry]],
) -> None:
    try:
        key = ChunkKey.from_str(item.name.removesuffix(CHUNK_SUFFIX))
    except InvalidInputError:
        return  # not a name this tier writes: not ours to judge
    try:
        with open(item.path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            try:
                _, header, offset = read_header(f, st.st_size)
                if header.fingerprint != spec.fingerprint:
                    scan.foreign += 1
                    return
                spec.check_header(header, key)
                if offset + header.length != st.st_size:
                    raise IntegrityError(
                        f"file is {st.st_size} bytes, its record {offset + header.length} bytes"
                    )
            except ForeignRecordError:
                scan.foreign += 1  # sealed under another key: another engine's to read
                return
            except IntegrityError as exc:
                unlink_if_same(Path(item.path), st)
                scan.corrupt.append((item.name, str(exc)))
                return
    except FileNotFoundError:
        return
    found.append((st.st_mtime_ns, item.name, key, DiskEntry(st.st_size, header.shape)))


def _remove_stale_temp(item: os.DirEntry[str], now: float) -> int:
    """Delete a temporary file left by a process that is gone (or long ago); 1 if deleted."""
    try:
        pid = int(item.name[len(TEMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        pid = 0
    try:
        if pid > 0 and _process_alive(pid) and now - item.stat().st_mtime < _STALE_TEMP_SECONDS:
            return 0  # probably being written right now by another engine
        os.unlink(item.path)
    except FileNotFoundError:
        return 0
    return 1


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
