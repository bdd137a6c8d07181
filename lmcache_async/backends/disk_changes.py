"""Every change to the disk tier's files, kept in step with its index and its manifest.

:class:`DiskChanges` writes records (room made within the capacity and the quotas, each
new file indexed), deletes them (forgotten first, the removal listener told once they are
gone), logs each change to the manifest (:mod:`.disk_manifest`) in the thread that made
it, rewrites the manifest from the index when its log has grown (or at close), and takes
what the index fill (:mod:`.disk_fill`) reports: files it deleted as corrupt, entries it
forgot, the end of the fill (the oldest files beyond the capacity evicted). The caller
holds the tier's write lock around :meth:`~DiskChanges.write`, :meth:`~DiskChanges.delete`
and :meth:`~DiskChanges.compact`; the fill's callbacks take it themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj

from ..errors import TierError
from .counters import TierCounters
from .disk_file import RecordFiles, WriteResult, as_key, encode_batch
from .disk_index import DiskIndex
from .disk_manifest import Manifest
from .disk_scan import Found
from .record import RecordSpec

__all__ = ["DiskChanges"]

log = get_logger(__name__)


class DiskChanges:
    """The changes to one disk tier's files (see the module doc). ``report``: tells the
    tier's removal listener; ``is_open``: whether the tier still takes work."""

    def __init__(
        self,
        index: DiskIndex,
        files: RecordFiles,
        manifest: Manifest,
        counts: TierCounters,
        lock: anyio.Lock,
        *,
        report: Callable[[Sequence[ChunkKey]], None],
        is_open: Callable[[], bool],
        complete: Callable[[], bool],
    ) -> None:
        self._index = index
        self._files = files
        self._manifest = manifest
        self._counts = counts
        self._lock = lock
        self._report = report
        self._is_open = is_open
        self._complete = complete
        self.compact_due = False
        """Rewrite the manifest once the index is complete (a tenant was erased meanwhile)."""

    # -- writes -------------------------------------------------------------------------

    async def write(self, batch: list[tuple[bytes, MemoryObj]], spec: RecordSpec) -> int:
        """Encode, make room, write, index; the caller holds the write lock and the
        objects' references. Returns how many records were written.

        Raises:
            TierError: a record could not be written (those before it stay indexed).
        """
        encoded = await anyio.to_thread.run_sync(encode_batch, spec, batch)
        index = self._index
        admitted, evicted = index.admit(
            [key for key, _ in batch], [len(head) + len(body) for head, body in encoded]
        )
        if len(admitted) < len(batch):
            log.warning(
                "disk_tier_chunks_refused",
                chunks=len(batch) - len(admitted),
                capacity=index.capacity,
            )
        if not admitted and not evicted:
            return 0
        keys = [batch[i][0] for i in admitted]
        sizes = [len(encoded[i][0]) + len(encoded[i][1]) for i in admitted]
        shapes = [tuple(batch[i][1].shape) for i in admitted]
        manifest = self._manifest

        def logged(result: WriteResult) -> None:  # in the writing thread
            n = result.written
            try:
                manifest.record_dropped(evicted)
                manifest.record_added(keys[:n], sizes[:n], shapes[:n])
            except Exception as exc:  # a hint lost (headers read at the next open), not a write
                log.warning(
                    "disk_manifest_log_failed", path=str(manifest.log_path), error=repr(exc)
                )

        # Shielded (see RecordFiles): what the thread wrote and deleted is always reflected
        # in the index.
        result = await self._files.write(
            evicted, [(batch[i][0], *encoded[i]) for i in admitted], after=logged
        )
        if evicted:
            log.debug("disk_tier_evicted", chunks=len(evicted))
            self._report([as_key(key) for key in evicted])
        for key, size, shape in zip(keys[: result.written], sizes, shapes, strict=False):
            index.add(key, size, shape)
        self._counts.puts += result.written
        if manifest.wants_compaction and self._complete():
            await self.compact()
        _check_written(self._counts, result, len(admitted))
        return result.written

    # -- deletions ----------------------------------------------------------------------

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (all indexed), delete their files, tell the removal listener.

        Raises:
            TierError: a file could not be deleted (the key is forgotten anyway).
        """
        if not keys:
            return
        for key in keys:
            self._index.pop(key)
        failures = await self._files.delete(
            keys, after=functools.partial(self._manifest.record_dropped, keys)
        )
        self._report([as_key(key) for key in keys])
        self.check_deleted(failures)

    async def delete_unindexed(self, keys: Sequence[bytes]) -> None:
        """Delete the files of ``keys``, not indexed yet while the index fills (the fill
        will not bring them back).

        Raises:
            TierError: a file could not be deleted.
        """
        if keys:
            self._index.mark_dropped(keys)
            self.check_deleted(await self._files.delete(keys))

    def check_deleted(self, failures: list[str]) -> None:
        """Count and log failed deletions.

        Raises:
            TierError: there were some.
        """
        if failures:
            self._counts.errors += 1
            log.warning("disk_tier_delete_failed", chunks=len(failures), error=failures[0])
            raise TierError(f"disk tier could not delete {len(failures)} files: {failures[0]}")

    # -- the manifest -------------------------------------------------------------------

    async def compact(self) -> None:
        """Rewrite the manifest from the index, in a worker thread (the caller holds the
        write lock, so nothing is logged meanwhile). A failure is logged, not raised: the
        manifest only saves header reads."""
        self.compact_due = False
        index = self._index
        items = index.items()
        shapes = list(index.shapes.shapes)
        manifest = self._manifest

        def write() -> None:
            manifest.compact(
                [key for key, _ in items],
                [index.size_of(entry) for _, entry in items],
                [index.number_of(entry) for _, entry in items],
                shapes,
            )

        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(write)
        except (OSError, ValueError) as exc:  # ValueError: an entry the format cannot hold
            log.warning(
                "disk_manifest_write_failed", path=str(manifest.snapshot_path), error=str(exc)
            )

    # -- what the index fill reports ----------------------------------------------------

    async def fill_complete(self) -> int:
        """Every file is indexed: evict the oldest beyond the capacity, and rewrite the
        manifest if it is due; returns how many were evicted."""
        async with self._lock:
            if not self._is_open():
                return 0
            victims = self._index.trim()
            if victims:
                failures = await self._files.delete(
                    victims, after=functools.partial(self._manifest.record_dropped, victims)
                )
                self._report([as_key(key) for key in victims])
                if failures:
                    self._counts.errors += 1
                    log.warning("disk_tier_delete_failed", chunks=len(failures), error=failures[0])
            if self.compact_due:
                await self.compact()
            return len(victims)

    async def fill_compact(self) -> None:
        """Rewrite the manifest (the fill read many headers the next open need not)."""
        async with self._lock:
            if self._is_open():
                await self.compact()

    def found_corrupt(self, found: Sequence[Found]) -> None:
        """The fill deleted these files as corrupt."""
        for item in found:
            log.warning("tier_entry_corrupt", tier="disk", key=item.name, reason=item.reason)
        self._counts.corrupt += len(found)

    def forgotten(self, keys: Sequence[bytes]) -> None:
        """The fill forgot these keys: their files are gone."""
        self._report([as_key(key) for key in keys])


def _check_written(counts: TierCounters, result: WriteResult, chunks: int) -> None:
    """Count and log what went wrong in a write of ``chunks`` records.

    Raises:
        TierError: a record could not be written.
    """
    if result.unlink_errors:
        counts.errors += 1
        log.warning(
            "disk_tier_delete_failed",
            chunks=len(result.unlink_errors),
            error=result.unlink_errors[0],
        )
    if result.error is not None:
        counts.errors += 1
        log.warning(
            "disk_tier_write_failed",
            written=result.written,
            chunks=chunks,
            errno=result.error.errno,
            error=str(result.error),
        )
        raise TierError(f"disk tier write failed: {result.error}") from result.error
