"""The disk tier across restarts: the open returns at once and the index fills behind it,
from the manifest a clean close (or the log a killed writer) left, checked against the
files: deleted, corrupted, truncated and added files, a bad manifest, a SIGKILL mid-write,
and puts, evictions, removals and erasures while the index fills. Real files in tmp_path."""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from structlog.testing import capture_logs

from lmcache_async.backends import disk_scan
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.disk_file import record_path
from lmcache_async.backends.disk_manifest import Manifest
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES
from tests.backends.test_disk import (
    CHUNK,
    HERE,
    LAYOUT,
    PAGE,
    REPO_ROOT,
    check_hits,
    chunk_files,
    expected,
    flip_payload,
    key,
    kill_mid_write,
    load_writer,
    make_obj,
    make_spec,
    open_disk,
    opened,
    put,
    raw,
    temp_files,
    truncate,
    written_ids,
)

TIMEOUT = 60


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    pool = MemoryPool(64 * PAGE, page_size=PAGE, pin_memory=False)
    yield pool
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


async def open_filling(directory: Path, pool: MemoryPool, *, cap: int = 1 << 30) -> DiskBackend:
    """An open tier, its index not waited for."""
    return await DiskBackend.open(
        directory,
        pool=pool,
        spec=make_spec(),
        allocation_timeout=1.0,
        max_local_disk_size=cap,
    )


class Gate:
    """Holds the fill thread inside one call until released (no sleeps, no timing)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def wrap(self, fn: Callable[..., Any], *, after: int = 0) -> Callable[..., Any]:
        """``fn``, holding its call number ``after`` (0: the first)."""
        calls = [0]

        def gated(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == after + 1:
                self.entered.set()
                if not self.release.wait(TIMEOUT):
                    raise TimeoutError("the gate was never released")
            return fn(*args, **kwargs)

        return gated

    async def reached(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, TIMEOUT)


@contextlib.contextmanager
def gated(monkeypatch: pytest.MonkeyPatch, name: str, *, after: int = 0) -> Iterator[Gate]:
    """A gate on ``disk_scan.<name>``, released on the way out whatever happens."""
    gate = Gate()
    monkeypatch.setattr(disk_scan, name, gate.wrap(getattr(disk_scan, name), after=after))
    try:
        yield gate
    finally:
        gate.release.set()


def counting_headers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files whose header the fill reads, from now on."""
    names: list[str] = []
    read = disk_scan.read_entry

    def counted(directory: Path, spec: Any, name: str) -> disk_scan.Found:
        names.append(name)
        return read(directory, spec, name)

    monkeypatch.setattr(disk_scan, "read_entry", counted)
    return names


def file_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in chunk_files(directory))


def write_records(directory: Path, ids: range) -> None:
    """Record files for ``ids`` written straight to the directory (a tier this size is
    quicker to make than to put), each chunk's payload that of ``expected(i % 16)``."""
    spec = make_spec()
    pool = MemoryPool(16 * PAGE, page_size=PAGE, pin_memory=False)
    try:
        objs = []
        for i in range(16):
            obj = pool.allocate_nowait(LAYOUT.payload_shape(CHUNK), LAYOUT.dtype)
            assert obj is not None
            raw(obj).copy_(expected(i))
            objs.append(obj)
        for i in ids:
            head, payload = spec.encode(key(i), objs[i % 16])
            path = record_path(directory, key(i))
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(head)
                f.write(payload)
        for obj in objs:
            obj.unref()
    finally:
        pool.close()


async def assert_exact_or_missing(disk: DiskBackend, ids: list[int], like: int = 0) -> list[int]:
    """Each chunk reads back its exact bytes or is a miss; returns the ids that hit."""
    hits = []
    for i in ids:
        (obj,) = await disk.get([key(i)])
        if obj is None:
            continue
        try:
            assert torch.equal(raw(obj), expected(i % 16 if like else i)), f"chunk {i} differs"
        finally:
            obj.unref()
        hits.append(i)
    return hits


