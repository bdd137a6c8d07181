"""One record file of the disk tier: its name, and reading, checking and writing it.

A chunk's record lives at ``<directory>/<first two hex chars of the key>/<key>.chunk``
(:func:`record_path`) and holds one record (see :mod:`.record`). *Writes* go to
``.tmp-<pid>-<random>-<name>`` in the same directory and are renamed over the final name
(``os.replace``), so a crash never leaves a partial record under a real name; with
``fsync`` each file and its directory are synced before the rename is reported done.
*Reads* check the header against the key and layout, the length against the file, and the
payload's checksum; a corrupt file is deleted (unless a writer replaced it meanwhile) and
reported, never loaded.

The functions run in worker threads, which :class:`RecordFiles` starts: plain file I/O
on paths, no shared state. The disk tier's index and counters stay on the event loop
(:mod:`.disk_index`, :mod:`.disk`).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import io
import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread
import torch

from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj

from ..errors import ForeignRecordError, IntegrityError
from .cipher import PIECE_BYTES, SealedReader, SealedWriter
from .codec import Codec
from .record import PREFIX_SIZE, RecordHeader, RecordSpec, tensor_bytes

__all__ = [
    "CHUNK_SUFFIX",
    "MISSING",
    "Read",
    "RecordFiles",
    "TEMP_PREFIX",
    "ReadOutcome",
    "ReadStatus",
    "WriteResult",
    "as_key",
    "encode_batch",
    "prepare_directory",
    "probe_directory",
    "read_header",
    "record_name",
    "record_path",
    "temp_name",
    "unlink_all",
    "unlink_if_same",
    "write_atomic",
    "write_batch",
]

CHUNK_SUFFIX: Final = ".chunk"
"""Suffix of every record file."""

TEMP_PREFIX: Final = ".tmp-"
"""Prefix of files being written (and of leftovers a crash may leave)."""

_HEAD_READ: Final = 4096
"""Bytes read first from a record: the whole header of any ordinary record."""
_MAX_HEAD: Final = PREFIX_SIZE + 64 * 1024
"""The most a record's prefix and header can take (record.py refuses larger headers)."""

_MAP_SEALED_BYTES: Final = 1 << 20
"""Sealed payloads from this size on are decrypted from the mapped file (below it the
mapping costs more than the read it saves)."""
_MAP_FLAGS: Final = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

_READ_THREADS: Final = 2
"""Worker threads one get reads with: a file read releases the GIL, the checksum does not,
so while one thread verifies a payload the other reads the next; verification then costs
little beyond the reads themselves."""

Payload = bytes | memoryview | SealedWriter
"""A record's payload as written: bytes, or sealed as it is written."""

_SPLIT_READ_BYTES: Final = 1 << 20
"""A get splits its reads over threads only from this many payload bytes on."""

_TOUCH_AFTER_SECONDS: Final = 60.0
"""A hit refreshes its file's mtime when older than this: LRU order survives a restart to
within a minute, and hot chunks do not cost a metadata write on every read."""
_PROBE: Final = b"lmcache-async disk probe\n"


def as_key(key: bytes) -> ChunkKey:
    """``key`` as a :class:`ChunkKey` (indexes hold ChunkKeys typed as bytes, so that a
    bare digest can probe them; a bare key's bytes are rebuilt as one)."""
    if isinstance(key, ChunkKey):
        return key
    layer = int.from_bytes(key[DIGEST_SIZE:], "little") if len(key) > DIGEST_SIZE else None
    return ChunkKey(bytes(key[:DIGEST_SIZE]), layer)


def record_name(key: bytes) -> str:
    """The name of the record file of ``key`` (in the fan-out directory named by its first
    two characters)."""
    if len(key) == DIGEST_SIZE:
        return key.hex() + CHUNK_SUFFIX  # as ChunkKey.to_str() names a whole-chunk key
    return as_key(key).to_str() + CHUNK_SUFFIX


def record_path(directory: Path, key: bytes) -> Path:
    """Where the record of ``key`` lives under ``directory`` (whether or not it exists)."""
    name = record_name(key)
    return directory / name[:2] / name


def temp_name(final_name: str) -> str:
    """A temporary name for a file to be renamed to ``final_name``: it names the writer's
    pid, so that a later scan can tell a crashed writer's leftover from a live write."""
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{final_name}"


def prepare_directory(directory: Path) -> None:
    """Create ``directory`` and check it can be listed, written and read back."""
    directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "no read/write/search permission", str(directory))
    probe_directory(directory)


