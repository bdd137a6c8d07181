"""The disk tier: one self-describing record file per chunk, LRU-capped, restart-durable.

Files live at ``<local_disk>/<first two hex chars of the key>/<key.to_str()>.chunk``; each
holds one record (see :mod:`.record`): a header naming the key, layout, shape, dtype, codec,
length and checksum, then the payload. Reading and writing one file is :mod:`.disk_file`;
the index and its capacity :mod:`.disk_index`; changes to the files :mod:`.disk_changes`.

*Writes* go to ``.tmp-<pid>-<random>-<name>`` in the same directory and are renamed over the
final name (``os.replace``), so a crash never leaves a partial record under a real name.
Files are not fsynced by default: after a power loss a renamed file may hold torn data,
which the record's checksums catch on the next read (a miss, the file deleted), and an fsync
per chunk costs far more than the occasional lost entry of a cache. ``fsync=True`` syncs
each file and its directory before the put returns.

*The index* (key → size and shape, least recently used first, :mod:`.disk_index`) lives in
memory. :meth:`DiskBackend.open` returns at once, whatever the tier's size: the index is
filled behind it (:mod:`.disk_fill`, a thread of its own, a batch at a time), from the
manifest (:mod:`.disk_manifest`: the index as the last run left it, trusted only for files
whose name the directory still lists, their sizes checked once the index is complete) and
from the headers of the files the manifest does not name. :meth:`wait_index` waits for it;
:attr:`index_complete` and :meth:`index_stats` tell where it stands. While it fills, RAM
and Redis hits are served as ever, and a lookup or get of a key not indexed yet *looks at
its file directly* (its header read and checked in a worker thread, the chunk indexed if
it is there and good): a disk hit is never a miss for being early, and a true miss costs
one thread call. The LRU order survives a clean restart exactly (the manifest's order) and
a crash to within the last writes; files the manifest does not name come after those it
names, by mtime (hits refresh a file's mtime, to within a minute). Files of another
KV layout are left alone: engines of other models may share the directory. One running
engine per directory and layout is supported; two at once would each keep their own index
and capacity.

*Tenants*: usage by tenant tag and the quotas of ``limits`` are kept by the index
(:mod:`.disk_index`, :mod:`.tenant_ledger`), filled at open from the files' keys.

*While the index fills*, a put writes what is not indexed yet (a file the fill finds later
for a key indexed since is skipped: each chunk is indexed once); what is evicted, removed
or found corrupt is never brought back by a batch of the fill read before; capacity is
kept over what is indexed, and once the index is complete the oldest files beyond it are
evicted. :meth:`remove` deletes the files of keys not indexed yet too; :meth:`clear` waits
for the index to be complete.

*Removals*: each chunk that leaves the index (evicted for the capacity or a tenant's quota,
found corrupt or missing on a read, removed, cleared, erased) is told to the removal
listener (:meth:`StorageBackend.set_removal_listener`) once its file is gone; files the
fill deletes as corrupt were never indexed, and are not told.

*Threads*: the index and counters belong to the event loop; worker threads only do file
I/O, checksums and codecs, one thread call per batch. Writes (put, eviction, remove,
clear) are serialized by a lock; reads are not, since a file is replaced atomically and an
open file outlives its unlink, so a reader sees one whole record or none.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Final

import anyio
import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool, current_budget
from lmcache_async.tenancy.tenants import TenantLimits, tag_hex

from ..errors import ConfigError, EngineClosedError, InvalidInputError
from ..stats import TierStats
from .base import StorageBackend, leading_run
from .counters import TierCounters
from .disk_changes import DiskChanges
from .disk_file import CHUNK_SUFFIX, TEMP_PREFIX, RecordFiles, as_key
from .disk_fill import IndexFill, IndexStats
from .disk_index import DiskIndex
from .disk_manifest import Manifest
from .disk_reads import Job, allocate_reads, settle_reads
from .disk_settings import check_disk_settings
from .record import RecordSpec
from .tenant_ledger import check_tag

__all__ = ["CHUNK_SUFFIX", "DEFAULT_HEALTH_TIMEOUT", "TEMP_PREFIX", "DiskBackend", "IndexStats"]

log = get_logger(__name__)

DEFAULT_HEALTH_TIMEOUT: Final = 5.0
"""Seconds :meth:`DiskBackend.check_health` waits for its probe write and read."""


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class DiskBackend(StorageBackend):
    """Chunks as record files under ``local_disk``, at most ``max_local_disk_size`` bytes.

    Build it with :meth:`open`, which checks the settings and the directory and starts
    filling the index (:meth:`wait_index`). A put that would exceed the capacity evicts
    least recently used files first; a chunk larger than the whole capacity is refused. A
    file found corrupt on read (checksum, truncation, another key's or layout's record) is
    a miss, is deleted and is counted in ``corrupt``. Write errors (a full disk, a
    read-only directory) raise :class:`~lmcache_async.errors.TierError`; read errors are
    misses. Both count in ``errors``. ``hits`` and ``misses`` count the keys :meth:`get`
    was asked for. ``limits``: the tenants' quotas in this tier (none by default).
    """

    name = "disk"

    def __init__(
        self,
        local_disk: str | os.PathLike[str],
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        max_local_disk_size: int,
        fsync: bool = False,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        limits: TenantLimits | None = None,
    ) -> None:
        """Check the settings; does no I/O (:meth:`open` does).

        Raises:
            ConfigError: ``local_disk`` is not a path, ``max_local_disk_size`` is not a
                positive int (bytes).
            InvalidInputError: ``allocation_timeout`` or ``health_timeout`` is not a number
                >= 0 (> 0 for the health timeout).
        """
        check_disk_settings(local_disk, max_local_disk_size, allocation_timeout, health_timeout)
        self._files = RecordFiles(Path(os.fspath(local_disk)), fsync=bool(fsync))
        self._pool = pool
        self._spec = spec
        self._allocation_timeout = float(allocation_timeout)
        self._health_timeout = float(health_timeout)
        self._state = _State.NEW
        self._healthy = False
        self._index = DiskIndex(max_local_disk_size, limits)
        self._write_lock = anyio.Lock()
        self._counts = TierCounters()
        self._manifest = Manifest(self._files.directory, spec, fsync=bool(fsync))
        self._changes = DiskChanges(
            self._index,
            self._files,
            self._manifest,
            self._counts,
            self._write_lock,
            report=self._report_removed,
            is_open=lambda: self._state is _State.OPEN,
            complete=lambda: self._fill.complete,
        )
        self._fill = IndexFill(
            self._files.directory,
            spec,
            self._index,
            self._manifest,
            on_complete=self._changes.fill_complete,
            on_compact=self._changes.fill_compact,
            on_corrupt=self._changes.found_corrupt,
            on_forgotten=self._changes.forgotten,
        )

    @classmethod
    async def open(
        cls,
        local_disk: str | os.PathLike[str],
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        max_local_disk_size: int,
        fsync: bool = False,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        limits: TenantLimits | None = None,
    ) -> DiskBackend:
        """Create the directory if missing, check it can be written and read, and start
        filling the index from the manifest and the files (behind: :meth:`wait_index`).

        Raises:
            ConfigError: a setting is invalid (see :meth:`__init__`), or the directory
                cannot be created, written or read (``field == "local_disk"``).
        """
        backend = cls(
            local_disk,
            pool=pool,
            spec=spec,
            allocation_timeout=allocation_timeout,
            max_local_disk_size=max_local_disk_size,
            fsync=fsync,
            health_timeout=health_timeout,
            limits=limits,
        )
        await backend._start()
        return backend

    async def _start(self) -> None:
        directory = self._files.directory
        try:
            await self._files.prepare()
        except OSError as exc:
            raise ConfigError(
                "local_disk", f"cannot use {str(directory)!r} as a cache directory: {exc}"
            ) from exc
        self._state = _State.OPEN
        self._healthy = True
        self._fill.start()
        log.info("disk_tier_opened", directory=str(directory), capacity=self._index.capacity)

    # -- the index fill -----------------------------------------------------------------

    @property
    def index_complete(self) -> bool:
        """Whether every file of the directory is indexed (see :meth:`wait_index`)."""
        return self._fill.complete

    async def wait_index(self, *, audited: bool = False) -> bool:
        """Wait until the index is complete (with ``audited``: and the sizes of the files
        the manifest named checked), or its fill stopped (the tier closed, the directory
        unreadable); returns whether it is complete. Bound it with ``anyio.fail_after``."""
        return await self._fill.wait(audited=audited)

    def index_stats(self) -> IndexStats:
        """Where the index fill stands, and what the index costs in memory."""
        return self._fill.stats()

    # -- properties ---------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The cache directory (``local_disk``)."""
        return self._files.directory

    @property
    def capacity_bytes(self) -> int:
        """The most bytes of record files the tier keeps (``max_local_disk_size``)."""
        return self._index.capacity

    def path_of(self, key: ChunkKey) -> Path:
        """Where the record of ``key`` lives (whether or not it exists)."""
        return self._files.path(key)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    # -- StorageBackend -----------------------------------------------------------------

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading ``keys`` indexed (no file is read); hits become most recent.

        Raises:
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        return await self._fill.held_prefix(keys)

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Read, verify and decode each key's record into a new pool object.

        Each object carries one reference for the caller. Misses, corrupt files (deleted),
        unreadable files and keys left when the pool had no room in time are ``None``.
        The files are read in worker threads (two for a large get, so one verifies while
        the other reads), straight into pool memory when the payload is stored uncompressed.
        Under a request's :class:`~lmcache_async.memory.pool.AllocationBudget` the memory comes
        within it, and nothing is read once the request can take no more.

        Raises:
            EngineClosedError: the tier or the pool is closed.
        """
        self._check_open()
        out: list[MemoryObj | None] = [None] * len(keys)
        budget = current_budget()
        if budget is not None and budget.exhausted:
            return out  # nothing read would find room: not a miss, so not counted
        await self._fill.look_unindexed(keys)
        jobs: list[Job] = []
        settled = False
        try:
            await allocate_reads(
                self._pool,
                self._spec,
                self._index,
                keys,
                timeout=self._allocation_timeout,
                jobs=jobs,
            )
            if jobs:
                reads = [(key, obj.tensor) for _, key, _, obj in jobs]
                nbytes = sum(obj.nbytes for *_, obj in jobs)
                outcomes = await self._files.read(self._spec, reads, nbytes)
                settled = True
                forgotten = settle_reads(self._index, self._counts, jobs, outcomes, out)
                self._report_removed(forgotten)
        finally:
            if not settled:
                for _, _, _, obj in jobs:
                    obj.unref()
        self._counts.got(len(keys), len(keys) - out.count(None))
        return out

    async def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """:meth:`get` of the leading run of ``keys`` the index holds (the first key past
        it counts as a miss): no file past the run is read.

        Raises:
            EngineClosedError: the tier or the pool is closed.
        """
        self._check_open()
        held = await self._fill.held_prefix(keys)
        if held < len(keys):
            self._counts.misses += 1
        return leading_run(await self.get(keys[:held]))

    async def put(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        *,
        spec: RecordSpec | None = None,
    ) -> int:
        """Write each new key's record (keys already held are kept, and become most recent).

        ``spec`` overrides the tier's record spec for these writes (another codec, used by
        the engine's ``compress``); it must describe the same layout.

        Older files are evicted first when the capacity would be exceeded; a chunk that
        does not fit even in an empty tier is refused, and so is one its tenant's quota
        cannot take, or one of a tenant erased since this put was called (see
        :meth:`erase_tenant`). The objects are referenced while
        they are written; the caller keeps its own references. Records written before a
        failure stay indexed.

        Returns:
            How many records were written.

        Raises:
            InvalidInputError: ``keys`` and ``objs`` differ in length, or a payload is not of
                the tier's dtype.
            TierError: a file could not be written (disk full, read-only directory, ...).
            EngineClosedError: the tier is not open.
        """
        if len(keys) != len(objs):
            raise InvalidInputError(f"{len(keys)} keys but {len(objs)} objects")
        for obj in objs:
            if obj.dtype != self._spec.dtype:
                raise InvalidInputError(
                    f"payload dtype {obj.dtype}, the tier stores {self._spec.dtype}"
                )
        self._check_open()
        mark = self._index.ledger.erasures
        held: list[MemoryObj] = []
        try:
            for obj in objs:
                held.append(obj.ref())
            async with self._write_lock:
                self._check_open()
                batch: list[tuple[bytes, MemoryObj]] = [
                    (keys[i], held[i]) for i in self._index.to_write(keys, since=mark)
                ]
                if not batch:
                    return 0
                return await self._changes.write(batch, spec or self._spec)
        finally:
            for obj in held:
                obj.unref()

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the files of ``keys``; returns how many were indexed. While the index
        fills, the files of keys not indexed yet are deleted too (the fill will not find
        them).

        Raises:
            TierError: a file could not be deleted (the key is forgotten anyway).
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        async with self._write_lock:
            self._check_open()
            wanted = list(dict.fromkeys(keys))
            gone = [key for key in wanted if key in self._index]
            if self._index.filling:
                await self._changes.delete_unindexed([k for k in wanted if k not in self._index])
            await self._changes.delete(gone)
            return len(gone)

    async def clear(self) -> int:
        """Delete every indexed file (files of other layouts stay); returns how many. Waits
        for the index to be complete first.

        Raises:
            TierError: a file could not be deleted (the key is forgotten anyway).
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        await self._fill.wait()
        async with self._write_lock:
            self._check_open()
            gone = list(self._index)
            await self._changes.delete(gone)
            return len(gone)

    async def erase_tenant(self, tag: bytes) -> int:
        """Delete the tenant's files (:meth:`DiskIndex.erase_tenant`); returns how many
        record files were deleted. Waits for writes under way; a put called before this
        returns writes none of the tenant's chunks after it.

        The indexed keys are reported to the removal listener (files of the tenant found
        by name only, of other layouts or processes, were never this tier's chunks).

        Raises:
            InvalidInputError: ``tag`` is not a tenant tag.
            TierError: a file could not be deleted (the indexed ones are forgotten anyway).
            EngineClosedError: the tier is not open.
        """
        check_tag(tag)
        self._check_open()
        async with self._write_lock:
            self._check_open()
            keys, others, temps, failures = await self._index.erase_tenant(self._files, tag)
            # The manifest must not name the tenant's chunks any longer.
            if self.index_complete:
                await self._changes.compact()
            else:
                self._changes.compact_due = True
        erased = len(keys) + others
        log.info("disk_tier_tenant_erased", tag=tag_hex(tag), chunks=erased, temps=temps)
        self._report_removed([as_key(key) for key in keys])
        self._changes.check_deleted(failures)
        return erased

    def healthy(self) -> bool:
        """Whether the tier is open and its last probe (or open) succeeded."""
        return self._state is _State.OPEN and self._healthy

    async def check_health(self) -> bool:
        """Write, read back and delete a small probe file, bounded by ``health_timeout``."""
        if self._state is not _State.OPEN:
            return False
        ok = False
        reason = "timeout"
        with anyio.move_on_after(self._health_timeout):
            try:
                await self._files.probe()
                ok = True
            except OSError as exc:
                reason = str(exc)
        if ok != self._healthy:
            if ok:
                log.info("disk_tier_healthy", directory=str(self._files.directory))
            else:
                log.warning(
                    "disk_tier_unhealthy", directory=str(self._files.directory), reason=reason
                )
        self._healthy = ok
        return ok

    def stats(self) -> TierStats:
        stats = self._counts.stats(
            self.name,
            chunks=len(self._index),
            nbytes=self._index.bytes,
            evictions=self._index.evictions,
            healthy=self.healthy(),
        )
        return dataclasses.replace(stats, tenants=MappingProxyType(self._index.ledger.usage()))

    @property
    def quota_refusals(self) -> int:
        """Chunks not written because of their tenant's quota or other tenants'."""
        return self._index.ledger.refused

    async def aclose(self) -> None:
        """Refuse new work, stop the index fill, wait for writes under way, write the
        manifest (if the index is complete), forget the index (files stay)."""
        if self._state is _State.CLOSED:
            return
        opened = self._state is _State.OPEN
        self._state = _State.CLOSED
        with anyio.CancelScope(shield=True):
            await self._fill.stop()
            async with self._write_lock:
                if opened and self._fill.complete:
                    await self._changes.compact()
                await anyio.to_thread.run_sync(self._manifest.close)
                self._index.clear()
        log.debug("disk_tier_closed", directory=str(self._files.directory))

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise EngineClosedError(f"disk tier is {self._state.value}, not open")
