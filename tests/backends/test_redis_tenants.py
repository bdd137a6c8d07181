"""Tenants in the Redis/Valkey tier against real servers (standalone and a 3-node cluster).

A tenant over its quota loses its own least recently used chunks and nobody else's; hosts
sharing a server share each quota (the index lives in Redis); erasure removes every record
of a tenant from every node and nothing else; quotas a server's ``maxmemory`` cannot hold
are refused at open. Every test ends with the pool empty.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.asyncio.cluster
import torch

from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX, RedisBackend
from lmcache_async.errors import ConfigError, InvalidInputError, TierError, TierUnavailableError
from lmcache_async.keys.chunks import LINK_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.quotas import TierQuota
from lmcache_async.tenancy.tenants import TenantLimits, tag_hex, tenant_tag
from tests.backends.test_redis import (
    CHUNK,
    PAGE,
    filled,
    make_layout,
    make_spec,
    poll_until,
    raw_bytes,
    release,
)
from tests.servers import RedisCluster, RedisServer

pytestmark = pytest.mark.subprocess

A = tenant_tag("alice")
B = tenant_tag("bob")
LAYOUT = make_layout()
PAYLOAD = math.prod(LAYOUT.payload_shape(CHUNK)) * LAYOUT.dtype.itemsize
HEADROOM = 1000
"""More than a record header, less than a payload: ``n * PAYLOAD + HEADROOM`` holds
exactly ``n`` records."""


def tkey(tag: bytes, i: int, layer: int | None = None) -> ChunkKey:
    return ChunkKey(tag + i.to_bytes(LINK_SIZE, "big"), layer)


def rkey(k: ChunkKey) -> bytes:
    return (DEFAULT_KEY_PREFIX + k.to_str()).encode()


def index_keys(tag: bytes) -> tuple[bytes, bytes]:
    base = f"{DEFAULT_KEY_PREFIX}{{t:{tag_hex(tag)}}}:".encode()
    return base + b"lru", base + b"size"


def limits(**quotas: int) -> TenantLimits:
    """Quotas in bytes by tenant name (``default`` for the rest)."""
    default = quotas.pop("default", None)
    return TenantLimits(TierQuota(named=quotas, default=default))


@dataclass
class Deployment:
    """A running Redis to test against: a client of it and a plain client of each node."""

    url: str
    raw: Any
    nodes: list[Any]
    cluster: bool

    async def keys(self, pattern: bytes = b"*") -> set[bytes]:
        """Every key on every node matching ``pattern``."""
        found: set[bytes] = set()
        for node in self.nodes:
            found.update([k async for k in node.scan_iter(match=pattern, count=1000)])
        return found

    async def stored_bytes(self, tag: bytes) -> tuple[int, int]:
        """The count and bytes of the tenant's chunk records on the servers."""
        rkeys = await self.keys(f"{DEFAULT_KEY_PREFIX}{tag_hex(tag)}*".encode())
        return len(rkeys), sum([int(await self.raw.strlen(k)) for k in rkeys])

    async def index(self, tag: bytes) -> tuple[int, int]:
        """The count and bytes the tenant's index in Redis says it holds."""
        lru, size = index_keys(tag)
        total = await self.raw.hget(size, b"~total")
        return int(await self.raw.zcard(lru)), int(total or 0)


@pytest.fixture(params=["standalone", "cluster"])
async def deployment(request: pytest.FixtureRequest) -> AsyncIterator[Deployment]:
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        raw: Any = redis.asyncio.Redis.from_url(server.url)
        d = Deployment(server.url, raw, [raw], cluster=False)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        raw = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        nodes = [redis.asyncio.Redis(host="127.0.0.1", port=port) for port in cluster.ports]
        d = Deployment(cluster.url, raw, nodes, cluster=True)
    yield d
    for client in {id(c): c for c in [d.raw, *d.nodes]}.values():
        await client.aclose()


