"""The Redis/Valkey tier against real servers: a standalone redis-server and a 3-node cluster.

Round trips are bit-exact; corrupt, truncated or misplaced values are misses that delete the
entry and count; a stopped server fails calls fast and the tier recovers when it returns.
Every test ends with the pool empty: the tier never leaks a MemoryObj.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.asyncio.cluster
import torch

from lmcache_async.backends.codec import Codec
from lmcache_async.backends.record import RecordHeader, RecordSpec
from lmcache_async.backends.redis import (
    DEFAULT_KEY_PREFIX,
    PUT_SPLIT,
    RedisBackend,
    parse_remote_url,
)
from lmcache_async.errors import (
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    TierUnavailableError,
)
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES
from tests.servers import RedisCluster, RedisServer

pytestmark = pytest.mark.subprocess

CHUNK = 16
PAGE = 4096


def make_layout(dtype: torch.dtype = torch.bfloat16, heads: int = 2, head: int = 64) -> KVLayout:
    return KVLayout.vllm_flash_attn(
        num_layers=2, block_size=16, num_kv_heads=heads, head_size=head, dtype=dtype
    )


def make_spec(layout: KVLayout, codec: Codec = Codec.NONE) -> RecordSpec:
    return RecordSpec(
        fingerprint=layout.fingerprint,
        fmt=str(layout.fmt),
        dtype=layout.dtype,
        max_tokens=CHUNK,
        shape_of=layout.payload_shape,
        codec=codec,
    )


def key(i: int, salt: int = 0) -> ChunkKey:
    return ChunkKey((i + (salt << 64)).to_bytes(DIGEST_SIZE, "little"))


def raw_bytes(obj: MemoryObj) -> torch.Tensor:
    return obj.tensor.contiguous().view(torch.uint8).reshape(-1)


async def filled(pool: MemoryPool, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Any:
    """A pool object of random bits (NaNs and infinities included for float types)."""
    obj = await pool.allocate(shape, dtype, timeout=1)
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen)
    raw_bytes(obj).copy_(bits)
    return obj


@dataclass
class Target:
    """A running Redis deployment to test against, with a raw client to poke at it."""

    url: str
    raw: Any
    cluster: bool


@pytest.fixture(params=["standalone", "cluster"])
async def target(request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        raw: Any = redis.asyncio.Redis.from_url(server.url)
        yield Target(server.url, raw, cluster=False)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        raw = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        yield Target(cluster.url, raw, cluster=True)
    await raw.aclose()


@dataclass
class Env:
    pool: MemoryPool
    spec: RecordSpec
    layout: KVLayout
    tier: RedisBackend


Opener = Callable[..., Awaitable[Env]]


@pytest.fixture
async def open_tier() -> AsyncIterator[Opener]:
    """Open tiers on fresh pools; at the end close them and check no pool object is left."""
    envs: list[Env] = []

    async def opener(
        url: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        capacity: int = 8 * 1024 * 1024,
        allocation_timeout: float = 1.0,
        heads: int = 2,
        head: int = 64,
        **options: Any,
    ) -> Env:
        layout = make_layout(dtype, heads, head)
        spec = make_spec(layout)
        pool = MemoryPool(capacity, page_size=PAGE, pin_memory=False)
        tier = await RedisBackend.open(
            url, pool=pool, spec=spec, allocation_timeout=allocation_timeout, **options
        )
        env = Env(pool, spec, layout, tier)
        envs.append(env)
        return env

    yield opener
    for env in envs:
        await env.tier.aclose()
        assert env.pool.stats().num_objects == 0, "the tier leaked pool objects"


def rkey(k: ChunkKey) -> bytes:
    return (DEFAULT_KEY_PREFIX + k.to_str()).encode()


async def absent(target: Target, k: ChunkKey) -> bool:
    return int(await target.raw.exists(rkey(k))) == 0


async def poll_until(check: Callable[[], Awaitable[bool]], interval: float = 0.05) -> None:
    """Poll state outside this process (a server) until ``check()`` holds; callers bound
    the wait with ``anyio.fail_after``."""
    for _ in itertools.count():
        if await check():
            return
        await anyio.sleep(interval)


async def put_random(env: Env, keys: list[ChunkKey], tokens: list[int]) -> list[Any]:
    """Put random payloads of ``tokens[i]`` tokens under ``keys[i]``; returns the objects
    (each still referenced by the caller)."""
    objs = [
        await filled(env.pool, env.layout.payload_shape(t), env.layout.dtype, seed=i)
        for i, t in enumerate(tokens)
    ]
    assert await env.tier.put(keys, objs) == len(keys)
    return objs


def release(*groups: list[Any]) -> None:
    for group in groups:
        for obj in group:
            if obj is not None:
                obj.unref()


# -- round trips ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("dtype", "heads", "head"),
    [(torch.bfloat16, 2, 64), (torch.float16, 4, 32), (torch.float32, 1, 128)],
)
async def test_round_trip_is_bit_exact(
    target: Target, open_tier: Opener, dtype: torch.dtype, heads: int, head: int
) -> None:
    env = await open_tier(target.url, dtype=dtype, heads=heads, head=head)
    keys = [key(i) for i in range(4)]
    objs = await put_random(env, keys, [CHUNK, CHUNK, CHUNK, 5])
    got = await env.tier.get(keys)
    try:
        for obj, back in zip(objs, got, strict=True):
            assert back is not None
            assert back is not obj
            assert back.shape == obj.shape and back.dtype == obj.dtype
            assert torch.equal(raw_bytes(back), raw_bytes(obj))
            assert back.ref_count == 1
    finally:
        release(objs, got)
    stats = env.tier.stats()
    assert (stats.puts, stats.hits, stats.misses, stats.chunks) == (4, 4, 0, 4)
    assert stats.healthy and stats.corrupt == 0 and stats.errors == 0


@pytest.mark.anyio
async def test_large_values_round_trip_through_worker_threads(
    target: Target, open_tier: Opener
) -> None:
    # 2 * 8 layers... here 2 * 2 * 16 * 8192 * 2 B = 1 MiB per chunk: above the inline limit.
    env = await open_tier(target.url, heads=16, head=512, capacity=16 * 1024 * 1024)
    keys = [key(i) for i in range(6)]
    objs = await put_random(env, keys, [CHUNK] * 6)
    assert objs[0].nbytes == 1024 * 1024
    got = await env.tier.get(keys)
    try:
        assert all(
            b is not None and torch.equal(raw_bytes(b), raw_bytes(o))
            for o, b in zip(objs, got, strict=True)
        )
    finally:
        release(objs, got)


@pytest.mark.anyio
async def test_small_batches_split_into_several_round_trips(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url, batch_bytes=1)  # one key per pipeline
    keys = [key(i) for i in range(5)]
    objs = await put_random(env, keys, [CHUNK, 3, CHUNK, 1, CHUNK])
    got = await env.tier.get([*keys, key(99)])
    try:
        assert got[-1] is None
        assert all(
            b is not None and torch.equal(raw_bytes(b), raw_bytes(o))
            for o, b in zip(objs, got, strict=False)
        )
    finally:
        release(objs, got)


@pytest.mark.anyio
async def test_existing_keys_are_kept_and_missing_keys_are_none(
    target: Target, open_tier: Opener
) -> None:
    env = await open_tier(target.url)
    first = await put_random(env, [key(0)], [CHUNK])
    other = await filled(env.pool, env.layout.payload_shape(CHUNK), env.layout.dtype, seed=7)
    assert await env.tier.put([key(0), key(1)], [other, other]) == 1
    got = await env.tier.get([key(0), key(2), key(1)])
    try:
        assert got[1] is None
        assert got[0] is not None and torch.equal(raw_bytes(got[0]), raw_bytes(first[0]))
        assert got[2] is not None and torch.equal(raw_bytes(got[2]), raw_bytes(other))
        assert other.ref_count == 1, "put must give back the references it took"
    finally:
        release(first, [other], got)
    assert (env.tier.stats().hits, env.tier.stats().misses) == (2, 1)


@pytest.mark.anyio
async def test_put_refuses_mismatched_lengths(redis_server: RedisServer, open_tier: Opener) -> None:
    env = await open_tier(redis_server.url)
    with pytest.raises(InvalidInputError):
        await env.tier.put([key(0), key(1)], [])
    assert await env.tier.put([], []) == 0
    assert await env.tier.get([]) == []


@pytest.mark.anyio
async def test_contains_prefix_counts_leading_keys(target: Target, open_tier: Opener) -> None:
    env = await open_tier(target.url)
    objs = await put_random(env, [key(0), key(1), key(3)], [CHUNK, CHUNK, CHUNK])
    release(objs)
    tier = env.tier
    assert await tier.contains_prefix([key(0), key(1), key(2), key(3)]) == 2
    assert await tier.contains_prefix([key(0), key(1), key(3)]) == 3
    assert await tier.contains_prefix([key(2), key(0)]) == 0
    assert await tier.contains_prefix([]) == 0


def command_calls(server: RedisServer, command: str) -> int:
    """How often ``server`` ran ``command`` since its statistics were last reset."""
    for line in server.command("INFO", "commandstats").decode().splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=", 1)[1].split(",", 1)[0])
    return 0


@pytest.mark.anyio
@pytest.mark.parametrize("batch_keys", [1, 64])
async def test_get_prefix_reads_the_leading_run_with_gets_alone(
    redis_server: RedisServer, open_tier: Opener, batch_keys: int
) -> None:
    """No EXISTS; nothing past the first missing key is loaded; with one key per batch no
    batch after it but the one fetched ahead is asked for."""
    layout = make_layout()
    chunk_bytes = math.prod(layout.payload_shape(CHUNK)) * layout.dtype.itemsize
    env = await open_tier(redis_server.url, batch_bytes=batch_keys * chunk_bytes)
    stored = [0, 1, 2, 4, 5, 6, 7]
    objs = await put_random(env, [key(i) for i in stored], [CHUNK] * len(stored))
    in_use = env.pool.stats().num_objects
    redis_server.command("CONFIG", "RESETSTAT")
    with anyio.fail_after(5):
        got = await env.tier.get_prefix([key(i) for i in range(8)])
    try:
        assert len(got) == 3
        assert all(torch.equal(raw_bytes(g), raw_bytes(o)) for g, o in zip(got, objs, strict=False))
        assert env.pool.stats().num_objects == in_use + 3, "nothing past the gap is kept"
    finally:
        release(objs, got)
    assert command_calls(redis_server, "exists") == 0
    gets = command_calls(redis_server, "get")
    assert gets == 8 if batch_keys == 64 else 4 <= gets <= 5
    assert (env.tier.stats().hits, env.tier.stats().misses) == (3, 1)
    assert await env.tier.get_prefix([]) == []


@pytest.mark.anyio
async def test_cluster_spreads_keys_over_every_node(
    redis_cluster: RedisCluster, open_tier: Opener
) -> None:
    env = await open_tier(redis_cluster.url)
    keys = [key(i) for i in range(24)]
    objs = await put_random(env, keys, [1] * 24)
    release(objs)
    sizes = [int(node.command("DBSIZE").strip().lstrip(b":")) for node in redis_cluster.nodes]
    assert sum(sizes) == 24
    assert all(size > 0 for size in sizes), sizes
    assert await env.tier.contains_prefix(keys) == 24
    assert await env.tier.clear() == 24
    assert await env.tier.contains_prefix(keys) == 0


@pytest.mark.anyio
async def test_concurrent_puts_and_gets_stay_bit_exact(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    # 256 KiB chunks and 1 MiB batches: several batches per call, with the thread path.
    env = await open_tier(
        redis_server.url, heads=8, head=256, capacity=64 * 1024 * 1024, batch_bytes=1 << 20
    )
    groups = [[key(i, salt=g) for i in range(10)] for g in range(4)]
    objs = [
        [
            await filled(env.pool, env.layout.payload_shape(CHUNK), env.layout.dtype, 10 * g + i)
            for i in range(10)
        ]
        for g in range(4)
    ]
    assert objs[0][0].nbytes == 256 * 1024
    added: list[int] = []

    async def put(g: int) -> None:
        added.append(await env.tier.put(groups[g], objs[g]))

    async with anyio.create_task_group() as tg:
        for g in range(4):
            tg.start_soon(put, g)
    assert added == [10] * 4
    results: dict[int, list[MemoryObj | None]] = {}

    async def get(g: int) -> None:
        results[g] = await env.tier.get(groups[g])

    async with anyio.create_task_group() as tg:
        for g in range(4):
            tg.start_soon(get, g)
    try:
        for g in range(4):
            for obj, back in zip(objs[g], results[g], strict=True):
                assert back is not None and torch.equal(raw_bytes(back), raw_bytes(obj))
    finally:
        for g in range(4):
            release(objs[g], results[g])


@pytest.mark.anyio
async def test_cancelled_calls_leak_nothing(redis_server: RedisServer, open_tier: Opener) -> None:
    env = await open_tier(
        redis_server.url, heads=16, head=512, capacity=32 * 1024 * 1024, batch_bytes=2 << 20
    )
    keys = [key(i) for i in range(12)]
    objs = await put_random(env, keys, [CHUNK] * 12)
    for delay in (0, 0.001, 0.005, 0.02):
        with anyio.move_on_after(delay):
            release(await env.tier.get(keys))
        with anyio.move_on_after(delay):
            await env.tier.put([key(i, salt=1) for i in range(12)], objs)
        assert env.pool.stats().num_objects == 12, "only the caller's objects are alive"
        assert all(obj.ref_count == 1 for obj in objs)
    # The tier still works after its calls were cut short.
    got = await env.tier.get(keys)
    try:
        assert all(
            b is not None and torch.equal(raw_bytes(b), raw_bytes(o))
            for o, b in zip(objs, got, strict=True)
        )
    finally:
        release(objs, got)


# -- standalone put: SET commands written from the objects' memory --------------------------

# 64 KiB per token (heads=16, head=512): 4 tokens make exactly one write piece (256 KiB),
# so these sizes cover payloads joined with their command, at the limit, and sent as views.
BIG = {"heads": 16, "head": 512}
MIXED_TOKENS = [CHUNK, 1, 4, CHUNK, 3, CHUNK, CHUNK, 2, 5, CHUNK, 1, CHUNK] * 2


async def stored_bytes(server: RedisServer, keys: list[ChunkKey]) -> int:
    raw: Any = redis.asyncio.Redis.from_url(server.url)
    try:
        return sum([int(await raw.strlen(rkey(k))) for k in keys])
    finally:
        await raw.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("ttl", [None, 60.0])
async def test_large_and_small_values_round_trip_byte_exact(
    redis_server: RedisServer, open_tier: Opener, ttl: float | None
) -> None:
    env = await open_tier(
        redis_server.url, capacity=64 * 1024 * 1024, batch_bytes=16 << 20, ttl=ttl, **BIG
    )
    keys = [key(i) for i in range(len(MIXED_TOKENS))]
    objs = await put_random(env, keys, MIXED_TOKENS)
    await assert_all_back(env.tier, keys, objs)
    assert env.tier.stats().bytes == await stored_bytes(redis_server, keys)
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        ttls = [int(await raw.pttl(rkey(k))) for k in keys]
    finally:
        await raw.aclose()
    if ttl is None:
        assert set(ttls) == {-1}
    else:
        assert all(0 < t <= ttl * 1000 for t in ttls)


async def assert_all_back(tier: Any, keys: list[ChunkKey], objs: list[Any]) -> None:
    """Every key reads back byte-exact; then ``objs`` and what was read are released."""
    got = await tier.get(keys)
    try:
        for obj, back in zip(objs, got, strict=True):
            assert back is not None and torch.equal(raw_bytes(back), raw_bytes(obj))
    finally:
        release(objs, got)


def in_use_connections(env: Env) -> int:
    """Connections a call holds: redis-py's, and the bulk path's own."""
    return len(env.tier._conn.client.connection_pool._in_use_connections) + (
        env.tier._conn.wire.in_use
    )


async def assert_whole_or_absent(env: Env, keys: list[ChunkKey], objs: list[Any]) -> None:
    """Every key holds the exact bytes put, or nothing: a cut-short put never stores a
    partial or mixed-up record."""
    got = await env.tier.get(keys)
    try:
        for obj, back in zip(objs, got, strict=True):
            assert back is None or torch.equal(raw_bytes(back), raw_bytes(obj))
    finally:
        release(got)
    assert env.tier.stats().corrupt == 0


@pytest.mark.anyio
async def test_cancelled_put_leaves_nothing_behind_and_the_client_still_works(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(
        redis_server.url, capacity=64 * 1024 * 1024, batch_bytes=8 << 20, timeout=5.0, **BIG
    )
    keys = [key(i) for i in range(24)]
    objs = [
        await filled(env.pool, env.layout.payload_shape(CHUNK), env.layout.dtype, seed=i)
        for i in range(24)
    ]
    for salt, delay in enumerate((0, 0.001, 0.003, 0.01, 0.03), start=1):
        salted = [key(i, salt) for i in range(24)]
        with anyio.move_on_after(delay):
            await env.tier.put(salted, objs)
        assert env.pool.stats().num_objects == 24, "only the caller's objects are alive"
        assert all(obj.ref_count == 1 for obj in objs)
        assert in_use_connections(env) == 0
        await assert_whole_or_absent(env, salted, objs)
    with anyio.fail_after(10):
        assert await env.tier.put(keys, objs) == 24
    await assert_all_back(env.tier, keys, objs)
    assert in_use_connections(env) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["killed", "hung", "cancelled"])
async def test_put_cut_short_mid_write_fails_fast_and_leaves_nothing_behind(
    redis_server: RedisServer,
    open_tier: Opener,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    # The server stops reading once the put knows what to send; the put's one batch of
    # 24 MiB does not fit in the socket buffers, so it is mid-write when, after 0.3 s, the
    # server is killed (the put fails at once), or stays hung (the put fails at its
    # deadline: the timeout plus 24 MiB at 50 MB/s), or the caller gives up.
    # Killed or cancelled, the put must end within ten times the 0.3 s, far before its
    # deadline; hung, within five times its deadline.
    timeout = 2.0 if fault == "hung" else 60.0
    deadline = timeout + (24 << 20) / 50e6
    limit = 5 * deadline if fault == "hung" else 3.0
    env = await open_tier(
        redis_server.url,
        capacity=64 * 1024 * 1024,
        batch_bytes=PUT_SPLIT * (24 << 20),
        timeout=timeout,
        **BIG,
    )
    tier = env.tier
    pid = redis_server.pid
    assert pid is not None
    keys = [key(i) for i in range(24)]
    objs = [
        await filled(env.pool, env.layout.payload_shape(CHUNK), env.layout.dtype, seed=i)
        for i in range(24)
    ]
    real_exists = tier._conn.exists

    async def exists_then_stop(rkeys: list[bytes]) -> list[bool]:
        found = await real_exists(rkeys)
        os.kill(pid, signal.SIGSTOP)
        return found

    monkeypatch.setattr(tier._conn, "exists", exists_then_stop)
    try:
        with anyio.fail_after(limit):
            if fault == "cancelled":
                with anyio.move_on_after(0.3) as scope:
                    await tier.put(keys, objs)
                assert scope.cancelled_caught
            else:
                async with anyio.create_task_group() as tg:
                    if fault == "killed":
                        tg.start_soon(kill_after, pid, 0.3)
                    with pytest.raises(TierUnavailableError):
                        await tier.put(keys, objs)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        monkeypatch.undo()
    if fault != "killed":
        # The connection cut mid-command was closed, so the server drops the half it has
        # (kept open, it would take the next command for the rest of the value).
        with anyio.fail_after(2):
            await poll_until(lambda: no_half_received_command(redis_server))
    assert tier.healthy() is (fault == "cancelled")
    assert env.pool.stats().num_objects == 24, "only the caller's objects are alive"
    assert all(obj.ref_count == 1 for obj in objs)
    assert in_use_connections(env) == 0

    if fault == "killed":
        redis_server.restart()  # same port, empty
    # The same client goes on at once (no back-off keeps it unhealthy).
    with anyio.fail_after(10):
        assert await tier.check_health()
        await assert_whole_or_absent(env, keys, objs)
    assert tier.stats().errors == (0 if fault == "cancelled" else 1)
    with anyio.fail_after(10):
        await tier.put(keys, objs)
    await assert_all_back(tier, keys, objs)


async def no_half_received_command(server: RedisServer) -> bool:
    """Whether no client of ``server`` (but the one asking) has part of a command buffered
    (a large argument is read straight into its own object, counted in ``argv-mem``)."""
    clients = server.command("CLIENT", "LIST").decode().splitlines()
    return all(
        " qbuf=0 " in line and " argv-mem=0 " in line
        for line in clients
        if "addr=" in line and "cmd=client|list" not in line
    )


async def kill_after(pid: int, delay: float) -> None:
    await anyio.sleep(delay)
    os.kill(pid, signal.SIGKILL)


# -- remove, clear, TTL -------------------------------------------------------------------


@pytest.mark.anyio
async def test_remove_and_clear_touch_only_this_prefix(target: Target, open_tier: Opener) -> None:
    env = await open_tier(target.url)
    keys = [key(i) for i in range(5)]
    release(await put_random(env, keys, [CHUNK] * 5))
    await target.raw.set(b"someone-else:1", b"x")
    await target.raw.set(b"lmca", b"y")  # the prefix without its colon is not ours either
    assert await env.tier.remove([key(0), key(9)]) == 1
    assert env.tier.stats().chunks == 4
    assert await env.tier.clear() == 4
    assert await env.tier.contains_prefix(keys[1:]) == 0
    assert await target.raw.get(b"someone-else:1") == b"x"
    assert await target.raw.get(b"lmca") == b"y"
    assert (env.tier.stats().chunks, env.tier.stats().bytes) == (0, 0)


@pytest.mark.anyio
async def test_clear_pages_through_many_keys(target: Target, open_tier: Opener) -> None:
    env = await open_tier(target.url)
    async with target.raw.pipeline() as pipe:
        for i in range(2500):  # more than one SCAN page and one UNLINK batch
            pipe.set(f"{DEFAULT_KEY_PREFIX}{i}".encode(), b"v")
        await pipe.execute()
    assert await env.tier.clear() == 2500
    assert await env.tier.clear() == 0


@pytest.mark.anyio
async def test_key_prefix_with_glob_characters(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url, key_prefix="t*[x]:")
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await raw.set(b"t-other", b"1")
        release(await put_random(env, [key(1)], [CHUNK]))
        assert await raw.exists(("t*[x]:" + key(1).to_str()).encode()) == 1
        assert await env.tier.clear() == 1
        assert await raw.get(b"t-other") == b"1"
    finally:
        await raw.aclose()


@pytest.mark.anyio
async def test_entries_expire_after_their_ttl(target: Target, open_tier: Opener) -> None:
    env = await open_tier(target.url, ttl=1)
    release(await put_random(env, [key(0)], [CHUNK]))
    ttl_ms = await target.raw.pttl(rkey(key(0)))
    assert 0 < ttl_ms <= 1000
    with anyio.fail_after(5):
        await poll_until(lambda: absent(target, key(0)))
    assert await env.tier.contains_prefix([key(0)]) == 0
    assert await env.tier.get([key(0)]) == [None]


@pytest.mark.anyio
async def test_without_ttl_entries_do_not_expire(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url)
    release(await put_random(env, [key(0)], [CHUNK]))
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        assert await raw.pttl(rkey(key(0))) == -1
    finally:
        await raw.aclose()


# -- corruption -----------------------------------------------------------------------


async def assert_corrupt_miss(env: Env, target: Target, k: ChunkKey, corrupt: int) -> None:
    assert await env.tier.get([k]) == [None]
    assert await target.raw.exists(rkey(k)) == 0, "a corrupt entry must be deleted"
    assert env.tier.stats().corrupt == corrupt
    assert env.pool.stats().num_objects == 0


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["payload", "header", "prefix", "last"])
async def test_a_flipped_byte_is_a_miss_and_is_deleted(
    target: Target, open_tier: Opener, where: str
) -> None:
    env = await open_tier(target.url)
    release(await put_random(env, [key(0)], [CHUNK]))
    value = bytearray(await target.raw.get(rkey(key(0))))
    offset = {"payload": len(value) // 2, "header": 20, "prefix": 0, "last": len(value) - 1}
    value[offset[where]] ^= 0x01
    await target.raw.set(rkey(key(0)), bytes(value))
    await assert_corrupt_miss(env, target, key(0), corrupt=1)


@pytest.mark.anyio
@pytest.mark.parametrize("keep", [0, 10, 100, -1])
async def test_a_truncated_value_is_a_miss_and_is_deleted(
    target: Target, open_tier: Opener, keep: int
) -> None:
    env = await open_tier(target.url)
    release(await put_random(env, [key(0), key(1)], [CHUNK, CHUNK]))
    value = await target.raw.get(rkey(key(0)))
    await target.raw.set(rkey(key(0)), value[:keep])
    got = await env.tier.get([key(0), key(1)])
    try:
        assert got[0] is None and got[1] is not None
    finally:
        release(got)
    assert await target.raw.exists(rkey(key(0))) == 0
    assert await target.raw.exists(rkey(key(1))) == 1
    assert env.tier.stats().corrupt == 1


@pytest.mark.anyio
async def test_a_record_of_another_key_or_layout_is_refused(
    target: Target, open_tier: Opener
) -> None:
    env = await open_tier(target.url)
    release(await put_random(env, [key(0)], [CHUNK]))
    # Another key's record moved under key 1.
    await target.raw.set(rkey(key(1)), await target.raw.get(rkey(key(0))))
    await assert_corrupt_miss(env, target, key(1), corrupt=1)
    # A record written by an engine with another layout, under the same key string.
    other = await open_tier(target.url, heads=4, head=32, key_prefix="other:")
    release(await put_random(other, [key(2)], [CHUNK]))
    value = await target.raw.get(("other:" + key(2).to_str()).encode())
    await target.raw.set(rkey(key(2)), value)
    await assert_corrupt_miss(env, target, key(2), corrupt=2)


@pytest.mark.anyio
async def test_corrupt_entries_in_a_large_batch_do_not_leak(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url, heads=16, head=512, capacity=16 * 1024 * 1024)
    keys = [key(i) for i in range(4)]
    objs = await put_random(env, keys, [CHUNK] * 4)
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        value = bytearray(await raw.get(rkey(keys[2])))
        value[-100] ^= 0xFF
        await raw.set(rkey(keys[2]), bytes(value))
        got = await env.tier.get(keys)
        try:
            assert [g is None for g in got] == [False, False, True, False]
            last = got[3]
            assert last is not None and torch.equal(raw_bytes(last), raw_bytes(objs[3]))
        finally:
            release(objs, got)
        assert await raw.exists(rkey(keys[2])) == 0
    finally:
        await raw.aclose()
    assert env.tier.stats().corrupt == 1


# -- memory ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_allocation_timeout_returns_none_for_the_rest(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    # Each chunk is 16 KiB; the pool holds 4 of them.
    env = await open_tier(redis_server.url, capacity=64 * 1024, allocation_timeout=0.05)
    keys = [key(i) for i in range(4)]
    release(await put_random(env, keys, [CHUNK] * 4))
    hold = await filled(env.pool, env.layout.payload_shape(CHUNK), env.layout.dtype, seed=1)
    got = await env.tier.get(keys)
    try:
        assert [g is not None for g in got] == [True, True, True, False]
    finally:
        release(got, [hold])
    assert env.tier.stats().corrupt == 0


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379",
        "memcached://h:1",
        "127.0.0.1:6379",
        "",
        "redis://",
        "redis://:6379",
        "redis://h:notaport",
        "redis://h:70000",
        "redis://h:6379/db1",
        "unix://",
        "redis-cluster://",
        "redis-cluster://h1:7000,h2",
        "redis-cluster://h1:7000,:7001",
        "redis-cluster://h1:7000/0",
    ],
)
def test_bad_urls_name_remote_url(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_remote_url(url)
    assert info.value.field == "remote_url"


def test_urls_parse() -> None:
    assert parse_remote_url("valkey://h:1/2").url == "redis://h:1/2"
    assert parse_remote_url("valkeys://h:1").url == "rediss://h:1"
    target = parse_remote_url("redis-cluster://u:secret@h1:7000,[::1]:7001")
    assert target.cluster and target.nodes == (("h1", 7000), ("::1", 7001))
    assert (target.username, target.password) == ("u", "secret")
    assert "secret" not in target.display and "secret" not in repr(target)
    assert "pw" not in parse_remote_url("redis://:pw@h:1").display
    assert "pw" not in parse_remote_url("redis://h:1/0?password=pw&db=1").display


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"timeout": 0}, "remote_timeout"),
        ({"timeout": -1}, "remote_timeout"),
        ({"timeout": math.nan}, "remote_timeout"),
        ({"timeout": "1"}, "remote_timeout"),
        ({"timeout": True}, "remote_timeout"),
        ({"ttl": 0}, "remote_ttl"),
        ({"ttl": -5}, "remote_ttl"),
        ({"ttl": math.inf}, "remote_ttl"),
        ({"key_prefix": ""}, "remote_key_prefix"),
        ({"batch_bytes": 0}, "remote_batch_bytes"),
        ({"url": "ftp://x"}, "remote_url"),
    ],
)
async def test_bad_settings_fail_at_open(options: dict[str, Any], field: str) -> None:
    layout = make_layout()
    pool = MemoryPool(1024 * 1024, page_size=PAGE, pin_memory=False)
    url = options.pop("url", "redis://127.0.0.1:1")
    with pytest.raises(ConfigError) as info:
        await RedisBackend.open(
            url, pool=pool, spec=make_spec(layout), allocation_timeout=1, **options
        )
    assert info.value.field == field


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", ["valkey", "unix"])
async def test_valkey_and_unix_urls_reach_the_server(
    redis_server: RedisServer, open_tier: Opener, scheme: str
) -> None:
    url = redis_server.unix_url if scheme == "unix" else f"valkey://127.0.0.1:{redis_server.port}"
    env = await open_tier(url)
    objs = await put_random(env, [key(0)], [CHUNK])
    got = await env.tier.get([key(0)])
    try:
        assert got[0] is not None and torch.equal(raw_bytes(got[0]), raw_bytes(objs[0]))
    finally:
        release(objs, got)


# -- faults ---------------------------------------------------------------------------

REFUSED_WITHIN = 5.0
"""Seconds a call to a stopped server may take: it fails on the refused connection (a few
milliseconds), so this is no bound on speed, only far below the tier's deadline."""


