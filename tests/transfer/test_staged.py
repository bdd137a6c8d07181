"""Staged transfers (:mod:`lmcache_async.transfer.staged`) give exactly the bytes of the
per-chunk path, with kernel launches that do not grow with the number of chunks, and move
payloads that lie back to back in host memory with one copy."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.transfer import staged as transfer_staged
from lmcache_async.transfer.plan import PlanPart, TransferPlan
from lmcache_async.transfer.staged import Job, StagedPlan, host_runs
from lmcache_async.transfer.staging import StagingBuffer
from tests.fake_cuda import CUDA, install

NUM_BLOCKS = 12
GRANULE = 256

KINDS = (
    "flash_nhd",
    "flash_hnd",
    "flashinfer",
    "mla",
    "vllm_cpu",
    "vllm_cpu_token_rows",
    "vllm_cpu_amx",
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PLACEMENTS = ("adjacent", "granule", "apart", "mixed")


def make_layout(kind: str, dtype: torch.dtype, num_layers: int = 2) -> KVLayout:
    """A small layout of ``kind`` (AMX: bfloat16 and sizes of 32, as its kernel needs)."""
    if kind in ("flash_nhd", "flash_hnd"):
        return KVLayout.vllm_flash_attn(
            num_layers=num_layers,
            block_size=4,
            num_kv_heads=2,
            head_size=4,
            dtype=dtype,
            hnd=kind == "flash_hnd",
        )
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=num_layers, block_size=4, num_kv_heads=2, head_size=4, dtype=dtype
        )
    if kind == "mla":
        return KVLayout.mla(num_layers=num_layers, block_size=4, latent_dim=12, dtype=dtype)
    if kind == "vllm_cpu_amx":
        return KVLayout.vllm_cpu(
            num_layers=num_layers,
            num_kv_heads=2,
            head_size=32,
            dtype=torch.bfloat16,
            block_size=32,
            packing="amx",
        )
    packing = "token_rows" if kind == "vllm_cpu_token_rows" else "keys_transposed"
    return KVLayout.vllm_cpu(
        num_layers=num_layers,
        num_kv_heads=2,
        head_size=4,
        dtype=dtype,
        block_size=4,
        packing=packing,
    )


def num_slots(layout: KVLayout) -> int:
    return NUM_BLOCKS * layout.block_size


def chunks_of(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]


def place(
    layout: KVLayout, ranges: Sequence[tuple[int, int]], placement: str, gen: torch.Generator
) -> list[torch.Tensor]:
    """Zeroed payloads for ``ranges``: carved back to back from one arena (``adjacent``),
    at granule-rounded offsets (``granule``), each its own tensor (``apart``), or in one
    arena with a gap after some (``mixed``)."""
    shapes = [layout.payload_shape(e - s) for s, e in ranges]
    if placement == "apart":
        return [torch.zeros(shape, dtype=layout.dtype) for shape in shapes]
    itemsize = layout.dtype.itemsize
    offsets, offset = [], 0
    for shape in shapes:
        offsets.append(offset)
        offset += math.prod(shape) * itemsize
        if placement == "granule":
            offset = -(-offset // GRANULE) * GRANULE
        elif placement == "mixed" and bool(torch.randint(0, 2, (), generator=gen)):
            offset += GRANULE
    arena = torch.zeros(offset + GRANULE, dtype=torch.uint8)
    return [
        arena[o : o + math.prod(shape) * itemsize].view(layout.dtype).view(shape)
        for o, shape in zip(offsets, shapes, strict=True)
    ]


def plan_over(layout: KVLayout, kv: list[torch.Tensor], slots: torch.Tensor) -> TransferPlan:
    return layout.plan(kv, slots)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def same_kv(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def staging_for(placement: str, max_bytes: int | None) -> StagingBuffer:
    granule = GRANULE if placement == "granule" else None
    if max_bytes is None:
        return StagingBuffer("cpu", host_granule=granule)
    return StagingBuffer("cpu", host_granule=granule, max_bytes=max_bytes)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    dtype = torch.bfloat16 if kind == "vllm_cpu_amx" else draw(st.sampled_from(DTYPES))
    layout = make_layout(kind, dtype, num_layers=draw(st.integers(1, 3)))
    num_tokens = draw(st.integers(1, 40))
    chunk = draw(st.integers(1, 12))
    ranges = chunks_of(num_tokens, chunk)
    # Some batches skip chunks (those already stored): their tokens do not follow.
    skip = draw(st.lists(st.booleans(), min_size=len(ranges), max_size=len(ranges)))
    picked = [r for r, s in zip(ranges, skip, strict=True) if not s] or ranges[:1]
    return {
        "layout": layout,
        "num_tokens": num_tokens,
        "ranges": picked,
        "placement": draw(st.sampled_from(PLACEMENTS)),
        # Small bounds cut the batch into several passes through the buffer.
        "max_bytes": draw(st.sampled_from([None, 1, 700, 5000])),
        "negative_rate": draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_staged_gather_gives_the_per_chunk_bytes(scenario: dict[str, Any]) -> None:
    layout: KVLayout = scenario["layout"]
    gen = torch.Generator().manual_seed(scenario["seed"])
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    slots = torch.randperm(num_slots(layout), generator=gen)[: scenario["num_tokens"]]
    plan = plan_over(layout, kv, slots)
    ranges = scenario["ranges"]
    expected = [torch.zeros(layout.payload_shape(e - s), dtype=layout.dtype) for s, e in ranges]
    plan.gather_chunks([(s, e, out) for (s, e), out in zip(ranges, expected, strict=True)])

    payloads = place(layout, ranges, scenario["placement"], gen)
    with staging_for(scenario["placement"], scenario["max_bytes"]) as staging:
        StagedPlan.from_plan(plan).gather_chunks(
            [(s, e, out) for (s, e), out in zip(ranges, payloads, strict=True)], staging
        )
    for got, want in zip(payloads, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_staged_scatter_writes_what_the_per_chunk_path_writes(scenario: dict[str, Any]) -> None:
    layout: KVLayout = scenario["layout"]
    gen = torch.Generator().manual_seed(scenario["seed"])
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    kv_ref = [layer.clone() for layer in kv]  # clone keeps HND's memory order
    num_tokens = scenario["num_tokens"]
    slots = torch.randperm(num_slots(layout), generator=gen)[:num_tokens]
    negative = torch.rand(num_tokens, generator=gen) < scenario["negative_rate"]
    slots[negative] = -1
    ranges = scenario["ranges"]
    payloads = place(layout, ranges, scenario["placement"], gen)
    for payload in payloads:
        payload.copy_(torch.randn(payload.shape, generator=gen))

    plan_over(layout, kv_ref, slots).scatter_chunks(
        [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True)]
    )
    with staging_for(scenario["placement"], scenario["max_bytes"]) as staging:
        StagedPlan.from_plan(plan_over(layout, kv, slots)).scatter_chunks(
            [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True)], staging
        )
    assert same_kv(kv, kv_ref)


# -- what a batch costs -------------------------------------------------------------------

COUNTED = ("aten::index_select", "aten::index", "aten::index_put_", "aten::index_copy_")
"""The indexing kernels (one launch each on a device)."""


def ops(fn: Callable[[], None]) -> Counter[str]:
    """The operators ``fn`` ran, by name (each one kernel launch or copy on a device)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = (*COUNTED, "aten::copy_", "aten::cat")
    return Counter({e.key: e.count for e in prof.key_averages() if e.key in names})