@dataclass
class Host:
    pool: MemoryPool
    tier: RedisBackend


@pytest.fixture
async def open_host() -> AsyncIterator[Any]:
    """Open tiers ("hosts") on fresh pools; at the end close them and check for leaks."""
    hosts: list[Host] = []

    async def opener(url: str, **options: Any) -> Host:
        pool = MemoryPool(8 * 1024 * 1024, page_size=PAGE, pin_memory=False)
        tier = await RedisBackend.open(
            url, pool=pool, spec=make_spec(LAYOUT), allocation_timeout=1.0, **options
        )
        host = Host(pool, tier)
        hosts.append(host)
        return host

    yield opener
    for host in hosts:
        await host.tier.aclose()
        assert host.pool.stats().num_objects == 0, "the tier leaked pool objects"


async def put(host: Host, keys: Sequence[ChunkKey], seed: int = 0) -> tuple[int, list[MemoryObj]]:
    """Put random full chunks under ``keys``; returns how many were added and the objects
    (still referenced by the caller)."""
    objs = [
        await filled(host.pool, LAYOUT.payload_shape(CHUNK), LAYOUT.dtype, seed=seed + i)
        for i in range(len(keys))
    ]
    return await host.tier.put(keys, objs), objs


async def assert_exact(host: Host, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
    got = await host.tier.get(keys)
    try:
        for obj, want in zip(got, objs, strict=True):
            assert obj is not None and torch.equal(raw_bytes(obj), raw_bytes(want))
    finally:
        release(got)


# -- quotas -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_tenant_over_its_quota_evicts_only_its_own_chunks(
    deployment: Deployment, open_host: Any
) -> None:
    quota = 4 * PAYLOAD + HEADROOM
    host = await open_host(deployment.url, limits=limits(alice=quota, bob=100 * PAYLOAD))
    b_keys = [tkey(B, i) for i in range(3)]
    added, b_objs = await put(host, b_keys, seed=1000)
    assert added == 3
    a_keys = [tkey(A, i) for i in range(40)]
    for start in range(0, 30, 5):  # 10x the quota, in puts of 5 and one of 10
        added, objs = await put(host, a_keys[start : start + 5], seed=start)
        release(objs)
        assert added == 5, "evictions come after the chunks are stored"
    _, objs = await put(host, a_keys[30:], seed=30)
    release(objs)

    await assert_exact(host, b_keys, b_objs)
    release(b_objs)
    count, nbytes = await deployment.stored_bytes(A)
    assert count == 4 and nbytes <= quota
    assert await deployment.index(A) == (count, nbytes), "the index must match the records"
    assert await host.tier.contains_prefix(a_keys[-4:]) == 4, "the newest chunks stay"
    usage = host.tier.stats().tenants
    assert usage[tag_hex(A)].quota_bytes == quota
    assert (usage[tag_hex(A)].chunks, usage[tag_hex(A)].bytes) == (4, nbytes)
    assert usage[tag_hex(A)].evictions == 36 == host.tier.stats().evictions
    assert usage[tag_hex(B)].chunks == 3 and usage[tag_hex(B)].evictions == 0
    assert await deployment.stored_bytes(B) == await deployment.index(B)


@pytest.mark.anyio
async def test_hits_refresh_the_last_use(deployment: Deployment, open_host: Any) -> None:
    host = await open_host(deployment.url, limits=limits(alice=3 * PAYLOAD + HEADROOM))
    k = [tkey(A, i) for i in range(5)]
    for i in range(3):
        release((await put(host, [k[i]], seed=i))[1])
    release(await host.tier.get([k[0]]))
    release((await put(host, [k[3]], seed=3))[1])  # k1 is the least recently used
    assert [await host.tier.contains_prefix([x]) for x in k[:4]] == [1, 0, 1, 1]
    release(await host.tier.get_prefix([k[2]]))
    release((await put(host, [k[4]], seed=4))[1])  # now k0
    assert [await host.tier.contains_prefix([x]) for x in k] == [0, 0, 1, 1, 1]


