"""Per-layer transfers of :class:`~lmcache_async.transfer.plan.TransferPlan`: every layout and
dtype, bit for bit against the whole-chunk gather/scatter, negative slots, several chunks."""

from __future__ import annotations

import pytest
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import SUPPORTED_DTYPES, KVLayout

KINDS = ("nhd", "hnd", "flashinfer", "mla", "vllm_cpu")
NUM_LAYERS = 3
BLOCK_SIZE = 4
NUM_BLOCKS = 12
HEADS = 2
HEAD_SIZE = 8
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def make_layout(kind: str, dtype: torch.dtype) -> KVLayout:
    if kind in ("nhd", "hnd"):
        return KVLayout.vllm_flash_attn(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
            hnd=kind == "hnd",
        )
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
        )
    if kind == "mla":
        return KVLayout.mla(
            num_layers=NUM_LAYERS, block_size=BLOCK_SIZE, latent_dim=HEADS * HEAD_SIZE, dtype=dtype
        )
    return KVLayout.vllm_cpu(
        num_layers=NUM_LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
        block_size=BLOCK_SIZE,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF[t.dtype])


def layer_of(layout: KVLayout, whole: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer`` of a whole-chunk payload ``[parts, L, T, W]`` in per-layer order."""
    part = whole[:, layer]  # [parts, T, W]
    if layout.kind.value == "mla":
        return part[0]
    return part.transpose(0, 1)  # [T, 2, W]


def scene(
    kind: str, dtype: torch.dtype, num_tokens: int, seed: int = 0
) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    layout = make_layout(kind, dtype)
    gen = torch.Generator().manual_seed(seed)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens].to(torch.int64)
    return layout, kv, slots


def test_layer_payload_shape() -> None:
    flash = make_layout("nhd", torch.float16)
    assert flash.layer_payload_shape(5) == (5, 2, HEADS * HEAD_SIZE)
    mla = make_layout("mla", torch.float16)
    assert mla.layer_payload_shape(5) == (5, HEADS * HEAD_SIZE)
    assert flash.layer_payload_shape(0) == (0, 2, HEADS * HEAD_SIZE)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        flash.layer_payload_shape(-1)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_gather_layer_matches_whole_chunk_gather(kind: str, dtype: torch.dtype) -> None:
    layout, kv, slots = scene(kind, dtype, 10)
    whole = torch.empty(layout.payload_shape(10), dtype=dtype)
    layout.gather(kv, slots, whole)
    plan = layout.plan(kv, slots)
    for layer in range(NUM_LAYERS):
        out = torch.full(layout.layer_payload_shape(7), 3.0, dtype=dtype)
        plan.gather_layer(layer, 2, 9, out)
        assert torch.equal(bits(out), bits(layer_of(layout, whole, layer)[2:9]))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_scatter_layer_round_trip_writes_only_its_layer(kind: str, dtype: torch.dtype) -> None:
    layout, kv, slots = scene(kind, dtype, 10)
    source_plan = layout.plan(kv, slots)
    target = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(9))
    before = [t.clone() for t in target]
    dst_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(4))
    dst_slots = dst_slots[:10].to(torch.int64)
    target_plan = layout.plan(target, dst_slots)
    # Expected: the whole-chunk path applied to a copy of the target.
    whole = torch.empty(layout.payload_shape(10), dtype=dtype)
    layout.gather(kv, slots, whole)
    expected = [t.clone() for t in before]
    layout.scatter(whole, expected, dst_slots)
    for layer in range(NUM_LAYERS):
        payload = torch.empty(layout.layer_payload_shape(10), dtype=dtype)
        source_plan.gather_layer(layer, 0, 10, payload)
        target_plan.scatter_layer(layer, payload, 0, 10)
        for other in range(NUM_LAYERS):
            want = expected[other] if other <= layer else before[other]
            assert torch.equal(bits(target[other]), bits(want)), (layer, other)


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_layer_skips_negative_slots(kind: str) -> None:
    layout, kv, slots = scene(kind, torch.float32, 8)
    payload = torch.empty(layout.layer_payload_shape(8), dtype=torch.float32)
    layout.plan(kv, slots).gather_layer(1, 0, 8, payload)
    target = layout.allocate_kv_caches(NUM_BLOCKS, random=False)
    dst = torch.arange(8, dtype=torch.int64) + BLOCK_SIZE
    dst[2] = -1
    dst[5] = -1
    layout.plan(target, dst).scatter_layer(1, payload, 0, 8)
    back = torch.empty_like(payload)
    kept = dst.clone()
    kept[kept < 0] = 0  # slot 0 was never written: it reads back as zeros
    layout.plan(target, kept).gather_layer(1, 0, 8, back)
    for token in range(8):
        if token in (2, 5):
            assert not back[token].any()
        else:
            assert torch.equal(bits(back[token]), bits(payload[token]))
    assert not target[0].any() and not target[2].any()


def test_scatter_layer_all_negative_writes_nothing() -> None:
    layout, _, _ = scene("nhd", torch.float32, 4)
    target = layout.allocate_kv_caches(NUM_BLOCKS, random=False)
    payload = torch.ones(layout.layer_payload_shape(4))
    layout.plan(target, torch.full((4,), -1, dtype=torch.int64)).scatter_layer(0, payload, 0, 4)
    assert not any(t.any() for t in target)


def test_gather_layer_refuses_negative_slots() -> None:
    layout, kv, slots = scene("flashinfer", torch.float16, 6)
    slots[3] = -1
    out = torch.empty(layout.layer_payload_shape(6), dtype=torch.float16)
    with pytest.raises(InvalidInputError, match="negative slot"):
        layout.plan(kv, slots).gather_layer(0, 0, 6, out)


@pytest.mark.parametrize("kind", KINDS)
def test_several_chunks_in_one_call(kind: str) -> None:
    layout, kv, slots = scene(kind, torch.bfloat16, 12)
    plan = layout.plan(kv, slots)
    ranges = [(0, 4), (4, 8), (9, 12)]  # the last one is not adjacent
    outs = [torch.empty(layout.layer_payload_shape(e - s), dtype=torch.bfloat16) for s, e in ranges]
    plan.gather_layer_chunks(2, [(s, e, o) for (s, e), o in zip(ranges, outs, strict=True)])
    for (s, e), out in zip(ranges, outs, strict=True):
        single = torch.empty_like(out)
        plan.gather_layer(2, s, e, single)
        assert torch.equal(bits(out), bits(single))
    target = layout.allocate_kv_caches(NUM_BLOCKS, random=False)
    tplan = layout.plan(target, slots)
    tplan.scatter_layer_chunks(2, [(s, e, o) for (s, e), o in zip(ranges, outs, strict=True)])
    for (s, e), out in zip(ranges, outs, strict=True):
        back = torch.empty_like(out)
        tplan.gather_layer(2, s, e, back)
        assert torch.equal(bits(back), bits(out))
    assert not target[0].any() and not target[1].any()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_plan_builds_an_empty_index(kind: str) -> None:
    """A plan of no tokens builds its per-layer index (of no rows) without an error, and its
    per-layer gathers and scatters, whole or by chunks, leave every cache byte as it was."""
    layout, kv, _ = scene(kind, torch.float32, 0)
    before = [bits(t).clone() for t in kv]
    plan = layout.plan(kv, torch.empty(0, dtype=torch.int64))
    for layer in range(NUM_LAYERS):
        out = torch.empty(layout.layer_payload_shape(0))
        plan.gather_layer(layer, 0, 0, out)
        plan.scatter_layer(layer, out, 0, 0)
        plan.gather_layer_chunks(layer, [(0, 0, out), (0, 0, out)])
        plan.scatter_layer_chunks(layer, [(0, 0, out), (0, 0, out)])
        assert out.numel() == 0
    assert len(kv) == len(before)
    for layer, (now, was) in enumerate(zip(kv, before, strict=True)):
        assert torch.equal(bits(now), was), layer


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_device_caches_with_host_payloads(kind: str) -> None:
    layout, kv_cpu, slots = scene(kind, torch.float16, 12)
    kv = [t.cuda() for t in kv_cpu]
    plan = layout.plan(kv, slots.cuda(), slots_cpu=slots)
    outs = [torch.empty(layout.layer_payload_shape(4), dtype=torch.float16).pin_memory()]
    outs += [torch.empty(layout.layer_payload_shape(4), dtype=torch.float16).pin_memory()]
    plan.gather_layer_chunks(1, [(0, 4, outs[0]), (4, 8, outs[1])])
    torch.cuda.synchronize()
    ref_plan = layout.plan(kv_cpu, slots)
    for start, out in zip((0, 4), outs, strict=True):
        ref = torch.empty_like(out)
        ref_plan.gather_layer(1, start, start + 4, ref)
        assert torch.equal(bits(out), bits(ref))
    target = [torch.zeros_like(t) for t in kv]
    tplan = layout.plan(target, slots.cuda(), slots_cpu=slots)
    tplan.scatter_layer_chunks(1, [(0, 4, outs[0]), (4, 8, outs[1])])
    torch.cuda.synchronize()
    back = torch.empty(layout.layer_payload_shape(8), dtype=torch.float16, device="cuda")
    tplan.gather_layer(1, 0, 8, back)
    assert torch.equal(bits(back.cpu()), bits(torch.cat(outs)))
