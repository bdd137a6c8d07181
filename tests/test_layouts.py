"""Tests for lmcache_async.layouts: geometry, validation and bit-exact gather/scatter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import (
    SUPPORTED_DTYPES,
    CpuKVPacking,
    KVCacheViews,
    KVFormat,
    KVLayout,
    LayoutKind,
)

KINDS = ("nhd", "hnd", "flashinfer", "mla", "vllm_cpu")
DTYPES = SUPPORTED_DTYPES


def make_layout(
    kind: str,
    dtype: torch.dtype = torch.float32,
    *,
    num_layers: int = 3,
    block_size: int = 4,
    heads: int = 2,
    head_size: int = 8,
    tp_world_size: int = 1,
    tp_rank: int = 0,
) -> KVLayout:
    tp: dict[str, Any] = {"tp_world_size": tp_world_size, "tp_rank": tp_rank}
    if kind in ("nhd", "hnd"):
        return KVLayout.vllm_flash_attn(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            hnd=kind == "hnd",
            **tp,
        )
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            **tp,
        )
    if kind == "mla":
        return KVLayout.mla(
            num_layers=num_layers,
            block_size=block_size,
            latent_dim=heads * head_size,
            dtype=dtype,
            **tp,
        )
    assert kind == "vllm_cpu"
    return KVLayout.vllm_cpu(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        **tp,
    )


def token_view(layout: KVLayout, layer: torch.Tensor, part: int, slot: int) -> torch.Tensor:
    """A view of the K (part 0), V (part 1) or latent values of one token in ``layer``.

    Written straight from each engine's documented per-layer shape, one token at a time:
    ``[H, D]`` (``[latent]`` for MLA), possibly strided.
    """
    bs = layout.block_size
    block, offset = divmod(slot, bs)
    if layout.kind is LayoutKind.VLLM_FLASH_ATTN:
        return layer[part, block, offset]  # through the logical shape, NHD or HND
    if layout.kind is LayoutKind.FLASHINFER:
        return layer[block, part, offset]
    if layout.kind is LayoutKind.MLA:
        return layer[block, offset]
    # vLLM CPU: per block and head, a key region then a value region of bs * D elements.
    nb, h, d = layer.shape[0], layout.num_kv_heads, layout.head_size
    if layout.cpu_packing is CpuKVPacking.AMX:
        if part == 0:  # keys [bs/16, D/2, 16, 2]
            keys = layer.view(nb, h, 2, bs // 16, d // 2, 16, 2)
            return keys[block, :, 0, offset // 16, :, offset % 16, :]
        values = layer.view(nb, h, 2, d // 16, bs // 2, 16, 2)  # values [D/16, bs/2, 16, 2]
        return values[block, :, 1, :, offset // 2, :, offset % 2]
    if layout.cpu_packing is CpuKVPacking.TOKEN_ROWS:  # as vLLM's flash-attn reads it
        keys, values = layer.transpose(1, 2).split(d, dim=-1)  # [nb, bs, H, D] each
        return (keys if part == 0 else values)[block, offset]
    if part == 0:  # keys [D, bs]: a token is a column
        return layer.view(nb, h, 2, d, bs)[block, :, 0, :, offset]
    return layer.view(nb, h, 2, bs, d)[block, :, 1, offset]  # values [bs, D]


def reference_gather(
    layout: KVLayout, kv: Sequence[torch.Tensor], slots: list[int]
) -> torch.Tensor:
    parts = 1 if layout.kind is LayoutKind.MLA else 2
    out = torch.zeros(layout.payload_shape(len(slots)), dtype=layout.dtype)
    for li, layer in enumerate(kv):
        for t, slot in enumerate(slots):
            for part in range(parts):
                out[part, li, t] = token_view(layout, layer, part, slot).reshape(-1)
    return out


def reference_scatter(
    layout: KVLayout, payload: torch.Tensor, kv: Sequence[torch.Tensor], slots: list[int]
) -> None:
    parts = payload.shape[0]
    for li, layer in enumerate(kv):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            for part in range(parts):
                view = token_view(layout, layer, part, slot)
                view.copy_(payload[part, li, t].view(view.shape))


def assert_caches_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape, i
        assert torch.equal(a, e), f"layer {i} differs"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------- geometry


@pytest.mark.parametrize(
    ("kind", "cache_shape", "payload_shape", "fmt"),
    [
        ("nhd", (2, 5, 4, 2, 8), (2, 3, 7, 16), KVFormat.KV_2LTD),
        ("hnd", (2, 5, 4, 2, 8), (2, 3, 7, 16), KVFormat.KV_2LTD),
        ("flashinfer", (5, 2, 4, 2, 8), (2, 3, 7, 16), KVFormat.KV_2LTD),
        ("mla", (5, 4, 16), (1, 3, 7, 16), KVFormat.KV_MLA),
        ("vllm_cpu", (5, 2, 4, 16), (2, 3, 7, 16), KVFormat.KV_2LTD),
    ],
)
def test_shapes_and_format(
    kind: str, cache_shape: tuple[int, ...], payload_shape: tuple[int, ...], fmt: KVFormat
) -> None:
    layout = make_layout(kind, torch.bfloat16)
    assert layout.kv_cache_shape(5) == cache_shape
    assert layout.payload_shape(7) == payload_shape
    assert layout.fmt is fmt
    assert layout.width == 16
    parts = 1 if kind == "mla" else 2
    assert layout.token_bytes == parts * 3 * 16 * 2
    kv = layout.allocate_kv_caches(5, generator=gen(0))
    assert len(kv) == 3
    assert all(t.shape == cache_shape and t.dtype == torch.bfloat16 for t in kv)
    assert layout.check_kv_caches(kv) == 5


def test_vllm_cpu_default_block_size() -> None:
    layout = KVLayout.vllm_cpu(num_layers=2, num_kv_heads=4, head_size=64, dtype=torch.float16)
    assert layout.block_size == 128
    assert layout.kv_cache_shape(3) == (3, 4, 128, 128)


def test_hnd_allocation_has_permuted_strides() -> None:
    layout = make_layout("hnd")
    (layer, *_) = layout.allocate_kv_caches(5, random=False)
    assert not layer.is_contiguous()
    assert layer.transpose(2, 3).is_contiguous()
    assert layer.stride() == (5 * 2 * 4 * 8, 2 * 4 * 8, 8, 4 * 8, 1)
    assert not layer.any()


def test_allocation_is_reproducible_with_a_generator() -> None:
    layout = make_layout("nhd", torch.float16)
    a = layout.allocate_kv_caches(3, generator=gen(7))
    b = layout.allocate_kv_caches(3, generator=gen(7))
    c = layout.allocate_kv_caches(3, generator=gen(8))
    assert_caches_equal(a, b)
    assert not torch.equal(a[0], c[0])


# ---------------------------------------------------------------------- fingerprint


def test_fingerprint_ignores_engine_side_layout() -> None:
    base = {"num_layers": 4, "heads": 2, "head_size": 8}
    prints = {
        make_layout("nhd", torch.float16, block_size=16, **base).fingerprint,
        make_layout("hnd", torch.float16, block_size=32, **base).fingerprint,
        make_layout("flashinfer", torch.float16, block_size=8, **base).fingerprint,
        make_layout("vllm_cpu", torch.float16, block_size=128, **base).fingerprint,
    }
    assert len(prints) == 1


def test_fingerprint_names_what_defines_payload_bytes() -> None:
    ref = make_layout("nhd", torch.float16)
    variants = [
        make_layout("nhd", torch.bfloat16),
        make_layout("nhd", torch.float16, num_layers=4),
        make_layout("nhd", torch.float16, heads=4),
        make_layout("nhd", torch.float16, head_size=16),
        make_layout("nhd", torch.float16, tp_world_size=2, tp_rank=0),
        make_layout("nhd", torch.float16, tp_world_size=2, tp_rank=1),
        # Same width (16) as the 2 x 8 flash layout, but a different payload format.
        make_layout("mla", torch.float16),
    ]
    prints = [ref.fingerprint, *(v.fingerprint for v in variants)]
    assert len(set(prints)) == len(prints)
    assert ref.fingerprint == make_layout("nhd", torch.float16).fingerprint
    assert "float16" in ref.fingerprint
    assert "KV_2LTD" in ref.fingerprint


# ---------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("num_layers", {"num_layers": 0}),
        ("block_size", {"block_size": -4}),
        ("num_kv_heads", {"num_kv_heads": 0}),
        ("head_size", {"head_size": True}),
        ("head_size", {"head_size": 8.0}),
        ("tp_world_size", {"tp_world_size": 0}),
        ("tp_rank", {"tp_rank": 1}),
        ("tp_rank", {"tp_rank": -1}),
        ("dtype", {"dtype": torch.float64}),
        ("dtype", {"dtype": torch.int32}),
        ("hnd", {"kind": LayoutKind.FLASHINFER, "hnd": True}),
        ("hnd", {"hnd": 1}),
        ("num_kv_heads", {"kind": LayoutKind.MLA, "num_kv_heads": 2}),
        ("kind", {"kind": "paged"}),
    ],
)
def test_constructor_rejects_bad_fields(field: str, overrides: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "kind": LayoutKind.VLLM_FLASH_ATTN,
        "num_layers": 2,
        "block_size": 16,
        "num_kv_heads": 4,
        "head_size": 8,
        "dtype": torch.float16,
    }
    fields.update(overrides)
    with pytest.raises(InvalidInputError, match=f"^{field}:"):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_constructor_accepts_kind_as_text_and_is_hashable() -> None:
    layout = KVLayout("mla", 2, 16, 1, 64, torch.bfloat16)  # type: ignore[arg-type]
    assert layout.kind is LayoutKind.MLA
    same = KVLayout.mla(num_layers=2, block_size=16, latent_dim=64, dtype=torch.bfloat16)
    assert layout == same
    assert hash(layout) == hash(same)
    with pytest.raises(AttributeError):
        layout.num_layers = 3  # type: ignore[misc]


def test_named_constructors_validate() -> None:
    with pytest.raises(InvalidInputError, match=r"^tp_rank:"):
        KVLayout.flashinfer(
            num_layers=2,
            block_size=16,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float16,
            tp_world_size=2,
            tp_rank=2,
        )
    with pytest.raises(InvalidInputError, match=r"^head_size:"):
        KVLayout.mla(num_layers=2, block_size=16, latent_dim=0, dtype=torch.float16)


# ---------------------------------------------------------------------- gather / scatter


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_matches_reference(kind: str, dtype: torch.dtype) -> None:
    layout = make_layout(kind, dtype)
    num_blocks = 6
    kv = layout.allocate_kv_caches(num_blocks, generator=gen(1))
    # A random permutation of all slots, cut short: tokens land in scattered blocks.
    slots = torch.randperm(num_blocks * layout.block_size, generator=gen(2))[:17]
    out = torch.full(layout.payload_shape(17), float("nan"), dtype=dtype)

    layout.gather(kv, slots, out)

    expected = reference_gather(layout, kv, slots.tolist())
    assert torch.equal(out, expected)

    fresh = layout.allocate_kv_caches(num_blocks, random=False)
    layout.scatter(out, fresh, slots)

    want = layout.allocate_kv_caches(num_blocks, random=False)
    reference_scatter(layout, expected, want, slots.tolist())
    assert_caches_equal(fresh, want)
    # Touched slots hold the source values, every other slot is still zero.
    assert torch.equal(reference_gather(layout, fresh, slots.tolist()), expected)
    untouched = sorted(set(range(num_blocks * layout.block_size)) - set(slots.tolist()))
    assert not reference_gather(layout, fresh, untouched).any()
    if layout.hnd:
        assert fresh[0].transpose(2, 3).is_contiguous()


def test_hnd_reads_the_permuted_memory() -> None:
    layout = make_layout("hnd", heads=3, head_size=4, block_size=5)
    nb, h, bs, d = 4, 3, 5, 4
    memory = [torch.randn(2, nb, h, bs, d, generator=gen(i)) for i in range(3)]
    kv = [m.transpose(2, 3) for m in memory]
    slots = [13, 0, 19, 7]
    out = torch.empty(layout.payload_shape(4))
    layout.gather(kv, torch.tensor(slots), out)
    for li, m in enumerate(memory):
        for t, slot in enumerate(slots):
            block, offset = divmod(slot, bs)
            for part in range(2):
                for head in range(h):
                    got = out[part, li, t, head * d : (head + 1) * d]
                    assert torch.equal(got, m[part, block, head, offset])


def vllm_cpu_offset(layout: KVLayout, block: int, head: int, *, part: int, t: int, d: int) -> int:
    """Flat element offset of token ``t``, dimension ``d`` of K (part 0) or V (part 1) of
    ``block`` and ``head`` in a vLLM CPU layer, from the index formulas vLLM's
    ``cpu_attn_reshape_and_cache`` writes with."""
    bs, h, dim = layout.block_size, layout.num_kv_heads, layout.head_size
    region = bs * dim
    start = (block * h + head) * 2 * region + part * region
    if layout.cpu_packing is CpuKVPacking.AMX:
        if part == 0:  # 4-byte words of two dims, 16 tokens per group row
            return start + (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        return start + (d // 16) * 16 * bs + (t // 2) * 32 + (d % 16) * 2 + t % 2
    if layout.cpu_packing is CpuKVPacking.TOKEN_ROWS:
        return (block * h + head) * 2 * region + t * 2 * dim + part * dim + d
    if part == 0:
        return start + d * bs + t
    return start + t * dim + d


def hand_written_caches(
    layout: KVLayout, num_blocks: int, slots: list[int], payload: torch.Tensor
) -> list[torch.Tensor]:
    """Zeroed caches with ``payload``'s tokens written element by element at ``slots``."""
    caches = []
    for li in range(layout.num_layers):
        flat = torch.zeros(num_blocks * layout.block_size * 2 * layout.width, dtype=layout.dtype)
        for t, slot in enumerate(slots):
            block, offset = divmod(slot, layout.block_size)
            for part in range(2):
                values = payload[part, li, t].view(layout.num_kv_heads, layout.head_size)
                for head in range(layout.num_kv_heads):
                    for d in range(layout.head_size):
                        flat[vllm_cpu_offset(layout, block, head, part=part, t=offset, d=d)] = (
                            values[head, d]
                        )
        caches.append(flat.view(layout.kv_cache_shape(num_blocks)))
    return caches