class Batch:
    """A request of ``full`` chunks of 4 tokens and a partial one of 3, on a 3-layer
    layout of ``kind``, with its payloads placed as ``placement`` says."""

    def __init__(
        self, kind: str, full: int, placement: str = "adjacent", *, negative: bool = False
    ) -> None:
        self.layout = layout = make_layout(kind, torch.float32, num_layers=3)
        gen = torch.Generator().manual_seed(full)
        self.kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
        num_tokens = 4 * full + 3
        slots = torch.randperm(num_slots(layout), generator=gen)[:num_tokens]
        if negative:
            slots[1] = -1  # one token of the first chunk
        self.plan = layout.plan(self.kv, slots)
        self.ranges = chunks_of(num_tokens, 4)
        self.payloads = place(layout, self.ranges, placement, gen)
        self.parts = len(self.plan._parts)

    def jobs(self, ranges: Sequence[tuple[int, int]] | None = None) -> list[Job]:
        pairs = zip(self.ranges, self.payloads, strict=True)
        return [(s, e, p) for (s, e), p in pairs if ranges is None or (s, e) in ranges]


def staged_ops(
    batch: Batch, direction: str, jobs: list[Job] | None = None, **staging: Any
) -> Counter[str]:
    """The operators of one staged transfer of ``jobs`` (default: the whole batch)."""
    staged = StagedPlan.from_plan(batch.plan)
    todo = batch.jobs() if jobs is None else jobs
    with StagingBuffer("cpu", **staging) as buffer:
        transfer = staged.gather_chunks if direction == "gather" else staged.scatter_chunks
        return ops(lambda: transfer(todo, buffer))


