"""What the disk tier's index fill asks of the file system: names, sizes, headers.

Plain functions on paths, run in worker threads (the fill's own, or a lookup's thread call
while the fill runs); no shared state. :func:`list_records` is the walk (names only: a
``stat`` per file costs five times the listing); :func:`stat_records` gives sizes and
mtimes of some of them; :func:`read_entry` reads and checks one file's header (never its
payload: checksums are verified at every read instead), deleting a file whose header is
bad or whose length does not match it. Files written for another KV layout, or sealed
under another key, are left alone and not indexed: engines of other models may share the
directory. :func:`erase_prefix` deletes a tenant's files by name.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from lmcache_async.keys.chunks import ChunkKey

from ..errors import ForeignRecordError, IntegrityError, InvalidInputError
from .disk_file import CHUNK_SUFFIX, TEMP_PREFIX, read_header, unlink_all, unlink_if_same
from .record import RecordSpec

__all__ = [
    "Found",
    "Listing",
    "Status",
    "erase_prefix",
    "key_of_name",
    "list_records",
    "read_entries",
    "read_entry",
    "stat_records",
]

_DIR_FLAGS: Final = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_STALE_TEMP_SECONDS: Final = 600.0
"""A temporary file this old is a leftover even if a process with its writer's pid runs."""


@dataclass(slots=True)
class Listing:
    """The record files under a cache directory, by name (``<key>.chunk``, each in the
    fan-out directory named by its first two characters)."""

    names: list[str] = field(default_factory=list)
    removed_temps: int = 0
    """Temporary files deleted: leftovers of writers that are gone."""


class Status(enum.Enum):
    """What reading one record file's header found."""

    OK = "ok"
    FOREIGN = "foreign"  # another layout's, or sealed under another key: left alone
    CORRUPT = "corrupt"  # deleted
    MISSING = "missing"
    ALIEN = "alien"  # not a name this tier writes: not ours to judge


@dataclass(frozen=True, slots=True)
class Found:
    """One file's header read: its key and, when OK, its size, shape and mtime."""

    status: Status
    name: str
    key: bytes = b""
    size: int = 0
    shape: tuple[int, ...] = ()
    mtime_ns: int = 0
    reason: str = ""


def list_records(directory: Path, now: float | None = None) -> Listing:
    """The record files under ``directory`` (names only, no ``stat``; a name may still
    turn out not to be a key's: :data:`Status.ALIEN`); deletes temporary files left by
    writers that are gone.

    Raises:
        OSError: ``directory`` cannot be listed.
    """
    now = time.time() if now is None else now
    listing = Listing()
    with os.scandir(directory) as tops:
        fanouts = []
        for top in tops:
            if top.name.startswith(TEMP_PREFIX):
                listing.removed_temps += _remove_stale_temp(Path(top.path), now)
            elif _is_fanout(top.name) and top.is_dir(follow_symlinks=False):
                fanouts.append(top.name)
    for fanout in sorted(fanouts):
        try:
            names = os.listdir(directory / fanout)
        except FileNotFoundError:
            continue
        if names and min(names)[:2] == fanout == max(names)[:2]:
            # Every name starts with the fan-out's (they sort between its first and last):
            # no temporary file, no stray; one that is no record's name is read as ALIEN.
            listing.names += names
            continue
        for name in names:
            if name.startswith(TEMP_PREFIX):
                listing.removed_temps += _remove_stale_temp(directory / fanout / name, now)
        listing.names += [n for n in names if n.endswith(CHUNK_SUFFIX) and n.startswith(fanout)]
    return listing


def stat_records(directory: Path, names: Sequence[str]) -> list[tuple[int, int] | None]:
    """(size, mtime in ns) of each named record file, None where it is gone."""
    out: list[tuple[int, int] | None] = []
    fanouts: dict[str, int] = {}  # fan-out directory → an open descriptor (no path walks)
    try:
        for name in names:
            fd = fanouts.get(name[:2])
            if fd is None:
                try:
                    fd = fanouts[name[:2]] = os.open(directory / name[:2], _DIR_FLAGS)
                except FileNotFoundError:
                    out.append(None)
                    continue
            try:
                st = os.stat(name, dir_fd=fd)
            except FileNotFoundError:
                out.append(None)
                continue
            out.append((st.st_size, st.st_mtime_ns))
    finally:
        for fd in fanouts.values():
            os.close(fd)
    return out


def key_of_name(name: str) -> ChunkKey | None:
    """The key a record file's name stands for; None for a name this tier never writes."""
    try:
        return ChunkKey.from_str(name.removesuffix(CHUNK_SUFFIX))
    except InvalidInputError:
        return None


def read_entries(directory: Path, spec: RecordSpec, names: Sequence[str]) -> list[Found]:
    """:func:`read_entry` of each name."""
    return [read_entry(directory, spec, name) for name in names]


def read_entry(directory: Path, spec: RecordSpec, name: str) -> Found:
    """Read and check the header of the record file ``name`` against ``spec``; a file
    whose header is bad or does not match its length is deleted (unless a writer replaced
    it meanwhile)."""
    key = key_of_name(name)
    if key is None:
        return Found(Status.ALIEN, name)
    path = f"{directory}{os.sep}{name[:2]}{os.sep}{name}"
    try:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            try:
                _, header, offset = read_header(f, st.st_size)
                if header.fingerprint != spec.fingerprint:
                    return Found(Status.FOREIGN, name, key)
                spec.check_header(header, key)
                if offset + header.length != st.st_size:
                    raise IntegrityError(
                        f"file is {st.st_size} bytes, its record {offset + header.length} bytes"
                    )
            except ForeignRecordError:
                return Found(Status.FOREIGN, name, key)  # sealed under another key
            except IntegrityError as exc:
                unlink_if_same(path, st)
                return Found(Status.CORRUPT, name, key, reason=str(exc))
    except FileNotFoundError:
        return Found(Status.MISSING, name, key)
    except OSError as exc:
        return Found(Status.MISSING, name, key, reason=str(exc))
    return Found(Status.OK, name, key, st.st_size, header.shape, st.st_mtime_ns)


def erase_prefix(directory: Path, prefix: str, known: list[Path]) -> tuple[int, int, list[str]]:
    """Delete ``known``, then the record files and temporary files (writes under way)
    under ``directory`` whose key's text starts with ``prefix`` (at least two hex
    characters: one fan-out directory is listed, no file is read).

    Returns:
        Record files deleted besides ``known``, temporary files deleted, and the errors.
    """
    errors = unlink_all(known)
    records = temps = 0
    try:
        names = os.listdir(directory / prefix[:2])
    except FileNotFoundError:
        return records, temps, errors
    except OSError as exc:
        return records, temps, [*errors, str(exc)]
    for name in names:
        is_temp = name.startswith(TEMP_PREFIX)
        final = name[len(TEMP_PREFIX) :].split("-", 2)[-1] if is_temp else name
        if not (final.startswith(prefix) and final.endswith(CHUNK_SUFFIX)):
            continue
        try:
            os.unlink(directory / prefix[:2] / name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(str(exc))
            continue
        if is_temp:
            temps += 1
        else:
            records += 1
    return records, temps, errors


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _remove_stale_temp(path: Path, now: float) -> int:
    """Delete a temporary file left by a process that is gone (or long ago); 1 if deleted."""
    try:
        pid = int(path.name[len(TEMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        pid = 0
    try:
        if pid > 0 and _process_alive(pid) and now - path.stat().st_mtime < _STALE_TEMP_SECONDS:
            return 0  # probably being written right now by another engine
        os.unlink(path)
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