CPU_PACKINGS = [
    pytest.param(CpuKVPacking.KEYS_TRANSPOSED, torch.float32, 5, 3, 4, id="transposed-fp32"),
    pytest.param(CpuKVPacking.KEYS_TRANSPOSED, torch.float16, 8, 2, 6, id="transposed-fp16"),
    pytest.param(CpuKVPacking.KEYS_TRANSPOSED, torch.bfloat16, 4, 1, 3, id="transposed-bf16"),
    pytest.param(CpuKVPacking.TOKEN_ROWS, torch.float16, 16, 2, 8, id="token-rows-fp16"),
    pytest.param(CpuKVPacking.TOKEN_ROWS, torch.bfloat16, 5, 3, 4, id="token-rows-bf16"),
    pytest.param(CpuKVPacking.AMX, torch.bfloat16, 32, 2, 32, id="amx-bf16"),
    pytest.param(CpuKVPacking.AMX, torch.bfloat16, 64, 1, 64, id="amx-bf16-wide"),
]


@pytest.mark.parametrize(("packing", "dtype", "block_size", "heads", "head_size"), CPU_PACKINGS)
def test_vllm_cpu_follows_vllm_index_formulas(
    packing: CpuKVPacking, dtype: torch.dtype, block_size: int, heads: int, head_size: int
) -> None:
    layout = KVLayout.vllm_cpu(
        num_layers=2,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        packing=packing,
    )
    num_blocks = 4
    # Partial blocks on both ends, a block in reverse order, one token alone in its block.
    bs = block_size
    slots = [*range(2 * bs + 1, 3 * bs - 1), *range(bs - 1, -1, -1), 3 * bs + bs // 2]
    payload = torch.randn(layout.payload_shape(len(slots)), generator=gen(5)).to(dtype)
    kv = hand_written_caches(layout, num_blocks, slots, payload)

    out = torch.full_like(payload, float("nan"))
    layout.gather(kv, torch.tensor(slots), out)
    assert torch.equal(out, payload)

    fresh = layout.allocate_kv_caches(num_blocks, random=False)
    layout.scatter(payload, fresh, torch.tensor(slots))
    assert_caches_equal(fresh, kv)

    # Every token alone, the rest of its block untouched: one token's K is a column.
    for t in (0, len(slots) - 1, bs // 2):
        single = layout.allocate_kv_caches(num_blocks, random=False)
        layout.scatter(payload[:, :, t : t + 1], single, torch.tensor(slots[t : t + 1]))
        assert_caches_equal(
            single, hand_written_caches(layout, num_blocks, [slots[t]], payload[:, :, t : t + 1])
        )


@pytest.mark.parametrize(("packing", "dtype", "block_size", "heads", "head_size"), CPU_PACKINGS)
def test_vllm_cpu_layerwise_matches_whole_chunk(
    packing: CpuKVPacking, dtype: torch.dtype, block_size: int, heads: int, head_size: int
) -> None:
    layout = KVLayout.vllm_cpu(
        num_layers=3,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        packing=packing,
    )
    kv = layout.allocate_kv_caches(3, generator=gen(6))
    slots = torch.randperm(3 * block_size, generator=gen(7))[: 2 * block_size + 1]
    n = int(slots.shape[0])
    whole = torch.empty(layout.payload_shape(n), dtype=dtype)
    layout.gather(kv, slots, whole)
    plan = layout.plan(kv, slots)
    fresh = layout.allocate_kv_caches(3, random=False)
    fresh_plan = layout.plan(fresh, slots)
    for li in range(3):
        per_layer = torch.empty(layout.layer_payload_shape(n), dtype=dtype)
        plan.gather_layer_chunks(li, [(0, 5, per_layer[:5]), (5, n, per_layer[5:])])
        assert torch.equal(per_layer, whole[:, li].transpose(0, 1))
        fresh_plan.scatter_layer(li, per_layer, 0, n)
    back = torch.empty_like(whole)
    layout.gather(fresh, slots, back)
    assert torch.equal(back, whole)


def test_vllm_cpu_scatter_skips_negative_slots_layer_by_layer() -> None:
    layout = KVLayout.vllm_cpu(
        num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.float16, block_size=4
    )
    kv = layout.allocate_kv_caches(4, generator=gen(8))
    before = [t.clone() for t in kv]
    slots = torch.tensor([9, -1, 2, 3, -1, 15])
    payload = torch.randn(layout.layer_payload_shape(6), generator=gen(9)).to(torch.float16)
    plan = layout.plan(kv, layout.check_slot_mapping(slots, 6, 4))
    plan.scatter_layer(1, payload, 0, 6)
    assert_caches_equal(kv[:1], before[:1])
    kept = [0, 2, 3, 5]
    got = torch.empty(layout.payload_shape(4), dtype=torch.float16)
    layout.gather(kv, slots[kept], got)
    assert torch.equal(got[:, 1].transpose(0, 1), payload[kept])
    want = [t.clone() for t in before]
    whole = torch.zeros(layout.payload_shape(6), dtype=torch.float16)
    layout.gather(before, slots.clamp(min=0), whole)
    whole[:, 1] = payload.transpose(0, 1)
    reference_scatter(layout, whole, want, slots.tolist())
    assert_caches_equal(kv, want)


VLLM_ISAS = [
    pytest.param("vec", 64, 32, id="vec"),
    pytest.param("vec", 128, 128, id="vec-128"),
    pytest.param("vec16", 80, 16, id="vec16"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("isa", "head_size", "block_size"), VLLM_ISAS)
def test_vllm_cpu_reads_what_vllms_kernel_writes(
    isa: str, head_size: int, block_size: int, dtype: torch.dtype
) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    heads, num_blocks, num_layers = 2, 4, 2
    layout = KVLayout.vllm_cpu(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        packing=CpuKVPacking.for_vllm_isa(isa, dtype),
    )
    # One buffer for all layers, as vLLM may allocate: layers start at storage offsets.
    kv = list(torch.zeros(num_layers, *layout.kv_cache_shape(num_blocks), dtype=dtype).unbind(0))
    # Scattered slots, partial blocks included; three slots stay empty.
    slots = torch.randperm(num_blocks * block_size, generator=gen(10))[:-3]
    n = int(slots.shape[0])
    keys = torch.randn(num_layers, n, heads, head_size, generator=gen(11)).to(dtype)
    values = torch.randn(num_layers, n, heads, head_size, generator=gen(12)).to(dtype)
    for li, layer in enumerate(kv):
        memory = layer.view(num_blocks, heads, 2 * block_size, head_size)
        key_cache, value_cache = memory.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[li], values[li], key_cache, value_cache, slots, isa)

    out = torch.empty(layout.payload_shape(n), dtype=dtype)
    layout.gather(kv, slots, out)
    assert torch.equal(out[0], keys.view(num_layers, n, -1))
    assert torch.equal(out[1], values.view(num_layers, n, -1))
    # A few tokens of one block: partial loads read the same values.
    part = slots[5:9]
    few = torch.empty(layout.payload_shape(4), dtype=dtype)
    layout.gather(kv, part, few)
    assert torch.equal(few, out[:, :, 5:9])

    fresh = layout.allocate_kv_caches(num_blocks, random=False)
    layout.scatter(out, fresh, slots)
    assert_caches_equal(fresh, kv)


def test_cpu_packing_for_vllm_isa() -> None:
    transposed = CpuKVPacking.KEYS_TRANSPOSED
    for isa in ("vec", "vec16", "vxe", "vsx", "rvv"):
        for dtype in DTYPES:
            assert CpuKVPacking.for_vllm_isa(isa, dtype) is transposed
    assert CpuKVPacking.for_vllm_isa("neon", torch.float16) is transposed
    assert CpuKVPacking.for_vllm_isa("amx", torch.bfloat16) is CpuKVPacking.AMX
    for isa, dtype in (("neon", torch.bfloat16), ("amx", torch.float32), ("sve", torch.float16)):
        with pytest.raises(InvalidInputError, match=rf"^isa: .*{isa}.* does not describe"):
            CpuKVPacking.for_vllm_isa(isa, dtype)


def test_cpu_packing_is_validated_and_kept() -> None:
    base: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "block_size": 32, "head_size": 64}
    default = KVLayout.vllm_cpu(dtype=torch.float32, **base)
    assert default.cpu_packing is CpuKVPacking.KEYS_TRANSPOSED
    amx = KVLayout.vllm_cpu(dtype=torch.bfloat16, packing="amx", **base)
    assert amx.cpu_packing is CpuKVPacking.AMX
    assert amx != KVLayout.vllm_cpu(dtype=torch.bfloat16, **base)
    # The payload is the logical K and V whatever the packing: one fingerprint.
    assert amx.fingerprint == KVLayout.vllm_cpu(dtype=torch.bfloat16, **base).fingerprint
    assert KVLayout.from_dict(amx.to_dict()) == amx
    assert amx.to_dict()["cpu_packing"] == "amx"
    assert "cpu_packing" not in make_layout("nhd").to_dict()
    flash = make_layout("nhd")
    assert flash.cpu_packing is None
    assert KVLayout.from_dict(flash.to_dict()) == flash
    with pytest.raises(InvalidInputError, match=r"^cpu_packing: expected one of"):
        KVLayout.vllm_cpu(dtype=torch.float32, packing="rows", **base)
    with pytest.raises(InvalidInputError, match=r"^cpu_packing: the amx packing holds bfloat16"):
        KVLayout.vllm_cpu(dtype=torch.float16, packing=CpuKVPacking.AMX, **base)
    with pytest.raises(InvalidInputError, match=r"^block_size: the amx packing needs"):
        KVLayout.vllm_cpu(dtype=torch.bfloat16, packing="amx", **{**base, "block_size": 16})
    with pytest.raises(InvalidInputError, match=r"^head_size: the amx packing needs"):
        KVLayout.vllm_cpu(dtype=torch.bfloat16, packing="amx", **{**base, "head_size": 80})
    flashinfer: dict[str, Any] = {**flash.to_dict(), "kind": "flashinfer", "dtype": torch.float16}
    with pytest.raises(
        InvalidInputError, match=r"^cpu_packing: only meaningful for vllm_cpu, not flashinfer"
    ):
        KVLayout(**{**flashinfer, "cpu_packing": "keys_transposed"})
    with pytest.raises(InvalidInputError, match=r"^cpu_packing: expected one of"):
        KVLayout.from_dict({**default.to_dict(), "cpu_packing": 3})


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_skips_negative_slots(kind: str) -> None:
    layout = make_layout(kind, torch.float16)
    num_blocks = 5
    kv = layout.allocate_kv_caches(num_blocks, generator=gen(3))
    before = [t.clone() for t in kv]
    slots = torch.tensor([9, -1, 2, -5, 17, 0, -1])
    payload = torch.randn(layout.payload_shape(7), generator=gen(4)).to(torch.float16)

    layout.scatter(payload, kv, slots)

    want = [t.clone() for t in before]
    reference_scatter(layout, payload, want, slots.tolist())
    assert_caches_equal(kv, want)
    kept = [0, 2, 4, 5]
    got = torch.empty(layout.payload_shape(4), dtype=torch.float16)
    layout.gather(kv, slots[kept], got)
    assert torch.equal(got, payload[:, :, kept])


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_with_only_negative_slots_writes_nothing(kind: str) -> None:
    layout = make_layout(kind)
    kv = layout.allocate_kv_caches(3, random=False)
    payload = torch.ones(layout.payload_shape(3))
    layout.scatter(payload, kv, torch.tensor([-1, -1, -3]))
    assert not any(t.any() for t in kv)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_rejects_negative_slots(kind: str) -> None:
    layout = make_layout(kind)
    kv = layout.allocate_kv_caches(3, generator=gen(5))
    out = torch.zeros(layout.payload_shape(3))
    with pytest.raises(InvalidInputError, match="slot"):
        layout.gather(kv, torch.tensor([0, -1, 2]), out)
    assert not out.any()


def test_gather_and_scatter_accept_narrow_integer_slots() -> None:
    layout = make_layout("flashinfer")
    kv = layout.allocate_kv_caches(4, generator=gen(6))
    slots32 = torch.tensor([15, 3, 8], dtype=torch.int32)
    out = torch.empty(layout.payload_shape(3))
    layout.gather(kv, slots32, out)
    assert torch.equal(out, reference_gather(layout, kv, [15, 3, 8]))


def test_gather_and_scatter_of_no_tokens() -> None:
    layout = make_layout("nhd")
    kv = layout.allocate_kv_caches(2, random=False)
    empty = torch.empty(0, dtype=torch.int64)
    layout.gather(kv, empty, torch.empty(layout.payload_shape(0)))
    layout.scatter(torch.empty(layout.payload_shape(0)), kv, empty)
    assert not any(t.any() for t in kv)


def test_gather_rejects_out_of_range_slot() -> None:
    layout = make_layout("nhd")
    kv = layout.allocate_kv_caches(2, random=False)
    with pytest.raises(InvalidInputError, match="out of range"):
        layout.gather(kv, torch.tensor([1, 8]), torch.empty(layout.payload_shape(2)))
    with pytest.raises(InvalidInputError, match="out of range"):
        layout.scatter(torch.zeros(layout.payload_shape(2)), kv, torch.tensor([1, 8]))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.empty(2, 3, 4, 16), "shape"),
        (torch.empty(2, 3, 3, 16, dtype=torch.float16), "dtype"),
        (torch.empty(2, 3, 16, 3).transpose(2, 3), "contiguous"),
    ],
)
def test_gather_rejects_bad_out(bad: torch.Tensor, match: str) -> None:
    layout = make_layout("nhd")
    kv = layout.allocate_kv_caches(2, random=False)
    with pytest.raises(InvalidInputError, match=match):
        layout.gather(kv, torch.tensor([0, 1, 2]), bad)