async def assert_index_matches_files(disk: DiskBackend, directory: Path) -> None:
    """Every record file is indexed, every indexed key has its file, bytes add up."""
    on_disk = sorted(path.name for path in chunk_files(directory))
    indexed = sorted(ChunkKey(bytes(k)).to_str() + ".chunk" for k in disk._index)
    assert indexed == on_disk
    assert disk.stats().bytes == file_bytes(directory)
    assert sum(u.bytes for u in disk.stats().tenants.values()) == disk.stats().bytes


# --------------------------------------------------------------------------- the manifest


@pytest.mark.anyio
async def test_reopen_after_a_clean_close_reads_no_header(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(40))
            await put(disk, pool, 40, tokens=3)  # a short chunk: another shape
            await check_hits(disk, [0])  # the most recent now
        read = counting_headers(monkeypatch)
        disk = await open_filling(root, pool, cap=1 << 30)
        try:
            assert await disk.wait_index(audited=True)
            stats = disk.index_stats()
            assert (stats.manifest, stats.from_manifest, stats.headers_read) == ("used", 41, 0)
            assert read == []  # the manifest's word, checked against the names and sizes
            assert len(disk) == 41 and disk.stats().corrupt == 0
            assert list(disk._index) == [bytes(key(i)) for i in [*range(1, 41), 0]]  # LRU
            await check_hits(disk, list(range(40)))
            await check_hits(disk, [40], tokens=3)
            await assert_index_matches_files(disk, root)
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_the_lru_order_comes_back_from_the_manifest(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    async with opened(tmp_path / "sizing", pool) as disk:
        await put(disk, pool, 0)
        size = disk.stats().bytes
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2, 3)
        await check_hits(disk, [0, 1])  # 2 is now the oldest, then 3
    async with opened(root, pool, cap=4 * size) as disk:
        assert await put(disk, pool, 4, 5) == 2
        assert key(2) not in disk and key(3) not in disk
        await check_hits(disk, [0, 1, 4, 5])


@pytest.mark.anyio
async def test_files_deleted_behind_its_back_are_dropped(root: Path, pool: MemoryPool) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(10))
        for i in (2, 5):
            record_path(root, key(i)).unlink()
        async with opened(root, pool) as disk:
            stats = disk.index_stats()
            assert (stats.from_manifest, stats.dropped, stats.headers_read) == (8, 2, 0)
            assert await disk.contains_prefix([key(i) for i in range(10)]) == 2
            assert await assert_exact_or_missing(disk, list(range(10))) == [0, 1, 3, 4, 6, 7, 8, 9]
            await assert_index_matches_files(disk, root)


@pytest.mark.anyio
async def test_a_payload_byte_flipped_is_a_miss_at_its_first_read_and_deleted(
    root: Path, pool: MemoryPool
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(4))
        flip_payload(record_path(root, key(1)))  # same name, same size: the manifest's word
        async with opened(root, pool) as disk:
            assert key(1) in disk  # indexed: only a read checks the payload
            with capture_logs() as logs:
                assert await assert_exact_or_missing(disk, list(range(4))) == [0, 2, 3]
            assert disk.stats().corrupt == 1 and key(1) not in disk
            assert not record_path(root, key(1)).exists()
            assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
                "tier_entry_corrupt"
            ]
            await assert_index_matches_files(disk, root)


@pytest.mark.anyio
async def test_a_truncated_file_is_caught_by_the_size_check(root: Path, pool: MemoryPool) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(4))
        truncate(record_path(root, key(3)))
        async with opened(root, pool) as disk:  # waits for the size check
            stats = disk.index_stats()
            assert (stats.dropped, stats.headers_read, disk.stats().corrupt) == (1, 1, 1)
            assert key(3) not in disk and not record_path(root, key(3)).exists()
            assert await assert_exact_or_missing(disk, list(range(4))) == [0, 1, 2]
            await assert_index_matches_files(disk, root)


