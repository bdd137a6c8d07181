"""A router nobody here wrote sees the sidecar's tiers: NVIDIA Dynamo's standalone KV
indexer, subscribed to a real ``lmcache-async serve --events``, finds a stored prompt in
the CPU tier, then (once the CPU tier evicted it) on disk only, and nowhere after a clear;
it never learns a named tenant's prompt.

Its ``/query`` answers in tokens of whole blocks, cumulatively: ``cpu`` counts blocks held
in host RAM (or a GPU), ``disk`` blocks held anywhere.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest

from lmcache_async import RemoteCacheEngine
from lmcache_async.rpc.admin import AdminClient
from tests.backends.test_redis import poll_until
from tests.integrations.dynamo_indexer import DynamoIndexer, TierMatch, require_dynamo_indexer
from tests.rpc.test_sidecar import CHUNK, LAYOUT, MODEL, Sidecars, kv_for, prompt, wait_ready
from tests.servers import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

TIMEOUT = 90.0
N = 4 * CHUNK  # whole chunks: every block of the prompt is announced


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-dy-", dir="/tmp"))  # ipc paths: 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def matched(
    indexer: DynamoIndexer, tokens: list[int], wanted: TierMatch
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await indexer.match(tokens, 1) == wanted

    return check


async def test_the_indexer_sees_each_tier_of_a_sidecar(
    tmp_path_factory: pytest.TempPathFactory, short_dir: Path
) -> None:
    require_dynamo_indexer()
    events = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    launcher = Sidecars(tmp_path_factory.mktemp("dynamo-logs"))
    url = f"ipc://{short_dir}/dynamo.sock"
    sidecar = launcher.start(
        url,
        "--events",
        events,
        "--events-replay",
        replay,
        "--local-disk",
        str(short_dir / "disk"),
        "--max-local-disk-size",
        "1",
        "--max-local-cpu-size",
        "0.002",  # 512 chunks: a few stores push the prompt out
    )
    indexer = DynamoIndexer(
        tmp_path_factory.mktemp("indexer"),
        block_size=LAYOUT.block_size,
        model_name=MODEL,
        workers={1: events},
    )
    target = prompt(N, salt=2800)
    secret = prompt(N, salt=2801)
    kv, slots = kv_for(N, seed=280)
    try:
        with anyio.fail_after(TIMEOUT):
            await wait_ready(sidecar)
            indexer.start()
            with AdminClient(url, timeout=10) as admin:
                async with RemoteCacheEngine.connect(
                    url, LAYOUT, model_name=MODEL, timeout=10
                ) as engine:
                    await poll_until(_subscribed(admin))
                    assert await engine.store(target, kv_caches=kv, slot_mapping=slots) == N
                    await poll_until(await matched(indexer, target, TierMatch(N, 0, N, N)))
                    # Push it out of the CPU tier with other prompts; disk keeps it.
                    salt = 2900
                    while await engine.lookup(target, search_range=["cpu"]) == N:
                        other = prompt(64 * CHUNK, salt=salt)
                        other_kv, other_slots = kv_for(len(other), seed=salt)
                        await engine.store(other, kv_caches=other_kv, slot_mapping=other_slots)
                        salt += 1
                    await poll_until(await matched(indexer, target, TierMatch(N, 0, 0, N)))
                    # A named tenant's prompt: stored in every tier, announced nowhere.
                    stored = await engine.store(
                        secret, kv_caches=kv, slot_mapping=slots, tenant="a-secret-salt"
                    )
                    assert stored == N
                    assert await engine.lookup(secret, tenant="a-secret-salt") == N
                    assert await indexer.match(prompt(N, salt=3100), 1) == TierMatch()
                    await admin.clear()
                    await poll_until(await matched(indexer, target, TierMatch()))
                    stats = await admin.stats()
            assert await indexer.match(secret, 1) == TierMatch()
    finally:
        indexer.stop()
        launcher.stop_all()
    assert stats["events"]["withheld"] >= 1
    assert "Traceback" not in sidecar.log()


def _subscribed(admin: AdminClient) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool((await admin.stats())["events"]["subscribers"])

    return check
