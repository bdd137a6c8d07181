"""The Redis tier's put and get GB/s next to plain pipelined redis-py SET and GET of the
same records, and the same tier with its records encrypted."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import torch

from lmcache_async import ChunkKey, InvalidInputError, TierError
from lmcache_async.bench import gbps
from lmcache_async.bench.tiers.common import (
    BENCH_DTYPE,
    BENCH_TOKENS,
    CHUNK_GRANULE,
    ENCRYPTION_TARGETS,
    bench_cipher,
    bench_spec,
    check_count,
    fill_random,
    interleaved,
)
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.memory.pool import DEFAULT_PAGE_SIZE, MemoryObj, MemoryPool

if TYPE_CHECKING:
    from lmcache_async.backends.redis import RedisBackend

__all__ = ["REDIS_TARGETS", "bench_redis"]

REDIS_TARGETS: Final[Mapping[str, float]] = {"put_ratio": 0.8, "get_ratio": 0.8}
"""The Redis tier should reach at least 0.8x raw pipelined SET and GET of the same values."""

_REDIS_TIER_PREFIX: Final = "lmca-bench:"
_REDIS_SEALED_PREFIX: Final = "lmca-bench-sealed:"
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
    encrypted: bool = True,
) -> dict[str, Any]:
    """Redis tier put/get GB/s against raw redis-py pipelined SET/GET of the same values,
    and with ``encrypted`` the same tier sealing its records (AES-256-GCM, a random key,
    its own key prefix) against the tier in the clear, taking turns with the other two.

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
        ratios); with ``encrypted`` also ``encrypted_put_gbps``, ``encrypted_get_gbps`` and
        their ratios to the tier in the clear, ``encrypted_put_ratio`` and
        ``encrypted_get_ratio``; the settings, the targets and ``runs`` (every run's
        figures).

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

    check_count("chunk_bytes", chunk_bytes)
    check_count("chunks", chunks)
    check_count("repeats", repeats)
    check_count("call_bytes", call_bytes)
    if chunk_bytes % CHUNK_GRANULE:
        raise InvalidInputError(
            f"chunk_bytes must be a multiple of {CHUNK_GRANULE}, got {chunk_bytes}"
        )
    spec = bench_spec("redis", chunk_bytes)
    target = parse_remote_url(url)
    per_call = max(1, call_bytes // chunk_bytes)
    batch_bytes = DEFAULT_BATCH_BYTES if batch_bytes is None else batch_bytes
    check_count("batch_bytes", batch_bytes)
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
    tiers: list[RedisBackend] = []
    sealed = bench_spec("redis", chunk_bytes, bench_cipher()) if encrypted else None
    try:
        for tier_spec, prefix in ((spec, _REDIS_TIER_PREFIX), (sealed, _REDIS_SEALED_PREFIX)):
            if tier_spec is not None:
                tiers.append(
                    await RedisBackend.open(
                        url,
                        pool=pool,
                        spec=tier_spec,
                        allocation_timeout=timeout,
                        timeout=timeout,
                        key_prefix=prefix,
                        batch_bytes=batch_bytes,
                    )
                )
        for _ in range(chunks):
            obj = pool.allocate_nowait(spec.shape_of(BENCH_TOKENS), BENCH_DTYPE)
            if obj is None:
                raise InvalidInputError("benchmark pool too small")  # sized above: a bug
            sources.append(obj)
        await anyio.to_thread.run_sync(fill_random, [obj.tensor for obj in sources])
        keys = [ChunkKey(i.to_bytes(DIGEST_SIZE, "little")) for i in range(chunks)]
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
            await _redis_run(tiers, side, keys=keys, sources=sources, per_call=per_call, run=run)
            for run in range(repeats + 1)  # run 0 warms connections and memory up
        ][1:]
    finally:
        for obj in sources:
            obj.unref()
        for tier in tiers:
            await tier.aclose()
        await raw.aclose()
        pool.close()

    def median(name: str) -> float:
        return statistics.median(r[name] for r in runs)

    sealed_names = ("put_gbps", "put_ratio", "get_gbps", "get_ratio") if encrypted else ()
    figures = {f"encrypted_{name}": median(f"encrypted_{name}") for name in sealed_names}
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
        **figures,
        "encrypted": encrypted,
        "targets": {**REDIS_TARGETS, **(ENCRYPTION_TARGETS if encrypted else {})},
        "runs": runs,
    }