@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "mla", "vllm_cpu"])
def test_a_gather_launches_per_layer_and_part_not_per_chunk(kind: str) -> None:
    counts = []
    for full in (2, 7):
        batch = Batch(kind, full)
        counts.append(staged_ops(batch, "gather"))
        per_length = batch.parts * 3  # parts x layers, for the full chunks and the partial one
        assert counts[-1] == Counter(
            {"aten::index": per_length, "aten::index_select": per_length, "aten::copy_": 1}
        )
    assert counts[0] == counts[1]  # whatever the number of chunks


def test_a_scatter_launches_per_layer_and_part_not_per_chunk() -> None:
    counts = []
    for full in (2, 7):
        counts.append(staged_ops(Batch("flash_nhd", full), "scatter"))
        assert counts[-1] == Counter(
            {"aten::copy_": 1, "aten::index_put_": 2 * 3, "aten::index_copy_": 2 * 3}
        )
    assert counts[0] == counts[1]


def test_negative_slots_cost_one_more_kernel_per_layer_and_part() -> None:
    counts = []
    for full in (2, 7):
        counts.append(staged_ops(Batch("flash_nhd", full, negative=True), "scatter"))
        # The full chunks (one has the negative slot): a gather of the rows kept and an
        # index_copy_ per layer and part, and the kept rows' index once per part; the
        # partial chunk: one index_copy_ per layer and part.
        assert counts[-1] == Counter(
            {"aten::copy_": 1, "aten::index": 2 * 3 + 2, "aten::index_copy_": 2 * 2 * 3}
        )
    assert counts[0] == counts[1]


def test_payloads_apart_take_one_copy_each_and_nothing_more() -> None:
    batch = Batch("flash_nhd", 5, placement="apart")
    gather = staged_ops(batch, "gather")
    scatter = staged_ops(batch, "scatter")
    assert gather == Counter({"aten::index": 6, "aten::index_select": 6, "aten::copy_": 6})
    assert scatter == Counter({"aten::index_put_": 6, "aten::index_copy_": 6, "aten::copy_": 6})


def test_chunks_whose_tokens_do_not_follow_build_their_index_once_per_part() -> None:
    batch = Batch("flash_nhd", 5)
    picked = [batch.ranges[i] for i in (0, 2, 3)]  # chunk 1 was stored already
    counts = staged_ops(batch, "gather", batch.jobs(picked))
    # Payloads 0, 2 and 3 are not back to back (payload 1 lies between): two copies.
    assert counts == Counter({"aten::cat": 2, "aten::index": 6, "aten::copy_": 2})


