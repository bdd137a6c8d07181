"""The disk tier's manifest: a snapshot and its log round-trip; a torn log is cut where
it tears; a stale or foreign log is ignored; changes logged before the log is ready are
kept; the log asks to be compacted once it outgrows the snapshot."""

from __future__ import annotations

from pathlib import Path

from lmcache_async.backends import disk_manifest
from lmcache_async.backends.disk_manifest import Manifest, ManifestState
from lmcache_async.keys.chunks import DIGEST_SIZE
from tests.backends.test_disk import make_spec

FULL = (2, 16, 2, 2, 8)
SHORT = (2, 3, 2, 2, 8)


def k(i: int) -> bytes:
    return i.to_bytes(DIGEST_SIZE, "little")


def manifest(directory: Path) -> Manifest:
    directory.mkdir(parents=True, exist_ok=True)
    return Manifest(directory, make_spec())


def rows(state: ManifestState | None) -> list[tuple[bytes, int, tuple[int, ...]]]:
    assert state is not None
    return [
        (key, size, state.shapes[number])
        for key, size, number in zip(state.keys, state.sizes, state.numbers, strict=True)
    ]


def test_a_snapshot_and_its_log_round_trip(tmp_path: Path) -> None:
    m = manifest(tmp_path)
    assert m.load() == (None, "missing")
    m.attach(None)  # an empty snapshot, and its log
    m.compact([k(1), k(2), k(3)], [10, 11, 12], [0, 1, 0], [FULL, SHORT])
    m.record_added([k(4), k(1)], [13, 14], [SHORT, FULL])  # 1 written again: the newest
    m.record_dropped([k(2)])
    m.close()
    state, problem = manifest(tmp_path).load()
    assert problem == ""
    assert rows(state) == [(k(3), 12, FULL), (k(4), 13, SHORT), (k(1), 14, FULL)]
    assert state is not None and state.log_keys == 3
    assert state.names_sum == disk_manifest.names_sum([key.hex() + ".chunk" for key in state.keys])


def test_a_torn_log_is_cut_where_it_tears_and_logging_goes_on(tmp_path: Path) -> None:
    m = manifest(tmp_path)
    m.attach(None)
    m.record_added([k(1)], [10], [FULL])
    m.close()
    with open(m.log_path, "ab") as f:
        f.write(b"\x40\x00\x00\x00half a record")  # a write the kill cut short
    m = manifest(tmp_path)
    state, _ = m.load()
    assert rows(state) == [(k(1), 10, FULL)]
    m.attach(state)
    m.record_added([k(2)], [11], [FULL])
    m.close()
    assert rows(manifest(tmp_path).load()[0]) == [(k(1), 10, FULL), (k(2), 11, FULL)]


def test_a_log_that_continues_another_snapshot_is_ignored(tmp_path: Path) -> None:
    m = manifest(tmp_path)
    m.attach(None)
    m.record_added([k(1)], [10], [FULL])
    old_log = m.log_path.read_bytes()
    m.compact([k(5)], [50], [0], [FULL])  # a new snapshot; the crash left the old log
    m.close()
    m.log_path.write_bytes(old_log)
    assert rows(manifest(tmp_path).load()[0]) == [(k(5), 50, FULL)]


def test_changes_logged_before_the_log_is_ready_are_kept(tmp_path: Path) -> None:
    m = manifest(tmp_path)
    m.record_added([k(1)], [10], [FULL])  # a put while the fill reads the manifest
    m.record_dropped([k(1)])
    m.record_added([k(2)], [11], [FULL])
    m.attach(None)
    m.close()
    assert rows(manifest(tmp_path).load()[0]) == [(k(2), 11, FULL)]


def test_the_log_asks_for_a_compaction_once_it_outgrows_the_snapshot(tmp_path: Path) -> None:
    m = manifest(tmp_path)
    m.attach(None)
    m.compact([k(i) for i in range(100)], [10] * 100, [0] * 100, [FULL])
    floor = disk_manifest._MIN_COMPACTION
    for start in range(0, floor, 4096):
        m.record_added([k(i) for i in range(start, start + 4096)], [10] * 4096, [FULL] * 4096)
    assert not m.wants_compaction  # as long as the floor
    m.record_dropped([k(0)])
    assert m.wants_compaction
    m.compact([k(1)], [10], [0], [FULL])
    assert not m.wants_compaction
    m.close()
