"""The disk tier's index fill: the index built behind an open that returned at once.

:meth:`IndexFill.start` (called by :meth:`DiskBackend.open <.disk.DiskBackend.open>`)
starts a thread of its own, which does every file system call in batches and hands each
batch's result to the event loop (``anyio.from_thread``), where the index is changed;
the thread waits for each hand-over, so at most one batch is in flight and the loop never
runs more than one batch's merge at a time. :meth:`IndexFill.stop` (the tier's close)
stops it between two batches and joins it. A backend opened by a class method has no
task group that outlives the call; the thread needs none.

The fill, in order:

1. *List*: the manifest (:mod:`.disk_manifest`) is loaded and the directory's names are
   listed (no ``stat``); leftover temporary files are deleted.
2. *Known files*: the manifest's entries whose file is there are indexed, in its order
   (least recently used first), a batch at a time; entries whose file is gone are dropped.
3. *Other files* (not in the manifest: written after its last record, copied in, or all
   of them when there is no manifest): sorted by mtime, their headers read
   (:func:`.disk_scan.read_entry`), indexed after the known ones, oldest first.
   The index is then *complete*: what was used meanwhile becomes the most recent, the
   oldest files beyond the capacity are evicted, :meth:`IndexFill.wait` returns.
4. *Audit*: each known file's size is checked (a ``stat`` each: five times the cost of
   the listing, so after the index is complete); an entry whose file's size differs is
   read again from its header (or forgotten). Then the manifest is rewritten if the fill
   had to read many headers.

While the fill runs, a lookup of a key not indexed yet looks at its file directly
(:meth:`IndexFill.look`), and every read checks the record itself, as always: what the
manifest says is never served unchecked.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.logging import get_logger

from . import disk_scan
from .disk_file import CHUNK_SUFFIX, ReadStatus, record_name
from .disk_index import DiskEntry, DiskIndex
from .disk_manifest import Manifest, ManifestState, names_sum
from .disk_scan import Found, Status
from .record import RecordSpec

__all__ = ["IndexFill", "IndexStats"]

log = get_logger(__name__)

_T = TypeVar("_T")

KNOWN_BATCH: Final = 8192
"""Manifest entries indexed per hand-over to the loop."""
READ_BATCH: Final = 256
"""Headers read per thread batch (about 10 ms of file work)."""
STAT_BATCH: Final = 4096
"""Files stat'ed per thread batch."""
JOIN_TIMEOUT: Final = 10.0
"""Seconds :meth:`IndexFill.stop` waits for the thread (it stops between two batches)."""
_COMPACT_FLOOR: Final = 1024
"""The fill rewrites the manifest once it read this many headers (and an eighth of the
index): reading them again at every open would cost more."""


class IndexStats(NamedTuple):
    """Where the disk tier's index fill stands (:meth:`DiskBackend.index_stats
    <.disk.DiskBackend.index_stats>`)."""

    complete: bool
    """Every file of the directory is indexed (or known not to be this tier's)."""
    audited: bool
    """The sizes of the files the manifest named were checked too."""
    manifest: str
    """``"used"``, ``"missing"``, ``"ignored"`` (unreadable: a warning said why), or
    ``"pending"`` before the fill reads it."""
    from_manifest: int
    """Files indexed from the manifest (no header read)."""
    headers_read: int
    """Files whose header the fill read (not in the manifest, or their size changed)."""
    looked_up: int
    """Files a lookup or get looked at directly while the fill ran (found or not)."""
    dropped: int
    """Manifest entries dropped: the file is gone, or its size differs."""
    foreign: int
    """Files of another layout or key, left alone."""
    removed_temps: int
    """Leftover temporary files deleted."""
    seconds: float | None
    """From the open until the index was complete (None before)."""
    failed: str
    """Why the fill stopped early ("" if it did not): the index holds what it found."""
    chunks: int
    """Chunks indexed now."""
    bytes_per_chunk: float
    """About how much memory the index holds per chunk (:meth:`DiskIndex.footprint
    <.disk_index.DiskIndex.footprint>`; 0 when empty)."""


