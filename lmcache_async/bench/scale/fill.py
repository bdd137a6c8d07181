"""Filling the disk and Redis tiers with N chunks quickly, without the engine, and the
names-only walk a disk directory is measured against.

Records are made by the tiers' own record encoder (:meth:`RecordSpec.encode
<lmcache_async.backends.record.RecordSpec.encode>`) and written where the tier looks for
them: a file at :func:`~lmcache_async.backends.disk_file.record_path` (a plain write, no
temporary file: nothing reads the directory while it fills), a Redis string at
``<key prefix><ChunkKey.to_str()>`` (pipelined ``SET``). Every record holds the same
random payload; the keys come first from the prompts the benchmark will look up, then
synthetic keys of the default tenant (as the tiers' own tests make them). Both run in a
worker thread (:func:`anyio.to_thread.run_sync`) and report progress on a stream.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import torch

from lmcache_async.backends.disk_file import CHUNK_SUFFIX, record_path
from lmcache_async.backends.record import RecordSpec
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

__all__ = [
    "FillProgress",
    "fill_directory",
    "fill_redis",
    "names_walk",
    "redis_keys",
    "remove_manifest",
    "remove_records",
    "remove_redis_keys",
]

PROGRESS_EVERY: Final = 2.0
"""Seconds between two progress lines of a fill."""

_REDIS_BATCH: Final = 2000
"""``SET`` commands per pipelined round trip of a Redis fill."""


class FillProgress:
    """Progress lines of one fill on ``stream`` (None: none): count, total and rate, at
    most every :data:`PROGRESS_EVERY` seconds, and one at the end."""

    def __init__(self, stream: TextIO | None, label: str, total: int, unit: str) -> None:
        self._stream = stream
        self._label = label
        self._total = total
        self._unit = unit
        self._done = 0
        self._start = self._last = time.perf_counter()

    def advance(self, count: int) -> None:
        self._done += count
        now = time.perf_counter()
        if now - self._last >= PROGRESS_EVERY:
            self._last = now
            self._say(now)

    def finish(self) -> float:
        """Print the last line; the fill's rate (per second)."""
        now = time.perf_counter()
        self._say(now)
        return self._done / (now - self._start) if now > self._start else float("nan")

    def _say(self, now: float) -> None:
        if self._stream is None:
            return
        rate = self._done / (now - self._start) if now > self._start else 0.0
        print(
            f"bench: {self._label}: {self._done}/{self._total} {self._unit} "
            f"({rate / 1000:.1f}k {self._unit}/s)",
            file=self._stream,
            flush=True,
        )


def _keys(first: Sequence[ChunkKey], count: int, start: int = 0) -> Iterator[ChunkKey]:
    """``first`` (from ``start`` on), then synthetic keys, ``count`` keys in all (from the
    ``start``-th key of that sequence)."""
    tag = tenant_tag(None)
    for i in range(start, start + count):
        if i < len(first):
            yield first[i]
        else:
            yield ChunkKey(tag + i.to_bytes(DIGEST_SIZE - TAG_BYTES, "little"))


def _with_payload(spec: RecordSpec, use: Callable[[MemoryObj], None]) -> None:
    """Call ``use`` with a pool object of one chunk of random payload (freed after)."""
    shape = spec.shape_of(spec.max_tokens)
    nbytes = int(torch.Size(shape).numel()) * spec.dtype.itemsize
    pool = MemoryPool(max(nbytes, 1 << 16), pin_memory=False)
    try:
        obj = pool.allocate_nowait(shape, spec.dtype)
        if obj is None:
            raise RuntimeError("a one-chunk pool could not hold one chunk")
        flat = obj.tensor.view(torch.uint8).reshape(-1)
        generator = torch.Generator().manual_seed(0)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
        try:
            use(obj)
        finally:
            obj.unref()
    finally:
        pool.close()


def _marker(directory: Path) -> Path:
    return directory.parent / f"{directory.name}.fill.json"