def test_scatter_rejects_bad_payload_and_accepts_non_contiguous() -> None:
    layout = make_layout("nhd")
    kv = layout.allocate_kv_caches(2, random=False)
    slots = torch.tensor([0, 5, 6])
    with pytest.raises(InvalidInputError, match="shape"):
        layout.scatter(torch.zeros(2, 3, 2, 16), kv, slots)
    with pytest.raises(InvalidInputError, match="dtype"):
        layout.scatter(torch.zeros(2, 3, 3, 16, dtype=torch.bfloat16), kv, slots)
    payload = torch.randn(2, 3, 16, 3, generator=gen(9)).transpose(2, 3)
    layout.scatter(payload, kv, slots)
    out = torch.empty(layout.payload_shape(3))
    layout.gather(kv, slots, out)
    assert torch.equal(out, payload)


def test_gather_rejects_a_bad_layer() -> None:
    layout = make_layout("hnd")
    kv = layout.allocate_kv_caches(3, random=False)
    kv[1] = torch.zeros(layout.kv_cache_shape(3))  # NHD-contiguous in an HND layout
    with pytest.raises(InvalidInputError, match=r"kv_caches\[1\]"):
        layout.gather(kv, torch.tensor([0, 1]), torch.empty(layout.payload_shape(2)))
    kv[1] = torch.zeros(layout.kv_cache_shape(2)).transpose(2, 3)
    with pytest.raises(InvalidInputError, match=r"kv_caches\[1\]"):
        layout.scatter(torch.zeros(layout.payload_shape(2)), kv, torch.tensor([0, 11]))
    kv[0] = torch.zeros(24)
    with pytest.raises(InvalidInputError, match=r"kv_caches\[0\]: expected a 5-D tensor"):
        layout.gather(kv, torch.tensor([0, 1]), torch.empty(layout.payload_shape(2)))


