"""Erasure by tenant through every layer: an engine with the CPU, disk and a real Redis tier
(standalone and a 3-node cluster), a sidecar process erased by ``lmcache-async ctl erase``
as a real CLI process, and the figures by tenant.

Each erasure test stores prompts of tenants ``a`` and ``b``, erases ``a``, then scans the
disk directory and every key of the Redis server(s): nothing of ``a`` is left, everything
of ``b`` is. ``a``'s prompts then miss and ``b``'s hit, also after the engine (or the
sidecar) is restarted over the same directory and server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import redis
import torch

from lmcache_async import (
    CacheEngine,
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVCacheClient,
    RemoteCacheEngine,
    SyncCacheEngine,
)
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.errors import EraseIncompleteError
from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.tenancy.tenants import tag_hex, tenant_tag
from tests.rpc.test_sidecar import Sidecars, serve_command, wait_ready
from tests.servers import RedisCluster, RedisServer
from tests.test_engine_tiers import (
    CHUNK,
    assert_loaded_exactly,
    layout,
    slots_of,
    source_caches,
    tokens_of,
)

TIMEOUT = 60
MODEL = "erase-test"
PROMPT = 4 * CHUNK  # 4 chunks a prompt
SEEDS = {"a": (1, 2), "b": (3, 4)}
"""Two prompts per tenant (token and KV seeds)."""
CHUNKS = {tenant: PROMPT // CHUNK * len(seeds) for tenant, seeds in SEEDS.items()}
TAGS = {tenant: tag_hex(tenant_tag(tenant)) for tenant in SEEDS}


def erase_config(directory: Path | None, remote_url: str | None, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        "wait_for_slow_tiers": True,
        "remote_timeout": 3.0,
        "health_check_interval": 0.1,
    }
    if directory is not None:
        values |= {"local_disk": str(directory), "max_local_disk_size": 0.05}
    if remote_url is not None:
        values["remote_url"] = remote_url
    values.update(overrides)
    return EngineConfig(**values)


@asynccontextmanager
async def open_engine(
    directory: Path | None, remote_url: str | None, **overrides: Any
) -> AsyncIterator[CacheEngine]:
    config = erase_config(directory, remote_url, **overrides)
    async with CacheEngine.open(config, layout(), model_name=MODEL) as engine:
        yield engine


async def store_all(engine: KVCacheClient) -> None:
    for tenant, seeds in SEEDS.items():
        for seed in seeds:
            stored = await engine.store(
                tokens_of(PROMPT, seed),
                kv_caches=source_caches(seed),
                slot_mapping=slots_of(PROMPT, seed),
                tenant=tenant,
            )
            assert stored == PROMPT
    if isinstance(engine, CacheEngine):
        assert await engine.flush()


async def assert_a_misses_and_b_hits(
    engine: KVCacheClient, search_range: list[str] | None = None
) -> None:
    """Every prompt of ``a`` misses; every prompt of ``b`` hits in full and loads exactly."""
    for seed in SEEDS["a"]:
        assert (
            await engine.lookup(tokens_of(PROMPT, seed), tenant="a", search_range=search_range) == 0
        )
        target = [torch.zeros_like(t) for t in source_caches(seed)]
        mask = await engine.retrieve(
            tokens_of(PROMPT, seed),
            kv_caches=target,
            slot_mapping=slots_of(PROMPT, seed),
            tenant="a",
            retrieve_locations=search_range,
        )
        assert not mask.any()
    for seed in SEEDS["b"]:
        tokens = tokens_of(PROMPT, seed)
        assert await engine.lookup(tokens, tenant="b", search_range=search_range) == PROMPT
        target = [torch.zeros_like(t) for t in source_caches(seed)]
        slots = slots_of(PROMPT, seed)
        mask = await engine.retrieve(
            tokens,
            kv_caches=target,
            slot_mapping=slots,
            tenant="b",
            retrieve_locations=search_range,
        )
        assert_loaded_exactly(source_caches(seed), target, slots, mask, PROMPT)


# -- scans of what the tiers hold -------------------------------------------------------------


def disk_names(directory: Path) -> list[str]:
    """The name of every file under ``directory`` (record files, temporaries, indexes)."""
    return [path.name for path in directory.rglob("*") if path.is_file()]


def redis_keys(ports: list[int]) -> list[str]:
    """Every key of every server (SCAN, so each node of a cluster is asked for its own)."""
    keys: list[str] = []
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
        try:
            keys += [key.decode(errors="replace") for key in client.scan_iter(count=1000)]
        finally:
            client.close()
    return keys


def with_tag(names: list[str], tenant: str) -> list[str]:
    return [name for name in names if TAGS[tenant] in name]


async def scan(directory: Path | None, ports: list[int]) -> dict[str, dict[str, int]]:
    """How many files and Redis keys carry each tenant's tag (off the event loop)."""

    def count() -> dict[str, dict[str, int]]:
        files = [] if directory is None else disk_names(directory)
        keys = redis_keys(ports)
        return {
            tenant: {"files": len(with_tag(files, tenant)), "keys": len(with_tag(keys, tenant))}
            for tenant in SEEDS
        }

    return await anyio.to_thread.run_sync(count)


