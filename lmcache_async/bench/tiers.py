"""Slow-tier benchmarks: each tier's put and get throughput next to a raw baseline of the
same bytes, measured in the same run.

- **disk** (:func:`bench_disk`): :class:`~lmcache_async.backends.disk.DiskBackend` ``put``
  and ``get`` of ``chunks`` chunks against plain files holding the same bytes in the same
  directory: ``open(path, "wb").write(...)`` per file and ``readinto`` a preallocated
  buffer, in one worker-thread call per batch, as the tier does. Reads come from the page
  cache for both sides (the files were just written) unless ``cold=True``, which syncs
  both sides' files and drops them from the page cache before reading.
- **redis** (:func:`bench_redis`): :class:`~lmcache_async.backends.redis.RedisBackend`
  ``put`` and ``get`` against plain redis-py (asyncio) pipelined ``SET`` / ``GET`` of the
  same records on the same server, ``call_bytes`` of values per call on both sides.

GB/s here is 10^9 bytes per second of payload; the median over ``repeats`` runs is
reported with every run's figures beside it. The two sides take turns batch by batch (a
batch through the tier, the same batch raw, and who goes first alternates), so background
write-back and other load on the machine weigh on both alike.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import torch

from lmcache_async.backends.codec import Codec
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.record import RecordSpec, tensor_bytes
from lmcache_async.errors import InvalidInputError, TierError
from lmcache_async.keys import ChunkKey
from lmcache_async.memory import DEFAULT_PAGE_SIZE, MemoryObj, MemoryPool

if TYPE_CHECKING:
    from lmcache_async.backends.redis import RedisBackend

__all__ = [
    "DISK_TARGETS",
    "REDIS_TARGETS",
    "bench_disk",
    "bench_redis",
    "format_tiers",
    "run_tiers_bench",
]

DISK_TARGETS: Final[Mapping[str, float]] = {"put_ratio": 0.7, "get_ratio": 0.7}
"""The disk tier should reach at least 0.7x the raw write and read of the same bytes."""

_BENCH_TOKENS: Final = 256
_BENCH_DTYPE: Final = torch.bfloat16
# Bytes per token of a chunk's [2, 1, tokens, width] bf16 payload must be whole elements.
_CHUNK_GRANULE: Final = 2 * _BENCH_TOKENS * 2


def _bench_shape(width: int, tokens: int) -> tuple[int, ...]:
    return (2, 1, tokens, width)


def _bench_spec(chunk_bytes: int) -> RecordSpec:
    width = chunk_bytes // _CHUNK_GRANULE
    return RecordSpec(
        fingerprint=f"bench-disk;width={width}",
        fmt="KV_2LTD",
        dtype=_BENCH_DTYPE,
        max_tokens=_BENCH_TOKENS,
        shape_of=functools.partial(_bench_shape, width),
        codec=Codec.NONE,
    )


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    return value


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


async def bench_disk(
    directory: str | os.PathLike[str],
    *,
    chunk_bytes: int = 4 << 20,
    chunks: int = 64,
    repeats: int = 3,
    batch: int = 16,
    cold: bool = False,
) -> dict[str, Any]:
    """Disk tier put/get GB/s against raw file writes/reads of the same bytes.

    Each run writes ``chunks`` chunks of ``chunk_bytes`` (random bytes) through a fresh
    tier and as plain files, ``batch`` chunks per call, then reads them all back; its files
    are deleted afterwards. Subdirectories ``tier-<run>`` and ``raw-<run>`` of
    ``directory`` are used.

    Returns:
        ``put_gbps``, ``raw_write_gbps``, ``put_ratio``, ``get_gbps``, ``raw_read_gbps``,
        ``get_ratio`` (medians over runs), the settings, the targets and ``runs`` (every
        run's figures).

    Raises:
        InvalidInputError: a count is not a positive int, or ``chunk_bytes`` is not a
            multiple of 1024.
    """
    _check_count("chunk_bytes", chunk_bytes)
    _check_count("chunks", chunks)
    _check_count("repeats", repeats)
    _check_count("batch", batch)
    if chunk_bytes % _CHUNK_GRANULE:
        raise InvalidInputError(
            f"chunk_bytes must be a multiple of {_CHUNK_GRANULE}, got {chunk_bytes}"
        )
    root = Path(os.fspath(directory))
    spec = _bench_spec(chunk_bytes)
    shape = spec.shape_of(_BENCH_TOKENS)
    page = DEFAULT_PAGE_SIZE
    per_chunk = -(-chunk_bytes // page) * page
    # Sources, plus one batch read back by a get and one by the raw reads.
    pool = MemoryPool(per_chunk * (chunks + 2 * min(batch, chunks)), pin_memory=False)
    sources: list[MemoryObj] = []
    try:
        for _ in range(chunks):
            obj = pool.allocate_nowait(shape, _BENCH_DTYPE)
            if obj is None:
                raise InvalidInputError("benchmark pool too small")  # sized above: a bug
            sources.append(obj)
        await anyio.to_thread.run_sync(_fill_random, [obj.tensor for obj in sources])
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(chunks)]
        runs = []
        for run in range(repeats):
            runs.append(
                await _disk_run(
                    root,
                    run,
                    spec=spec,
                    pool=pool,
                    keys=keys,
                    sources=sources,
                    batch=batch,
                    cold=cold,
                )
            )
    finally:
        for obj in sources:
            obj.unref()
        pool.close()

    def median(name: str) -> float:
        return statistics.median(r[name] for r in runs)

    put, raw_write = median("put_gbps"), median("raw_write_gbps")
    get, raw_read = median("get_gbps"), median("raw_read_gbps")
    return {
        "tier": "disk",
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "batch": batch,
        "repeats": repeats,
        "cold": cold,
        "reads_from": "device (page cache dropped)" if cold else "page cache (both sides)",
        "put_gbps": put,
        "raw_write_gbps": raw_write,
        "put_ratio": put / raw_write,
        "get_gbps": get,
        "raw_read_gbps": raw_read,
        "get_ratio": get / raw_read,
        "targets": dict(DISK_TARGETS),
        "runs": runs,
    }


async def _disk_run(
    root: Path,
    run: int,
    *,
    spec: RecordSpec,
    pool: MemoryPool,
    keys: list[ChunkKey],
    sources: list[MemoryObj],
    batch: int,
    cold: bool,
) -> dict[str, float]:
    """One run: writes then reads through the tier and as raw files; returns GB/s."""
    tier_dir, raw_dir = root / f"tier-{run}", root / f"raw-{run}"
    nbytes = sum(obj.nbytes for obj in sources)
    spans = [(start, min(start + batch, len(keys))) for start in range(0, len(keys), batch)]
    raw_paths = [raw_dir / f"{i:06d}.bin" for i in range(len(keys))]
    views = [tensor_bytes(obj.tensor) for obj in sources]
    disk = await DiskBackend.open(
        tier_dir,
        pool=pool,
        spec=spec,
        allocation_timeout=30.0,
        max_local_disk_size=2 * nbytes + (1 << 20),
    )
    scratch = pool.allocate_nowait((min(batch, len(keys)) * views[0].nbytes,), torch.uint8)
    if scratch is None:
        raise InvalidInputError("benchmark pool too small")  # sized by bench_disk: a bug
    try:
        await anyio.to_thread.run_sync(functools.partial(raw_dir.mkdir, parents=True))
        dest = tensor_bytes(scratch.tensor)

        async def tier_put(lo: int, hi: int) -> None:
            await disk.put(keys[lo:hi], sources[lo:hi])

        async def raw_write(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_write, raw_paths[lo:hi], views[lo:hi])

        async def tier_get(lo: int, hi: int) -> None:
            got = await disk.get(keys[lo:hi])
            for obj in got:
                if obj is None:
                    raise InvalidInputError("disk tier lost a chunk during the benchmark")
                obj.unref()

        async def raw_read(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_read, raw_paths[lo:hi], dest)

        put_s, raw_write_s = await _interleaved(tier_put, raw_write, spans, run)
        if cold:
            tier_files = [disk.path_of(key) for key in keys]
            await anyio.to_thread.run_sync(_drop_cached, [*tier_files, *raw_paths])
        get_s, raw_read_s = await _interleaved(tier_get, raw_read, spans, run)
    finally:
        scratch.unref()
        await disk.aclose()
        await anyio.to_thread.run_sync(_remove_trees, [tier_dir, raw_dir])
    return {
        "put_gbps": _rate(nbytes, put_s),
        "raw_write_gbps": _rate(nbytes, raw_write_s),
        "get_gbps": _rate(nbytes, get_s),
        "raw_read_gbps": _rate(nbytes, raw_read_s),
    }


async def _interleaved(
    tier: Callable[[int, int], Awaitable[None]],
    raw: Callable[[int, int], Awaitable[None]],
    spans: list[tuple[int, int]],
    run: int,
) -> tuple[float, float]:
    """Seconds ``tier`` and ``raw`` take over all spans, a batch of one then the same batch
    of the other (who goes first alternates), so both see the same background load."""
    times = [0.0, 0.0]
    sides = (tier, raw)
    for n, (lo, hi) in enumerate(spans):
        for side in (0, 1) if (n + run) % 2 == 0 else (1, 0):
            start = time.perf_counter()
            await sides[side](lo, hi)
            times[side] += time.perf_counter() - start
    return times[0], times[1]


def _fill_random(tensors: list[torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(0)
    for tensor in tensors:
        flat = tensor.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


def _raw_write(paths: list[Path], views: list[memoryview]) -> None:
    for path, view in zip(paths, views, strict=True):
        with open(path, "wb") as f:
            f.write(view)


def _raw_read(paths: list[Path], dest: memoryview) -> None:
    offset = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view = dest[offset : offset + size]
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            offset += size


def _drop_cached(paths: list[Path]) -> None:
    """Write back and evict ``paths`` from the page cache, so reads hit the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _remove_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


# -- Redis tier -----------------------------------------------------------------------------

REDIS_TARGETS: Final[Mapping[str, float]] = {"put_ratio": 0.8, "get_ratio": 0.8}
"""The Redis tier should reach at least 0.8x raw pipelined SET and GET of the same values."""

_REDIS_TIER_PREFIX: Final = "lmca-bench:"
_REDIS_RAW_SUFFIX: Final = b"}:raw"


async def bench_redis(
    url: str,
    *,
    chunk_bytes: int = 4 << 20,
    chunks: int = 64,
    repeats: int = 3,
    call_bytes: int = 32 << 20,
    batch_bytes: int | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Redis tier put/get GB/s against raw redis-py pipelined SET/GET of the same values.

    Each run puts ``chunks`` chunks of ``chunk_bytes`` random bytes through a
    :class:`~lmcache_async.backends.redis.RedisBackend` and SETs the very records the tier
    stores (header and payload) with a plain ``redis.asyncio`` client; then gets them all
    back both ways. The sides take turns ``call_bytes`` of values at a time (who goes
    first alternates), so the machine's drift weighs on both alike: one ``put``/``get``
    call of the tier, and raw, one pipelined round trip after another of ``batch_bytes``
    of values each (the tier's batch size, ``DEFAULT_BATCH_BYTES`` by default; a quarter
    of that for SET, as the tier's put sends).

    The tier's put includes computing every payload's checksum (reset before each run, as
    for a chunk written for the first time) and checking which keys exist; its get
    includes verifying every checksum and copying the payload into pool memory; the raw
    side only moves bytes. Keys live under the benchmark's own prefixes and are deleted
    after each run. ``timeout`` is both sides' socket timeout and the tier's
    ``remote_timeout``.

    Returns:
        ``put_gbps``, ``raw_set_gbps``, ``put_ratio``, ``get_gbps``, ``raw_get_gbps``,
        ``get_ratio`` (medians over runs; each ratio is the median of the runs' own
        ratios), the settings, the targets and ``runs`` (every run's figures).

    Raises:
        InvalidInputError: a count or size is not a positive int, or ``chunk_bytes`` is
            not a multiple of 1024.
        ConfigError: a bad ``url``.
        TierError: the server failed, or either side read back other bytes than it wrote.
    """
    # Local imports: redis-py is an optional dependency, needed only by this benchmark.
    import redis.asyncio  # noqa: PLC0415
    import redis.asyncio.cluster  # noqa: PLC0415

    from lmcache_async.backends.redis import (  # noqa: PLC0415
        DEFAULT_BATCH_BYTES,
        PUT_SPLIT,
        RedisBackend,
        parse_remote_url,
    )

    _check_count("chunk_bytes", chunk_bytes)
    _check_count("chunks", chunks)
    _check_count("repeats", repeats)
    _check_count("call_bytes", call_bytes)
    if chunk_bytes % _CHUNK_GRANULE:
        raise InvalidInputError(
            f"chunk_bytes must be a multiple of {_CHUNK_GRANULE}, got {chunk_bytes}"
        )
    width = chunk_bytes // _CHUNK_GRANULE
    spec = RecordSpec(
        fingerprint=f"bench-redis;width={width}",
        fmt="KV_2LTD",
        dtype=_BENCH_DTYPE,
        max_tokens=_BENCH_TOKENS,
        shape_of=functools.partial(_bench_shape, width),
        codec=Codec.NONE,
    )
    target = parse_remote_url(url)
    per_call = max(1, call_bytes // chunk_bytes)
    batch_bytes = DEFAULT_BATCH_BYTES if batch_bytes is None else batch_bytes
    _check_count("batch_bytes", batch_bytes)
    per_trip = max(1, batch_bytes // chunk_bytes)
    per_chunk = -(-chunk_bytes // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
    # Sources, and every chunk read back by a get.
    pool = MemoryPool(2 * per_chunk * chunks, pin_memory=False)
    raw: Any
    if target.cluster:
        raw = redis.asyncio.cluster.RedisCluster(
            startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.nodes],
            username=target.username,
            password=target.password,
            socket_timeout=timeout,
        )
    else:
        raw = redis.asyncio.Redis.from_url(target.url, socket_timeout=timeout)
    sources: list[MemoryObj] = []
    tier: RedisBackend | None = None
    try:
        tier = await RedisBackend.open(
            url,
            pool=pool,
            spec=spec,
            allocation_timeout=timeout,
            timeout=timeout,
            key_prefix=_REDIS_TIER_PREFIX,
            batch_bytes=batch_bytes,
        )
        for _ in range(chunks):
            obj = pool.allocate_nowait(spec.shape_of(_BENCH_TOKENS), _BENCH_DTYPE)
            if obj is None:
                raise InvalidInputError("benchmark pool too small")  # sized above: a bug
            sources.append(obj)
        await anyio.to_thread.run_sync(_fill_random, [obj.tensor for obj in sources])
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(chunks)]
        records = []
        for key, obj in zip(keys, sources, strict=True):
            header, payload = spec.encode(key, obj)
            records.append(header + bytes(payload))
        side = _RawRedis(
            raw,
            cluster=target.cluster,
            # "{<tier key>}:raw" hashes to the tier key's cluster slot (only the part in
            # braces is hashed), so both sides spread their values over the same nodes.
            keys=[b"{" + _redis_tier_key(key) + _REDIS_RAW_SUFFIX for key in keys],
            records=records,
            per_trip=per_trip,
            # As many values per SET round trip as the tier's put sends (a quarter batch).
            set_per_trip=-(-per_trip // PUT_SPLIT),
        )
        runs = [
            await _redis_run(tier, side, keys=keys, sources=sources, per_call=per_call, run=run)
            for run in range(repeats + 1)  # run 0 warms connections and memory up
        ][1:]
    finally:
        for obj in sources:
            obj.unref()
        if tier is not None:
            await tier.aclose()
        await raw.aclose()
        pool.close()

    def median(name: str) -> float:
        return statistics.median(r[name] for r in runs)

    return {
        "tier": "redis",
        "url": target.display,
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "values_per_call": per_call,
        "values_per_round_trip": per_trip,
        "repeats": repeats,
        "put_gbps": median("put_gbps"),
        "raw_set_gbps": median("raw_set_gbps"),
        "put_ratio": median("put_ratio"),
        "get_gbps": median("get_gbps"),
        "raw_get_gbps": median("raw_get_gbps"),
        "get_ratio": median("get_ratio"),
        "targets": dict(REDIS_TARGETS),
        "runs": runs,
    }


def _redis_tier_key(key: ChunkKey) -> bytes:
    return (_REDIS_TIER_PREFIX + key.to_str()).encode()


class _RawRedis:
    """The baseline: plain redis-py pipelines moving the records the tier stores."""

    def __init__(
        self,
        client: Any,
        *,
        cluster: bool,
        keys: list[bytes],
        records: list[bytes],
        per_trip: int,
        set_per_trip: int,
    ) -> None:
        self._client = client
        self._cluster = cluster
        self._keys = keys
        self._records = records
        self._per_trip = per_trip
        self._set_per_trip = set_per_trip

    def _pipeline(self) -> Any:
        return self._client.pipeline() if self._cluster else self._client.pipeline(False)

    def _trips(self, lo: int, hi: int, step: int) -> list[range]:
        return [range(i, min(hi, i + step)) for i in range(lo, hi, step)]

    async def set(self, lo: int, hi: int) -> None:
        for trip in self._trips(lo, hi, self._set_per_trip):
            async with self._pipeline() as pipe:
                for i in trip:
                    pipe.set(self._keys[i], self._records[i])
                await pipe.execute()

    async def get(self, lo: int, hi: int) -> None:
        got: list[bytes | None] = []
        for trip in self._trips(lo, hi, self._per_trip):
            async with self._pipeline() as pipe:
                for i in trip:
                    pipe.get(self._keys[i])
                got += await pipe.execute()
        if got[0] != self._records[lo] or got[-1] != self._records[hi - 1]:
            raise TierError("raw GET returned other bytes than were SET")

    async def delete(self, extra: list[bytes]) -> None:
        """DEL the raw keys and ``extra`` keys. Not UNLINK: the server frees the values
        before it answers, instead of in a background thread competing with the next run."""
        async with self._pipeline() as pipe:
            for key in [*self._keys, *extra]:
                pipe.execute_command("DEL", key)
            await pipe.execute()


async def _redis_run(
    tier: RedisBackend,
    raw: _RawRedis,
    *,
    keys: list[ChunkKey],
    sources: list[MemoryObj],
    per_call: int,
    run: int,
) -> dict[str, float]:
    """One run: all puts then all gets, through the tier and raw, ``per_call`` values at a
    time, the two sides taking turns (see :func:`_interleaved`)."""
    nbytes = sum(obj.nbytes for obj in sources)
    spans = [(lo, min(lo + per_call, len(keys))) for lo in range(0, len(keys), per_call)]

    async def tier_put(lo: int, hi: int) -> None:
        for obj in sources[lo:hi]:
            obj.checksum = None  # computed by the tier, as for a chunk seen the first time
        added = await tier.put(keys[lo:hi], sources[lo:hi])
        if added != hi - lo:
            raise TierError(f"the redis tier stored {added} of {hi - lo} chunks")

    async def tier_get(lo: int, hi: int) -> None:
        got = await tier.get(keys[lo:hi])
        for obj in got:
            if obj is not None:
                obj.unref()
        if any(obj is None for obj in got):
            raise TierError("the redis tier lost a chunk during the benchmark")

    try:
        put_s, set_s = await _interleaved(tier_put, raw.set, spans, run)
        get_s, raw_get_s = await _interleaved(tier_get, raw.get, spans, run)
        # Untimed: the tier hands back exactly the bytes it was given.
        got = await tier.get([keys[0], keys[-1]])
        try:
            for obj, source in zip(got, (sources[0], sources[-1]), strict=True):
                if obj is None or not torch.equal(
                    obj.tensor.view(torch.uint8), source.tensor.view(torch.uint8)
                ):
                    raise TierError("the redis tier returned other bytes than were put")
        finally:
            for obj in got:
                if obj is not None:
                    obj.unref()
    finally:
        await raw.delete([_redis_tier_key(key) for key in keys])
    return {
        "put_gbps": _rate(nbytes, put_s),
        "raw_set_gbps": _rate(nbytes, set_s),
        "put_ratio": set_s / put_s,
        "get_gbps": _rate(nbytes, get_s),
        "raw_get_gbps": _rate(nbytes, raw_get_s),
        "get_ratio": raw_get_s / get_s,
    }


async def run_tiers_bench(
    *,
    directory: str | os.PathLike[str] | None = None,
    redis_url: str | None = None,
    chunk_bytes: int = 4 << 20,
    chunks: int = 64,
    repeats: int = 3,
) -> dict[str, Any]:
    """Both tier benchmarks: disk in ``directory`` (a temporary one by default), Redis at
    ``redis_url`` or, when none is given, a ``redis-server`` started for the run on a free
    loopback port (skipped, and said so, when redis-server is not installed)."""
    results: dict[str, Any] = {"problems": []}
    if directory is None:
        with tempfile_directory() as tmp:
            results["disk"] = await bench_disk(
                tmp, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
            )
    else:
        results["disk"] = await bench_disk(
            directory, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
        )
    if redis_url is not None:
        results["redis"] = await bench_redis(
            redis_url, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
        )
    elif shutil.which("redis-server") is None:
        results["problems"].append("redis-server is not installed: Redis tier not measured")
    else:
        with tempfile_directory() as tmp, local_redis(tmp) as url:
            results["redis"] = await bench_redis(
                url, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
            )
    for tier, targets in (("disk", DISK_TARGETS), ("redis", REDIS_TARGETS)):
        figures = results.get(tier)
        if figures is None:
            continue
        for name, target in targets.items():
            if figures[name] < target:
                results.setdefault("below_target", []).append(
                    f"{tier} {name} {figures[name]:.2f} < {target}"
                )
    return results


def format_tiers(results: Mapping[str, Any]) -> str:
    """The tier benchmark as a short table, with each ratio next to its target."""
    lines = ["tier   op    GB/s   raw GB/s  ratio  target"]
    rows = (
        ("disk", "put", "put_gbps", "raw_write_gbps", "put_ratio", DISK_TARGETS),
        ("disk", "get", "get_gbps", "raw_read_gbps", "get_ratio", DISK_TARGETS),
        ("redis", "put", "put_gbps", "raw_set_gbps", "put_ratio", REDIS_TARGETS),
        ("redis", "get", "get_gbps", "raw_get_gbps", "get_ratio", REDIS_TARGETS),
    )
    for tier, op, rate, raw, ratio, targets in rows:
        figures = results.get(tier)
        if figures is None:
            continue
        lines.append(
            f"{tier:<6} {op:<4} {figures[rate]:6.2f}   {figures[raw]:6.2f}   "
            f"{figures[ratio]:5.2f}  >= {targets[ratio]}"
        )
    lines.extend(f"note: {problem}" for problem in results.get("problems", []))
    lines.extend(f"below target: {item}" for item in results.get("below_target", []))
    return "\n".join(lines)


@contextlib.contextmanager
def tempfile_directory() -> Iterator[str]:
    """A temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lmcache-async-bench-") as tmp:
        yield tmp


@contextlib.contextmanager
def local_redis(directory: str, timeout: float = 10.0) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port for the length of the block (no
    persistence), stopped by pid afterwards; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise InvalidInputError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