class IndexFill:
    """The fill of ``index`` from the files of ``directory`` (see the module doc).

    The tier passes what the fill reports to: ``on_complete`` (on the loop, once the
    index is complete: evict beyond the capacity; returns how many), ``on_compact``
    (rewrite the manifest),
    ``on_corrupt`` (files deleted as corrupt), ``on_forgotten`` (keys the audit forgot,
    their files gone).
    """

    def __init__(
        self,
        directory: Path,
        spec: RecordSpec,
        index: DiskIndex,
        manifest: Manifest,
        *,
        on_complete: Callable[[], Awaitable[int]],
        on_compact: Callable[[], Awaitable[None]],
        on_corrupt: Callable[[Sequence[Found]], None],
        on_forgotten: Callable[[Sequence[bytes]], None],
    ) -> None:
        self._directory = directory
        self._spec = spec
        self._index = index
        self._manifest = manifest
        self._on_complete = on_complete
        self._on_compact = on_compact
        self._on_corrupt = on_corrupt
        self._on_forgotten = on_forgotten
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._complete = anyio.Event()
        self._audited = anyio.Event()
        self._started = 0.0
        self._counts = dict.fromkeys(
            ("from_manifest", "headers_read", "looked_up", "dropped", "foreign", "removed_temps"), 0
        )
        self._manifest_state = "pending"
        self._seconds: float | None = None
        self._failed = ""

    # -- the loop's side ----------------------------------------------------------------

    def start(self) -> None:
        """Begin the fill (on the event loop): the index tracks what is used and dropped
        until the fill ends, and the thread starts."""
        self._token = anyio.lowlevel.current_token()
        self._started = time.perf_counter()
        self._index.begin_fill()
        self._thread = threading.Thread(target=self._run, name="disk-index-fill", daemon=True)
        self._thread.start()

    @property
    def complete(self) -> bool:
        return self._complete.is_set() and not self._failed

    async def wait(self, *, audited: bool = False) -> bool:
        """Wait until the index is complete (with ``audited``: and the sizes checked), or
        the fill stopped; whether the index is complete."""
        await (self._audited if audited else self._complete).wait()
        return self.complete

    def stats(self) -> IndexStats:
        """Where the fill stands; ``bytes_per_chunk`` takes one pass over the index."""
        c = self._counts
        chunks = len(self._index)
        return IndexStats(
            complete=self.complete,
            audited=self._audited.is_set() and not self._failed,
            manifest=self._manifest_state,
            from_manifest=c["from_manifest"],
            headers_read=c["headers_read"],
            looked_up=c["looked_up"],
            dropped=c["dropped"],
            foreign=c["foreign"],
            removed_temps=c["removed_temps"],
            seconds=self._seconds,
            failed=self._failed,
            chunks=chunks,
            bytes_per_chunk=self._index.footprint() / chunks if chunks else 0.0,
        )

    async def stop(self) -> None:
        """Stop the thread between two batches and join it (bounded by
        :data:`JOIN_TIMEOUT`); the fill's events are set."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join, JOIN_TIMEOUT)
            if thread.is_alive():
                log.warning("disk_index_fill_not_stopped", directory=str(self._directory))
        self._finish("")

    async def held_prefix(self, keys: Sequence[bytes]) -> int:
        """:meth:`DiskIndex.held_prefix <.disk_index.DiskIndex.held_prefix>`; while the
        index fills, the files of the keys past its run are looked at first."""
        index = self._index
        held = index.held_prefix(keys)
        if held < len(keys) and index.filling:
            await self.look(keys[held:], prefix=True)
            held += index.held_prefix(keys[held:])
        return held

    async def look_unindexed(self, keys: Sequence[bytes]) -> None:
        """While the index fills, look at the files of those ``keys`` it lacks."""
        if self._index.filling:
            await self.look([key for key in keys if key not in self._index], prefix=False)

    async def look(self, keys: Sequence[bytes], *, prefix: bool) -> None:
        """Index the files of ``keys`` the fill has not reached yet, reading their headers
        now (with ``prefix``: up to the first that is not there). They count as used."""
        if not keys:
            return
        since = self._index.ledger.erasures
        names = [record_name(key) for key in keys]
        found = await anyio.to_thread.run_sync(
            _read_names, self._directory, self._spec, names, prefix
        )
        self._counts["looked_up"] += len(found)
        self._merge_found(found, since, used=True)

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._fill()
        except _Stopped:
            return
        except Exception as exc:  # an unreadable directory, or the event loop is gone
            failed = repr(exc)
            log.warning("disk_index_fill_failed", directory=str(self._directory), error=failed)
            with contextlib.suppress(Exception):
                self._call(self._finish, failed)

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the event loop and wait for it."""
        if self._stop.is_set():
            raise _Stopped
        return anyio.from_thread.run_sync(fn, *args, token=self._token)

    def _call_async(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``fn()`` on the event loop and wait for it."""
        self._check_stop()
        anyio.from_thread.run(fn, token=self._token)

    def _fill(self) -> None:
        since = self._call(lambda: self._index.ledger.erasures)
        state, problem = self._manifest.load()
        if state is not None:
            self._manifest_state = "used"
        elif problem == "missing":
            self._manifest_state = "missing"
        else:
            self._manifest_state = "ignored"
            log.warning(
                "disk_manifest_ignored", path=str(self._manifest.snapshot_path), reason=problem
            )
        try:
            self._manifest.attach(state)
        except OSError as exc:
            log.warning(
                "disk_manifest_log_failed", path=str(self._manifest.log_path), error=str(exc)
            )
        listing = disk_scan.list_records(self._directory)
        self._counts["removed_temps"] = listing.removed_temps
        known, unknown = _match(state, listing.names)
        keys: list[bytes] = []
        sizes: list[int] = []
        if state is not None:
            self._counts["dropped"] += len(state.keys) - len(known)
            keys, sizes, numbers = state.keys, state.sizes, state.numbers
            if len(known) < len(keys):
                keys = [keys[i] for i in known]
                sizes = [sizes[i] for i in known]
                numbers = [numbers[i] for i in known]
            for start in range(0, len(keys), KNOWN_BATCH):
                end = start + KNOWN_BATCH
                batch = (keys[start:end], sizes[start:end], numbers[start:end])
                self._call(self._merge_known, batch, state.shapes, since)
        self._read_unknown(unknown, since)
        self._call_async(self._completed)
        self._audit(keys, sizes)
        self._call_async(self._audit_done)

    def _read_unknown(self, names: list[str], since: int) -> None:
        """Index the files the manifest does not name, oldest first, from their headers."""
        dated: list[tuple[int, str]] = []
        for start in range(0, len(names), STAT_BATCH):
            batch = names[start : start + STAT_BATCH]
            self._check_stop()
            for name, st in zip(batch, disk_scan.stat_records(self._directory, batch), strict=True):
                if st is not None:
                    dated.append((st[1], name))
        dated.sort()
        ordered = [name for _, name in dated]
        for start in range(0, len(ordered), READ_BATCH):
            self._check_stop()
            found = disk_scan.read_entries(
                self._directory, self._spec, ordered[start : start + READ_BATCH]
            )
            self._call(self._merge_found, found, since)

    def _audit(self, keys: list[bytes], sizes: list[int]) -> None:
        """Check the size of each file the manifest named (``sizes``: what it said); read
        again those that differ. The comparison with the manifest runs here, so the loop
        sees only the files that changed (a put since wrote its file before indexing its
        size, so a file the manifest describes still matches or is compared there)."""
        for start in range(0, len(keys), STAT_BATCH):
            batch = keys[start : start + STAT_BATCH]
            said = sizes[start : start + STAT_BATCH]
            names = [record_name(key) for key in batch]
            self._check_stop()
            stats = disk_scan.stat_records(self._directory, names)
            odd = [i for i, st in enumerate(stats) if st is None or st[0] != said[i]]
            if not odd:
                continue
            batch = [batch[i] for i in odd]
            names = [names[i] for i in odd]
            stats = [stats[i] for i in odd]
            changed = self._call(self._compare, batch, names, stats)
            if changed:
                self._check_stop()
                names = [name for _, _, name in changed]
                found = disk_scan.read_entries(self._directory, self._spec, names)
                self._call(self._apply, changed, found)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    # -- run on the loop by the thread --------------------------------------------------

    def _merge_known(
        self,
        batch: tuple[list[bytes], list[int], list[int]],
        shapes: list[tuple[int, ...]],
        since: int,
    ) -> None:
        if not self._stop.is_set():
            self._counts["from_manifest"] += self._index.merge(*batch, shapes, since=since)

    def _merge_found(self, found: Sequence[Found], since: int, *, used: bool = False) -> None:
        if self._stop.is_set():
            return
        keys: list[bytes] = []
        sizes: list[int] = []
        numbers: list[int] = []
        shapes: dict[tuple[int, ...], int] = {}
        corrupt: list[Found] = []
        for item in found:
            if item.status is Status.OK:
                keys.append(item.key)
                sizes.append(item.size)
                numbers.append(shapes.setdefault(item.shape, len(shapes)))
            elif item.status is Status.CORRUPT:
                corrupt.append(item)
            elif item.status is Status.FOREIGN:
                self._counts["foreign"] += 1
        if not used:
            self._counts["headers_read"] += sum(item.status is not Status.ALIEN for item in found)
        self._index.merge(keys, sizes, numbers, list(shapes), since=since, used=used)
        if corrupt:
            self._on_corrupt(corrupt)

    def _compare(
        self, keys: list[bytes], names: list[str], stats: list[tuple[int, int] | None]
    ) -> list[tuple[bytes, DiskEntry, str]]:
        """The audited entries whose file's size differs (to read again); those whose
        file is gone are forgotten here."""
        changed: list[tuple[bytes, DiskEntry, str]] = []
        gone: list[bytes] = []
        if self._stop.is_set():
            return changed
        index = self._index
        for key, name, st in zip(keys, names, stats, strict=True):
            entry = index.get(key)
            if entry is None or index.size_of(entry) == (st[0] if st is not None else -1):
                continue
            if st is None:
                if index.settle(key, entry, ReadStatus.MISSING):
                    gone.append(key)
            else:
                changed.append((key, entry, name))
        self._counts["dropped"] += len(changed) + len(gone)
        if gone:
            self._on_forgotten(gone)
        return changed

    def _apply(self, changed: list[tuple[bytes, DiskEntry, str]], found: list[Found]) -> None:
        if self._stop.is_set():
            return
        self._counts["headers_read"] += len(found)
        gone: list[bytes] = []
        corrupt: list[Found] = []
        for (key, entry, _), item in zip(changed, found, strict=True):
            if item.status is Status.OK:
                self._index.replace(key, entry, item.size, item.shape)
                continue
            if item.status is Status.CORRUPT:
                corrupt.append(item)  # deleted by the thread: counted even if a read forgot it
            if self._index.settle(key, entry, ReadStatus.MISSING):
                gone.append(key)
        if corrupt:
            self._on_corrupt(corrupt)
        if gone:
            self._on_forgotten(gone)

    async def _completed(self) -> None:
        if self._stop.is_set():
            return
        self._index.end_fill()
        self._seconds = time.perf_counter() - self._started
        evicted = await self._on_complete()
        self._complete.set()
        c = self._counts
        log.info(
            "disk_index_complete",
            directory=str(self._directory),
            chunks=len(self._index),
            manifest=self._manifest_state,
            from_manifest=c["from_manifest"],
            headers_read=c["headers_read"],
            dropped=c["dropped"],
            other_layouts=c["foreign"],
            removed_temps=c["removed_temps"],
            evicted=evicted,
            seconds=round(self._seconds, 3),
        )

    async def _audit_done(self) -> None:
        if self._stop.is_set():
            return
        read = self._counts["headers_read"] + self._counts["dropped"]
        if read >= max(_COMPACT_FLOOR, len(self._index) // 8):
            await self._on_compact()
        self._audited.set()

    def _finish(self, failed: str) -> None:
        """The fill is over, done or not: nobody waits any longer."""
        if failed and not self._failed:
            self._failed = failed
        if self._index.filling and not self._complete.is_set():
            self._index.end_fill()
        self._complete.set()
        self._audited.set()


class _Stopped(Exception):
    """The tier is closing: the fill thread ends."""


def _read_names(directory: Path, spec: RecordSpec, names: list[str], prefix: bool) -> list[Found]:
    """Headers of the named files; with ``prefix`` only up to the first that is not OK."""
    out: list[Found] = []
    for name in names:
        found = disk_scan.read_entry(directory, spec, name)
        out.append(found)
        if prefix and found.status is not Status.OK:
            break
    return out


def _match(state: ManifestState | None, names: list[str]) -> tuple[list[int], list[str]]:
    """The manifest's rows whose file was listed, and the listed names it does not have."""
    if state is None:
        return [], names
    if len(names) == len(state.keys) and names_sum(names) == state.names_sum:
        return list(range(len(names))), []  # the same names (one sum, not two sets)
    listed = set(names)
    if set(map(len, state.keys)) == {DIGEST_SIZE}:
        stems = map(bytes.hex, state.keys)  # record_name of a whole-chunk key, in C loops
        manifest_names = list(map(operator.add, stems, itertools.repeat(CHUNK_SUFFIX)))
    else:
        manifest_names = [record_name(key) for key in state.keys]
    if listed.issuperset(manifest_names):
        known = list(range(len(manifest_names)))
    else:
        known = list(
            itertools.compress(itertools.count(), map(listed.__contains__, manifest_names))
        )
    return known, list(listed.difference(manifest_names))