# ---------------------------------------------------------------------- check_kv_caches


@pytest.mark.parametrize("kind", KINDS)
def test_check_kv_caches_errors(kind: str) -> None:
    layout = make_layout(kind, torch.float16)
    kv = layout.allocate_kv_caches(4, random=False)
    with pytest.raises(InvalidInputError, match="expected 3 layer tensors, got 2"):
        layout.check_kv_caches(kv[:2])
    with pytest.raises(InvalidInputError, match="sequence"):
        layout.check_kv_caches(kv[0])  # type: ignore[arg-type]

    wrong_shape = [kv[0], torch.zeros(layout.kv_cache_shape(5), dtype=torch.float16), kv[2]]
    with pytest.raises(InvalidInputError, match=r"kv_caches\[1\]: expected shape"):
        layout.check_kv_caches(wrong_shape)

    wrong_dtype = [kv[0], kv[1], kv[2].to(torch.float32)]
    with pytest.raises(InvalidInputError, match=r"kv_caches\[2\]: expected dtype float16"):
        layout.check_kv_caches(wrong_dtype)

    meta = layout.allocate_kv_caches(4, device="meta", random=False)
    with pytest.raises(InvalidInputError, match=r"kv_caches\[1\]: on device meta"):
        layout.check_kv_caches([kv[0], meta[1], kv[2]])

    bad_rank = [torch.zeros(4, 4), *kv[1:]]
    with pytest.raises(InvalidInputError, match=r"kv_caches\[0\]: expected a \d-D tensor"):
        layout.check_kv_caches(bad_rank)


