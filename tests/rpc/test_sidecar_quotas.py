"""Tenant quotas through a real sidecar process (``lmcache-async serve --tenant-quotas``):
a tenant whose prompts add up to ten times its CPU quota evicts only its own chunks, and
another tenant's prompts stay whole hits that load bit for bit."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async import RemoteCacheEngine
from lmcache_async.config import GB
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    Sidecar,
    Sidecars,
    kv_for,
    payload_of,
    prompt,
    server_state,
    wait_ready,
)

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

N: Final = 3 * CHUNK  # three whole chunks a prompt
CHUNK_BYTES: Final = math.prod(LAYOUT.payload_shape(CHUNK)) * LAYOUT.dtype.itemsize
QUOTA_CHUNKS: Final = 6
QUOTA_BYTES: Final = int(QUOTA_CHUNKS * (CHUNK_BYTES + 256))  # six chunks fit, seven do not
TIMEOUT: Final = 60.0


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar whose tenants "a" and "b" may each hold six chunks in its CPU tier."""
    short = Path(tempfile.mkdtemp(prefix="lmc-q-", dir="/tmp"))  # ipc paths: 107 bytes
    launcher = Sidecars(tmp_path_factory.mktemp("quota-logs"))
    quota = repr(QUOTA_BYTES / GB)
    try:
        started = launcher.start(
            f"ipc://{short}/quotas.sock", "--tenant-quotas", f"cpu.a={quota},cpu.b={quota}"
        )
        anyio.run(wait_ready, started)
        yield started
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)


def connect(url: str) -> Any:
    return RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL, timeout=10)


def cpu_usage(engine_stats: Mapping[str, Any], tenant: str) -> Mapping[str, Any]:
    """The tenant's usage of the sidecar's CPU tier, from its STATS reply."""
    usage: Mapping[str, Any] = engine_stats["tenants"][tenant]["tiers"]["cpu"]
    return usage


async def test_a_tenant_writing_ten_times_its_quota_leaves_another_tenants_prompts_whole(
    sidecar: Sidecar,
) -> None:
    b_prompts = [(prompt(N, salt=3000 + i), kv_for(N, seed=30 + i)) for i in range(2)]
    a_prompts = [prompt(N, salt=4000 + i) for i in range(10 * QUOTA_CHUNKS // 3)]
    a_kv, a_slots = kv_for(N, seed=40)
    with anyio.fail_after(TIMEOUT):
        async with connect(sidecar.url) as engine:
            for tokens, (kv, slots) in b_prompts:  # six chunks: b's quota
                assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="b") == N
            for tokens in a_prompts:  # sixty chunks: ten times a's quota
                stored = await engine.store(
                    tokens, kv_caches=a_kv, slot_mapping=a_slots, tenant="a"
                )
                assert stored == N
            b_hits = [await engine.lookup(tokens, tenant="b") for tokens, _ in b_prompts]
            loads = []
            for tokens, (kv, slots) in b_prompts:
                target = [torch.zeros_like(layer) for layer in kv]
                mask = await engine.retrieve(
                    tokens, kv_caches=target, slot_mapping=slots, tenant="b"
                )
                loads.append((mask, payload_of(target, slots), payload_of(kv, slots)))
            a_hits = [await engine.lookup(tokens, tenant="a") for tokens in a_prompts]
            engine_stats, _ = await server_state(engine)
    assert b_hits == [N, N]
    for mask, loaded, stored_kv in loads:
        assert mask.tolist() == [True] * N
        assert torch.equal(loaded.view(torch.int16), stored_kv.view(torch.int16))
    # a keeps its newest two prompts (its quota); the older ones went for them.
    assert a_hits == [0] * (len(a_prompts) - 2) + [N, N]
    a_usage, b_usage = cpu_usage(engine_stats, "a"), cpu_usage(engine_stats, "b")
    assert (a_usage["chunks"], a_usage["quota_bytes"]) == (QUOTA_CHUNKS, QUOTA_BYTES)
    assert a_usage["bytes"] == QUOTA_CHUNKS * CHUNK_BYTES <= QUOTA_BYTES
    assert a_usage["evictions"] == 3 * len(a_prompts) - QUOTA_CHUNKS
    assert (b_usage["chunks"], b_usage["bytes"]) == (QUOTA_CHUNKS, QUOTA_CHUNKS * CHUNK_BYTES)
    assert b_usage["evictions"] == 0