@pytest.mark.anyio
async def test_a_record_copied_in_from_another_directory_is_found(
    tmp_path: Path, root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    with anyio.fail_after(TIMEOUT):
        async with opened(other, pool) as disk:
            await put(disk, pool, 7)
        async with opened(root, pool) as disk:
            await put(disk, pool, 0, 1)
        copied = record_path(root, key(7))
        copied.parent.mkdir(exist_ok=True)
        shutil.copyfile(record_path(other, key(7)), copied)
        read = counting_headers(monkeypatch)
        async with opened(root, pool) as disk:
            assert read == [copied.name]  # the one file the manifest does not name
            stats = disk.index_stats()
            assert (stats.from_manifest, stats.headers_read) == (2, 1)
            await check_hits(disk, [0, 1, 7])
            await assert_index_matches_files(disk, root)


def manifest_of(directory: Path, layout: KVLayout = LAYOUT) -> Manifest:
    return Manifest(directory, make_spec(layout=layout))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


OTHER_LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "version"])
async def test_a_bad_manifest_is_ignored_with_a_warning_and_every_header_read(
    tmp_path: Path, root: Path, pool: MemoryPool, damage: str
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(6))
        snapshot = manifest_of(root).snapshot_path
        if damage == "corrupt":
            flip_last_byte(snapshot)
        elif damage == "truncated":
            cut_in_half(snapshot)
        elif damage == "foreign":  # another layout's manifest in its place
            async with opened(tmp_path / "other", pool, layout=OTHER_LAYOUT):
                pass
            shutil.copyfile(manifest_of(tmp_path / "other", OTHER_LAYOUT).snapshot_path, snapshot)
        else:
            data = bytearray(snapshot.read_bytes())
            data[8] += 1  # the format version, after the magic number
            snapshot.write_bytes(bytes(data))
        with capture_logs() as logs:
            disk = await open_disk(root, pool)
        try:
            (warning,) = [e for e in logs if e["log_level"] == "warning"]
            assert warning["event"] == "disk_manifest_ignored" and warning["reason"]
            stats = disk.index_stats()
            assert (stats.manifest, stats.from_manifest, stats.headers_read) == ("ignored", 0, 6)
            await check_hits(disk, list(range(6)))
        finally:
            await disk.aclose()
        async with opened(root, pool) as disk:  # the close wrote a good one
            assert disk.index_stats().manifest == "used"


# --------------------------------------------------------------------------- a SIGKILL


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_writer_killed_mid_write_leaves_exact_chunks_or_misses(root: Path) -> None:
    """A tier closed cleanly (a manifest), then a writer appending to its log killed in the
    middle of a write; before the reopen, files are deleted and truncated behind its back.
    Every chunk reads back exactly or misses; what the log named is found without reading
    a header, and nothing it names is believed where the files say otherwise."""
    writer = load_writer()
    pool = MemoryPool(64 << 20, pin_memory=False)

    async def open_writers_tier() -> DiskBackend:
        return await DiskBackend.open(
            root,
            pool=pool,
            spec=writer.make_spec(),
            allocation_timeout=5.0,
            max_local_disk_size=1 << 40,
        )

    shape = writer.LAYOUT.payload_shape(writer.CHUNK_TOKENS)
    first, count = 8, 60
    try:
        with anyio.fail_after(120):
            disk = await open_writers_tier()
            for i in range(first):
                obj = await pool.allocate(shape, writer.LAYOUT.dtype, timeout=5.0)
                obj.tensor.view(torch.uint8).view(-1).copy_(writer.payload_for(i))
                await disk.put([writer.key_for(i)], [obj])
                obj.unref()
            await disk.aclose()  # a clean close: the snapshot
            process = await anyio.open_process(
                [sys.executable, str(HERE / "disk_writer.py"), str(root), str(count), str(first)],
                cwd=REPO_ROOT,
            )
            try:
                assert process.stdout is not None
                output = b""
                while len(written_ids(output)) < 16:
                    output += await process.stdout.receive()
                await anyio.to_thread.run_sync(kill_mid_write, root, process.pid)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                await process.aclose()
            assert process.returncode == -signal.SIGKILL
            reported = written_ids(output)
            deleted, cut = reported[3], reported[5]
            writer_path = record_path(root, writer.key_for(deleted))
            writer_path.unlink()
            truncate(record_path(root, writer.key_for(cut)))

            disk = await open_writers_tier()
            try:
                assert await disk.wait_index(audited=True)
                assert temp_files(root) == []
                stats = disk.index_stats()
                assert stats.manifest == "used"
                # The snapshot's chunks and every chunk the writer reported came from the
                # manifest (its log); at most the file being renamed at the kill was read.
                assert stats.from_manifest >= first + len(reported) - 1
                # Read: the files renamed in the batch the kill cut short (logged after the
                # batch), and the truncated one again.
                assert stats.headers_read <= writer.BATCH + 1 and stats.dropped == 2
                hits: list[int] = []
                for i in range(first + count):
                    (obj,) = await disk.get([writer.key_for(i)])
                    if obj is None:
                        continue
                    assert torch.equal(raw(obj), writer.payload_for(i)), f"chunk {i} differs"
                    obj.unref()
                    hits.append(i)
                expected_hits = [i for i in range(first) if i not in (deleted, cut)]
                expected_hits += [i for i in reported if i not in (deleted, cut)]
                assert set(expected_hits) <= set(hits)
                assert deleted not in hits and cut not in hits
                assert disk.stats().corrupt == 1  # the truncated one, by the size check
            finally:
                await disk.aclose()
    finally:
        assert pool.stats().num_objects == 0
        pool.close()