def probe_directory(directory: Path) -> None:
    """Write, read back and delete a small file in ``directory``."""
    path = directory / temp_name("probe")
    try:
        with open(path, "xb") as f:
            f.write(_PROBE)
        with open(path, "rb") as f:
            if f.read() != _PROBE:
                raise OSError(errno.EIO, "probe file read back wrong bytes", str(path))
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class ReadStatus(enum.Enum):
    """What reading one record came to."""

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """The status of one read, and why it failed (for the logs)."""

    status: ReadStatus
    reason: str = ""


_OK: Final = ReadOutcome(ReadStatus.OK)
MISSING: Final = ReadOutcome(ReadStatus.MISSING)


Read = tuple[Path, bytes, torch.Tensor]
"""A record to read: its path, its key, and the tensor its payload is decoded into."""


class RecordFiles:
    """The record files under ``directory``, and the worker threads that touch them.

    Each method is one thread call (reads of a large batch: two, see
    :data:`_READ_THREADS`). Writes and deletes are shielded from cancellation: the thread
    runs to its end anyway, and its caller must learn what it did. ``fsync``: each written
    file and its directory are synced before a write returns.
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self.fsync = fsync

    def path(self, key: bytes) -> Path:
        """Where the record of ``key`` lives (whether or not it exists)."""
        return record_path(self.directory, key)

    async def prepare(self) -> None:
        """Create the directory if missing; check it can be listed, written and read back.

        Raises:
            OSError: it cannot.
        """
        await anyio.to_thread.run_sync(prepare_directory, self.directory)

    async def probe(self) -> None:
        """Write, read back and delete a small file (a cancelled probe's thread is left to
        finish alone).

        Raises:
            OSError: any of that failed.
        """
        await anyio.to_thread.run_sync(probe_directory, self.directory, abandon_on_cancel=True)

    async def read(
        self, spec: RecordSpec, reads: Sequence[tuple[bytes, torch.Tensor]], nbytes: int
    ) -> list[ReadOutcome]:
        """Read and verify the record of each key into its tensor (``nbytes`` of payload in
        all), split over threads from :data:`_SPLIT_READ_BYTES` on; the outcomes in the
        order of ``reads``."""
        jobs: list[Read] = [(self.path(key), key, out) for key, out in reads]
        threads = min(_READ_THREADS, len(jobs)) if nbytes >= _SPLIT_READ_BYTES else 1
        if threads == 1:
            return await anyio.to_thread.run_sync(_read_batch, spec, jobs)
        parts: list[list[ReadOutcome]] = [[] for _ in range(threads)]

        async def read_part(part: int) -> None:
            parts[part] = await anyio.to_thread.run_sync(_read_batch, spec, jobs[part::threads])

        async with anyio.create_task_group() as task_group:
            for part in range(threads):
                task_group.start_soon(read_part, part)
        outcomes: list[ReadOutcome] = [MISSING] * len(jobs)
        for part, results in enumerate(parts):
            outcomes[part::threads] = results
        return outcomes

    async def write(
        self,
        evicted: Sequence[bytes],
        writes: Sequence[tuple[bytes, bytes, Payload]],
        after: Callable[[WriteResult], None] | None = None,
    ) -> WriteResult:
        """Delete the files of ``evicted``, then write ``(key, header, payload)`` records in
        order, stopping at the first failure; then ``after(result)``, in the same thread."""
        victims = [self.path(key) for key in evicted]
        records = [(self.path(key), header, payload) for key, header, payload in writes]

        def run() -> WriteResult:
            result = write_batch(victims, records, self.fsync)
            if after is not None:
                after(result)
            return result

        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(run)
        return result  # noqa: RET504 (returned inside, mypy takes the scope to swallow it)

    async def delete(
        self, keys: Sequence[bytes], after: Callable[[], None] | None = None
    ) -> list[str]:
        """Delete the files of ``keys`` (already missing is fine), then ``after()`` in the
        same thread; returns the errors."""
        paths = [self.path(key) for key in keys]

        def run() -> list[str]:
            failures = unlink_all(paths)
            if after is not None:
                after()
            return failures

        with anyio.CancelScope(shield=True):
            failures = await anyio.to_thread.run_sync(run)
        return failures  # noqa: RET504 (as above)


def _read_batch(spec: RecordSpec, reads: list[Read]) -> list[ReadOutcome]:
    return [_read_one(spec, path, key, out) for path, key, out in reads]


def _read_one(spec: RecordSpec, path: Path, key: bytes, out: torch.Tensor) -> ReadOutcome:
    """Read the record at ``path`` into ``out``; delete the file if it is corrupt."""
    try:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            try:
                _read_record(spec, f, st.st_size, key, out)
            except IntegrityError as exc:
                if not isinstance(exc, ForeignRecordError):  # another key's: left in place
                    unlink_if_same(path, st)
                return ReadOutcome(ReadStatus.CORRUPT, str(exc))
            if time.time() - st.st_mtime > _TOUCH_AFTER_SECONDS:
                # A hit: most recently used, also in the order rebuilt after a restart.
                with contextlib.suppress(OSError):
                    os.utime(f.fileno())
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return ReadOutcome(ReadStatus.ERROR, str(exc))
    return _OK


def _read_record(
    spec: RecordSpec, f: io.FileIO, file_size: int, key: bytes, out: torch.Tensor
) -> None:
    """Read, check and decode one record into ``out`` (the shape the index expects).

    Raises:
        IntegrityError: anything in the file does not match.
    """
    head, header, offset = read_header(f, file_size)
    spec.check_header(header, key)
    if header.shape != tuple(out.shape):
        raise IntegrityError(f"record shape {header.shape} differs from the indexed one")
    if offset + header.length != file_size:
        raise IntegrityError(
            f"file is {file_size} bytes, its record {offset + header.length} bytes"
        )
    if header.sealed and Codec(header.codec) is Codec.NONE:
        if header.length >= _MAP_SEALED_BYTES:
            _decrypt_mapped(spec, f, header, out)
        else:
            _read_sealed(f, head[offset:], spec.sealed_reader(header, out))
        return
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


def read_header(f: io.FileIO, file_size: int) -> tuple[bytes, RecordHeader, int]:
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


def _decrypt_mapped(
    spec: RecordSpec, f: io.FileIO, header: RecordHeader, out: torch.Tensor
) -> None:
    """Authenticate and decrypt the file's payload (its last ``header.length`` bytes)
    into ``out`` in one call, straight from the page cache through a read-only mapping
    with its pages populated at once: one pass over the bytes, and the decryption runs
    with the GIL released, so a get's reading threads decrypt side by side. (Record
    files are replaced by a rename or deleted, never truncated in place, so the mapped
    bytes stay valid while they are read.)"""
    with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=_MAP_FLAGS) as mapped:
        view = memoryview(mapped)
        payload = view[len(view) - header.length :]
        try:
            spec.decode_into(header, payload, out)
        finally:  # released even while a traceback holds them: the mapping can close
            payload.release()
            view.release()


def _read_sealed(f: io.FileIO, first: bytes, reader: SealedReader) -> None:
    """Feed the rest of an encrypted payload to ``reader``, a piece at a time through a
    buffer that stays in the CPU cache (decrypted straight into pool memory), then check
    its tag."""
    reader.feed(first[: reader.needed])
    piece = memoryview(bytearray(min(PIECE_BYTES, reader.needed)))
    while reader.needed:
        got = f.readinto(piece[: reader.needed])
        if not got:
            raise IntegrityError("record file ended early")
        reader.feed(piece[:got])
    reader.finish()


def _fill(f: io.FileIO, first: bytes, dest: memoryview) -> None:
    n = min(len(first), len(dest))
    dest[:n] = first[:n]
    while n < len(dest):
        got = f.readinto(dest[n:])
        if not got:
            raise IntegrityError("record file ended early")
        n += got


def unlink_if_same(path: str | Path, seen: os.stat_result) -> None:
    """Delete ``path`` if it is still the file ``seen`` (a writer may have replaced it)."""
    with contextlib.suppress(OSError):
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
            os.unlink(path)


def encode_batch(
    spec: RecordSpec, batch: list[tuple[bytes, MemoryObj]]
) -> list[tuple[bytes, Payload]]:
    return [spec.encode_deferred(key, obj) for key, obj in batch]


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: int
    """Records written, in order, before the first failure."""
    unlink_errors: list[str]
    error: OSError | None


def write_batch(
    victims: list[Path], writes: list[tuple[Path, bytes, Payload]], fsync: bool
) -> WriteResult:
    """Delete evicted files, then write records in order, stopping at the first failure."""
    unlink_errors = unlink_all(victims)
    written = 0
    try:
        for path, header, payload in writes:
            write_atomic(path, header, payload, fsync)
            written += 1
    except OSError as exc:
        return WriteResult(written, unlink_errors, exc)
    return WriteResult(written, unlink_errors, None)


def write_atomic(path: Path, header: bytes, payload: Payload, fsync: bool) -> None:
    """Write ``header`` and ``payload`` to a temporary file beside ``path`` and rename it to
    ``path`` (with ``fsync``: the file synced before the rename, its directory after)."""
    tmp = path.with_name(temp_name(path.name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        try:
            _write_all(fd, header)
            if isinstance(payload, SealedWriter):
                payload.write_to(functools.partial(_write_all, fd))  # encrypted as written
            else:
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


def unlink_all(paths: list[Path]) -> list[str]:
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