@pytest.mark.anyio
async def test_server_down_fails_fast_and_recovers(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    # A stopped server refuses connections: each call fails on the refusal, within a few
    # seconds (a refusal takes milliseconds), never by waiting out its one-minute deadline.
    env = await open_tier(redis_server.url, timeout=60.0)
    tier = env.tier
    objs = await put_random(env, [key(0)], [CHUNK])
    redis_server.stop()
    for call in (
        lambda: tier.contains_prefix([key(0)]),
        lambda: tier.get([key(0)]),
        lambda: tier.put([key(1)], objs),
        lambda: tier.remove([key(0)]),
        tier.clear,
    ):
        with anyio.fail_after(REFUSED_WITHIN), pytest.raises(TierUnavailableError):
            await call()
    assert not tier.healthy()
    assert tier.stats().errors == 5 and not tier.stats().healthy
    assert env.pool.stats().num_objects == 1, "only the caller's own object is alive"
    with anyio.fail_after(REFUSED_WITHIN):
        assert await tier.check_health() is False
    assert not tier.healthy()

    redis_server.restart()  # same port, empty (no persistence)
    with anyio.fail_after(10):
        assert await tier.check_health() is True
    assert tier.healthy()
    assert await tier.put([key(1)], objs) == 1
    got = await tier.get([key(1)])
    try:
        assert got[0] is not None and torch.equal(raw_bytes(got[0]), raw_bytes(objs[0]))
    finally:
        release(objs, got)


@pytest.mark.anyio
async def test_cluster_node_down_and_back(redis_cluster: RedisCluster, open_tier: Opener) -> None:
    env = await open_tier(redis_cluster.url, timeout=1.0)
    tier = env.tier
    keys = [key(i) for i in range(12)]
    objs = await put_random(env, keys, [1] * 12)
    redis_cluster.nodes[1].stop()
    with anyio.fail_after(10):
        with pytest.raises(TierUnavailableError):
            await tier.contains_prefix(keys)
        assert await tier.check_health() is False
    assert not tier.healthy()
    redis_cluster.nodes[1].restart()
    redis_cluster.wait_ready()
    with anyio.fail_after(10):
        await poll_until(tier.check_health)
        assert await tier.put(keys, objs) >= 1  # the restarted node lost its keys
        assert await tier.contains_prefix(keys) == 12
    release(objs)


@pytest.mark.anyio
async def test_open_while_the_server_is_down(redis_server: RedisServer, open_tier: Opener) -> None:
    redis_server.stop()
    env = await open_tier(redis_server.url, timeout=0.5)
    assert not env.tier.healthy()
    redis_server.restart()
    with anyio.fail_after(2):
        assert await env.tier.check_health()
    assert await env.tier.contains_prefix([key(0)]) == 0


@pytest.mark.anyio
async def test_closed_tier_refuses_calls(redis_server: RedisServer, open_tier: Opener) -> None:
    env = await open_tier(redis_server.url)
    await env.tier.aclose()
    await env.tier.aclose()
    assert not env.tier.healthy()
    assert await env.tier.check_health() is False
    with pytest.raises(EngineClosedError):
        await env.tier.contains_prefix([key(0)])
    with pytest.raises(EngineClosedError):
        await env.tier.get([key(0)])


# -- benchmark ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_bench_redis_reports_both_sides_and_cleans_up(redis_server: RedisServer) -> None:
    from lmcache_async.bench.tiers import bench_redis

    result = await bench_redis(
        redis_server.url, chunk_bytes=64 * 1024, chunks=8, repeats=2, call_bytes=256 * 1024
    )
    assert result["values_per_call"] == 4 and len(result["runs"]) == 2
    for name in ("put_gbps", "raw_set_gbps", "get_gbps", "raw_get_gbps"):
        assert result[name] > 0
    assert result["put_ratio"] > 0 and result["get_ratio"] > 0
    assert redis_server.command("DBSIZE") == b":0\r\n", "the benchmark left keys behind"
    with pytest.raises(InvalidInputError):
        await bench_redis(redis_server.url, chunk_bytes=1000, chunks=1, repeats=1)


@pytest.mark.anyio
async def test_a_value_of_the_16_byte_key_form_is_a_miss_not_an_error(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url)
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    chunk = ChunkKey(bytes(range(DIGEST_SIZE)))
    try:
        for obj in await put_random(env, [chunk], [CHUNK]):
            obj.unref()
        value = await raw.get(rkey(chunk))
        # The record as the 16-byte key form had it: the tag's first 4 bytes over the link's.
        header, offset = RecordHeader.from_bytes(value)
        old_key = chunk[:4] + chunk[TAG_BYTES + 4 :]
        old = dataclasses.replace(header, key=old_key).to_bytes() + value[offset:]
        old_name = (DEFAULT_KEY_PREFIX + old_key.hex()).encode()
        await raw.set(old_name, old)
        await raw.delete(rkey(chunk))
        assert await env.tier.contains_prefix([chunk]) == 0
        assert await env.tier.get([chunk]) == [None]
        assert await raw.get(old_name) == old, "another form's value is left alone"
    finally:
        await raw.aclose()