# --------------------------------------------------------------------------- while filling


@pytest.mark.anyio
async def test_open_returns_before_the_index_is_complete(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20k files: the open returns while the fill is held; a lookup and a get of chunks
    not indexed yet read their files; a put is indexed once; then the index completes."""
    await anyio.to_thread.run_sync(write_records, root, range(20_000))
    with anyio.fail_after(TIMEOUT), gated(monkeypatch, "list_records") as gate:
        disk = await open_filling(root, pool)
        try:
            await gate.reached()
            assert not disk.index_complete and len(disk) == 0
            assert disk.index_stats().manifest == "missing"  # read; the listing is held
            assert await disk.contains_prefix([key(5), key(6), key(20_001)]) == 2
            assert disk.index_stats().looked_up == 3  # two files, and one that is not there
            got = await disk.get([key(7), key(20_002)])
            assert got[1] is None and got[0] is not None
            assert torch.equal(raw(got[0]), expected(7))
            got[0].unref()
            assert await put(disk, pool, 7, 20_003) == 1  # 7 was indexed by the get's look
            assert await put(disk, pool, 11) == 1  # on disk, not indexed yet: written again
            gate.release.set()
            assert await disk.wait_index(audited=True)
            assert len(disk) == 20_001
            await assert_index_matches_files(disk, root)
            await check_hits(disk, [20_003])
            assert await assert_exact_or_missing(disk, [11, 12], like=1) == [11, 12]
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_evictions_while_filling_are_not_undone_and_the_capacity_holds_once_complete(
    tmp_path: Path, root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No manifest: the fill reads headers a batch at a time. Held after its first batch,
    puts past the capacity evict what is indexed so far; the fill does not bring them
    back; once complete, the oldest files beyond the capacity go; the bytes add up."""
    async with opened(tmp_path / "sizing", pool) as disk:
        await put(disk, pool, 0)
        size = disk.stats().bytes
    await anyio.to_thread.run_sync(write_records, root, range(600))
    with anyio.fail_after(TIMEOUT), gated(monkeypatch, "read_entries", after=1) as gate:
        disk = await open_filling(root, pool, cap=400 * size)
        try:
            await gate.reached()  # the first 256 files (the oldest) are indexed
            assert len(disk) == 256
            first_batch = list(disk._index)
            assert await put(disk, pool, *range(1000, 1010)) == 10  # fits: nothing evicted
            for start in range(1010, 1400, 30):  # evicts the oldest: the fill's batch
                assert await put(disk, pool, *range(start, min(start + 30, 1400))) > 0
            evicted = [k for k in first_batch if k not in disk]
            assert len(evicted) == disk.stats().evictions == 256
            assert not any(record_path(root, k).exists() for k in evicted)
            assert disk.stats().bytes == 400 * size
            gate.release.set()
            assert await disk.wait_index(audited=True)
            assert all(k not in disk for k in evicted)
            assert disk.stats().bytes <= 400 * size
            # What the fill found was older than the puts: it went first.
            for start in range(1000, 1400, 30):
                await check_hits(disk, list(range(start, min(start + 30, 1400))))
            await assert_index_matches_files(disk, root)
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_remove_erase_and_clear_while_filling_are_final(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = bytes([9]) * TAG_BYTES
    tagged = [ChunkKey(tag + i.to_bytes(DIGEST_SIZE - TAG_BYTES, "little")) for i in range(3)]
    async with opened(root, pool) as disk:
        await put(disk, pool, *range(20))
        objs = [make_obj(pool, i) for i in range(3)]
        assert await disk.put(tagged, objs) == 3
        for obj in objs:
            obj.unref()
    with anyio.fail_after(TIMEOUT), gated(monkeypatch, "list_records") as gate:
        disk = await open_filling(root, pool)
        try:
            await gate.reached()
            assert await disk.remove([key(3), key(4)]) == 0  # not indexed yet: files deleted
            assert not record_path(root, key(3)).exists()
            assert await disk.erase_tenant(tag) == 3
            clearing = anyio.Event()
            cleared: list[int] = []

            async def clear() -> None:
                clearing.set()
                cleared.append(await disk.clear())

            async with anyio.create_task_group() as tg:
                tg.start_soon(clear)
                await clearing.wait()
                await anyio.wait_all_tasks_blocked()
                assert cleared == []  # waits for the index to be complete
                gate.release.set()
            assert cleared == [18]
            assert len(disk) == 0 and chunk_files(root) == []
        finally:
            await disk.aclose()
    async with opened(root, pool) as disk:
        assert len(disk) == 0


# --------------------------------------------------------------------------- the engine


@pytest.mark.anyio
async def test_a_ram_hit_is_answered_while_the_disk_index_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_engine_tiers import engine_on, retrieve, store, tokens_of

    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64, seed=1)  # on disk for the next engine
        with gated(monkeypatch, "list_records") as gate:
            async with engine_on(tmp_path) as engine:
                disk = engine._parts.manager.tier("disk")
                assert isinstance(disk, DiskBackend)
                await gate.reached()
                await store(engine, 64, seed=2)  # in RAM (and written to disk meanwhile)
                assert await engine.lookup(tokens_of(64, 2)) == 64
                assert await engine.lookup(tokens_of(64, 1)) == 64  # its files read directly
                assert disk.index_stats().looked_up == 4 and not disk.index_complete
                await retrieve(engine, 64, 64, seed=2)
                gate.release.set()
                assert await disk.wait_index()
                await retrieve(engine, 64, 64, seed=1)


@pytest.mark.anyio
async def test_a_get_naming_a_chunk_twice_while_filling_counts_it_once(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The get reads the file of a chunk not indexed yet twice (once per request slot):
    the index holds it once and its bytes once, and the fill then finds what remains."""
    await anyio.to_thread.run_sync(write_records, root, range(8))
    with anyio.fail_after(TIMEOUT), gated(monkeypatch, "list_records") as gate:
        disk = await open_filling(root, pool)
        try:
            await gate.reached()
            got = await disk.get([key(3), key(3)])
            try:
                assert all(obj is not None and torch.equal(raw(obj), expected(3)) for obj in got)
            finally:
                for obj in got:
                    if obj is not None:
                        obj.unref()
            assert len(disk) == 1 and disk.stats().bytes == file_bytes(root) // 8
            gate.release.set()
            assert await disk.wait_index(audited=True)
            assert len(disk) == 8
            await assert_index_matches_files(disk, root)
        finally:
            await disk.aclose()