def test_check_kv_caches_memory_order() -> None:
    hnd = make_layout("hnd")
    nhd = make_layout("nhd")
    nhd_caches = nhd.allocate_kv_caches(4, random=False)
    hnd_caches = hnd.allocate_kv_caches(4, random=False)
    assert nhd.check_kv_caches(nhd_caches) == 4
    assert hnd.check_kv_caches(hnd_caches) == 4
    with pytest.raises(InvalidInputError, match=r"kv_caches\[0\]: expected memory ordered"):
        hnd.check_kv_caches(nhd_caches)
    with pytest.raises(InvalidInputError, match=r"kv_caches\[0\]: expected memory ordered"):
        nhd.check_kv_caches(hnd_caches)
    cpu = make_layout("vllm_cpu")
    strided = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in cpu.allocate_kv_caches(4)]
    with pytest.raises(InvalidInputError, match="memory ordered"):
        cpu.check_kv_caches(strided)


def test_hnd_with_one_head_accepts_either_order() -> None:
    layout = make_layout("hnd", heads=1)
    nhd_contiguous = [torch.randn(layout.kv_cache_shape(3), generator=gen(i)) for i in range(3)]
    assert layout.check_kv_caches(nhd_contiguous) == 3
    slots = torch.tensor([5, 0, 11])
    out = torch.empty(layout.payload_shape(3))
    layout.gather(nhd_contiguous, slots, out)
    assert torch.equal(out, reference_gather(layout, nhd_contiguous, [5, 0, 11]))


