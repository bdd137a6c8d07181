"""The disk tier: bit-exact round trips, restarts, LRU capacity, corruption, faults, crashes."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
from structlog.testing import capture_logs

from lmcache_async.backends import disk_file
from lmcache_async.backends.codec import Codec
from lmcache_async.backends.disk import CHUNK_SUFFIX, TEMP_PREFIX, DiskBackend
from lmcache_async.backends.record import PREFIX_SIZE, RecordHeader, RecordSpec
from lmcache_async.errors import (
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    TierError,
)
from lmcache_async.keys.chunks import DIGEST_SIZE, LINK_SIZE, ChunkKey
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, tag_hex, tenant_tag

CHUNK = 16
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)
FULL_BYTES = math.prod(LAYOUT.payload_shape(CHUNK)) * 2  # 2048
PAGE = 2048
HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent


def make_spec(codec: Codec = Codec.NONE, layout: KVLayout = LAYOUT) -> RecordSpec:
    return RecordSpec(
        fingerprint=layout.fingerprint,
        fmt=str(layout.fmt),
        dtype=layout.dtype,
        max_tokens=CHUNK,
        shape_of=layout.payload_shape,
        codec=codec,
    )


def key(i: int, layer: int | None = None) -> ChunkKey:
    return ChunkKey(i.to_bytes(DIGEST_SIZE, "little"), layer)


def expected(i: int, tokens: int = CHUNK) -> torch.Tensor:
    """Payload bytes of chunk ``i`` (uint8), random (NaN bit patterns included)."""
    nbytes = math.prod(LAYOUT.payload_shape(tokens)) * 2
    generator = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def raw(obj: MemoryObj) -> torch.Tensor:
    return obj.tensor.reshape(-1).view(torch.uint8)


def make_obj(pool: MemoryPool, i: int, tokens: int = CHUNK) -> MemoryObj:
    obj = pool.allocate_nowait(LAYOUT.payload_shape(tokens), LAYOUT.dtype)
    assert obj is not None
    raw(obj).copy_(expected(i, tokens))
    return obj


async def put(disk: DiskBackend, pool: MemoryPool, *ids: int, tokens: int = CHUNK) -> int:
    objs = [make_obj(pool, i, tokens) for i in ids]
    try:
        return await disk.put([key(i) for i in ids], objs)
    finally:
        for obj in objs:
            obj.unref()


async def check_hits(disk: DiskBackend, ids: list[int], tokens: int = CHUNK) -> None:
    """Every id is served with exactly its bytes."""
    got = await disk.get([key(i) for i in ids])
    try:
        for i, obj in zip(ids, got, strict=True):
            assert obj is not None, f"chunk {i} missing"
            assert obj.shape == LAYOUT.payload_shape(tokens)
            assert obj.ref_count == 1
            assert torch.equal(raw(obj), expected(i, tokens))
    finally:
        for obj in got:
            if obj is not None:
                obj.unref()


def subdirs(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_dir()]


def chunk_files(directory: Path) -> list[Path]:
    """Record files (named after a key) under ``directory``."""
    return sorted(
        p for p in directory.glob(f"??/*{CHUNK_SUFFIX}") if len(p.name.split(".")[0]) >= 32
    )


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{TEMP_PREFIX}*")) + sorted(directory.glob(f"??/{TEMP_PREFIX}*"))


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    pool = MemoryPool(64 * PAGE, page_size=PAGE, pin_memory=False)
    yield pool
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


async def open_disk(
    directory: Path,
    pool: MemoryPool,
    *,
    cap: int = 1 << 30,
    codec: Codec = Codec.NONE,
    timeout: float = 1.0,
    layout: KVLayout = LAYOUT,
    fsync: bool = False,
) -> DiskBackend:
    """An open tier whose index is complete (its fill is tested in test_disk_restart.py)."""
    disk = await DiskBackend.open(
        directory,
        pool=pool,
        spec=make_spec(codec, layout),
        allocation_timeout=timeout,
        max_local_disk_size=cap,
        fsync=fsync,
    )
    with anyio.fail_after(30):
        await disk.wait_index(audited=True)
    return disk


@contextlib.asynccontextmanager
async def opened(directory: Path, pool: MemoryPool, **kwargs: object) -> AsyncIterator[DiskBackend]:
    disk = await open_disk(directory, pool, **kwargs)  # type: ignore[arg-type]
    try:
        yield disk
    finally:
        await disk.aclose()


async def record_size(tmp_path: Path, pool: MemoryPool, tokens: int = CHUNK) -> int:
    async with opened(tmp_path / "sizing", pool) as disk:
        await put(disk, pool, 0, tokens=tokens)
        return disk.stats().bytes


# --------------------------------------------------------------------------- round trips


@pytest.mark.anyio
@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD, Codec.LZ4])
@pytest.mark.parametrize("fsync", [False, True])
async def test_round_trip_is_bit_exact(
    root: Path, pool: MemoryPool, codec: Codec, fsync: bool
) -> None:
    with anyio.fail_after(30):
        disk = await open_disk(root, pool, codec=codec, fsync=fsync)
        assert await put(disk, pool, 1, 2, 3) == 3
        assert await put(disk, pool, 4, tokens=5) == 1  # a short last chunk
        await check_hits(disk, [1, 2, 3])
        await check_hits(disk, [4], tokens=5)
        assert [p.name for p in chunk_files(root)] == sorted(
            f"{key(i).to_str()}{CHUNK_SUFFIX}" for i in (1, 2, 3, 4)
        )
        assert all(p.parent.name == p.name[:2] for p in chunk_files(root))
        assert temp_files(root) == []
        stats = disk.stats()
        assert (stats.name, stats.chunks, stats.puts, stats.hits, stats.misses) == (
            "disk",
            4,
            4,
            4,
            0,
        )
        assert stats.bytes == sum(p.stat().st_size for p in chunk_files(root))
        assert stats.healthy
        await disk.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_get_misses_and_prefix_use_the_index(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 3)
        assert await disk.contains_prefix([key(0), key(1), key(2), key(3)]) == 2
        assert await disk.contains_prefix([key(5)]) == 0
        assert await disk.contains_prefix([]) == 0
        got = await disk.get([key(2), key(3), key(9)])
        assert got[0] is None and got[2] is None
        assert got[1] is not None and torch.equal(raw(got[1]), expected(3))
        got[1].unref()
        assert (disk.stats().hits, disk.stats().misses) == (1, 2)
        assert await disk.get([]) == []


@pytest.mark.anyio
async def test_get_prefix_reads_only_the_leading_run(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix read asks the index where the run ends and reads no file past it; a file
    found corrupt ends the run there."""
    read: list[bytes] = []
    read_batch = disk_file._read_batch

    def counting(spec: RecordSpec, reads: list[tuple[Path, bytes, torch.Tensor]]) -> object:
        read.extend(k for _, k, _ in reads)
        return read_batch(spec, reads)

    monkeypatch.setattr(disk_file, "_read_batch", counting)
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2, 4, 5)
        got = await disk.get_prefix([key(i) for i in range(6)])
        try:
            assert [torch.equal(raw(obj), expected(i)) for i, obj in enumerate(got)] == [True] * 3
            assert all(obj.ref_count == 1 for obj in got)
        finally:
            for obj in got:
                obj.unref()
        assert read == [key(0), key(1), key(2)], "nothing past the gap at 3 is read"
        assert (disk.stats().hits, disk.stats().misses) == (3, 1)
        flip_payload(disk.path_of(key(1)))
        got = await disk.get_prefix([key(i) for i in range(3)])
        assert [torch.equal(raw(obj), expected(0)) for obj in got] == [True]
        got[0].unref()
        assert disk.stats().corrupt == 1
        assert await disk.get_prefix([key(9), key(0)]) == []
        assert await disk.get_prefix([]) == []
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_existing_keys_are_kept_not_rewritten(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        assert await put(disk, pool, 1) == 1
        path = disk.path_of(key(1))
        inode = path.stat().st_ino
        other = make_obj(pool, 99)
        try:
            # Same key, other bytes: the stored record stays as it is.
            assert await disk.put([key(1), key(2), key(2)], [other, other, other]) == 1
        finally:
            other.unref()
        assert path.stat().st_ino == inode
        await check_hits(disk, [1])
        assert disk.stats().puts == 2


@pytest.mark.anyio
async def test_layer_keys_round_trip(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        obj = make_obj(pool, 7)
        try:
            assert await disk.put([key(7, layer=3)], [obj]) == 1
        finally:
            obj.unref()
        assert disk.path_of(key(7, layer=3)).name.endswith(f"@L3{CHUNK_SUFFIX}")
        got = await disk.get([key(7, layer=3), key(7)])
        assert got[1] is None and got[0] is not None
        assert torch.equal(raw(got[0]), expected(7))
        got[0].unref()


@pytest.mark.anyio
async def test_put_takes_references_only_while_writing(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        obj = make_obj(pool, 1)
        assert await disk.put([key(1)], [obj]) == 1
        assert obj.ref_count == 1
        obj.unref()
    assert pool.stats().num_objects == 0


# --------------------------------------------------------------------------- restart


@pytest.mark.anyio
@pytest.mark.parametrize("reader_codec", [Codec.NONE, Codec.ZSTD])
async def test_restart_serves_what_an_earlier_backend_stored(
    root: Path, pool: MemoryPool, reader_codec: Codec
) -> None:
    with anyio.fail_after(30):
        async with opened(root, pool, codec=Codec.LZ4) as disk:
            await put(disk, pool, *range(6))
            await put(disk, pool, 6, tokens=3)
        # Each record names its codec, so a reader configured otherwise still decodes it.
        async with opened(root, pool, codec=reader_codec) as disk:
            stats = disk.stats()
            assert (stats.chunks, stats.corrupt, stats.evictions) == (7, 0, 0)
            assert stats.bytes == sum(p.stat().st_size for p in chunk_files(root))
            assert await disk.contains_prefix([key(i) for i in range(8)]) == 7
            await check_hits(disk, list(range(6)))
            await check_hits(disk, [6], tokens=3)


@pytest.mark.anyio
async def test_lru_order_survives_a_restart(tmp_path: Path, root: Path, pool: MemoryPool) -> None:
    size = await record_size(tmp_path, pool)
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2)
    now = time.time()
    for age, i in ((300, 0), (200, 1), (100, 2)):
        os.utime(root / key(i).to_str()[:2] / f"{key(i).to_str()}{CHUNK_SUFFIX}", (now, now - age))
    async with opened(root, pool) as disk:
        await check_hits(disk, [0])  # a hit refreshes the file's mtime
    async with opened(root, pool, cap=3 * size) as disk:
        assert await put(disk, pool, 3) == 1
        assert disk.stats().evictions == 1
        assert key(1) not in disk and not disk.path_of(key(1)).exists()
        await check_hits(disk, [0, 2, 3])


# --------------------------------------------------------------------------- capacity


@pytest.mark.anyio
async def test_capacity_evicts_least_recently_used(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    size = await record_size(tmp_path, pool)
    async with opened(root, pool, cap=3 * size) as disk:
        assert disk.capacity_bytes == 3 * size
        assert await put(disk, pool, 0, 1, 2) == 3
        await check_hits(disk, [0])  # 1 is now the oldest
        assert await put(disk, pool, 3) == 1
        stats = disk.stats()
        assert (stats.chunks, stats.bytes, stats.evictions) == (3, 3 * size, 1)
        assert not disk.path_of(key(1)).exists()
        assert len(chunk_files(root)) == 3
        await check_hits(disk, [0, 2, 3])
        # A batch larger than the capacity keeps what fits, evicting everything older.
        assert await put(disk, pool, 10, 11, 12, 13) == 3
        assert sorted(p.name[:2] for p in chunk_files(root)) == ["0a", "0b", "0c"]
        assert disk.stats().evictions == 4


@pytest.mark.anyio
async def test_chunk_larger_than_the_capacity_is_refused(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    size = await record_size(tmp_path, pool)
    async with opened(root, pool, cap=size - 1) as disk:
        assert await put(disk, pool, 1, tokens=4) == 1  # a short chunk fits
        with capture_logs() as logs:
            assert await put(disk, pool, 0) == 0
        assert key(1) in disk  # nothing was evicted for a chunk that cannot fit
        assert chunk_files(root) == [disk.path_of(key(1))] and temp_files(root) == []
        assert (disk.stats().chunks, disk.stats().puts, disk.stats().evictions) == (1, 1, 0)
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "disk_tier_chunks_refused"
        ]


@pytest.mark.anyio
async def test_open_with_a_smaller_capacity_evicts_the_oldest(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    size = await record_size(tmp_path, pool)
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2, 3)
    now = time.time()
    for i in range(4):
        path = root / key(i).to_str()[:2] / f"{key(i).to_str()}{CHUNK_SUFFIX}"
        os.utime(path, (now, now - 100 + i))
    async with opened(root, pool, cap=2 * size) as disk:
        assert (disk.stats().chunks, disk.stats().evictions) == (2, 2)
        assert len(chunk_files(root)) == 2
        await check_hits(disk, [2, 3])


# --------------------------------------------------------------------------- corruption


def forget_manifest(directory: Path) -> None:
    """Delete the manifest the last close wrote: the next open reads every header."""
    for path in directory.glob("manifest-*"):
        path.unlink()


def flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x20
    path.write_bytes(bytes(data))


def flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[PREFIX_SIZE + 3] ^= 0x01
    path.write_bytes(bytes(data))


def flip_magic(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def append_garbage(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 16)


def other_key_record(path: Path) -> None:
    other = path.parent.parent / key(1).to_str()[:2] / f"{key(1).to_str()}{CHUNK_SUFFIX}"
    shutil.copyfile(other, path)


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "payload_byte": flip_payload,
    "header_byte": flip_header,
    "magic": flip_magic,
    "truncated": truncate,
    "trailing_bytes": append_garbage,
    "other_key": other_key_record,
}


@pytest.mark.anyio
async def test_a_get_split_over_threads_keeps_each_outcome_in_place(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large gets read in several worker threads; hits, corrupt files and missing files
    land at their own positions, whichever thread read them."""
    batches: list[int] = []
    read_batch = disk_file._read_batch

    def counting(spec: RecordSpec, reads: list[tuple[Path, bytes, torch.Tensor]]) -> object:
        batches.append(len(reads))
        return read_batch(spec, reads)

    monkeypatch.setattr(disk_file, "_read_batch", counting)
    monkeypatch.setattr(disk_file, "_SPLIT_READ_BYTES", FULL_BYTES)
    ids = list(range(9))
    async with opened(root, pool) as disk:
        await put(disk, pool, *ids)
        flip_payload(disk.path_of(key(4)))
        disk.path_of(key(7)).unlink()
        got = await disk.get([key(i) for i in ids])
        try:
            assert [i for i, obj in enumerate(got) if obj is None] == [4, 7]
            for i, obj in enumerate(got):
                if obj is not None:
                    assert torch.equal(raw(obj), expected(i)), f"chunk {i} differs"
        finally:
            for obj in got:
                if obj is not None:
                    obj.unref()
        assert sorted(batches) == [4, 5]  # two threads, reads interleaved between them
        stats = disk.stats()
        assert (stats.corrupt, stats.hits, stats.misses) == (1, 7, 2)
        batches.clear()
        await check_hits(disk, [0])  # a single read stays in one thread
        assert batches == [1]


@pytest.mark.anyio
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD])
async def test_corrupt_entry_is_a_miss_and_is_deleted(
    root: Path, pool: MemoryPool, corruption: str, codec: Codec
) -> None:
    async with opened(root, pool, codec=codec) as disk:
        await put(disk, pool, 0, 1)
        path = disk.path_of(key(0))
        CORRUPTIONS[corruption](path)
        with capture_logs() as logs:
            got = await disk.get([key(0), key(1)])
        assert got[0] is None
        assert got[1] is not None and torch.equal(raw(got[1]), expected(1))
        got[1].unref()
        assert not path.exists()
        stats = disk.stats()
        assert (stats.corrupt, stats.chunks, stats.hits, stats.misses) == (1, 1, 1, 1)
        warnings = [e for e in logs if e["event"] == "tier_entry_corrupt"]
        assert len(warnings) == 1
        assert warnings[0]["log_level"] == "warning"
        assert (warnings[0]["tier"], warnings[0]["key"]) == ("disk", key(0).to_str())
        assert warnings[0]["reason"]
        # The key can be stored again.
        assert await put(disk, pool, 0) == 1
        await check_hits(disk, [0, 1])


@pytest.mark.anyio
async def test_open_cleans_leftovers_and_bad_files_but_keeps_other_layouts(
    root: Path, pool: MemoryPool
) -> None:
    """Without a manifest every header is read at open (with one, a file whose name and
    size it lists is checked at its first read: test_disk_restart.py)."""
    other_layout = KVLayout.vllm_flash_attn(
        num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2, 3, 4)
    async with opened(root, pool, layout=other_layout) as other:
        # Another model shares the directory; its record has the other layout's shape.
        foreign = pool.allocate_nowait(other_layout.payload_shape(CHUNK), torch.bfloat16)
        assert foreign is not None
        foreign.tensor.fill_(1.5)
        assert await other.put([key(50)], [foreign]) == 1
        foreign.unref()
    paths = {i: root / key(i).to_str()[:2] / f"{key(i).to_str()}{CHUNK_SUFFIX}" for i in range(5)}
    truncate(paths[0])
    flip_header(paths[1])
    other_key_record(paths[2])  # the file of key 2 holds key 1's record
    flip_payload(paths[3])  # not caught at open (payloads are not read) but at get
    dead = root / "00" / f"{TEMP_PREFIX}999999999-0-x{CHUNK_SUFFIX}"
    dead.write_bytes(b"half a record")
    old = root / f"{TEMP_PREFIX}{os.getpid()}-1-probe"  # a live pid, but long ago
    old.write_bytes(b"")
    os.utime(old, (1, 1))
    fresh = root / "01" / f"{TEMP_PREFIX}{os.getpid()}-2-y{CHUNK_SUFFIX}"  # being written
    fresh.parent.mkdir(exist_ok=True)
    fresh.write_bytes(b"")
    stray = root / "ab" / f"not-a-key{CHUNK_SUFFIX}"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"x")
    forget_manifest(root)
    with capture_logs() as logs:
        disk = await open_disk(root, pool)
    try:
        stats = disk.stats()
        assert (stats.chunks, stats.corrupt) == (2, 3)
        assert not paths[0].exists() and not paths[1].exists() and not paths[2].exists()
        assert not dead.exists() and not old.exists()
        assert fresh.exists() and stray.exists()
        assert disk.path_of(key(50)).exists() and key(50) not in disk
        corrupt = [e for e in logs if e["event"] == "tier_entry_corrupt"]
        assert len(corrupt) == 3
        opened_log = next(e for e in logs if e["event"] == "disk_index_complete")
        assert (opened_log["removed_temps"], opened_log["other_layouts"]) == (2, 1)
        got = await disk.get([key(3), key(4)])
        assert got[0] is None and got[1] is not None
        got[1].unref()
        assert disk.stats().corrupt == 4 and not paths[3].exists()
        # clear() deletes this layout's files only.
        assert await disk.clear() == 1
        assert chunk_files(root) == [disk.path_of(key(50))]
    finally:
        await disk.aclose()
        fresh.unlink()


# --------------------------------------------------------------------------- faults


@pytest.mark.anyio
async def test_write_failure_fails_that_put_cleanly(
    root: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with opened(root, pool) as disk:
        real = disk_file._write_all
        calls = 0

        def disk_full(fd: int, data: bytes | memoryview) -> None:
            nonlocal calls
            calls += 1
            if calls == 4:  # the second record's payload: half written, then ENOSPC
                real(fd, memoryview(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, data)

        monkeypatch.setattr(disk_file, "_write_all", disk_full)
        with capture_logs() as logs, pytest.raises(TierError, match="No space left"):
            await put(disk, pool, 0, 1, 2)
        monkeypatch.setattr(disk_file, "_write_all", real)
        assert temp_files(root) == []
        stats = disk.stats()
        assert (stats.errors, stats.puts, stats.chunks) == (1, 1, 1)
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "disk_tier_write_failed"
        ]
        # Nothing else broke: what was written is served, and later puts work.
        await check_hits(disk, [0])
        assert await put(disk, pool, 1, 2) == 2
        await check_hits(disk, [0, 1, 2])


def skip_unless_permissions_apply(tmp_path: Path) -> None:
    """Skip when mode bits do not stop this process (root, or CAP_DAC_OVERRIDE)."""
    probe = tmp_path / "permission-probe"
    probe.mkdir(mode=0o500)
    try:
        (probe / "x").write_bytes(b"")
    except PermissionError:
        return
    finally:
        probe.chmod(0o700)
    pytest.skip("permissions do not stop this user (root)")


@pytest.mark.anyio
async def test_read_only_directory_fails_puts_not_gets(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    skip_unless_permissions_apply(tmp_path)
    async with opened(root, pool) as disk:
        await put(disk, pool, 0)
        dirs = [root, *subdirs(root)]
        for d in dirs:
            d.chmod(0o500)
        try:
            with pytest.raises(TierError):
                await put(disk, pool, 1)
            with pytest.raises(TierError):
                await put(disk, pool, 0x1234)  # its fan-out directory cannot be created
            assert disk.stats().errors == 2
            await check_hits(disk, [0])
            assert await disk.check_health() is False
            assert disk.healthy() is False
        finally:
            for d in dirs:
                d.chmod(0o700)
        assert await disk.check_health() is True
        assert await put(disk, pool, 1) == 1


@pytest.mark.anyio
async def test_check_health_probes_the_directory(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        await put(disk, pool, 0)
        assert disk.healthy() and await disk.check_health()
        shutil.rmtree(root)
        with capture_logs() as logs:
            assert await disk.check_health() is False
        assert not disk.healthy() and not disk.stats().healthy
        assert [e["event"] for e in logs] == ["disk_tier_unhealthy"]
        # The vanished file is a miss; its entry is dropped, nothing counted as corrupt.
        assert await disk.get([key(0)]) == [None]
        assert (disk.stats().chunks, disk.stats().corrupt) == (0, 0)
        os.mkdir(root)
        assert await disk.check_health() is True
        assert await put(disk, pool, 0) == 1
        await check_hits(disk, [0])


@pytest.mark.anyio
async def test_allocation_timeout_misses_the_rest_and_leaks_nothing(root: Path) -> None:
    pool = MemoryPool(2 * PAGE, page_size=PAGE, pin_memory=False)
    async with opened(root, pool, timeout=0.05) as disk:
        for i in range(3):
            await put(disk, pool, i)
        blocker = make_obj(pool, 9)  # one page left
        with anyio.fail_after(5), capture_logs() as logs:
            got = await disk.get([key(0), key(1), key(2)])
        assert got[1] is None and got[2] is None
        assert got[0] is not None and torch.equal(raw(got[0]), expected(0))
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "disk_tier_allocation_timeout"
        ]
        assert disk.stats().misses == 2 and disk.stats().chunks == 3
        got[0].unref()
        blocker.unref()
    assert pool.stats().num_objects == 0
    pool.close()


@pytest.mark.anyio
async def test_cancelled_get_leaks_nothing(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await disk.get([key(0), key(1), key(2)])
        assert pool.stats().num_objects == 0
        await check_hits(disk, [0, 1, 2])


@pytest.mark.anyio
async def test_concurrent_puts_gets_and_evictions_serve_exact_bytes(
    tmp_path: Path, root: Path, pool: MemoryPool
) -> None:
    size = await record_size(tmp_path, pool)
    served = 0
    writers_done = anyio.Event()
    async with opened(root, pool, cap=4 * size) as disk:

        async def writers() -> None:
            async with anyio.create_task_group() as tg:
                for offset in range(3):
                    tg.start_soon(writer, offset)
            writers_done.set()

        async def writer(offset: int) -> None:
            for i in range(offset, 60, 3):
                await put(disk, pool, i % 12, (i + 5) % 12)

        async def reader() -> None:
            nonlocal served
            i = 0
            while not writers_done.is_set():
                i += 1
                await anyio.lowlevel.checkpoint()
                got = await disk.get([key((i + j) % 12) for j in range(3)])
                for j, obj in enumerate(got):
                    if obj is not None:
                        assert torch.equal(raw(obj), expected((i + j) % 12))
                        served += 1
                        obj.unref()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writers)
                tg.start_soon(reader)
                tg.start_soon(reader)
        stats = disk.stats()
        assert stats.chunks <= 4 and stats.bytes <= 4 * size
        assert stats.corrupt == 0 and stats.errors == 0
        assert len(chunk_files(root)) == stats.chunks
    assert served > 0


@pytest.mark.anyio
async def test_remove_and_clear(root: Path, pool: MemoryPool) -> None:
    async with opened(root, pool) as disk:
        await put(disk, pool, 0, 1, 2, 3)
        assert await disk.remove([key(1), key(1), key(9)]) == 1
        assert not disk.path_of(key(1)).exists()
        assert await disk.contains_prefix([key(0), key(1)]) == 1
        assert await disk.clear() == 3
        assert chunk_files(root) == []
        assert (disk.stats().chunks, disk.stats().bytes) == (0, 0)
        assert await disk.get([key(0)]) == [None]


@pytest.mark.anyio
async def test_erase_tenant_finds_its_files_by_name_only(root: Path, pool: MemoryPool) -> None:
    """Erasure reaches a tenant's layer keys and its files of another layout, and spares
    a neighbour whose keys share the fan-out directory (the same first byte)."""
    tag = tenant_tag("a")
    neighbour = tag[:1] + bytes(b ^ 0xFF for b in tag[1:])
    keys = [ChunkKey(tag + os.urandom(LINK_SIZE)), ChunkKey(tag + os.urandom(LINK_SIZE), layer=3)]
    kept = [ChunkKey(neighbour + os.urandom(LINK_SIZE)), ChunkKey(os.urandom(DIGEST_SIZE))]
    other_layout = KVLayout.vllm_flash_attn(
        num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    async with opened(root, pool, layout=other_layout) as other:
        foreign = pool.allocate_nowait(other_layout.payload_shape(CHUNK), torch.bfloat16)
        assert foreign is not None
        foreign.tensor.fill_(1.5)
        assert await other.put([ChunkKey(tag + os.urandom(LINK_SIZE))], [foreign]) == 1
        foreign.unref()
    async with opened(root, pool) as disk:
        objs = [make_obj(pool, i) for i in range(4)]
        try:
            assert await disk.put(keys + kept, objs) == 4
        finally:
            for obj in objs:
                obj.unref()
        with pytest.raises(InvalidInputError, match="tenant tag"):
            await disk.erase_tenant(tag[:3])
        assert await disk.erase_tenant(tag) == 3
        assert [p.name.startswith(tag.hex()) for p in chunk_files(root)] == [False, False]
        got = await disk.get(kept)
        try:
            assert [
                item is not None and torch.equal(raw(item), expected(i))
                for i, item in zip((2, 3), got, strict=True)
            ] == [True, True]
        finally:
            for item in got:
                if item is not None:
                    item.unref()
        usage = disk.stats().tenants[tag_hex(tag)]
        assert (usage.chunks, usage.bytes, usage.erased) == (0, 0, 3)
        assert disk.stats().chunks == 2
    with pytest.raises(EngineClosedError):
        await disk.erase_tenant(tag)


@pytest.mark.anyio
async def test_closed_tier_refuses_work(root: Path, pool: MemoryPool) -> None:
    disk = await open_disk(root, pool)
    await put(disk, pool, 0)
    await disk.aclose()
    await disk.aclose()
    assert not disk.healthy() and await disk.check_health() is False
    with pytest.raises(EngineClosedError):
        await disk.get([key(0)])
    with pytest.raises(EngineClosedError):
        await put(disk, pool, 1)
    with pytest.raises(EngineClosedError):
        await disk.clear()
    assert disk.path_of(key(0)).exists()  # closing keeps the files


# --------------------------------------------------------------------------- bad input


@pytest.mark.anyio
@pytest.mark.parametrize("cap", [-1, 0, True, 1.5, "10"])
async def test_bad_capacity_is_a_config_error(root: Path, pool: MemoryPool, cap: object) -> None:
    with pytest.raises(ConfigError) as info:
        await DiskBackend.open(
            root,
            pool=pool,
            spec=make_spec(),
            allocation_timeout=1.0,
            max_local_disk_size=cap,  # type: ignore[arg-type]
        )
    assert info.value.field == "max_local_disk_size"
    assert root.name not in os.listdir(root.parent)  # refused before touching the disk


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["under_a_file", "not_a_path", "empty", "a_file"])
async def test_unusable_directory_is_a_config_error(
    tmp_path: Path, pool: MemoryPool, where: str
) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    local_disk: object = {
        "under_a_file": regular / "cache",
        "not_a_path": 42,
        "empty": "",
        "a_file": regular,
    }[where]
    with pytest.raises(ConfigError) as info:
        await DiskBackend.open(
            local_disk,  # type: ignore[arg-type]
            pool=pool,
            spec=make_spec(),
            allocation_timeout=1.0,
            max_local_disk_size=1 << 20,
        )
    assert info.value.field == "local_disk"


@pytest.mark.anyio
async def test_unwritable_directory_is_a_config_error(tmp_path: Path, pool: MemoryPool) -> None:
    skip_unless_permissions_apply(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError) as info:
            await open_disk(locked, pool)
        assert info.value.field == "local_disk"
    finally:
        locked.chmod(0o700)


@pytest.mark.anyio
async def test_bad_arguments(root: Path, pool: MemoryPool) -> None:
    with pytest.raises(InvalidInputError, match="allocation_timeout"):
        await open_disk(root, pool, timeout=-1.0)
    async with opened(root, pool) as disk:
        obj = make_obj(pool, 0)
        try:
            with pytest.raises(InvalidInputError):
                await disk.put([key(0), key(1)], [obj])
        finally:
            obj.unref()
        wrong = pool.allocate_nowait((4, 4), torch.float32)
        assert wrong is not None
        try:
            with pytest.raises(InvalidInputError, match="dtype"):
                await disk.put([key(0)], [wrong])
            assert wrong.ref_count == 1
        finally:
            wrong.unref()
        assert disk.stats().puts == 0


# --------------------------------------------------------------------------- crash safety


def load_writer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("disk_writer", HERE / "disk_writer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_mid_write(root: Path, pid: int) -> None:
    """SIGKILL ``pid`` as soon as a temporary file shows up under ``root`` (a record is
    being written), or after 10 s."""
    deadline = time.monotonic() + 10.0
    while not temp_files(root) and time.monotonic() < deadline:
        time.sleep(0.0002)
    os.kill(pid, signal.SIGKILL)


def written_ids(output: bytes) -> list[int]:
    """The chunk numbers the writer reported as stored (its log lines are skipped)."""
    return [int(line) for line in output.split(b"\n")[:-1] if line.strip().isdigit()]


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_sigkilled_writer_leaves_nothing_servable_with_wrong_bytes(root: Path) -> None:
    writer = load_writer()
    count = 150
    with anyio.fail_after(120):
        process = await anyio.open_process(
            [sys.executable, str(HERE / "disk_writer.py"), str(root), str(count)],
            cwd=REPO_ROOT,
        )
        try:
            assert process.stdout is not None
            output = b""
            while len(written_ids(output)) < 20:
                output += await process.stdout.receive()
            await anyio.to_thread.run_sync(kill_mid_write, root, process.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            await process.aclose()
        assert process.returncode == -signal.SIGKILL
        reported = len(written_ids(output))
        left_by_kill = len(temp_files(root))
        # A leftover from the dead writer, whether or not the kill left one itself.
        (root / "00").mkdir(exist_ok=True)
        (root / "00" / f"{TEMP_PREFIX}{process.pid}-0-z{CHUNK_SUFFIX}").write_bytes(b"LMCA")
        torn = writer.key_for(count).to_str()
        (root / torn[:2]).mkdir(exist_ok=True)
        (root / torn[:2] / f"{torn}{CHUNK_SUFFIX}").write_bytes(b"LMCA" + b"\0" * 40)

        pool = MemoryPool(64 << 20, pin_memory=False)
        with capture_logs() as logs:
            disk = await DiskBackend.open(
                root,
                pool=pool,
                spec=writer.make_spec(),
                allocation_timeout=5.0,
                max_local_disk_size=1 << 40,
            )
            assert await disk.wait_index()
        try:
            assert temp_files(root) == []
            assert disk.stats().corrupt == 1
            log_line = next(e for e in logs if e["event"] == "disk_index_complete")
            assert log_line["removed_temps"] == 1 + left_by_kill
            held = [i for i in range(count) if writer.key_for(i) in disk]
            assert held == list(range(len(held)))  # a prefix, with no gap
            assert len(held) >= reported
            for start in range(0, len(held), 8):
                ids = held[start : start + 8]
                got = await disk.get([writer.key_for(i) for i in ids])
                for i, obj in zip(ids, got, strict=True):
                    assert obj is not None
                    assert torch.equal(raw(obj), writer.payload_for(i))
                    obj.unref()
            assert disk.stats().corrupt == 1
        finally:
            await disk.aclose()
            assert pool.stats().num_objects == 0
            pool.close()


# --------------------------------------------------------------------------- benchmark


@pytest.mark.anyio
async def test_bench_disk_reports_both_sides_and_cleans_up(tmp_path: Path) -> None:
    from lmcache_async.bench.tiers import bench_disk

    with anyio.fail_after(60):
        result = await bench_disk(tmp_path, chunk_bytes=64 * 1024, chunks=6, repeats=2, batch=4)
    for name in ("put_gbps", "raw_write_gbps", "get_gbps", "raw_read_gbps"):
        assert result[name] > 0
    assert len(result["runs"]) == 2
    assert result["put_ratio"] == pytest.approx(result["put_gbps"] / result["raw_write_gbps"])
    assert result["get_ratio"] == pytest.approx(result["get_gbps"] / result["raw_read_gbps"])
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidInputError, match="chunk_bytes"):
        await bench_disk(tmp_path, chunk_bytes=1000, chunks=1, repeats=1)
    with pytest.raises(InvalidInputError, match="chunks"):
        await bench_disk(tmp_path, chunk_bytes=1024, chunks=0, repeats=1)


def as_16_byte_record(data: bytes) -> tuple[bytes, str]:
    """A record of the 16-byte key form (before tags were 16 bytes): the same record with
    its header's key as that form had it (the tag's first 4 bytes over the link's), and the
    file name that key had (32 hex chars)."""
    header, offset = RecordHeader.from_bytes(data)
    tag, link = bytes(header.key)[:TAG_BYTES], bytes(header.key)[TAG_BYTES:]
    old_key = tag[:4] + link[4:]
    old = dataclasses.replace(header, key=old_key)
    return old.to_bytes() + data[offset:], old_key.hex() + CHUNK_SUFFIX


@pytest.mark.anyio
async def test_a_record_named_in_the_16_byte_key_form_is_a_miss_not_an_error(
    root: Path, pool: MemoryPool
) -> None:
    chunk = ChunkKey(bytes(range(DIGEST_SIZE)))

    async def put_chunk(disk: DiskBackend) -> int:
        obj = make_obj(pool, 1)
        try:
            return await disk.put([chunk], [obj])
        finally:
            obj.unref()

    async with opened(root, pool) as disk:
        assert await put_chunk(disk) == 1
    path = disk_file.record_path(root, chunk)
    data, old_name = as_16_byte_record(path.read_bytes())
    old_path = root / old_name[:2] / old_name
    old_path.parent.mkdir(exist_ok=True)
    old_path.write_bytes(data)
    path.unlink()
    async with opened(root, pool) as disk:  # the scan meets the old name
        assert disk.stats().chunks == 0 and disk.stats().corrupt == 0
        assert await disk.contains_prefix([chunk]) == 0
        assert await disk.get([chunk]) == [None]
        assert await disk.erase_tenant(chunk[:TAG_BYTES]) == 0
        assert await put_chunk(disk) == 1  # stored again under its 64-hex name
        assert await disk.contains_prefix([chunk]) == 1
    assert old_path.exists(), "a name this tier does not write is left alone"
