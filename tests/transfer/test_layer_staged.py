"""Staged per-layer transfers (:mod:`lmcache_async.transfer.layer_staged`) give exactly the
bytes of the per-chunk per-layer path, with one kernel per layer (and part) and one host
copy per run of adjacent payloads, whatever the number of chunks."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import KVLayout
from lmcache_async.transfer.layer_staged import StagedLayers
from lmcache_async.transfer.staging import StagingBuffer
from tests.fake_cuda import install
from tests.transfer.test_staged import NUM_BLOCKS, make_layout, num_slots, same_kv

KINDS = ("flash_nhd", "flash_hnd", "flashinfer", "mla", "vllm_cpu")
Ranges = list[tuple[int, int]]


def layer_payloads(
    layout: KVLayout, ranges: Ranges, *, adjacent: bool, fill: int | None = None
) -> list[torch.Tensor]:
    """Per-layer payloads of ``ranges``: carved back to back from one arena, or apart."""
    shapes = [layout.layer_payload_shape(e - s) for s, e in ranges]
    if not adjacent:
        out = [torch.zeros(shape, dtype=layout.dtype) for shape in shapes]
    else:
        arena = torch.zeros(sum(math.prod(shape) for shape in shapes), dtype=layout.dtype)
        out, offset = [], 0
        for shape in shapes:
            out.append(arena[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
    if fill is not None:
        gen = torch.Generator().manual_seed(fill)
        for payload in out:
            payload.copy_(torch.randn(payload.shape, generator=gen))
    return out


def jobs_of(
    ranges: Ranges, payloads: Sequence[torch.Tensor]
) -> list[tuple[int, int, torch.Tensor]]:
    return [(s, e, p) for (s, e), p in zip(ranges, payloads, strict=True)]


def scene(
    kind: str, num_tokens: int, *, negative: bool = False, seed: int = 0
) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    layout = make_layout(kind, torch.float32, num_layers=3)
    gen = torch.Generator().manual_seed(seed)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    slots = torch.randperm(num_slots(layout), generator=gen)[:num_tokens]
    if negative:
        slots[1] = -1
        slots[num_tokens - 2] = -1
    return layout, kv, slots


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8), (8, 11)], [(0, 4), (8, 11)], [(4, 4), (4, 8)]])
def test_staged_layers_give_the_per_chunk_bytes(kind: str, adjacent: bool, ranges: Ranges) -> None:
    layout, kv, slots = scene(kind, 11)
    plan = layout.plan(kv, slots)
    staged = StagedLayers(plan, ranges)
    with StagingBuffer("cpu") as staging:
        for layer in range(3):
            want = layer_payloads(layout, ranges, adjacent=False)
            plan.gather_layer_chunks(layer, jobs_of(ranges, want))
            got = layer_payloads(layout, ranges, adjacent=adjacent)
            staged.gather(layer, jobs_of(ranges, got), staging)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8), (8, 11)], [(0, 4), (8, 11)]])
def test_staged_layers_write_what_the_per_chunk_path_writes(
    kind: str, negative: bool, ranges: Ranges
) -> None:
    layout, kv, slots = scene(kind, 11, negative=negative)
    reference = [layer.clone() for layer in kv]
    staged = StagedLayers(layout.plan(kv, slots), ranges)
    ref_plan = layout.plan(reference, slots)
    with StagingBuffer("cpu") as staging:
        for layer in range(3):
            payloads = layer_payloads(layout, ranges, adjacent=True, fill=layer)
            ref_plan.scatter_layer_chunks(layer, jobs_of(ranges, payloads))
            staged.scatter(layer, jobs_of(ranges, payloads), staging)
            assert same_kv(kv, reference), layer


KERNELS = ("index_select", "index_copy_", "index", "index_put_")


def per_layer_ops(
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    chunks: int,
    *,
    adjacent: bool,
    negative: bool = False,
) -> tuple[Counter[str], Counter[str]]:
    """The operations of a gather and of a scatter of every layer of ``chunks`` chunks of
    4 tokens (by name, over the 3 layers)."""
    layout, kv, slots = scene(kind, 4 * chunks, negative=negative)
    ranges = [(4 * i, 4 * i + 4) for i in range(chunks)]
    plan = layout.plan(kv, slots)
    staged = StagedLayers(plan, ranges)
    cuda = install(monkeypatch)
    counts = []
    with StagingBuffer("cpu") as staging:
        for transfer in ("gather", "scatter"):
            payloads = [layer_payloads(layout, ranges, adjacent=adjacent) for _ in range(3)]
            cuda.ops.clear()
            with monkeypatch.context() as patch:
                cuda.count_ops(patch)
                for layer in range(3):
                    jobs = jobs_of(ranges, payloads[layer])
                    if transfer == "gather":
                        if not negative:
                            staged.gather(layer, jobs, staging)
                    else:
                        staged.scatter(layer, jobs, staging)
            counts.append(cuda.launches())
    return counts[0], counts[1]


@pytest.mark.parametrize("chunks", [2, 8])
def test_a_layer_costs_one_kernel_and_one_copy_whatever_the_chunks(
    monkeypatch: pytest.MonkeyPatch, chunks: int
) -> None:
    gather, scatter = per_layer_ops(monkeypatch, "flash_nhd", chunks, adjacent=True)
    assert gather == Counter({"index_select": 3, "copy_": 3})
    assert scatter == Counter({"copy_": 3, "index_copy_": 3})


def test_negative_slots_cost_one_kernel_more_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    _, scatter = per_layer_ops(monkeypatch, "mla", 6, adjacent=True, negative=True)
    assert scatter == Counter({"copy_": 3, "index_select": 3, "index_copy_": 3})


def test_parts_with_views_of_their_own_take_a_kernel_each(monkeypatch: pytest.MonkeyPatch) -> None:
    gather, scatter = per_layer_ops(monkeypatch, "vllm_cpu", 5, adjacent=True)
    assert gather == Counter({"index_select": 2 * 3, "copy_": 3})
    assert scatter == Counter({"copy_": 3, "index_copy_": 2 * 3})


def test_payloads_apart_take_a_copy_each_and_still_one_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gather, scatter = per_layer_ops(monkeypatch, "flashinfer", 4, adjacent=False)
    assert gather == Counter({"index_select": 3, "copy_": 4 * 3})
    assert scatter == Counter({"copy_": 4 * 3, "index_copy_": 3})


def test_jobs_other_than_the_ranges_are_refused_before_anything_moves() -> None:
    layout, kv, slots = scene("flash_nhd", 8)
    staged = StagedLayers(layout.plan(kv, slots), [(0, 4), (4, 8)])
    before = [layer.clone() for layer in kv]
    payloads = layer_payloads(layout, [(0, 4), (4, 8)], adjacent=True, fill=1)
    with StagingBuffer("cpu") as staging:
        with pytest.raises(InvalidInputError, match="not the token ranges"):
            staged.scatter(0, jobs_of([(0, 4), (4, 7)], payloads), staging)
        bad = [payloads[0], torch.zeros(3, 2, 8)]
        with pytest.raises(InvalidInputError, match=r"contiguous torch\.float32 payload"):
            staged.scatter(0, jobs_of([(0, 4), (4, 8)], bad), staging)
        with pytest.raises(InvalidInputError, match="staging: on meta"):
            staged.scatter(0, jobs_of([(0, 4), (4, 8)], payloads), StagingBuffer("meta"))
        assert staging.statistics().uses == 0
    assert same_kv(kv, before)
    with pytest.raises(InvalidInputError, match="out of 8 tokens"):
        StagedLayers(layout.plan(kv, slots), [(0, 9)])


def test_a_gather_over_a_negative_slot_is_refused() -> None:
    layout, kv, slots = scene("mla", 8, negative=True)
    staged = StagedLayers(layout.plan(kv, slots), [(0, 4), (4, 8)])
    payloads = layer_payloads(layout, [(0, 4), (4, 8)], adjacent=True)
    with StagingBuffer("cpu") as staging, pytest.raises(InvalidInputError, match="negative slot"):
        staged.gather(0, jobs_of([(0, 4), (4, 8)], payloads), staging)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "flashinfer", "mla"])
def test_staged_layers_on_cuda_match_the_per_chunk_path(kind: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    layout, kv_cpu, slots = scene(kind, 11, negative=True)
    kv = [layer.to(device) for layer in kv_cpu]
    ranges = [(4, 8), (8, 11)]
    plan = layout.plan(kv, slots.to(device), slots_cpu=slots)
    staged = StagedLayers(plan, ranges)
    with StagingBuffer(device) as staging:
        for layer in range(3):
            payloads = [p.pin_memory() for p in layer_payloads(layout, ranges, adjacent=False)]
            staged.gather(layer, jobs_of(ranges, payloads), staging)
            torch.cuda.synchronize(device)
            want = layer_payloads(layout, ranges, adjacent=False)
            layout.plan(kv_cpu, slots).gather_layer_chunks(layer, jobs_of(ranges, want))
            assert all(torch.equal(a, b) for a, b in zip(payloads, want, strict=True))
        reference = [layer.clone() for layer in kv_cpu]
        for layer in range(3):
            payloads = layer_payloads(layout, [(0, 4), *ranges], adjacent=True, fill=layer)
            pinned = [p.pin_memory() for p in payloads]
            everything = StagedLayers(plan, [(0, 4), *ranges])
            everything.scatter(layer, jobs_of([(0, 4), *ranges], pinned), staging)
            torch.cuda.synchronize(device)  # before the pinned payloads are freed
            ref_jobs = jobs_of([(0, 4), *ranges], payloads)
            layout.plan(reference, slots).scatter_layer_chunks(layer, ref_jobs)
        torch.cuda.synchronize(device)
        assert same_kv([layer.cpu() for layer in kv], reference)
