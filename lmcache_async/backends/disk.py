"""The disk tier: one self-describing record file per chunk, LRU-capped, restart-durable.

Files live at ``<local_disk>/<first two hex chars of the key>/<key.to_str()>.chunk``; each
holds one record (see :mod:`.record`): a header naming the key, layout, shape, dtype, codec,
length and checksum, then the payload.

*Writes* go to ``.tmp-<pid>-<random>-<name>`` in the same directory and are renamed over the
final name (``os.replace``), so a crash never leaves a partial record under a real name.
Files are not fsynced by default: after a power loss a renamed file may hold torn data,
which the record's checksums catch on the next read (a miss, the file deleted), and an fsync
per chunk costs far more than the occasional lost entry of a cache. ``fsync=True`` syncs
each file and its directory before the put returns.

*The index* (key → size and shape, least recently used first) lives in memory and is
rebuilt by :meth:`DiskBackend.open` from each file's header, size and mtime (never its
payload: checksums are verified on every read instead). Hits refresh a file's mtime, so the
LRU order survives restarts (to within a minute). At open, temporary files whose writer
process is gone are deleted, and so are files whose header is bad or whose length does not
match the file.
Files written for another KV layout (another fingerprint) are left alone and not indexed:
engines of other models may share the directory. One running engine per directory and
layout is supported; two at once would each keep their own index and capacity.

*Threads*: the index and counters belong to the event loop; worker threads only do file
I/O, checksums and codecs, one thread call per batch. Writes (put, eviction, remove,
clear) are serialized by a lock; reads are not, since a file is replaced atomically and an
open file outlives its unlink, so a reader sees one whole record or none.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import io
import math
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread
import structlog
import torch

from ..errors import (
    AllocationTimeoutError,
    ConfigError,
    EngineClosedError,
    IntegrityError,
    InvalidInputError,
    TierError,
)
from ..keys import DIGEST_SIZE, ChunkKey
from ..memory import MemoryObj, MemoryPool
from ..stats import TierStats
from .base import StorageBackend
from .codec import Codec
from .lru import held_prefix_count
from .record import PREFIX_SIZE, RecordHeader, RecordSpec, tensor_bytes

__all__ = ["CHUNK_SUFFIX", "DEFAULT_HEALTH_TIMEOUT", "TEMP_PREFIX", "DiskBackend"]

log = structlog.get_logger(__name__)

CHUNK_SUFFIX: Final = ".chunk"
"""Suffix of every record file."""

TEMP_PREFIX: Final = ".tmp-"
"""Prefix of files being written (and of leftovers a crash may leave)."""

DEFAULT_HEALTH_TIMEOUT: Final = 5.0
"""Seconds :meth:`DiskBackend.check_health` waits for its probe write and read."""

_HEAD_READ: Final = 4096
"""Bytes read first from a record: the whole header of any ordinary record."""
_MAX_HEAD: Final = PREFIX_SIZE + 64 * 1024
"""The most a record's prefix and header can take (record.py refuses larger headers)."""
_STALE_TEMP_SECONDS: Final = 600.0

_READ_THREADS: Final = 2
"""Worker threads one get reads with: a file read releases the GIL, the checksum does not,
so while one thread verifies a payload the other reads the next; verification then costs
little beyond the reads themselves."""

_SPLIT_READ_BYTES: Final = 1 << 20
"""A get splits its reads over threads only from this many payload bytes on."""
"""A temporary file this old is a leftover even if a process with its writer's pid runs."""
_TOUCH_AFTER_SECONDS: Final = 60.0
"""A hit refreshes its file's mtime when older than this: LRU order survives a restart to
within a minute, and hot chunks do not cost a metadata write on every read."""
_PROBE: Final = b"lmcache-async disk probe\n"