@pytest.mark.anyio
async def test_two_hosts_share_one_quota(deployment: Deployment, open_host: Any) -> None:
    quota = 5 * PAYLOAD + HEADROOM
    hosts = [await open_host(deployment.url, limits=limits(alice=quota)) for _ in range(2)]

    async def write(host: Host, first: int) -> None:
        for start in range(first, first + 20, 2):
            release((await put(host, [tkey(A, start), tkey(A, start + 1)], seed=start))[1])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write, hosts[0], 0)
            tg.start_soon(write, hosts[1], 1000)
    count, nbytes = await deployment.stored_bytes(A)
    assert count == 5 and nbytes <= quota
    assert await deployment.index(A) == (count, nbytes)
    evictions = [h.tier.stats().tenants[tag_hex(A)].evictions for h in hosts]
    assert sum(evictions) == 40 - 5, "each chunk evicted by one host exactly"
    # What one host reports is the shared index, the other host's chunks included.
    everything = [tkey(A, first + i) for first in (0, 1000) for i in range(20)]
    release(await hosts[1].tier.get(everything))
    assert hosts[1].tier.stats().tenants[tag_hex(A)].chunks == 5


@pytest.mark.anyio
async def test_a_chunk_larger_than_its_quota_is_not_written(
    deployment: Deployment, open_host: Any
) -> None:
    # Payload over the quota: never sent. Payload within, record (with header) over: the
    # server's index refuses it and the client deletes it again.
    host = await open_host(deployment.url, limits=limits(alice=PAYLOAD - 1, carol=PAYLOAD))
    carol = tenant_tag("carol")
    added, objs = await put(host, [tkey(A, 0), tkey(carol, 0), tkey(B, 0)])
    release(objs)
    assert added == 1 and host.tier.quota_refusals == 2
    assert await deployment.keys() == {rkey(tkey(B, 0))}, "Bob has no quota"
    stats = host.tier.stats()
    assert (stats.chunks, stats.bytes) == await deployment.stored_bytes(B)
    assert stats.tenants[tag_hex(carol)].chunks == 0


@pytest.mark.anyio
async def test_without_quotas_no_script_runs_and_no_index_is_kept(
    deployment: Deployment, open_host: Any
) -> None:
    for node in deployment.nodes:
        await node.config_resetstat()
    host = await open_host(deployment.url)
    keys = [tkey(A, 0), tkey(A, 1), tkey(B, 0)]
    added, objs = await put(host, keys)
    assert added == 3
    await assert_exact(host, keys, objs)
    release(objs)
    assert await host.tier.remove([tkey(A, 1)]) == 1
    for node in deployment.nodes:
        stats = await node.info("commandstats")
        assert not {"cmdstat_eval", "cmdstat_evalsha"} & set(stats)
    assert await deployment.keys(f"{DEFAULT_KEY_PREFIX}{{*".encode()) == set()
    usage = host.tier.stats().tenants
    assert usage[tag_hex(A)].chunks == 1 and usage[tag_hex(A)].quota_bytes is None
    assert (usage[tag_hex(B)].chunks, usage[tag_hex(B)].bytes) == await deployment.stored_bytes(B)


@pytest.mark.anyio
async def test_remove_and_clear_keep_the_index_exact(
    deployment: Deployment, open_host: Any
) -> None:
    host = await open_host(deployment.url, limits=limits(alice=10 * PAYLOAD))
    keys = [tkey(A, i) for i in range(5)]
    release((await put(host, keys))[1])
    assert await host.tier.remove(keys[:2]) == 2
    assert await deployment.index(A) == await deployment.stored_bytes(A)
    assert (await deployment.index(A))[0] == 3
    assert host.tier.stats().tenants[tag_hex(A)].chunks == 3
    assert await host.tier.clear() == 3, "the index keys are not counted"
    assert await deployment.keys() == set()
    assert host.tier.stats().tenants[tag_hex(A)].chunks == 0