# ---------------------------------------------------------------------- check_slot_mapping


def test_check_slot_mapping_returns_int64() -> None:
    layout = make_layout("nhd", block_size=4)
    raw = torch.tensor([3, -1, 11, 0], dtype=torch.int32)
    slots = layout.check_slot_mapping(raw, 4, 3)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [3, -1, 11, 0]
    moved = layout.check_slot_mapping(raw, 4, 3, device="cpu")
    assert moved.device == torch.device("cpu")
    assert layout.check_slot_mapping(torch.empty(0, dtype=torch.int64), 0, 1).numel() == 0


@pytest.mark.parametrize(
    ("slot_mapping", "num_tokens", "match"),
    [
        (torch.tensor([0, 1, 2]), 4, "expected 4 entries, got 3"),
        (torch.tensor([[0, 1], [2, 3]]), 4, "1-D"),
        (torch.tensor([0.0, 1.0, 2.0, 3.0]), 4, "integer dtype"),
        (torch.tensor([True, False, True, True]), 4, "integer dtype"),
        (torch.tensor([0, 1, 12, 3]), 4, "slot 12 out of range"),
        ([0, 1, 2, 3], 4, "tensor"),
    ],
)
def test_check_slot_mapping_errors(slot_mapping: object, num_tokens: int, match: str) -> None:
    layout = make_layout("flashinfer", block_size=4)
    with pytest.raises(InvalidInputError, match=match):
        layout.check_slot_mapping(slot_mapping, num_tokens, 3)  # type: ignore[arg-type]