def _redis_tier_key(key: ChunkKey, prefix: str = _REDIS_TIER_PREFIX) -> bytes:
    return (prefix + key.to_str()).encode()


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
    tiers: list[RedisBackend],
    raw: _RawRedis,
    *,
    keys: list[ChunkKey],
    sources: list[MemoryObj],
    per_call: int,
    run: int,
) -> dict[str, float]:
    """One run: all puts then all gets, raw and through the tier (and the encrypted tier,
    the second of ``tiers`` if there is one), ``per_call`` values at a time, the sides
    taking turns (see :func:`~lmcache_async.bench.tiers.common.interleaved`)."""
    nbytes = sum(obj.nbytes for obj in sources)
    spans = [(lo, min(lo + per_call, len(keys))) for lo in range(0, len(keys), per_call)]
    puts = [functools.partial(_tier_put, tier, keys, sources) for tier in tiers]
    gets = [functools.partial(_tier_get, tier, keys) for tier in tiers]
    try:
        put_s = await interleaved([raw.set, *puts], spans, run)
        get_s = await interleaved([raw.get, *gets], spans, run)
        for tier in tiers:  # untimed: each tier hands back exactly the bytes it was given
            await _check_exact(tier, [keys[0], keys[-1]], [sources[0], sources[-1]])
    finally:
        prefixes = (_REDIS_TIER_PREFIX, _REDIS_SEALED_PREFIX)[: len(tiers)]
        await raw.delete([_redis_tier_key(key, prefix) for prefix in prefixes for key in keys])
    figures = {
        "put_gbps": gbps(nbytes, put_s[1]),
        "raw_set_gbps": gbps(nbytes, put_s[0]),
        "put_ratio": put_s[0] / put_s[1],
        "get_gbps": gbps(nbytes, get_s[1]),
        "raw_get_gbps": gbps(nbytes, get_s[0]),
        "get_ratio": get_s[0] / get_s[1],
    }
    if len(tiers) > 1:
        figures["encrypted_put_gbps"] = gbps(nbytes, put_s[2])
        figures["encrypted_put_ratio"] = put_s[1] / put_s[2]
        figures["encrypted_get_gbps"] = gbps(nbytes, get_s[2])
        figures["encrypted_get_ratio"] = get_s[1] / get_s[2]
    return figures


async def _tier_put(
    tier: RedisBackend, keys: list[ChunkKey], sources: list[MemoryObj], lo: int, hi: int
) -> None:
    for obj in sources[lo:hi]:
        obj.checksum = None  # computed by the tier, as for a chunk seen the first time
    added = await tier.put(keys[lo:hi], sources[lo:hi])
    if added != hi - lo:
        raise TierError(f"the redis tier stored {added} of {hi - lo} chunks")


async def _tier_get(tier: RedisBackend, keys: list[ChunkKey], lo: int, hi: int) -> None:
    got = await tier.get(keys[lo:hi])
    for obj in got:
        if obj is not None:
            obj.unref()
    if any(obj is None for obj in got):
        raise TierError("the redis tier lost a chunk during the benchmark")


async def _check_exact(tier: RedisBackend, keys: list[ChunkKey], sources: list[MemoryObj]) -> None:
    got = await tier.get(keys)
    try:
        for obj, source in zip(got, sources, strict=True):
            if obj is None or not torch.equal(
                obj.tensor.view(torch.uint8), source.tensor.view(torch.uint8)
            ):
                raise TierError("the redis tier returned other bytes than were put")
    finally:
        for obj in got:
            if obj is not None:
                obj.unref()