def fill_directory(
    directory: Path,
    spec: RecordSpec,
    first: Sequence[ChunkKey],
    count: int,
    *,
    stream: TextIO | None = sys.stderr,
    label: str = "disk fill",
) -> dict[str, Any]:
    """``directory`` holding ``count`` record files: the keys ``first``, then synthetic
    ones. A directory an earlier fill left with the same keys and record spec (its marker
    beside it) and still ``count`` files is used as it is. A new fill is flushed to the
    disk (``os.sync``) before it returns. Returns ``reused`` and, for a new fill,
    ``seconds`` (the flush included) and ``files_per_s``."""
    wanted = {
        "count": count,
        "fingerprint": spec.fingerprint,
        "codec": str(spec.codec),
        "sealed": spec.cipher is not None,
        "first": len(first),
        "first_sum": sum(_key_number(key) for key in first) & (2**64 - 1),
    }
    marker = _marker(directory)
    if directory.is_dir() and marker.is_file():
        try:
            known = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = None
        if known == wanted and names_walk(directory) == count:
            return {"reused": True}
    marker.unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    progress = FillProgress(stream, label, count, "files")
    start = time.perf_counter()

    def write(obj: MemoryObj) -> None:
        made: set[Path] = set()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for n, key in enumerate(_keys(first, count), 1):
            head, payload = spec.encode(key, obj)
            path = record_path(directory, key)
            if path.parent not in made:
                path.parent.mkdir(exist_ok=True)
                made.add(path.parent)
            fd = os.open(path, flags, 0o644)
            try:
                os.write(fd, head + bytes(payload))
            finally:
                os.close(fd)
            if n % 1024 == 0:
                progress.advance(1024)
        progress.advance(count % 1024)

    _with_payload(spec, write)
    rate = progress.finish()
    os.sync()  # the fill's write-back is over before anything is timed
    marker.write_text(json.dumps(wanted), encoding="utf-8")
    return {"reused": False, "seconds": time.perf_counter() - start, "files_per_s": rate}


def _key_number(key: bytes) -> int:
    """A key as a number, to sum a set of keys into the fill's marker."""
    return int.from_bytes(key[-8:], "little")


def names_walk(directory: Path) -> int:
    """Record files under ``directory`` by a names-only walk (``os.scandir`` of the top
    and of each fan-out directory, no ``stat``): the least any index of them costs."""
    count = 0
    with os.scandir(directory) as tops:
        for top in tops:
            if not top.is_dir(follow_symlinks=False):
                continue
            with os.scandir(top.path) as items:
                count += sum(1 for item in items if item.name.endswith(CHUNK_SUFFIX))
    return count


def remove_manifest(directory: Path) -> int:
    """Delete the disk tier's manifest files (``manifest-*`` at the top of ``directory``),
    so that the next open indexes every file from its header; how many were there."""
    removed = 0
    for path in directory.glob("manifest-*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def remove_records(directory: Path, keys: Sequence[bytes]) -> None:
    """Delete the record files of ``keys`` (those missing are skipped)."""
    for key in keys:
        record_path(directory, key).unlink(missing_ok=True)


def fill_redis(
    url: str,
    spec: RecordSpec,
    first: Sequence[ChunkKey],
    start: int,
    count: int,
    *,
    key_prefix: str,
    stream: TextIO | None = sys.stderr,
    label: str = "redis fill",
) -> float:
    """Write ``count`` records to the Redis at ``url``, the ``start``-th on of the keys
    ``first`` then synthetic ones (a fill grows one server from size to size); returns
    the keys written per second."""
    import redis  # noqa: PLC0415  (the optional extra the Redis tier needs anyway)

    prefix = key_prefix.encode()
    progress = FillProgress(stream, label, count, "keys")

    def write(obj: MemoryObj) -> None:
        with redis.Redis.from_url(url, socket_timeout=60.0) as client:
            keys = _keys(first, count, start)
            left = count
            while left:
                batch = min(left, _REDIS_BATCH)
                pipe = client.pipeline(transaction=False)
                for _ in range(batch):
                    key = next(keys)
                    head, payload = spec.encode(key, obj)
                    pipe.set(prefix + key.to_str().encode(), head + bytes(payload))
                pipe.execute()
                left -= batch
                progress.advance(batch)

    _with_payload(spec, write)
    return progress.finish()


def remove_redis_keys(url: str, keys: Sequence[ChunkKey], *, key_prefix: str) -> int:
    """Delete the records of ``keys`` from the Redis at ``url``; how many were there."""
    import redis  # noqa: PLC0415

    if not keys:
        return 0
    prefix = key_prefix.encode()
    with redis.Redis.from_url(url, socket_timeout=60.0) as client:
        return int(client.delete(*(prefix + key.to_str().encode() for key in keys)))


def redis_keys(url: str) -> int:
    """Keys in the Redis at ``url`` (``DBSIZE``)."""
    import redis  # noqa: PLC0415

    with redis.Redis.from_url(url, socket_timeout=60.0) as client:
        return int(client.dbsize())