def test_a_batch_larger_than_the_bound_goes_in_passes() -> None:
    batch = Batch("flash_nhd", 4)
    full_bytes = batch.payloads[0].numel() * 4
    with StagingBuffer("cpu", max_bytes=2 * full_bytes) as staging:
        staged = StagedPlan.from_plan(batch.plan)
        counts = ops(lambda: staged.gather_chunks(batch.jobs(), staging))
        assert staging.statistics().uses == 1
    # Passes [0, 1], [2, 3], [4 (partial)]: one copy and one kernel per layer and part each.
    assert counts == Counter({"aten::index": 2 * 6, "aten::index_select": 6, "aten::copy_": 3})
    expected = [torch.zeros_like(p) for p in batch.payloads]
    batch.plan.gather_chunks([(s, e, o) for (s, e), o in zip(batch.ranges, expected, strict=True)])
    assert all(torch.equal(a, b) for a, b in zip(batch.payloads, expected, strict=True))


# -- host ranges --------------------------------------------------------------------------


def test_adjacent_pool_allocations_are_one_host_range_and_one_copy() -> None:
    layout = make_layout("flash_nhd", torch.float32, num_layers=3)
    ranges = chunks_of(4 * 4, 4)
    # A payload of 4 tokens is 2 * 3 * 4 * 8 * 4 = 768 bytes: three pages of 256.
    pool = MemoryPool(64 * 1024, page_size=256, pin_memory=False)
    objs = [pool.allocate_nowait(layout.payload_shape(e - s), layout.dtype) for s, e in ranges]
    payloads = [obj.tensor for obj in objs if obj is not None]
    assert len(payloads) == len(ranges)
    assert host_runs(payloads) == [range(4)]

    gen = torch.Generator().manual_seed(0)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    plan = layout.plan(kv, torch.randperm(num_slots(layout), generator=gen)[:16])
    jobs = [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True)]
    with StagingBuffer("cpu", host_granule=pool.page_size) as staging:
        counts = ops(lambda: StagedPlan.from_plan(plan).gather_chunks(jobs, staging))
    assert counts["aten::copy_"] == 1
    expected = [torch.zeros_like(p) for p in payloads]
    plan.gather_chunks([(s, e, o) for (s, e), o in zip(ranges, expected, strict=True)])
    assert all(torch.equal(a, b) for a, b in zip(payloads, expected, strict=True))
    for obj in objs:
        assert obj is not None
        obj.unref()
    assert pool.stats().used_bytes == 0


def test_page_rounded_allocations_join_only_with_the_pool_granule() -> None:
    pool = MemoryPool(64 * 1024, page_size=1024, pin_memory=False)
    objs = [pool.allocate_nowait((300,), torch.float32) for _ in range(3)]  # 1200 B: 2 pages
    payloads = [obj.tensor for obj in objs if obj is not None]
    assert host_runs(payloads) == [range(1), range(1, 2), range(2, 3)]
    assert host_runs(payloads, granule=1024) == [range(3)]
    assert host_runs(payloads[::-1], granule=1024) == [range(1), range(1, 2), range(2, 3)]
    # A hole (a payload handed back) cuts the run.
    assert objs[1] is not None
    objs[1].unref()
    assert host_runs([payloads[0], payloads[2]], granule=1024) == [range(1), range(1, 2)]


def test_payloads_of_different_storages_never_join() -> None:
    a = torch.zeros(64)
    b = torch.zeros(64)
    assert host_runs([a, b]) == [range(1), range(1, 2)]
    arena = torch.zeros(128)
    assert host_runs([arena[:64], arena[64:]]) == [range(2)]
    assert host_runs([]) == []


def test_granule_slack_between_payloads_is_copied_within_their_allocations() -> None:
    """The bytes after a payload up to its granule's end are its own allocation's: a gather
    may write them; the bytes after the last payload of a range are never touched."""
    batch = Batch("flash_nhd", 2, placement="granule")
    arena = batch.payloads[0].untyped_storage()
    sentinel = 0xA5
    torch.empty(0, dtype=torch.uint8).set_(arena).fill_(sentinel)
    with StagingBuffer("cpu", host_granule=GRANULE) as staging:
        StagedPlan.from_plan(batch.plan).gather_chunks(batch.jobs(), staging)
    whole = torch.empty(0, dtype=torch.uint8).set_(arena)
    last = batch.payloads[-1]
    end = last.storage_offset() * 4 + last.numel() * 4
    assert bool((whole[end:] == sentinel).all())


