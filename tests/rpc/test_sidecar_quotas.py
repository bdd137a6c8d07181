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
from lmcache_async.memory.pool import page_size_for
from lmcache_async.tenancy.tenants import tag_hex, tenant_tag
from tests.backends.test_redis import poll_until
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
    """The tenant's usage of the sidecar's CPU tier, from its STATS reply (where a tenant
    with no label is shown by its tag, never by its name)."""
    usage: Mapping[str, Any] = engine_stats["tenants"][tag_hex(tenant_tag(tenant))]["tiers"]["cpu"]
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


PAGE: Final = page_size_for(CHUNK_BYTES)  # the pool's page: each chunk here takes one
PIN_PROMPT: Final = 2 * CHUNK  # two whole chunks


def tenant_cpu(engine_stats: Mapping[str, Any], tenant: str) -> Mapping[str, Any]:
    """The tenant's usage of the CPU tier in a STATS reply (found by its tag), or {}."""
    tag = tag_hex(tenant_tag(tenant))
    for figures in engine_stats["tenants"].values():
        if figures["tag"] == tag:
            usage: Mapping[str, Any] = figures["tiers"].get("cpu", {})
            return usage
    return {}


async def test_prefetches_past_a_tenants_cpu_quota_stop_short_and_leave_others_room(
    tmp_path: Path,
) -> None:
    """The reported case through PREFETCH: a tenant with a 2-chunk CPU quota prefetches 4
    prompts of 2 chunks from disk (8 chunks: the sidecar's whole pool); its pins stop at
    its quota, counted, and another tenant within its own quota then stores."""
    short = Path(tempfile.mkdtemp(prefix="lmc-qp-", dir="/tmp"))
    launcher = Sidecars(tmp_path)
    quota = {"a": 2 * (CHUNK_BYTES + 256) / GB, "b": 4 * (CHUNK_BYTES + 256) / GB}
    a_prompts = [prompt(PIN_PROMPT, salt=5000 + i) for i in range(4)]
    a_kv, a_slots = kv_for(PIN_PROMPT, seed=50)
    b_tokens, (b_kv, b_slots) = prompt(N, salt=5100), kv_for(N, seed=51)
    try:
        sidecar = launcher.start(
            f"ipc://{short}/pins.sock",
            *("--tenant-quotas", f"cpu.a={quota['a']!r},cpu.b={quota['b']!r}"),
            *("--local-disk", str(tmp_path / "disk"), "--wait-for-slow-tiers", "true"),
            *("--max-local-cpu-size", repr(8 * PAGE / GB), "--allocation-timeout", "1"),
        )
        with anyio.fail_after(TIMEOUT):
            await wait_ready(sidecar)
            async with connect(sidecar.url) as engine:
                for tokens in a_prompts:
                    stored = await engine.store(
                        tokens,
                        kv_caches=a_kv,
                        slot_mapping=a_slots,
                        tenant="a",
                        store_location=["disk"],
                    )
                    assert stored == PIN_PROMPT
                for i, tokens in enumerate(a_prompts):
                    hits = await engine.prefetch(tokens, lookup_id=f"a{i}", tenant="a")
                    assert hits == PIN_PROMPT

                async def prefetches_done() -> bool:
                    figures, _ = await server_state(engine)
                    refused = tenant_cpu(figures, "a").get("pins_refused", 0)
                    return bool(figures["pinned_chunks"] + refused == 4 * 2)

                await poll_until(prefetches_done)
                figures, _ = await server_state(engine)
                assert figures["pinned_chunks"] == 2, "a's pins stop at its quota"
                assert tenant_cpu(figures, "a")["pins_refused"] == 3 * 2
                stored = await engine.store(
                    b_tokens, kv_caches=b_kv, slot_mapping=b_slots, tenant="b"
                )
                assert stored == N, "b, within its quota, stores whole"
                target = [torch.zeros_like(layer) for layer in b_kv]
                mask = await engine.retrieve(
                    b_tokens, kv_caches=target, slot_mapping=b_slots, tenant="b"
                )
                assert mask.tolist() == [True] * N
                loaded, want = payload_of(target, b_slots), payload_of(b_kv, b_slots)
                assert torch.equal(loaded.view(torch.int16), want.view(torch.int16))
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)
