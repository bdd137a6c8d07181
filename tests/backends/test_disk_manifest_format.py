"""The manifest snapshot's column format: entries of every kind round-trip; a snapshot
damaged in any region (framing, head, identity, shapes, columns, keys, its end) or
checksummed but malformed, cut short, another layout's, or of the old msgpack format
(version 1) is refused, and the tier then builds its index from the files' headers and
serves only what the files say; a well-formed manifest that lies is believed only as far
as the directory agrees."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgpack
import pytest
import xxhash
from structlog.testing import capture_logs

from lmcache_async.backends import disk_manifest, disk_snapshot
from lmcache_async.backends.disk_file import record_name, record_path
from lmcache_async.backends.disk_manifest import Manifest, ManifestState, names_sum
from lmcache_async.backends.disk_snapshot import decode_snapshot, encode_snapshot
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES
from tests.backends.test_disk import (
    CHUNK,
    LAYOUT,
    PAGE,
    check_hits,
    key,
    make_spec,
    open_disk,
    opened,
    put,
)
from tests.backends.test_disk_restart import (
    assert_exact_or_missing,
    assert_index_matches_files,
    manifest_of,
)

TIMEOUT = 60
IDENTITY = "layout|clear"
FULL = (2, 16, 2, 2, 8)
SHORT = (2, 3, 2, 2, 8)
SCALAR = ()


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    pool = MemoryPool(64 * PAGE, page_size=PAGE, pin_memory=False)
    yield pool
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def k(i: int, tag: int = 0) -> bytes:
    """A whole-chunk key of tenant ``tag`` (the tag its first bytes, as in the engine)."""
    return tag.to_bytes(TAG_BYTES, "little") + i.to_bytes(DIGEST_SIZE - TAG_BYTES, "little")


def rows(state: ManifestState | None) -> list[tuple[bytes, int, tuple[int, ...]]]:
    assert state is not None
    return [
        (key_, size, state.shapes[number])
        for key_, size, number in zip(state.keys, state.sizes, state.numbers, strict=True)
    ]


def body(
    keys: list[bytes],
    sizes: list[int] | None = None,
    numbers: list[int] | None = None,
    shapes: list[tuple[int, ...]] | None = None,
    identity: str = IDENTITY,
) -> bytes:
    return encode_snapshot(
        identity,
        b"snapshot",
        7,
        keys=keys,
        sizes=sizes if sizes is not None else [100] * len(keys),
        numbers=numbers if numbers is not None else [0] * len(keys),
        shapes=shapes if shapes is not None else [FULL],
    )


# --------------------------------------------------------------------------- round trips


def test_entries_of_every_kind_round_trip(tmp_path: Path) -> None:
    """Keys of two tenants, layer keys (36 bytes: the keys then differ in length), files
    over 4 GiB, shapes of several ranks (a scalar's too), in their LRU order."""
    entries = [
        (k(1), 4166, FULL),
        (k(2, tag=9), 1 << 33, SHORT),
        (bytes(key(3, layer=5)), 0, FULL),
        (k(4), 17, SCALAR),
        (bytes(key(3, layer=0)), 2**63 - 1, (7,)),
    ]
    shapes = [FULL, SHORT, SCALAR, (7,)]
    keys = [e[0] for e in entries]
    m = Manifest(tmp_path, make_spec())
    m.attach(None)
    m.compact(keys, [e[1] for e in entries], [shapes.index(e[2]) for e in entries], shapes)
    m.close()
    state, problem = Manifest(tmp_path, make_spec()).load()
    assert problem == ""
    assert rows(state) == entries
    assert state is not None and state.shapes == shapes
    assert state.names_sum == names_sum(map(record_name, keys))
    assert all(type(key_) is bytes for key_ in state.keys)
    assert all(type(size) is int for size in state.sizes)


@pytest.mark.parametrize("layers", [False, True], ids=["chunk keys", "layer keys"])
@pytest.mark.parametrize("count", [0, 1, 3, 1000])
def test_columns_of_one_width_round_trip(count: int, layers: bool) -> None:
    keys = [bytes(key(i, layer=i % 4)) if layers else k(i, tag=i % 3) for i in range(count)]
    sizes = [4166 if i % 5 else 1000 + i for i in range(count)]
    numbers = [i % 2 for i in range(count)]
    state = decode_snapshot(body(keys, sizes, numbers, [FULL, SHORT]), IDENTITY)
    assert state is not None
    assert (state.keys, state.sizes, state.numbers) == (keys, sizes, numbers)
    assert (state.snapshot_id, state.names_sum, state.shapes) == (b"snapshot", 7, [FULL, SHORT])


def test_equal_sizes_and_shapes_come_back_as_one_int() -> None:
    state = decode_snapshot(body([k(i) for i in range(50)], [4166] * 50), IDENTITY)
    assert state is not None and state.sizes == [4166] * 50
    assert len(set(map(id, state.sizes))) == 1 and len(set(map(id, state.numbers))) == 1


# --------------------------------------------------------------------------- refusals


def test_another_identity_is_not_read() -> None:
    assert decode_snapshot(body([k(1)]), "another|clear") is None


def forged(data: bytes) -> bytes:
    """A body checksummed as the manifest frames it: only the format's checks stand."""
    return disk_manifest._framed(disk_manifest._SNAP_MAGIC, data)


def malformed_bodies(identity: str = IDENTITY) -> dict[str, bytes]:
    head = disk_snapshot._HEAD
    good = body([k(1), k(2)], [10, 20], [0, 1], [FULL, SHORT], identity)
    fields = list(head.unpack_from(good))

    def with_head(**changes: int) -> bytes:
        names = ["id", "sum", "rows", "width", "shapes", "dims", "identity"]
        values = [changes.get(name, value) for name, value in zip(names, fields, strict=True)]
        return head.pack(*values) + good[head.size :]

    return {
        "a key twice": body([k(1), k(2), k(1)], identity=identity),
        "a layer key twice": body(
            [bytes(key(1, layer=2)), k(3), bytes(key(1, layer=2))], identity=identity
        ),
        "a layer key twice among many": body(
            [bytes(key(i, layer=i % 3)) for i in range(3000)] + [bytes(key(7, layer=1))],
            identity=identity,
        ),
        "a key twice among many": body(
            [k(i, tag=i % 2) for i in range(5000)] + [k(4000)], identity=identity
        ),
        "a shape number out of range": body([k(1), k(2)], numbers=[0, 1], identity=identity),
        "a negative dimension": body([k(1)], shapes=[(2, -16)], identity=identity),
        "more rows than columns": with_head(rows=3),
        "fewer rows than columns": with_head(rows=1),
        "more shapes than the table": with_head(shapes=3),
        "ranks not adding up": with_head(dims=9),
        "another key width": with_head(width=16),
        "a key width out of range": with_head(width=5000),
        "too many shapes": with_head(shapes=(1 << 20) + 1),
        "an identity too long": with_head(identity=(1 << 32) - 1),
        "the head cut short": good[: head.size - 1],
        "the keys cut short": good[:-8],
        "bytes after the keys": good + bytes(8),
        "an empty key": with_lengths(identity, b"\x01\x00\x02\x00", b"\x00\x00\x03\x00"),
    }


def with_lengths(identity: str, old: bytes, new: bytes) -> bytes:
    """A body of the keys ``a`` and ``bc`` (two widths: a lengths column) with the start
    of that column ``old`` made ``new``."""
    data = encode_snapshot(
        identity, b"snapshot", 0, keys=[b"a", b"bc"], sizes=[1, 1], numbers=[0, 0], shapes=[FULL]
    )
    assert data.count(old) == 1
    return data.replace(old, new)


@pytest.mark.parametrize("damage", sorted(malformed_bodies()))
def test_a_checksummed_but_malformed_snapshot_is_refused(tmp_path: Path, damage: str) -> None:
    with pytest.raises(ValueError, match="snapshot"):
        decode_snapshot(malformed_bodies()[damage], IDENTITY)
    m = Manifest(tmp_path, make_spec())
    m.snapshot_path.write_bytes(forged(malformed_bodies(m.identity)[damage]))
    state, problem = m.load()
    assert state is None and "snapshot" in problem


def test_the_writer_refuses_what_the_format_cannot_hold() -> None:
    with pytest.raises(ValueError, match="keys out of range"):
        body([b"", k(1)])
    with pytest.raises(ValueError, match="differ in length"):
        body([k(1)], sizes=[1, 2])


def regions(data: bytes, identity: str) -> dict[str, int]:
    """An offset inside each region of a snapshot file of two entries, of one key width."""
    prefix = disk_manifest._PREFIX.size
    head = prefix + disk_snapshot._HEAD.size
    identity_end = head + len(identity.encode())
    ranks = identity_end + -identity_end % 8
    return {
        "magic": 0,
        "version": 8,
        "length": 12,
        "checksum": 16,
        "head: snapshot id": prefix,
        "head: names sum": prefix + 8,
        "head: rows": prefix + 16,
        "head: key width": prefix + 24,
        "identity": head + 2,
        "ranks": ranks,
        "dims": ranks + 8,
        "sizes": len(data) - 2 * 32 - 8 - 16,
        "numbers": len(data) - 2 * 32 - 8,
        "keys": len(data) - 40,
        "the last byte": len(data) - 1,
    }


def flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x40
    return bytes(out)


def cut(data: bytes, offset: int) -> bytes:
    return data[:offset]


@pytest.mark.parametrize("damage", [flip, cut], ids=["flipped", "cut"])
def test_a_snapshot_damaged_in_any_region_is_refused(
    tmp_path: Path, damage: Callable[[bytes, int], bytes]
) -> None:
    m = Manifest(tmp_path, make_spec())
    m.attach(None)
    m.compact([k(1), k(2)], [10, 20], [0, 0], [FULL])
    m.close()
    good = m.snapshot_path.read_bytes()
    for region, offset in regions(good, m.identity).items():
        m.snapshot_path.write_bytes(damage(good, offset))
        state, problem = Manifest(tmp_path, make_spec()).load()
        assert state is None and problem, region
    m.snapshot_path.write_bytes(good + b"\x00")
    assert Manifest(tmp_path, make_spec()).load() == (None, "manifest has bytes after its body")


def test_an_old_msgpack_snapshot_is_ignored(tmp_path: Path) -> None:
    m = Manifest(tmp_path, make_spec())
    old = msgpack.packb(
        {
            "id": m.identity,
            "snapshot": os.urandom(8),
            "names_sum": names_sum([record_name(k(1))]),
            "shapes": [list(FULL)],
            "keys": [k(1)],
            "sizes": [10],
            "numbers": [0],
        },
        use_bin_type=True,
    )
    prefix = disk_manifest._PREFIX.pack(b"LMCASNAP", 1, len(old), xxhash.xxh3_64_intdigest(old))
    m.snapshot_path.write_bytes(prefix + old)
    assert m.load() == (None, "manifest version 1, expected 2")


# --------------------------------------------------------------------------- the tier


SPOILERS: dict[str, Callable[[Path, Path], None]] = {}


def spoiler(name: str) -> Callable[[Callable[[Path, Path], None]], Callable[[Path, Path], None]]:
    def register(fn: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
        SPOILERS[name] = fn
        return fn

    return register


@spoiler("a byte of the head flipped")
def _flip_head(snapshot: Path, _: Path) -> None:
    data = snapshot.read_bytes()
    snapshot.write_bytes(flip(data, disk_manifest._PREFIX.size + 16))


@spoiler("a byte of the sizes flipped")
def _flip_sizes(snapshot: Path, _: Path) -> None:
    data = snapshot.read_bytes()
    snapshot.write_bytes(flip(data, len(data) - 6 * 32 - 24 - 6 * 8 + 3))  # 6 keys


@spoiler("a byte of the keys flipped")
def _flip_keys(snapshot: Path, _: Path) -> None:
    data = snapshot.read_bytes()
    snapshot.write_bytes(flip(data, len(data) - 40))


@spoiler("cut inside its keys")
def _cut_keys(snapshot: Path, _: Path) -> None:
    data = snapshot.read_bytes()
    snapshot.write_bytes(data[: len(data) - 100])


@spoiler("a key twice, checksummed")
def _twice(snapshot: Path, root: Path) -> None:
    keys = [bytes(key(i)) for i in (0, 1, 2, 3, 4, 0)]
    m = Manifest(root, make_spec())
    data = encode_snapshot(
        m.identity, b"snapshot", 0, keys=keys, sizes=[1] * 6, numbers=[0] * 6, shapes=[FULL]
    )
    snapshot.write_bytes(forged(data))


@spoiler("the old msgpack format")
def _old(snapshot: Path, root: Path) -> None:
    m = Manifest(root, make_spec())
    old = msgpack.packb({"id": m.identity, "keys": []}, use_bin_type=True)
    prefix = disk_manifest._PREFIX.pack(b"LMCASNAP", 1, len(old), xxhash.xxh3_64_intdigest(old))
    snapshot.write_bytes(prefix + old)


@pytest.mark.anyio
@pytest.mark.parametrize("spoil", sorted(SPOILERS))
async def test_a_refused_snapshot_falls_back_to_the_files(
    root: Path, pool: MemoryPool, spoil: str
) -> None:
    """The tier warns, reads every header, and serves exactly what the files hold (one
    deleted, one damaged behind its back); its close writes a snapshot the next open uses."""
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(6))
        snapshot = manifest_of(root).snapshot_path
        SPOILERS[spoil](snapshot, root)
        record_path(root, key(5)).unlink()
        with capture_logs() as logs:
            disk = await open_disk(root, pool)
        try:
            (warning,) = [e for e in logs if e["log_level"] == "warning"]
            assert warning["event"] == "disk_manifest_ignored" and warning["reason"]
            stats = disk.index_stats()
            assert (stats.manifest, stats.from_manifest, stats.headers_read) == ("ignored", 0, 5)
            assert await assert_exact_or_missing(disk, list(range(6))) == [0, 1, 2, 3, 4]
            await assert_index_matches_files(disk, root)
        finally:
            await disk.aclose()
        async with opened(root, pool) as disk:
            stats = disk.index_stats()
            assert (stats.manifest, stats.from_manifest, stats.headers_read) == ("used", 5, 0)
            await check_hits(disk, [0, 1, 2, 3, 4])


@pytest.mark.anyio
async def test_a_well_formed_manifest_that_lies_is_believed_only_where_the_files_agree(
    root: Path, pool: MemoryPool
) -> None:
    """A checksummed snapshot naming a file that is not there, a wrong size and a wrong
    shape, and not naming a file that is: the name is dropped, the size read again, the
    shape caught at the first read (a miss, the file deleted as corrupt: the manifest's
    shapes are believed until then), the file found; the index ends up what the files
    say."""
    with anyio.fail_after(TIMEOUT):
        async with opened(root, pool) as disk:
            await put(disk, pool, *range(4))
            size = disk.stats().bytes // 4
        m = manifest_of(root)
        keys = [bytes(key(i)) for i in (0, 1, 2, 9)]  # 3 not named; 9 has no file
        data = encode_snapshot(
            m.identity,
            b"snapshot",
            names_sum(map(record_name, keys)),
            keys=keys,
            sizes=[size, size + 1, size, size],  # 1's size is wrong
            numbers=[0, 0, 1, 0],  # 2's shape is wrong, its size right: the read checks it
            shapes=[LAYOUT.payload_shape(CHUNK), LAYOUT.payload_shape(3)],
        )
        m.log_path.unlink()
        m.snapshot_path.write_bytes(forged(data))
        disk = await open_disk(root, pool)
        try:
            stats = disk.index_stats()
            assert stats.manifest == "used"
            assert (stats.from_manifest, stats.dropped) == (3, 2)  # 9 gone; 1 read again
            assert key(9) not in disk
            await check_hits(disk, [0, 1, 3])
            assert await assert_exact_or_missing(disk, [2, 9]) == []
            assert disk.stats().corrupt == 1 and not record_path(root, key(2)).exists()
            await assert_index_matches_files(disk, root)
        finally:
            await disk.aclose()