@pytest.mark.anyio
async def test_scripts_run_again_after_the_server_forgets_them(
    deployment: Deployment, open_host: Any
) -> None:
    host = await open_host(deployment.url, limits=limits(alice=2 * PAYLOAD + HEADROOM))
    release((await put(host, [tkey(A, 0), tkey(A, 1)]))[1])
    for node in deployment.nodes:
        await node.script_flush()
    release((await put(host, [tkey(A, 2)]))[1])
    assert await deployment.stored_bytes(A) == await deployment.index(A)
    assert await host.tier.contains_prefix([tkey(A, 1), tkey(A, 2)]) == 2


@pytest.mark.anyio
async def test_with_a_ttl_the_index_expires_too(redis_server: RedisServer, open_host: Any) -> None:
    host = await open_host(redis_server.url, ttl=1, limits=limits(alice=10 * PAYLOAD))
    release((await put(host, [tkey(A, 0)]))[1])
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        for name in index_keys(A):
            assert 0 < await raw.pttl(name) <= 1000

        async def gone() -> bool:
            return int(await raw.exists(rkey(tkey(A, 0)), *index_keys(A))) == 0

        with anyio.fail_after(5):
            await poll_until(gone)
    finally:
        await raw.aclose()


# -- erasure ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("quotas", [False, True])
async def test_erase_removes_every_record_of_the_tenant_and_nothing_else(
    deployment: Deployment, open_host: Any, quotas: bool
) -> None:
    options = {"limits": limits(alice=100 * PAYLOAD)} if quotas else {}
    host = await open_host(deployment.url, **options)
    other = await open_host(deployment.url, key_prefix="other:")
    # Alice's chunks of two "models" and layer keys; Bob's; another prefix's Alice.
    a_keys = [tkey(A, i) for i in range(20)] + [tkey(A, i, layer=3) for i in range(10)]
    b_keys = [tkey(B, i) for i in range(5)]
    release((await put(host, a_keys))[1])
    _, b_objs = await put(host, b_keys, seed=500)
    release((await put(other, [tkey(A, 0)]))[1])
    await deployment.raw.set(b"lmca", b"x")
    if quotas:
        assert await deployment.index(A) == await deployment.stored_bytes(A)

    with anyio.fail_after(10):
        assert await host.tier.erase_tenant(A) == 30
    left = await deployment.keys()
    assert not [k for k in left if k.startswith(f"{DEFAULT_KEY_PREFIX}{tag_hex(A)}".encode())]
    assert not set(index_keys(A)) & left
    assert {rkey(k) for k in b_keys} <= left
    assert ("other:" + tkey(A, 0).to_str()).encode() in left and b"lmca" in left
    await assert_exact(host, b_keys, b_objs)
    release(b_objs)
    usage = host.tier.stats().tenants[tag_hex(A)]
    assert (usage.chunks, usage.bytes, usage.erased) == (0, 0, 30)
    assert await host.tier.erase_tenant(A) == 0


@pytest.mark.anyio
async def test_erase_pages_through_many_records(redis_server: RedisServer, open_host: Any) -> None:
    host = await open_host(redis_server.url)
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with raw.pipeline() as pipe:
            for i in range(2500):  # more than one SCAN page and one UNLINK batch
                pipe.set(rkey(tkey(A, i)), b"v")
                if i % 10 == 0:
                    pipe.set(rkey(tkey(B, i)), b"v")
            await pipe.execute()
        assert await host.tier.erase_tenant(A) == 2500
        assert await raw.dbsize() == 250
    finally:
        await raw.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("tag", [b"abc", b"abcde", "abcd", None])
async def test_erase_refuses_what_is_not_a_tag(
    redis_server: RedisServer, open_host: Any, tag: Any
) -> None:
    host = await open_host(redis_server.url)
    with pytest.raises(InvalidInputError):
        await host.tier.erase_tenant(tag)