# -- errors -------------------------------------------------------------------------------


def test_a_gather_over_a_negative_slot_is_refused_before_anything_moves() -> None:
    batch = Batch("flash_nhd", 2, negative=True)
    for payload in batch.payloads:
        payload.fill_(7.0)
    with StagingBuffer("cpu") as staging:
        with pytest.raises(InvalidInputError, match=r"tokens \[0, 4\) include a negative slot"):
            StagedPlan.from_plan(batch.plan).gather_chunks(batch.jobs(), staging)
        assert staging.statistics().uses == 0
    assert all(bool((p == 7.0).all()) for p in batch.payloads)


@pytest.mark.parametrize(
    ("job", "match"),
    [
        ((4, 8, torch.zeros(2, 3, 4, 8, dtype=torch.float64)), "contiguous torch.float32"),
        ((4, 8, torch.zeros(2, 3, 3, 8)), "of 192 elements"),
        ((4, 8, torch.zeros(2, 3, 8, 4).transpose(2, 3)), "contiguous"),
        ((8, 99, torch.zeros(2, 3, 91, 8)), r"job \[8, 99\): out of the request's 11 tokens"),
        ((-1, 3, torch.zeros(2, 3, 4, 8)), "out of the request"),
    ],
)
def test_a_malformed_job_is_refused_before_anything_moves(job: Job, match: str) -> None:
    batch = Batch("flash_nhd", 2)
    before = [layer.clone() for layer in batch.kv]
    staged = StagedPlan.from_plan(batch.plan)
    with StagingBuffer("cpu") as staging:
        for transfer in (staged.gather_chunks, staged.scatter_chunks):
            batch.payloads[0].fill_(3.0)
            with pytest.raises(InvalidInputError, match=match):
                transfer([*batch.jobs()[:1], job], staging)
            assert bool((batch.payloads[0] == 3.0).all())
            assert same_kv(batch.kv, before)
        assert staging.statistics().uses == 0


def test_a_staging_buffer_of_another_device_is_refused() -> None:
    batch = Batch("mla", 1)
    staged = StagedPlan.from_plan(batch.plan)
    with pytest.raises(InvalidInputError, match="staging: on meta, the KV caches are on cpu"):
        staged.gather_chunks(batch.jobs(), StagingBuffer("meta"))


def test_a_closed_staging_buffer_is_refused() -> None:
    batch = Batch("mla", 1)
    staging = StagingBuffer("cpu")
    staging.close()
    with pytest.raises(EngineClosedError):
        StagedPlan.from_plan(batch.plan).scatter_chunks(batch.jobs(), staging)


def test_empty_batches_and_empty_jobs_move_nothing() -> None:
    batch = Batch("flash_nhd", 1)
    staged = StagedPlan.from_plan(batch.plan)
    with StagingBuffer("cpu") as staging:
        staged.gather_chunks([], staging)
        staged.scatter_chunks([(2, 2, torch.zeros(2, 3, 0, 8))], staging)
        assert staging.statistics() == (0, 0, 0)


