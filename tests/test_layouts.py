"""Tests for lmcache_async.layouts: geometry, validation and bit-exact gather/scatter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import (
    SUPPORTED_DTYPES,
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
    tp = {"tp_world_size": tp_world_size, "tp_rank": tp_rank}
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
    # vLLM CPU: viewed as [blocks, H, 2 * block_size, D], K rows first, then V rows.
    nb, h, d = layer.shape[0], layout.num_kv_heads, layout.head_size
    return layer.view(nb, h, 2 * bs, d)[block, :, part * bs + offset]


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


def test_vllm_cpu_reads_k_rows_then_v_rows() -> None:
    layout = make_layout("vllm_cpu", heads=3, head_size=4, block_size=5)
    nb, h, bs, d = 4, 3, 5, 4
    memory = [torch.randn(nb, h, 2, bs, d, generator=gen(i)) for i in range(3)]
    kv = [m.view(nb, h, bs, 2 * d) for m in memory]
    slots = [13, 0, 19, 7]
    out = torch.empty(layout.payload_shape(4))
    layout.gather(kv, torch.tensor(slots), out)
    for li, m in enumerate(memory):
        for t, slot in enumerate(slots):
            block, offset = divmod(slot, bs)
            for part in range(2):
                for head in range(h):
                    got = out[part, li, t, head * d : (head + 1) * d]
                    assert torch.equal(got, m[block, head, part, offset])


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