@dataclass(slots=True)
class _Entry:
    """What the index knows of one file (compared by identity to detect replacement)."""

    size: int
    shape: tuple[int, ...]


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class DiskBackend(StorageBackend):
    """Chunks as record files under ``local_disk``, at most ``max_local_disk_size`` bytes.

    Build it with :meth:`open`, which checks the settings and the directory and rebuilds
    the index. A put that would exceed the capacity evicts least recently used files
    first; a chunk larger than the whole capacity is refused. A file found corrupt on read
    (checksum, truncation, another key's or layout's record) is a miss, is deleted and is
    counted in ``corrupt``. Write errors (a full disk, a read-only directory) raise
    :class:`~lmcache_async.errors.TierError`; read errors are misses. Both count in
    ``errors``. ``hits`` and ``misses`` count the keys :meth:`get` was asked for.
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
    ) -> None:
        """Check the settings; does no I/O (:meth:`open` does).

        Raises:
            ConfigError: ``local_disk`` is not a path, ``max_local_disk_size`` is not a
                positive int (bytes).
            InvalidInputError: ``allocation_timeout`` or ``health_timeout`` is not a number
                >= 0 (> 0 for the health timeout).
        """
        if not isinstance(local_disk, str | os.PathLike) or not os.fspath(local_disk):
            raise ConfigError("local_disk", f"expected a directory path, got {local_disk!r}")
        if isinstance(max_local_disk_size, bool) or not isinstance(max_local_disk_size, int):
            raise ConfigError(
                "max_local_disk_size", f"expected a size in bytes, got {max_local_disk_size!r}"
            )
        if max_local_disk_size <= 0:
            raise ConfigError(
                "max_local_disk_size", f"must be > 0 bytes, got {max_local_disk_size}"
            )
        _check_seconds("allocation_timeout", allocation_timeout, allow_zero=True)
        _check_seconds("health_timeout", health_timeout, allow_zero=False)
        self._directory = Path(os.fspath(local_disk))
        self._pool = pool
        self._spec = spec
        self._allocation_timeout = float(allocation_timeout)
        self._capacity = max_local_disk_size
        self._fsync = bool(fsync)
        self._health_timeout = float(health_timeout)
        self._state = _State.NEW
        self._healthy = False
        # Keys are ChunkKeys; typed as bytes so a bare digest can probe the index.
        self._index: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._write_lock = anyio.Lock()
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._evictions = 0
        self._corrupt = 0
        self._errors = 0

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
    ) -> DiskBackend:
        """Create the directory if missing, check it can be written and read, and rebuild
        the index from the files in it (in a worker thread).

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
        )
        await backend._start()
        return backend

    async def _start(self) -> None:
        try:
            await anyio.to_thread.run_sync(_prepare_directory, self._directory)
        except OSError as exc:
            raise ConfigError(
                "local_disk", f"cannot use {str(self._directory)!r} as a cache directory: {exc}"
            ) from exc
        try:
            scan = await anyio.to_thread.run_sync(
                _scan_directory, self._directory, self._spec, self._capacity
            )
        except OSError as exc:
            raise ConfigError(
                "local_disk", f"cannot read the cache directory {str(self._directory)!r}: {exc}"
            ) from exc
        for key, entry in scan.entries:
            self._index[key] = entry
            self._bytes += entry.size
        for name, reason in scan.corrupt:
            log.warning("tier_entry_corrupt", tier=self.name, key=name, reason=reason)
        self._corrupt += len(scan.corrupt)
        self._evictions += scan.evicted
        self._state = _State.OPEN
        self._healthy = True
        log.info(
            "disk_tier_opened",
            directory=str(self._directory),
            chunks=len(self._index),
            bytes=self._bytes,
            capacity=self._capacity,
            removed_temps=scan.removed_temps,
            corrupt=len(scan.corrupt),
            other_layouts=scan.foreign,
            evicted=scan.evicted,
        )

    # -- properties ---------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The cache directory (``local_disk``)."""
        return self._directory

    @property
    def capacity_bytes(self) -> int:
        """The most bytes of record files the tier keeps (``max_local_disk_size``)."""
        return self._capacity

    def path_of(self, key: ChunkKey) -> Path:
        """Where the record of ``key`` lives (whether or not it exists)."""
        name = key.to_str()
        return self._directory / name[:2] / (name + CHUNK_SUFFIX)

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
        return held_prefix_count(self._index, keys)

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Read, verify and decode each key's record into a new pool object.

        Each object carries one reference for the caller. Misses, corrupt files (deleted),
        unreadable files and keys left when the pool had no room in time are ``None``.
        The files are read in worker threads (two for a large get, so one verifies while
        the other reads), straight into pool memory when the payload is stored uncompressed.

        Raises:
            EngineClosedError: the tier or the pool is closed.
        """
        self._check_open()
        out: list[MemoryObj | None] = [None] * len(keys)
        jobs: list[tuple[int, bytes, _Entry, MemoryObj]] = []
        settled = False
        try:
            for i, key in enumerate(keys):
                entry = self._index.get(key)
                if entry is None:
                    continue
                try:
                    obj = await self._pool.allocate(
                        entry.shape, self._spec.dtype, timeout=self._allocation_timeout
                    )
                except AllocationTimeoutError:
                    log.warning(
                        "disk_tier_allocation_timeout",
                        keys=len(keys) - i,
                        timeout=self._allocation_timeout,
                    )
                    break
                jobs.append((i, key, entry, obj))
            if jobs:
                reads = [(self.path_of(_as_key(key)), key, obj.tensor) for _, key, _, obj in jobs]
                outcomes = await self._read(reads, sum(obj.nbytes for *_, obj in jobs))
                settled = True
                self._settle_reads(jobs, outcomes, out)
        finally:
            if not settled:
                for _, _, _, obj in jobs:
                    obj.unref()
        hits = len(keys) - out.count(None)
        self._hits += hits
        self._misses += len(keys) - hits
        return out

    async def _read(
        self, reads: list[tuple[Path, bytes, torch.Tensor]], nbytes: int
    ) -> list[_Outcome]:
        """Read and verify ``reads`` in worker threads (see :data:`_READ_THREADS`); the
        outcomes in the order of ``reads``."""
        threads = min(_READ_THREADS, len(reads)) if nbytes >= _SPLIT_READ_BYTES else 1
        if threads == 1:
            return await anyio.to_thread.run_sync(_read_batch, self._spec, reads)
        parts: list[list[_Outcome]] = [[] for _ in range(threads)]

        async def read_part(part: int) -> None:
            parts[part] = await anyio.to_thread.run_sync(
                _read_batch, self._spec, reads[part::threads]
            )

        async with anyio.create_task_group() as task_group:
            for part in range(threads):
                task_group.start_soon(read_part, part)
        outcomes: list[_Outcome] = [_MISSING] * len(reads)
        for part, results in enumerate(parts):
            outcomes[part::threads] = results
        return outcomes

    def _settle_reads(
        self,
        jobs: list[tuple[int, bytes, _Entry, MemoryObj]],
        outcomes: list[_Outcome],
        out: list[MemoryObj | None],
    ) -> None:
        """Hand verified objects to ``out``; release the rest and drop their index entries."""
        read_errors: list[str] = []
        for (i, key, entry, obj), outcome in zip(jobs, outcomes, strict=True):
            if outcome.status is _Status.OK:
                out[i] = obj
                if self._index.get(key) is entry:
                    self._index.move_to_end(key)
                continue
            obj.unref()
            if outcome.status is _Status.ERROR:
                read_errors.append(outcome.reason)
                continue
            # Missing or corrupt: forget the entry unless a newer write replaced it.
            if self._index.get(key) is entry:
                del self._index[key]
                self._bytes -= entry.size
            if outcome.status is _Status.CORRUPT:
                self._corrupt += 1
                log.warning(
                    "tier_entry_corrupt",
                    tier=self.name,
                    key=_as_key(key).to_str(),
                    reason=outcome.reason,
                )
            else:
                log.debug("disk_tier_entry_vanished", key=_as_key(key).to_str())
        if read_errors:
            self._errors += 1
            log.warning("disk_tier_read_failed", chunks=len(read_errors), error=read_errors[0])

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
        does not fit even in an empty tier is refused. The objects are referenced while
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
        held: list[MemoryObj] = []
        try:
            for obj in objs:
                held.append(obj.ref())
            async with self._write_lock:
                self._check_open()
                batch: list[tuple[bytes, MemoryObj]] = []
                seen: set[bytes] = set()
                for key, obj in zip(keys, held, strict=True):
                    if key in self._index:
                        self._index.move_to_end(key)
                    elif key not in seen:
                        seen.add(key)
                        batch.append((key, obj))
                if not batch:
                    return 0
                return await self._write(batch, spec or self._spec)
        finally:
            for obj in held:
                obj.unref()

    async def _write(self, batch: list[tuple[bytes, MemoryObj]], spec: RecordSpec) -> int:
        """Encode, make room, write; the caller holds the write lock and the references."""
        encoded = await anyio.to_thread.run_sync(_encode_batch, spec, batch)
        victims: list[Path] = []
        writes: list[tuple[Path, bytes, bytes | memoryview]] = []
        planned: list[tuple[bytes, _Entry]] = []
        reserved = 0
        refused = 0
        for (key, obj), (header, payload) in zip(batch, encoded, strict=True):
            size = len(header) + len(payload)
            if reserved + size > self._capacity:
                # Larger than the tier, or than what this batch leaves of it: evicting
                # older entries would not make room.
                refused += 1
                continue
            while self._bytes + reserved + size > self._capacity and self._index:
                victim, entry = self._index.popitem(last=False)
                self._bytes -= entry.size
                victims.append(self.path_of(_as_key(victim)))
            reserved += size
            writes.append((self.path_of(_as_key(key)), header, payload))
            planned.append((key, _Entry(size, tuple(obj.shape))))
        if refused:
            log.warning("disk_tier_chunks_refused", chunks=refused, capacity=self._capacity)
        if not writes and not victims:
            return 0
        # The thread runs to its end even if we are cancelled; shield so that what it
        # wrote and deleted is always reflected in the index.
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(_write_batch, victims, writes, self._fsync)
        self._evictions += len(victims)
        if victims:
            log.debug("disk_tier_evicted", chunks=len(victims))
        for key, entry in planned[: result.written]:
            self._index[key] = entry
            self._bytes += entry.size
        self._puts += result.written
        if result.unlink_errors:
            self._errors += 1
            log.warning(
                "disk_tier_delete_failed",
                chunks=len(result.unlink_errors),
                error=result.unlink_errors[0],
            )
        if result.error is not None:
            self._errors += 1
            log.warning(
                "disk_tier_write_failed",
                written=result.written,
                chunks=len(writes),
                errno=result.error.errno,
                error=str(result.error),
            )
            raise TierError(f"disk tier write failed: {result.error}") from result.error
        return result.written

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the files of ``keys``; returns how many were held.

        Raises:
            TierError: a file could not be deleted (the key is forgotten anyway).
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        async with self._write_lock:
            self._check_open()
            gone = [key for key in dict.fromkeys(keys) if key in self._index]
            await self._delete(gone)
            return len(gone)

    async def clear(self) -> int:
        """Delete every indexed file (files of other layouts stay); returns how many.

        Raises:
            TierError: a file could not be deleted (the key is forgotten anyway).
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        async with self._write_lock:
            self._check_open()
            gone = list(self._index)
            await self._delete(gone)
            return len(gone)

    async def _delete(self, keys: Sequence[bytes]) -> None:
        paths = []
        for key in keys:
            self._bytes -= self._index.pop(key).size
            paths.append(self.path_of(_as_key(key)))
        if not paths:
            return
        with anyio.CancelScope(shield=True):
            failures = await anyio.to_thread.run_sync(_unlink_all, paths)
        if failures:
            self._errors += 1
            log.warning("disk_tier_delete_failed", chunks=len(failures), error=failures[0])
            raise TierError(f"disk tier could not delete {len(failures)} files: {failures[0]}")

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
                await anyio.to_thread.run_sync(
                    _probe_directory, self._directory, abandon_on_cancel=True
                )
                ok = True
            except OSError as exc:
                reason = str(exc)
        if ok != self._healthy:
            if ok:
                log.info("disk_tier_healthy", directory=str(self._directory))
            else:
                log.warning("disk_tier_unhealthy", directory=str(self._directory), reason=reason)
        self._healthy = ok
        return ok

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            chunks=len(self._index),
            bytes=self._bytes,
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            healthy=self.healthy(),
            corrupt=self._corrupt,
            errors=self._errors,
        )

    async def aclose(self) -> None:
        """Refuse new work, wait for writes under way, forget the index (files stay)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        with anyio.CancelScope(shield=True):
            async with self._write_lock:
                self._index.clear()
                self._bytes = 0
        log.debug("disk_tier_closed", directory=str(self._directory))

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise EngineClosedError(f"disk tier is {self._state.value}, not open")


# -- worker-thread side: file I/O only, no shared state ---------------------------------


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidInputError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidInputError(f"{name} must be {'>=' if allow_zero else '>'} 0, got {value}")


def _as_key(key: bytes) -> ChunkKey:
    # The index holds ChunkKeys (typed as bytes); a bare key's bytes are rebuilt as one.
    if isinstance(key, ChunkKey):
        return key
    layer = int.from_bytes(key[DIGEST_SIZE:], "little") if len(key) > DIGEST_SIZE else None
    return ChunkKey(bytes(key[:DIGEST_SIZE]), layer)


def _temp_name(final_name: str) -> str:
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{final_name}"


def _prepare_directory(directory: Path) -> None:
    """Create ``directory`` and check it can be listed, written and read back."""
    directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "no read/write/search permission", str(directory))
    _probe_directory(directory)


def _probe_directory(directory: Path) -> None:
    """Write, read back and delete a small file in ``directory``."""
    path = directory / _temp_name("probe")
    try:
        with open(path, "xb") as f:
            f.write(_PROBE)
        with open(path, "rb") as f:
            if f.read() != _PROBE:
                raise OSError(errno.EIO, "probe file read back wrong bytes", str(path))
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class _Status(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class _Outcome:
    status: _Status
    reason: str = ""


_OK: Final = _Outcome(_Status.OK)
_MISSING: Final = _Outcome(_Status.MISSING)


def _read_batch(spec: RecordSpec, reads: list[tuple[Path, bytes, torch.Tensor]]) -> list[_Outcome]:
    return [_read_one(spec, path, key, out) for path, key, out in reads]


def _read_one(spec: RecordSpec, path: Path, key: bytes, out: torch.Tensor) -> _Outcome:
    """Read the record at ``path`` into ``out``; delete the file if it is corrupt."""
    try:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            try:
                _read_record(spec, f, st.st_size, key, out)
            except IntegrityError as exc:
                _unlink_if_same(path, st)
                return _Outcome(_Status.CORRUPT, str(exc))
            if time.time() - st.st_mtime > _TOUCH_AFTER_SECONDS:
                # A hit: most recently used, also in the order rebuilt after a restart.
                with contextlib.suppress(OSError):
                    os.utime(f.fileno())
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        return _Outcome(_Status.ERROR, str(exc))
    return _OK


def _read_record(
    spec: RecordSpec, f: io.FileIO, file_size: int, key: bytes, out: torch.Tensor
) -> None:
    """Read, check and decode one record into ``out`` (the shape the index expects).

    Raises:
        IntegrityError: anything in the file does not match.
    """
    head, header, offset = _read_header(f, file_size)
    spec.check_header(header, key)
    if header.shape != tuple(out.shape):
        raise IntegrityError(f"record shape {header.shape} differs from the indexed one")
    if offset + header.length != file_size:
        raise IntegrityError(
            f"file is {file_size} bytes, its record {offset + header.length} bytes"
        )
    if Codec(header.codec) is Codec.NONE:
        # Straight into pool memory, verified there: no intermediate copy.
        dest = tensor_bytes(out)
        if header.length != len(dest):
            raise IntegrityError("record payload does not fill its tensor")
        _fill(f, head[offset:], dest)
        spec.verify_payload(header, dest)
        return
    buf = memoryview(bytearray(header.length))
    _fill(f, head[offset:], buf)
    spec.verify_payload(header, buf)
    spec.decode_into(header, buf, out)


def _read_header(f: io.FileIO, file_size: int) -> tuple[bytes, RecordHeader, int]:
    """The first bytes read, the header, and the payload offset (the file is left after
    those bytes)."""
    head = f.read(min(file_size, _HEAD_READ))
    try:
        header, offset = RecordHeader.from_bytes(head)
    except IntegrityError:
        limit = min(file_size, _MAX_HEAD)
        if len(head) >= limit:
            raise
        head += f.read(limit - len(head))  # an unusually large header
        header, offset = RecordHeader.from_bytes(head)
    return head, header, offset


def _fill(f: io.FileIO, first: bytes, dest: memoryview) -> None:
    n = min(len(first), len(dest))
    dest[:n] = first[:n]
    while n < len(dest):
        got = f.readinto(dest[n:])
        if not got:
            raise IntegrityError("record file ended early")
        n += got


def _unlink_if_same(path: Path, seen: os.stat_result) -> None:
    """Delete ``path`` if it is still the file ``seen`` (a writer may have replaced it)."""
    with contextlib.suppress(OSError):
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
            os.unlink(path)


def _encode_batch(
    spec: RecordSpec, batch: list[tuple[bytes, MemoryObj]]
) -> list[tuple[bytes, bytes | memoryview]]:
    return [spec.encode(key, obj) for key, obj in batch]


@dataclass(frozen=True, slots=True)
class _WriteResult:
    written: int
    """Records written, in order, before the first failure."""
    unlink_errors: list[str]
    error: OSError | None


def _write_batch(
    victims: list[Path], writes: list[tuple[Path, bytes, bytes | memoryview]], fsync: bool
) -> _WriteResult:
    """Delete evicted files, then write records in order, stopping at the first failure."""
    unlink_errors = _unlink_all(victims)
    written = 0
    try:
        for path, header, payload in writes:
            _write_record(path, header, payload, fsync)
            written += 1
    except OSError as exc:
        return _WriteResult(written, unlink_errors, exc)
    return _WriteResult(written, unlink_errors, None)


def _write_record(path: Path, header: bytes, payload: bytes | memoryview, fsync: bool) -> None:
    """Write one record to a temporary file and rename it to ``path``."""
    tmp = path.with_name(_temp_name(path.name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, payload)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _unlink_all(paths: list[Path]) -> list[str]:
    """Delete ``paths`` (already missing is fine); returns the errors."""
    errors = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(str(exc))
    return errors


@dataclass(slots=True)
class _Scan:
    entries: list[tuple[ChunkKey, _Entry]]
    """Indexable records, least recently used first."""
    corrupt: list[tuple[str, str]]
    """Deleted bad records: (file name, reason)."""
    removed_temps: int = 0
    foreign: int = 0
    """Records of other layouts, left alone."""
    evicted: int = 0
    """Oldest records deleted because they exceeded the capacity."""


def _scan_directory(directory: Path, spec: RecordSpec, capacity: int) -> _Scan:
    """Index the records under ``directory`` from their headers; clean up leftovers."""
    scan = _Scan(entries=[], corrupt=[])
    found: list[tuple[int, str, ChunkKey, _Entry]] = []
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


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _scan_record(
    item: os.DirEntry[str],
    spec: RecordSpec,
    scan: _Scan,
    found: list[tuple[int, str, ChunkKey, _Entry]],
) -> None:
    try:
        key = ChunkKey.from_str(item.name.removesuffix(CHUNK_SUFFIX))
    except InvalidInputError:
        return  # not a name this tier writes: not ours to judge
    try:
        with open(item.path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            try:
                _, header, offset = _read_header(f, st.st_size)
                if header.fingerprint != spec.fingerprint:
                    scan.foreign += 1
                    return
                spec.check_header(header, key)
                if offset + header.length != st.st_size:
                    raise IntegrityError(
                        f"file is {st.st_size} bytes, its record {offset + header.length} bytes"
                    )
            except IntegrityError as exc:
                _unlink_if_same(Path(item.path), st)
                scan.corrupt.append((item.name, str(exc)))
                return
    except FileNotFoundError:
        return
    found.append((st.st_mtime_ns, item.name, key, _Entry(st.st_size, header.shape)))


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