def test_check_slot_mapping_validates_counts() -> None:
    layout = make_layout("mla")
    with pytest.raises(InvalidInputError, match="num_tokens"):
        layout.check_slot_mapping(torch.tensor([0]), -1, 3)
    with pytest.raises(InvalidInputError, match="num_blocks"):
        layout.check_slot_mapping(torch.tensor([0]), 1, 0)


# ---------------------------------------------------------------------- property test


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 3),
    block_size=st.integers(1, 5),
    heads=st.integers(1, 3),
    head_size=st.integers(1, 5),
    num_blocks=st.integers(1, 5),
    data=st.data(),
)
def test_round_trip_property(
    *,
    kind: str,
    dtype: torch.dtype,
    num_layers: int,
    block_size: int,
    heads: int,
    head_size: int,
    num_blocks: int,
    data: st.DataObject,
) -> None:
    layout = make_layout(
        kind,
        dtype,
        num_layers=num_layers,
        block_size=block_size,
        heads=heads,
        head_size=head_size,
    )
    num_slots = num_blocks * block_size
    perm = data.draw(st.permutations(range(num_slots)))
    count = data.draw(st.integers(0, num_slots))
    slot_list = list(perm[:count])
    kv = layout.allocate_kv_caches(num_blocks, generator=gen(count))
    slots = layout.check_slot_mapping(torch.tensor(slot_list, dtype=torch.int64), count, num_blocks)

    out = torch.empty(layout.payload_shape(count), dtype=dtype)
    layout.gather(kv, slots, out)
    assert torch.equal(out, reference_gather(layout, kv, slot_list))

    fresh = layout.allocate_kv_caches(num_blocks, random=False)
    layout.scatter(out, fresh, slots)
    want = layout.allocate_kv_caches(num_blocks, random=False)
    reference_scatter(layout, out, want, slot_list)
    assert_caches_equal(fresh, want)