@pytest.mark.anyio
async def test_erase_with_the_server_down_fails_fast(
    redis_server: RedisServer, open_host: Any
) -> None:
    # The erase fails on the refused connection (milliseconds), not at its one-minute
    # deadline: five seconds is a bound no busy machine reaches, and far below that.
    host = await open_host(redis_server.url, timeout=60.0, limits=limits(alice=PAYLOAD * 9))
    release((await put(host, [tkey(A, 0)]))[1])
    redis_server.stop()
    with anyio.fail_after(5), pytest.raises(TierUnavailableError):
        await host.tier.erase_tenant(A)
    assert not host.tier.healthy()


@pytest.mark.anyio
async def test_erase_with_a_cluster_node_down_fails(
    redis_cluster: RedisCluster, open_host: Any
) -> None:
    host = await open_host(redis_cluster.url, timeout=1.0)
    release((await put(host, [tkey(A, i) for i in range(12)]))[1])
    redis_cluster.nodes[1].stop()
    try:
        with anyio.fail_after(10), pytest.raises(TierError):
            await host.tier.erase_tenant(A)
    finally:
        redis_cluster.nodes[1].restart()
        redis_cluster.wait_ready()


# -- maxmemory ----------------------------------------------------------------------------

MB = 1024 * 1024


class ConfiguredServer(RedisServer):
    """A standalone server started with extra command-line settings."""

    def __init__(self, directory: Path, *settings: str) -> None:
        super().__init__(directory)
        self.settings = list(settings)

    def _command(self) -> list[str]:
        return [*super()._command(), *self.settings]


@pytest.mark.anyio
async def test_a_quota_over_maxmemory_is_a_config_error(
    redis_server: RedisServer, open_host: Any
) -> None:
    assert redis_server.command("CONFIG", "SET", "maxmemory", str(8 * MB)).startswith(b"+OK")
    for quotas in (limits(alice=16 * MB), limits(alice=MB, default=9 * MB)):
        with pytest.raises(ConfigError) as err:
            await open_host(redis_server.url, limits=quotas)
        assert err.value.field == "tenant_quotas.redis"
    host = await open_host(redis_server.url, limits=limits(alice=4 * MB, default=8 * MB))
    assert host.tier.healthy()


@pytest.mark.anyio
async def test_maxmemory_is_read_from_info_when_config_is_refused(
    tmp_path: Path, open_host: Any
) -> None:
    settings = ("--maxmemory", str(8 * MB), "--rename-command", "CONFIG", "")
    with ConfiguredServer(tmp_path / "noconfig", *settings).start() as server:
        assert server.command("CONFIG", "GET", "maxmemory").startswith(b"-ERR")
        with pytest.raises(ConfigError) as err:
            await open_host(server.url, limits=limits(alice=16 * MB))
        assert err.value.field == "tenant_quotas.redis"
        host = await open_host(server.url, limits=limits(alice=4 * MB))
        release((await put(host, [tkey(A, 0)]))[1])
        assert await host.tier.contains_prefix([tkey(A, 0)]) == 1


@pytest.mark.anyio
async def test_a_cluster_quota_is_checked_against_its_primaries(
    redis_cluster: RedisCluster, open_host: Any
) -> None:
    try:
        for node in redis_cluster.nodes:
            assert node.command("CONFIG", "SET", "maxmemory", str(8 * MB)).startswith(b"+OK")
        with pytest.raises(ConfigError) as err:
            await open_host(redis_cluster.url, limits=limits(alice=30 * MB))
        assert err.value.field == "tenant_quotas.redis"
        # More than one node holds, less than the three: a tenant's chunks spread over all.
        await open_host(redis_cluster.url, limits=limits(alice=16 * MB))
    finally:
        for node in redis_cluster.nodes:
            node.command("CONFIG", "SET", "maxmemory", "0")