# -- an engine over CPU, disk and Redis -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_engine_erases_a_tenant_from_cpu_disk_and_redis_for_good(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    ports = [redis_server.port]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(disk, redis_server.url) as engine:
            await store_all(engine)
            before = await scan(disk, ports)
            assert before["a"]["files"] >= CHUNKS["a"] and before["a"]["keys"] >= CHUNKS["a"]
            assert await engine.erase("a") == {
                "cpu": CHUNKS["a"],
                "disk": CHUNKS["a"],
                "redis": CHUNKS["a"],
            }
            after = await scan(disk, ports)
            assert after["a"] == {"files": 0, "keys": 0}, "no record of a is left"
            assert after["b"] == before["b"], "every record of b is still there"
            assert after["b"]["files"] >= CHUNKS["b"] and after["b"]["keys"] >= CHUNKS["b"]
            await assert_a_misses_and_b_hits(engine)
            assert await engine.erase("a") == {"cpu": 0, "disk": 0, "redis": 0}
        # A restarted engine over the same directory and server: a is gone from both.
        for search_range in (["disk"], ["redis"]):
            async with open_engine(disk, redis_server.url) as engine:
                await assert_a_misses_and_b_hits(engine, search_range)
        assert (await scan(disk, ports))["a"] == {"files": 0, "keys": 0}


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_erasure_records_the_removal_of_exactly_the_tenants_chunks_per_tier(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tag = tenant_tag("a")
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tmp_path / "disk", redis_server.url) as engine:
            await store_all(engine)
            stored: dict[str, set[bytes]] = {"cpu": set(), "disk": set(), "redis": set()}
            for event in engine.take_events():
                stored[event.medium] |= {h for h in event.block_hashes if h.startswith(tag)}
            assert all(len(hashes) == CHUNKS["a"] for hashes in stored.values())
            await engine.erase("a")
            gone = [e for e in engine.take_events() if e.kind == "removed"]
            assert sorted(e.medium for e in gone) == ["cpu", "disk", "redis"]
            for event in gone:
                assert set(event.block_hashes) == stored[event.medium], event.medium
                assert len(event.block_hashes) == CHUNKS["a"], event.medium


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_engine_erases_a_tenant_from_every_node_of_a_redis_cluster(
    redis_cluster: RedisCluster,
) -> None:
    ports = list(redis_cluster.ports)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(None, redis_cluster.url) as engine:
            await store_all(engine)
            before = await scan(None, ports)
            assert before["a"]["keys"] >= CHUNKS["a"]
            removed = await engine.erase("a")
            assert removed == {"cpu": CHUNKS["a"], "redis": CHUNKS["a"]}
            after = await scan(None, ports)
            assert after["a"]["keys"] == 0 and after["b"] == before["b"]
        async with open_engine(None, redis_cluster.url) as engine:
            await assert_a_misses_and_b_hits(engine, ["redis"])


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_redis_down_is_reported_and_a_second_erasure_finishes_the_job(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis stopped (SIGSTOP: it keeps its data, it just does not answer): the erasure
    reports it and erases the other tiers; once Redis answers again, erasing again
    removes the rest."""
    disk = tmp_path / "disk"
    pid = redis_server.pid
    assert pid is not None
    with anyio.fail_after(TIMEOUT):
        async with open_engine(disk, redis_server.url, remote_timeout=0.5) as engine:
            await store_all(engine)
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(EraseIncompleteError) as caught:
                    await engine.erase("a")
            finally:
                os.kill(pid, signal.SIGCONT)
            assert caught.value.removed == {"cpu": CHUNKS["a"], "disk": CHUNKS["a"]}
            assert list(caught.value.failed) == ["redis"]
            assert (await scan(disk, [redis_server.port]))["a"]["keys"] >= CHUNKS["a"]
            assert (await engine.check_health())["redis"]
            assert await engine.erase("a") == {"cpu": 0, "disk": 0, "redis": CHUNKS["a"]}
            assert (await scan(disk, [redis_server.port]))["a"] == {"files": 0, "keys": 0}
            await assert_a_misses_and_b_hits(engine)


@pytest.mark.anyio
async def test_erase_checks_its_tenant_and_erases_the_engines_own_by_default(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    with anyio.fail_after(TIMEOUT):
        config = erase_config(disk, None)
        async with CacheEngine.open(config, layout(), model_name=MODEL, tenant="a") as engine:
            await store_all(engine)
            for bad in (5, b"a", "x" * 300):
                with pytest.raises(InvalidInputError, match="tenant"):
                    await engine.erase(bad)  # type: ignore[arg-type]
            # None is the engine's own tenant: "a" here.
            assert await engine.erase() == {"cpu": CHUNKS["a"], "disk": CHUNKS["a"]}
            await assert_a_misses_and_b_hits(engine)
        with pytest.raises(EngineClosedError):
            await engine.erase("b")


@pytest.mark.anyio
async def test_writes_queued_for_disk_when_the_tenant_is_erased_never_land(
    tmp_path: Path,
) -> None:
    """Stores write behind: the erasure comes while the disk tier's writes are queued or
    under way; none of a's chunks is on disk afterwards, b's all are."""
    disk = tmp_path / "disk"
    with anyio.fail_after(TIMEOUT):
        async with open_engine(disk, None, wait_for_slow_tiers=False) as engine:
            for tenant, seeds in SEEDS.items():
                for seed in seeds:
                    await engine.store(
                        tokens_of(PROMPT, seed),
                        kv_caches=source_caches(seed),
                        slot_mapping=slots_of(PROMPT, seed),
                        tenant=tenant,
                    )
            removed = await engine.erase("a")
            assert removed["cpu"] == CHUNKS["a"]
            assert await engine.flush()
            files = await anyio.to_thread.run_sync(disk_names, disk)
            assert with_tag(files, "a") == []
            assert len(with_tag(files, "b")) >= CHUNKS["b"]
            await engine.clear(["cpu"])
            await assert_a_misses_and_b_hits(engine)


def test_a_sync_engine_erases_on_its_loop_thread(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with SyncCacheEngine.open(erase_config(disk, None), layout(), model_name=MODEL) as engine:
        for tenant, seeds in SEEDS.items():
            for seed in seeds:
                tokens = tokens_of(PROMPT, seed)
                kv, slots = source_caches(seed), slots_of(PROMPT, seed)
                assert engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant=tenant)
        assert engine.erase("a") == {"cpu": CHUNKS["a"], "disk": CHUNKS["a"]}
        assert engine.lookup(tokens_of(PROMPT, SEEDS["a"][0]), tenant="a") == 0
        assert engine.lookup(tokens_of(PROMPT, SEEDS["b"][0]), tenant="b") == PROMPT
        with pytest.raises(InvalidInputError):
            engine.erase(b"a")  # type: ignore[arg-type]
    assert with_tag(disk_names(disk), "a") == []


# -- figures by tenant ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stats_by_tenant_count_lookups_usage_and_erasure(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with anyio.fail_after(TIMEOUT):
        # a has a label; b is shown by its tag, never by its name.
        async with open_engine(disk, None, tenant_labels={"a": "team-a"}) as engine:
            await store_all(engine)
            for seed in SEEDS["a"]:
                assert await engine.lookup(tokens_of(PROMPT, seed), tenant="a") == PROMPT
            assert await engine.lookup(tokens_of(PROMPT, 9), tenant="b") == 0
            assert await engine.lookup(tokens_of(PROMPT, 3)) == 0  # the engine's own: (none)
            figures = engine.stats().tenants
            assert set(figures) == {"team-a", TAGS["b"], "(none)"}
            a, b = figures["team-a"], figures[TAGS["b"]]
            assert (a.tag, b.tag) == (TAGS["a"], TAGS["b"])
            assert (a.lookup_requests, a.lookup_tokens, a.lookup_hit_tokens) == (
                2,
                2 * PROMPT,
                2 * PROMPT,
            )
            assert (b.lookup_requests, b.lookup_tokens, b.lookup_hit_tokens) == (1, PROMPT, 0)
            assert (a.hit_rate, b.hit_rate) == (1.0, 0.0)
            assert figures["(none)"].lookup_requests == 1
            assert engine.tenant_stats("a") == a
            assert engine.tenant_stats("nobody").lookup_requests == 0
            for name, tenant in (("a", a), ("b", b)):
                assert set(tenant.tiers) == {"cpu", "disk"}
                assert tenant.tiers["cpu"].chunks == tenant.tiers["disk"].chunks == CHUNKS[name]
                assert tenant.chunks == 2 * CHUNKS[name]
                assert tenant.bytes == sum(u.bytes for u in tenant.tiers.values()) > 0
            await engine.erase("a")
            after = engine.stats().tenants
            assert after["team-a"].chunks == 0 and after["team-a"].bytes == 0
            assert {tier: u.erased for tier, u in after["team-a"].tiers.items()} == {
                "cpu": CHUNKS["a"],
                "disk": CHUNKS["a"],
            }
            assert after["team-a"].erased == 2 * CHUNKS["a"]
            assert after[TAGS["b"]].tiers == b.tiers, "b's usage is untouched"
            assert after["team-a"].lookup_hit_tokens == 2 * PROMPT, "traffic figures stay"


# -- a sidecar process, erased by `lmcache-async ctl erase` -----------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lmcache-async ARGS`` as a real process (the one a shell would run)."""
    return subprocess.run(
        [*serve_command(), *args], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (a unix socket path holds at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="lmc-er-", dir="/tmp") as path:
        yield Path(path)


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[Sidecars]:
    launcher = Sidecars(tmp_path)
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_ctl_erase_empties_a_sidecars_tiers_of_a_tenant_across_restarts(
    redis_server: RedisServer, tmp_path: Path, short_dir: Path, sidecars: Sidecars
) -> None:
    disk = tmp_path / "disk"
    ports = [redis_server.port]
    url = f"ipc://{short_dir}/erase.sock"
    flags = ["--local-disk", str(disk), "--max-local-disk-size", "0.05"]
    flags += ["--remote-url", redis_server.url, "--wait-for-slow-tiers", "true"]
    flags += ["--model-name", MODEL, "--layout", json.dumps(layout().to_dict())]
    sidecar = sidecars.start(url, *flags)
    with anyio.fail_after(2 * TIMEOUT):
        await wait_ready(sidecar)
        async with RemoteCacheEngine.connect(url, layout(), model_name=MODEL) as client:
            await store_all(client)
            before = await scan(disk, ports)
            assert before["a"]["files"] >= CHUNKS["a"] and before["a"]["keys"] >= CHUNKS["a"]
            done = await anyio.to_thread.run_sync(
                cli, "ctl", "erase", "--tenant", "a", "--url", url
            )
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            # The output names the tenant by its tag: a name is a secret, even in a terminal.
            assert lines[0] == f"erased tenant {TAGS['a']}: {3 * CHUNKS['a']} chunks removed"
            assert [line.split() for line in lines[1:]] == [
                [tier, str(CHUNKS["a"]), "chunks"] for tier in ("cpu", "disk", "redis")
            ]
            after = await scan(disk, ports)
            assert after["a"] == {"files": 0, "keys": 0} and after["b"] == before["b"]
            await assert_a_misses_and_b_hits(client)
            table = await anyio.to_thread.run_sync(cli, "stats", "--by-tenant", "--url", url)
            assert table.returncode == 0, table.stderr
            text = table.stdout.splitlines()
            usage_at = text.index("tenant usage by tier")
            traffic = {line.split()[0]: line.split() for line in text[2:usage_at]}
            usage = {tuple(line.split()[:2]): line.split() for line in text[usage_at + 2 :]}
            # TENANT TAG LOOKUPS HIT-TOKENS TOKENS HIT-RATE CHUNKS BYTES...
            a, b = TAGS["a"], TAGS["b"]  # no labels configured: tenants show as their tags
            assert traffic[a][:3] == [a, a, "2"]
            assert traffic[b][:3] == [b, b, "2"]
            assert traffic[a][6] == "0" and traffic[b][6] == str(3 * CHUNKS["b"])
            # TENANT TIER CHUNKS BYTES(2) QUOTA EVICTED ERASED
            assert usage[a, "disk"][2] == "0" and usage[a, "disk"][-1] == str(CHUNKS["a"])
            assert usage[b, "redis"][2] == str(CHUNKS["b"])
        assert sidecar.terminate() == 0
        # The sidecar restarted over the same directory and server: a is gone for good.
        restarted = sidecars.start(url, *flags)
        await wait_ready(restarted)
        async with RemoteCacheEngine.connect(url, layout(), model_name=MODEL) as client:
            await assert_a_misses_and_b_hits(client)
        assert (await scan(disk, ports))["a"] == {"files": 0, "keys": 0}


def test_ctl_erase_needs_a_tenant_and_a_sidecar_that_answers(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/nobody.sock"
    missing = cli("ctl", "erase", "--url", url)
    assert missing.returncode == 2 and "ctl erase needs --tenant" in missing.stderr
    other = cli("ctl", "clear", "--tenant", "a", "--url", url)
    assert other.returncode == 2 and "takes no tenant" in other.stderr
    both = cli("ctl", "erase", "--tenant", "a", "--own-tenant", "--url", url)
    assert both.returncode == 2
    silent = cli("ctl", "erase", "--tenant", "a", "--url", url, "--timeout", "0.2")
    assert silent.returncode == 1 and "did not answer ERASE within 0.2 s" in silent.stderr


# -- erasure is final: nothing read or reserved before it lands after it ----------------------


class HeldDiskReads:
    """Holds each disk read once it has read its chunks: ``read`` is set then, and the
    read returns them when ``release`` is set (a slow read in flight, at a known point)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read = anyio.Event()
        self.release = anyio.Event()
        get_prefix = DiskBackend.get_prefix

        async def held(tier: DiskBackend, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
            run = await get_prefix(tier, keys)
            self.read.set()
            await self.release.wait()
            return run

        monkeypatch.setattr(DiskBackend, "get_prefix", held)


def cpu_chunks_of(engine: CacheEngine, tenant: str) -> int:
    """Chunks of ``tenant`` the engine's CPU tier holds."""
    usage = engine.stats().tiers["cpu"].tenants.get(TAGS[tenant])
    return 0 if usage is None else usage.chunks


async def store_on_disk_only(engine: CacheEngine, seed: int, tenant: str) -> list[int]:
    tokens = tokens_of(PROMPT, seed)
    stored = await engine.store(
        tokens,
        kv_caches=source_caches(seed),
        slot_mapping=slots_of(PROMPT, seed),
        tenant=tenant,
        store_location=["disk"],
    )
    assert stored == PROMPT
    assert cpu_chunks_of(engine, tenant) == 0
    return tokens


@pytest.mark.anyio
async def test_a_retrieve_reading_disk_when_the_tenant_is_erased_promotes_nothing_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retrieve began before the erasure: it loads what it read, but puts none of it
    back into the CPU tier, and every later lookup of the tenant misses."""
    seed = SEEDS["a"][0]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tmp_path / "disk", None) as engine:
            tokens = await store_on_disk_only(engine, seed, "a")
            reads = HeldDiskReads(monkeypatch)
            target = [torch.zeros_like(t) for t in source_caches(seed)]
            loaded: list[torch.Tensor] = []

            async def retrieve() -> None:
                loaded.append(
                    await engine.retrieve(
                        tokens, kv_caches=target, slot_mapping=slots_of(PROMPT, seed), tenant="a"
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(retrieve)
                await reads.read.wait()
                assert await engine.erase("a") == {"cpu": 0, "disk": PROMPT // CHUNK}
                reads.release.set()
            assert_loaded_exactly(
                source_caches(seed), target, slots_of(PROMPT, seed), loaded[0], PROMPT
            )
            assert cpu_chunks_of(engine, "a") == 0
            assert engine.stats().tiers["cpu"].chunks == 0
            assert engine.stats().promoted_chunks == 0
            assert await engine.lookup(tokens, tenant="a") == 0
            assert await engine.lookup(tokens, tenant="a", search_range=["cpu"]) == 0


@pytest.mark.anyio
async def test_a_prefetch_reading_disk_when_the_tenant_is_erased_pins_and_promotes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = SEEDS["a"][0]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tmp_path / "disk", None) as engine:
            tokens = await store_on_disk_only(engine, seed, "a")
            reads = HeldDiskReads(monkeypatch)
            assert await engine.prefetch(tokens, lookup_id="p", tenant="a") == PROMPT
            prefetch = engine._parts.core.load.prefetching("p")
            assert prefetch is not None
            await reads.read.wait()
            await engine.erase("a")
            reads.release.set()
            await prefetch.done.wait()
            stats = engine.stats()
            assert (stats.pinned_chunks, stats.tiers["cpu"].chunks) == (0, 0)
            assert cpu_chunks_of(engine, "a") == 0
            assert await engine.lookup(tokens, tenant="a") == 0
            target = [torch.zeros_like(t) for t in source_caches(seed)]
            mask = await engine.retrieve(
                tokens,
                kv_caches=target,
                slot_mapping=slots_of(PROMPT, seed),
                tenant="a",
                lookup_id="p",
            )
            assert not mask.any(), "nothing of a is served to a load begun after the erasure"


@pytest.mark.anyio
@pytest.mark.parametrize("wait_for_slow_tiers", [True, False])
async def test_a_store_reserved_before_the_erasure_and_committed_after_lands_nowhere(
    tmp_path: Path, wait_for_slow_tiers: bool
) -> None:
    """A store's memory is reserved, the tenant erased, then the store commits (the
    sidecar's STORE and the pipelines run these same steps): no tier takes any of it,
    whether the slow tiers are written at once or behind."""
    disk = tmp_path / "disk"
    seed = SEEDS["a"][0]
    tokens = tokens_of(PROMPT, seed)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(disk, None, wait_for_slow_tiers=wait_for_slow_tiers) as engine:
            core = engine._parts.core.store
            txn = core.begin(
                "r1", engine.hasher_for("a").spans(tokens), None, limit=None, locations=None
            )
            objs = await core.reserve(txn, txn.todo)
            assert len(objs) == PROMPT // CHUNK
            await engine.erase("a")
            assert await core.commit(txn, txn.todo, objs) == 0
            assert core.finish(txn) == 0
            assert await engine.flush()
            assert cpu_chunks_of(engine, "a") == 0
            assert with_tag(await anyio.to_thread.run_sync(disk_names, disk), "a") == []
            assert await engine.lookup(tokens, tenant="a") == 0
            # A store begun after the erasure is kept.
            assert (
                await engine.store(
                    tokens,
                    kv_caches=source_caches(seed),
                    slot_mapping=slots_of(PROMPT, seed),
                    tenant="a",
                )
                == PROMPT
            )
            assert await engine.lookup(tokens, tenant="a") == PROMPT
