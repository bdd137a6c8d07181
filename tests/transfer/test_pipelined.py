"""Double-buffered staged transfers (:mod:`lmcache_async.transfer.pipelined`) and the
engine's CUDA copies through them (:mod:`lmcache_async.core.copy`), driven on the CPU with
stand-in streams and events: exact bytes, the kernels on one stream and the host copies on
the other with events between them, and launches that do not grow with the chunks."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest
import torch

from lmcache_async.core import copy as core_copy
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.transfer import pipelined
from lmcache_async.transfer.cuda import Direction, Transfers, caller_stream
from lmcache_async.transfer.pipelined import (
    Lanes,
    gather_pipelined,
    pass_bound,
    scatter_pipelined,
)
from lmcache_async.transfer.staged import StagedPlan
from lmcache_async.transfer.staging import StagingBuffer
from tests.fake_cuda import CUDA, FakeCuda, install
from tests.transfer.test_staged import (
    NUM_BLOCKS,
    Batch,
    chunks_of,
    make_layout,
    num_slots,
    same_kv,
)

KERNELS = ("index", "index_select", "index_put_", "index_copy_")


def lanes_of(cuda: FakeCuda, **staging: Any) -> Lanes:
    home, side = cuda.Stream(name="home"), cuda.Stream(name="side")
    return Lanes(home, side, (StagingBuffer("cpu", **staging), StagingBuffer("cpu", **staging)))


def kernels_on(cuda: FakeCuda) -> Counter[str]:
    return Counter(stream for name, stream in cuda.ops if name in KERNELS)


def copies_on(cuda: FakeCuda) -> Counter[str]:
    return Counter(stream for name, stream in cuda.ops if name == "copy_")


def per_chunk_scatter(
    batch: Batch, jobs: list[tuple[int, int, torch.Tensor]]
) -> list[torch.Tensor]:
    """What the per-chunk path writes for ``jobs`` (the caches are left as they were)."""
    before = [layer.clone() for layer in batch.kv]
    batch.plan.scatter_chunks(jobs)
    written = [layer.clone() for layer in batch.kv]
    for layer, was in zip(batch.kv, before, strict=True):
        layer.copy_(was)
    return written


def run_on_home(cuda: FakeCuda, lanes: Lanes, fn: Any) -> None:
    with torch.cuda.stream(lanes.home):
        fn()


def test_a_pass_carries_about_a_share_of_the_batch() -> None:
    assert pass_bound(100 << 20, 256 << 20, passes=4, min_pass_bytes=4 << 20) == 25 << 20
    assert pass_bound(8 << 20, 256 << 20, passes=4, min_pass_bytes=4 << 20) == 4 << 20
    assert pass_bound(8 << 30, 256 << 20, passes=4, min_pass_bytes=4 << 20) == 256 << 20
    assert pass_bound(0, 256, passes=4, min_pass_bytes=0) == 1


@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "mla", "vllm_cpu"])
@pytest.mark.parametrize("placement", ["adjacent", "apart"])
def test_pipelined_transfers_give_the_per_chunk_bytes(
    monkeypatch: pytest.MonkeyPatch, kind: str, placement: str
) -> None:
    cuda = install(monkeypatch)
    batch = Batch(kind, 7, placement, negative=True)
    jobs = [job for job in batch.jobs() if job[0] >= 4]  # the gather refuses the negative
    expected = [torch.zeros_like(p) for _, _, p in jobs]
    batch.plan.gather_chunks([(s, e, o) for (s, e, _), o in zip(jobs, expected, strict=True)])
    lanes = lanes_of(cuda)
    staged = StagedPlan.from_plan(batch.plan)
    run_on_home(
        cuda, lanes, lambda: gather_pipelined(staged, jobs, lanes, passes=3, min_pass_bytes=1)
    )
    assert all(torch.equal(p, want) for (_, _, p), want in zip(jobs, expected, strict=True))

    # Scatter every chunk (the negative slot too) into a copy of the caches.
    for _, _, payload in batch.jobs():
        payload.copy_(torch.randn(payload.shape, generator=torch.Generator().manual_seed(1)))
    reference = per_chunk_scatter(batch, batch.jobs())
    run_on_home(
        cuda,
        lanes,
        lambda: scatter_pipelined(staged, batch.jobs(), lanes, passes=3, min_pass_bytes=1),
    )
    assert same_kv(batch.kv, reference)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_passes_alternate_buffers_with_kernels_and_copies_on_two_streams(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """A store gathers pass k on home and copies it out on side; pass k + 1's gather waits
    for no copy (it overlaps pass k's), pass k + 2's waits for pass k's (same buffer); home
    joins side at the end. A load mirrors it: copies in on home, scatters on side."""
    cuda = install(monkeypatch)
    batch = Batch("flash_nhd", 8)  # 8 full chunks of 4 tokens and one of 3
    full = batch.payloads[0].numel() * 4
    lanes = lanes_of(cuda)
    staged = StagedPlan.from_plan(batch.plan)
    cuda.count_ops(monkeypatch)
    transfer = gather_pipelined if direction == "gather" else scatter_pipelined
    run_on_home(
        cuda,
        lanes,
        lambda: transfer(staged, batch.jobs(), lanes, passes=4, min_pass_bytes=3 * full),
    )
    # Passes of 3 full chunks, 3 full chunks, then 2 and the partial one (its own length).
    kernel_stream, copy_stream = ("home", "side") if direction == "gather" else ("side", "home")
    layers_parts = 3 * batch.parts
    assert kernels_on(cuda) == Counter({kernel_stream: (3 + 1) * layers_parts})
    assert copies_on(cuda) == Counter({copy_stream: 3})  # one per pass: payloads adjacent
    waits = [(entry[1], entry[2]) for entry in cuda.log if entry[0] == "wait"]
    records = {entry[1]: entry[2] for entry in cuda.log if entry[0] == "record"}
    # side waits for home before each pass's second step; home waits for side before the
    # third pass (pass 0's buffer) and at the end. Pass 1 waits for nothing of pass 0.
    assert [stream for stream, _ in waits] == ["side", "side", "home", "side", "home"]
    assert all(records[event] != stream for stream, event in waits)
    side_events = [e for e, s in records.items() if s == "side"]
    home_waits = [event for stream, event in waits if stream == "home"]
    assert home_waits == [side_events[0], side_events[2]]
    assert staged is not None and lanes.slots[0].statistics().uses == 1
    assert lanes.slots[1].statistics().uses == 1


def test_a_failed_pipelined_transfer_waits_for_both_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = install(monkeypatch)
    batch = Batch("mla", 4)
    lanes = lanes_of(cuda)
    staged = StagedPlan.from_plan(batch.plan)

    def broken(*args: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(StagedPlan, "copy_out", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        run_on_home(
            cuda, lanes, lambda: gather_pipelined(staged, batch.jobs(), lanes, min_pass_bytes=1)
        )
    assert cuda.log[-2:] == [("sync", "side"), ("sync", "home")]
    assert lanes.slots[0].statistics().uses == 1  # the buffers were given back


# -- the engine's copies on (stand-in) CUDA -----------------------------------------------


def pooled(batch: Batch, pool: MemoryPool) -> list[tuple[int, int, torch.Tensor]]:
    """The batch's jobs with payloads allocated one after the other from ``pool``."""
    jobs = []
    for (start, end), _ in zip(batch.ranges, batch.payloads, strict=True):
        obj = pool.allocate_nowait(batch.layout.payload_shape(end - start), batch.layout.dtype)
        assert obj is not None
        jobs.append((start, end, obj.tensor))
    return jobs


@pytest.mark.anyio
@pytest.mark.parametrize("full", [3, 10])
async def test_a_cuda_store_and_retrieve_are_staged_on_two_streams(
    monkeypatch: pytest.MonkeyPatch, full: int
) -> None:
    """``core.copy.gather`` (a store) gathers with a kernel per layer and part on the
    store stream and copies out on a second stream; ``scatter`` (a retrieve) copies in on
    the load stream and scatters on a second one. The launches do not depend on the
    number of chunks; the bytes are the per-chunk path's."""
    cuda = install(monkeypatch, host_device=True)
    batch = Batch("flash_nhd", full)
    pool = MemoryPool(256 * 1024, page_size=256, pin_memory=False)
    jobs = pooled(batch, pool)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    cuda.count_ops(monkeypatch)
    layers_parts = 3 * batch.parts
    try:
        with anyio.fail_after(10):
            await core_copy.gather(
                transfers, batch.plan, jobs, timeout=5, caller=caller_stream(CUDA)
            )
        store = transfers.lanes(CUDA, Direction.STORE)
        assert kernels_on(cuda) == Counter({store.home.name: 2 * layers_parts})
        assert copies_on(cuda) == Counter({store.side.name: 1})
        expected = [torch.zeros_like(p) for _, _, p in jobs]
        batch.plan.gather_chunks([(s, e, o) for (s, e, _), o in zip(jobs, expected, strict=True)])
        assert all(torch.equal(p, want) for (_, _, p), want in zip(jobs, expected, strict=True))

        for _, _, payload in jobs:
            payload.mul_(-1)
        reference = per_chunk_scatter(batch, jobs)
        cuda.ops.clear()
        with anyio.fail_after(10):
            await core_copy.scatter(
                transfers, batch.plan, jobs, timeout=5, caller=caller_stream(CUDA)
            )
        load = transfers.lanes(CUDA, Direction.LOAD)
        assert copies_on(cuda) == Counter({load.home.name: 1})
        assert kernels_on(cuda) == Counter({load.side.name: 2 * layers_parts})
        assert same_kv(batch.kv, reference)
        # The caller's stream waits for the load's completion event, recorded on home.
        done = cuda.log[-2]
        assert done[0] == "record" and done[2] == load.home.name
        assert cuda.log[-1] == ("wait", "default", done[1])
    finally:
        transfers.close()


# -- on a GPU -----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "flashinfer", "mla"])
async def test_the_engine_copies_on_cuda_match_the_per_chunk_path(kind: str) -> None:
    """core.copy's double-buffered store and retrieve on a real device, in several passes,
    against the per-chunk path; the caller's stream reads the retrieved KV."""
    device = torch.device("cuda", torch.cuda.current_device())
    layout = make_layout(kind, torch.bfloat16, num_layers=4)
    gen = torch.Generator(device=device).manual_seed(0)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, device=device, generator=gen)
    num_tokens = 4 * 9 + 3
    slots = torch.randperm(num_slots(layout))[:num_tokens]
    plan = layout.plan(kv, slots.to(device), slots_cpu=slots)
    ranges = chunks_of(num_tokens, 4)
    pool = MemoryPool(1024**2, page_size=256, pin_memory=True)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    # Small passes: the batch crosses in several, alternating the two buffers.
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(pipelined, "DEFAULT_MIN_PASS_BYTES", 1)
    try:
        objs = [pool.allocate_nowait(layout.payload_shape(e - s), layout.dtype) for s, e in ranges]
        jobs = [(s, e, obj.tensor) for (s, e), obj in zip(ranges, objs, strict=True) if obj]
        expected = [(s, e, torch.zeros_like(p)) for s, e, p in jobs]
        plan.gather_chunks(expected)
        torch.cuda.synchronize(device)
        with anyio.fail_after(30):
            await core_copy.gather(transfers, plan, jobs, timeout=20)
        assert all(
            torch.equal(got, want) for (_, _, got), (_, _, want) in zip(jobs, expected, strict=True)
        )
        for _, _, p in jobs:
            p.copy_(torch.randn(p.shape))
        kv_ref = [layer.clone() for layer in kv]
        layout.plan(kv_ref, slots.to(device), slots_cpu=slots).scatter_chunks(jobs)
        torch.cuda.synchronize(device)
        with anyio.fail_after(30):
            await core_copy.scatter(transfers, plan, jobs, timeout=20)
        assert same_kv(kv, kv_ref)  # read on the current stream, ordered after the load
        for obj in objs:
            assert obj is not None
            obj.unref()
    finally:
        monkeypatch.undo()
        transfers.close()
        pool.close()