def test_parts_must_agree_on_layers_and_width() -> None:
    view = torch.zeros(8, 4)
    index = torch.arange(4)
    with pytest.raises(InvalidInputError, match="at least one part"):
        StagedPlan([], rows_per_token=1)
    with pytest.raises(InvalidInputError, match="one view per layer"):
        StagedPlan(
            [PlanPart([view], index, (4,)), PlanPart([view, view], index, (4,))],
            rows_per_token=1,
        )
    with pytest.raises(InvalidInputError, match="do not all hold one width"):
        StagedPlan([PlanPart([view], index, (4,)), PlanPart([view], index, (2,))], rows_per_token=1)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_a_failed_transfer_settles_before_raising_and_frees_the_buffer(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    settled: list[BaseException] = []
    monkeypatch.setattr(StagedPlan, "_settle", lambda self, exc: settled.append(exc))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel failed")

    batch = Batch("flash_nhd", 3)
    staged = StagedPlan.from_plan(batch.plan)
    with StagingBuffer("cpu") as staging:
        with monkeypatch.context() as patch:
            patch.setattr(transfer_staged, "_index_out", broken)
            patch.setattr(torch.Tensor, "index_put_", broken)
            transfer = staged.gather_chunks if direction == "gather" else staged.scatter_chunks
            with pytest.raises(RuntimeError, match="kernel failed") as raised:
                transfer(batch.jobs(), staging)
        assert settled == [raised.value]
        staged.gather_chunks(batch.jobs(), staging)  # the buffer is free for the next batch
        assert staging.statistics().uses == 2


def test_settling_waits_for_the_current_stream_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = install(monkeypatch)
    staged = StagedPlan.from_plan(Batch("mla", 1).plan)
    staged._device = CUDA  # as built over CUDA caches
    error = RuntimeError("copy failed")
    staged._settle(error)
    assert cuda.log == [("sync", "default")]

    def lost(self: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(cuda.Stream, "synchronize", lost)
    staged._settle(error)
    assert any("device lost" in note for note in error.__notes__)


def test_settling_makes_no_cuda_call_for_cpu_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda(*args: Any) -> None:
        raise AssertionError("torch.cuda was called for CPU caches")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    StagedPlan.from_plan(Batch("mla", 1).plan)._settle(RuntimeError("copy failed"))


# -- on a GPU -----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "flashinfer", "mla"])
def test_staged_transfers_on_cuda_match_the_per_chunk_path(kind: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    layout = make_layout(kind, torch.bfloat16, num_layers=4)
    gen = torch.Generator(device=device).manual_seed(0)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, device=device, generator=gen)
    num_tokens = 4 * 7 + 3
    slots = torch.randperm(num_slots(layout))[:num_tokens]
    slots[5] = -1
    plan = layout.plan(kv, slots.to(device), slots_cpu=slots)
    ranges = chunks_of(num_tokens, 4)
    pool = MemoryPool(1024**2, page_size=256, pin_memory=True)
    try:
        objs = [pool.allocate_nowait(layout.payload_shape(e - s), layout.dtype) for s, e in ranges]
        payloads = [obj.tensor for obj in objs if obj is not None]
        staged = StagedPlan.from_plan(plan)
        good = [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True) if s > 5 or e <= 5]
        expected = [(s, e, torch.zeros_like(p).pin_memory()) for s, e, p in good]
        plan.gather_chunks(expected)
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with StagingBuffer(device, host_granule=256) as staging:
            # Two streams take turns with one buffer: each waits for the other's copies.
            for stream in (side, torch.cuda.current_stream(device), side):
                for _, _, p in good:
                    p.zero_()
                with torch.cuda.stream(stream):
                    staged.gather_chunks(good, staging)
                stream.synchronize()
                for (_, _, got), (_, _, want) in zip(good, expected, strict=True):
                    assert torch.equal(bits(got), bits(want))
            for p in payloads:
                p.copy_(torch.randn(p.shape))
            jobs = [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True)]
            kv_ref = [layer.clone() for layer in kv]
            plan_ref = layout.plan(kv_ref, slots.to(device), slots_cpu=slots)
            plan_ref.scatter_chunks(jobs)
            with torch.cuda.stream(side):
                staged.scatter_chunks(jobs, staging)
            side.synchronize()
            torch.cuda.synchronize(device)
            assert same_kv(kv, kv_ref)
            assert staging.statistics().allocations == 1
        for obj in objs:
            assert obj is not None
            obj.unref()
    finally:
        pool.close()
