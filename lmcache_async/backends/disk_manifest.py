"""The disk tier's manifest: what its index held, so that an open reads no header twice.

Two files per directory and record spec (the layout's fingerprint and the cipher's key
id: engines of other models may share the directory), at its top level:

* ``manifest-<id>.snap``, a snapshot: every indexed key, least recently used first, with
  its file's size and its payload's shape (a table of the distinct shapes, a number per
  key), as fixed-width columns (:mod:`.disk_snapshot`: read with a few ``numpy`` calls).
  Written whole (temporary file and rename; synced when the tier syncs its records)
  at a clean close, after a fill that had to read many headers, and when the log has
  grown as long as the snapshot.
* ``manifest-<id>.log``, the changes since: one record per write (the files written) and
  per deletion (the keys dropped), appended in the worker thread that did the file work,
  never synced: a record costs one ``write`` of a few hundred bytes. Each log begins with
  the id of the snapshot it continues; each record has its length and checksum, and
  replay stops at the first one that is torn.

The manifest is a hint, never the truth: an open trusts an entry only if the directory
still holds a file of that name (:mod:`.disk_fill` checks each size later, and every read
checks the record itself). A manifest that is missing, corrupt, truncated, of another
version (version 1, msgpack columns, included: such a snapshot is not read), or written
for another layout or key is ignored with a warning (the index is then built from the
headers) and replaced. A lost or stale log costs header reads only.
All file work runs in worker threads, under the manifest's lock.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgpack
import xxhash

from .disk_file import record_name, write_atomic
from .disk_snapshot import ManifestState, decode_snapshot, encode_snapshot
from .record import RecordSpec

__all__ = ["MANIFEST_VERSION", "Manifest", "ManifestState", "manifest_identity", "names_sum"]

MANIFEST_VERSION: Final = 2
"""2: the snapshot in fixed-width columns (1: msgpack, ignored when found)."""
_SNAP_MAGIC: Final = b"LMCASNAP"
_LOG_MAGIC: Final = b"LMCAMLOG"
_PREFIX: Final = struct.Struct("<8sHxxIQ")  # magic, version, body length, xxh3-64 of body
_RECORD: Final = struct.Struct("<IQ")  # body length, xxh3-64 of body
_MAX_RECORD: Final = 64 << 20
_ADD: Final = 1
_DROP: Final = 2
_PENDING_LIMIT: Final = 1 << 20
"""Keys the log keeps in memory before it is attached; past this it forgets them (their
files' headers are read at the next open instead)."""
_MASK64: Final = (1 << 64) - 1
_MIN_COMPACTION: Final = 65536
"""The log is compacted once it names more keys than this and than the snapshot holds."""


def names_sum(names: Iterable[str]) -> int:
    """A sum over record file names (xxh3-64 of each, modulo 2**64): the same for the same
    set of names in any order, so that a listing that matches a manifest's is known as
    such without a set built of either."""
    return sum(map(xxhash.xxh3_64_intdigest, map(str.encode, names))) & _MASK64


def manifest_identity(spec: RecordSpec) -> str:
    """What a manifest must have been written for: the layout, and the cipher's key."""
    cipher = spec.cipher
    seal = "clear" if cipher is None else f"{cipher.name}:{cipher.key_id.hex()}"
    return f"{spec.fingerprint}|{seal}"


class Manifest:
    """The manifest files of one directory for one record spec (see the module doc)."""

    def __init__(self, directory: Path, spec: RecordSpec, *, fsync: bool = False) -> None:
        self.identity = manifest_identity(spec)
        stem = f"manifest-{xxhash.xxh3_64_hexdigest(self.identity.encode())}"
        self.snapshot_path = directory / f"{stem}.snap"
        self.log_path = directory / f"{stem}.log"
        self._fsync = fsync
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._attached = False
        self._closed = False
        self._pending: list[bytes] = []
        self._pending_keys = 0
        self._logged = 0
        self._snapshot_keys = 0

    # -- reading ------------------------------------------------------------------------

    def load(self) -> tuple[ManifestState | None, str]:
        """The snapshot with its log replayed; or None and why (``"missing"``, or what is
        wrong with it, for a warning)."""
        try:
            data = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            return None, f"unreadable: {exc}"
        try:
            state = self._parse_snapshot(data)
        except ValueError as exc:
            return None, str(exc) or type(exc).__name__
        if state is None:
            return None, "written for another layout or key"
        self._replay(state)
        return state, ""

    def _parse_snapshot(self, data: bytes) -> ManifestState | None:
        body = _checked_body(data, _SNAP_MAGIC)
        if _PREFIX.size + len(body) != len(data):
            raise ValueError("manifest has bytes after its body")
        return decode_snapshot(body, self.identity)

    def _replay(self, state: ManifestState) -> None:
        """Apply the log records that continue ``state``'s snapshot (none if the log is
        missing or continues another), up to the first torn one."""
        try:
            data = self.log_path.read_bytes()
            offset = _PREFIX.size + _PREFIX.unpack_from(data)[2]
            header: Any = msgpack.unpackb(_checked_body(data[:offset], _LOG_MAGIC), raw=False)
            if header["snapshot"] != state.snapshot_id or header["id"] != self.identity:
                return
        except (OSError, ValueError, TypeError, KeyError, struct.error, msgpack.UnpackException):
            return  # no log, or not this snapshot's: its changes are found by the fill
        position: dict[bytes, int] | None = None
        numbers = {shape: i for i, shape in enumerate(state.shapes)}
        while True:
            record = _next_record(data, offset)
            if record is None:
                break
            end, (op, keys, sizes, shape_numbers, shapes) = record
            if position is None:
                position = {key: i for i, key in enumerate(state.keys)}
            for key in keys:  # a key dropped or written again: its old row is void
                row = position.pop(key, None)
                if row is not None:
                    state.sizes[row] = -1
                    state.names_sum -= names_sum([record_name(key)])
            if op == _ADD:
                own = [_number(numbers, state.shapes, tuple(shape)) for shape in shapes]
                state.names_sum += names_sum(map(record_name, keys))
                for key, size, number in zip(keys, sizes, shape_numbers, strict=True):
                    position[key] = len(state.keys)
                    state.keys.append(key)
                    state.sizes.append(size)
                    state.numbers.append(own[number])
            state.log_keys += len(keys)
            offset = end
        state.log_length = offset
        state.names_sum &= _MASK64
        if position is not None:
            rows = [i for i, size in enumerate(state.sizes) if size >= 0]
            state.keys = [state.keys[i] for i in rows]
            state.numbers = [state.numbers[i] for i in rows]
            state.sizes = [state.sizes[i] for i in rows]

    # -- writing ------------------------------------------------------------------------

    def attach(self, state: ManifestState | None) -> None:
        """Begin appending this session's changes: to the log of ``state`` (what
        :meth:`load` gave: a torn tail cut off), or to a new log of a new, empty snapshot
        when there was no usable one. The changes recorded before are written now.

        Raises:
            OSError: the log could not be prepared (nothing is logged until a compaction).
        """
        with self._lock:
            if self._closed or self._attached:
                return
            self._attached = True
            pending, self._pending = self._pending, []
            try:
                if state is None:
                    self._write_snapshot([], [], [], [])
                elif state.log_length:
                    os.truncate(self.log_path, state.log_length)
                    self._open_log()
                    self._logged, self._snapshot_keys = state.log_keys, len(state.keys)
                else:
                    self._new_log(state.snapshot_id)
                    self._snapshot_keys = len(state.keys)
            except OSError:
                self._close_log()  # nothing is logged until a compaction starts a log
                raise
            finally:
                for record in pending:
                    self._append(record)
                self._logged += self._pending_keys
                self._pending_keys = 0

    def record_added(
        self, keys: Sequence[bytes], sizes: Sequence[int], shapes: Sequence[tuple[int, ...]]
    ) -> None:
        """Log files just written (any thread): ``keys[i]``'s of ``sizes[i]`` bytes."""
        if not keys:
            return
        table: dict[tuple[int, ...], int] = {}
        numbers = [table.setdefault(tuple(shape), len(table)) for shape in shapes]
        self._record([_ADD, [bytes(k) for k in keys], list(sizes), numbers, list(table)])

    def record_dropped(self, keys: Sequence[bytes]) -> None:
        """Log keys whose files were deleted (any thread)."""
        if keys:
            self._record([_DROP, [bytes(k) for k in keys], [], [], []])

    def _record(self, fields: list[Any]) -> None:
        body: bytes = msgpack.packb(fields, use_bin_type=True)
        record = _RECORD.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body
        with self._lock:
            if self._closed:
                return
            if not self._attached:
                if self._pending_keys < _PENDING_LIMIT:
                    self._pending.append(record)
                    self._pending_keys += len(fields[1])
                return
            self._append(record)
            self._logged += len(fields[1])

    @property
    def wants_compaction(self) -> bool:
        """Whether the log names more keys than the snapshot holds (and than a floor)."""
        return self._attached and self._logged > max(self._snapshot_keys, _MIN_COMPACTION)

    def compact(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        numbers: Sequence[int],
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        """Write a snapshot of these entries (least recently used first) and start an empty
        log after it. The caller makes sure no change is logged meanwhile (the tier's
        write lock)."""
        with self._lock:
            if self._closed:
                return
            self._write_snapshot(keys, sizes, numbers, shapes)
            self._attached = True
            self._pending, self._pending_keys = [], 0

    def close(self) -> None:
        """Stop logging (what is logged stays)."""
        with self._lock:
            self._closed = True
            self._close_log()

    # -- inside the lock ----------------------------------------------------------------

    def _write_snapshot(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        numbers: Sequence[int],
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        snapshot_id = os.urandom(8)
        total = names_sum(map(record_name, keys))
        body = encode_snapshot(
            self.identity,
            snapshot_id,
            total,
            keys=keys,
            sizes=sizes,
            numbers=numbers,
            shapes=shapes,
        )
        write_atomic(self.snapshot_path, _framed(_SNAP_MAGIC, body), b"", self._fsync)
        self._new_log(snapshot_id)
        self._logged, self._snapshot_keys = 0, len(keys)

    def _new_log(self, snapshot_id: bytes) -> None:
        self._close_log()
        header = msgpack.packb({"id": self.identity, "snapshot": snapshot_id}, use_bin_type=True)
        write_atomic(self.log_path, _framed(_LOG_MAGIC, header), b"", False)
        self._open_log()

    def _open_log(self) -> None:
        self._fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def _close_log(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _append(self, record: bytes) -> None:
        if self._fd is None:
            return
        try:
            view = memoryview(record)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            self._close_log()  # the log ends here; the next open reads those headers


def _framed(magic: bytes, body: bytes) -> bytes:
    return _PREFIX.pack(magic, MANIFEST_VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body


def _checked_body(data: bytes, magic: bytes) -> memoryview:
    """The body of a framed file, checked (a view of ``data``: no copy).

    Raises:
        ValueError: bad magic, another version, truncated, checksum mismatch.
    """
    if len(data) < _PREFIX.size:
        raise ValueError("manifest is truncated")
    found, version, length, checksum = _PREFIX.unpack_from(data)
    if found != magic:
        raise ValueError("not a manifest (bad magic number)")
    if version != MANIFEST_VERSION:
        raise ValueError(f"manifest version {version}, expected {MANIFEST_VERSION}")
    body = memoryview(data)[_PREFIX.size : _PREFIX.size + length]
    if len(body) != length:
        raise ValueError("manifest is truncated")
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise ValueError("manifest checksum mismatch")
    return body


def _next_record(
    data: bytes, offset: int
) -> tuple[int, tuple[int, list[bytes], Any, Any, Any]] | None:
    """The log record at ``offset`` and where the next begins; None at the end or at a
    torn or malformed record."""
    if offset + _RECORD.size > len(data):
        return None
    length, checksum = _RECORD.unpack_from(data, offset)
    start = offset + _RECORD.size
    body = data[start : start + length]
    if length > _MAX_RECORD or len(body) != length or xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    try:
        op, keys, sizes, numbers, shapes = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not _well_formed(op, keys, sizes, numbers, shapes):
        return None
    return start + length, (op, keys, sizes, numbers, shapes)


def _well_formed(op: Any, keys: Any, sizes: Any, numbers: Any, shapes: Any) -> bool:
    """Whether a log record's fields are what :meth:`Manifest.record_added` and
    :meth:`Manifest.record_dropped` write."""
    if op not in (_ADD, _DROP) or not isinstance(keys, list):
        return False
    if not all(type(key) is bytes for key in keys):
        return False
    if op == _DROP:
        return True
    return (
        isinstance(sizes, list)
        and isinstance(numbers, list)
        and isinstance(shapes, list)
        and len(keys) == len(sizes) == len(numbers)
        and all(type(size) is int and size >= 0 for size in sizes)
        and all(type(n) is int and 0 <= n < len(shapes) for n in numbers)
        and all(
            isinstance(shape, list) and all(type(dim) is int for dim in shape) for shape in shapes
        )
    )


def _number(
    numbers: dict[tuple[int, ...], int], shapes: list[tuple[int, ...]], shape: tuple[int, ...]
) -> int:
    number = numbers.get(shape)
    if number is None:
        number = numbers[shape] = len(shapes)
        shapes.append(shape)
    return number