# ---------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_caches_with_host_payload(kind: str) -> None:
    layout = make_layout(kind, torch.bfloat16)
    kv_host = layout.allocate_kv_caches(6, generator=gen(11))
    kv = [t.cuda() for t in kv_host]
    assert layout.check_kv_caches(kv) == 6
    slots_host = torch.randperm(6 * layout.block_size, generator=gen(12))[:13]
    out = torch.empty(layout.payload_shape(13), dtype=torch.bfloat16).pin_memory()

    layout.gather(kv, slots_host, out)
    torch.cuda.synchronize()
    assert torch.equal(out, reference_gather(layout, kv_host, slots_host.tolist()))

    device_slots = layout.check_slot_mapping(slots_host, 13, 6, device="cuda")
    fresh = layout.allocate_kv_caches(6, device="cuda", random=False)
    layout.scatter(out, fresh, device_slots)
    torch.cuda.synchronize()
    back = torch.empty_like(out)
    layout.gather(fresh, device_slots, back)
    torch.cuda.synchronize()
    assert torch.equal(back, out)


# --------------------------------------------------------------------------- cache views


@pytest.mark.parametrize("kind", KINDS)
def test_cache_views_are_reused_only_for_the_same_unchanged_tensors(kind: str) -> None:
    layout = make_layout(kind)
    kv = layout.allocate_kv_caches(6, random=False)
    views = KVCacheViews(layout)
    blocks, first = views.check(kv)
    assert blocks == 6 and views.remembered
    assert (first is None) == (kind == "vllm_cpu")
    again = views.check(tuple(kv))  # another sequence of the same tensors
    assert again[0] == 6 and again[1] is first
    # Another tensor of the same shape: checked and viewed anew.
    other = [*kv[:-1], layout.allocate_kv_caches(6, random=False)[-1]]
    _, fresh = views.check(other)
    assert fresh is None if kind == "vllm_cpu" else fresh is not first
    # The same tensor objects given other memory in place: checked and viewed anew.
    for layer, bigger in zip(other, layout.allocate_kv_caches(9, random=False), strict=True):
        layer.set_(bigger)
    assert views.check(other)[0] == 9
    other[1].resize_(other[1].numel())  # reshaped in place: refused, not reused
    with pytest.raises(InvalidInputError, match=r"kv_caches\[1\]"):
        views.check(other)
    assert not views.remembered


def test_cache_views_never_keep_the_caches_alive() -> None:
    layout = make_layout("nhd")
    views = KVCacheViews(layout)
    kv = layout.allocate_kv_caches(4, random=False)
    views.check(kv)
    assert views.remembered
    kv.pop()  # one layer is freed: the views, which would keep its memory, go with it
    assert not views.remembered
    views.check([*kv, layout.allocate_kv_caches(4, random=False)[0]])
    views.forget()
    assert not views.remembered
