"""A :class:`~lmcache_async.transfer.plan.TransferPlan` moves chunks there and back bit for bit,
and one that fails mid-transfer waits for the copies it queued before its error reaches the
caller, who hands the payloads back then. Every test runs on the C row copies and on the
torch path (the fallback where the C extension is not built)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_async.layouts import KVLayout
from lmcache_async.transfer import native as transfer_native
from lmcache_async.transfer.plan import TransferPlan
from tests.fake_cuda import CUDA, install
from tests.transfer.test_native import KINDS
from tests.transfer.test_native import make_layout as layout_of

CHUNK = 4


@pytest.fixture(params=["native", "torch"], autouse=True)
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which copies the plans made in a test use: the C row copies, or torch's."""
    if request.param == "torch":
        monkeypatch.setattr(transfer_native, "NATIVE_ROWS", False)
    elif not transfer_native.NATIVE_ROWS:
        pytest.skip("lmcache_async.transfer._rows was not built")
    path: str = request.param
    return path


def make_layout(kind: str) -> KVLayout:
    if kind == "vllm_cpu":  # parts on views of their own: the unfused per-layer path
        return KVLayout.vllm_cpu(num_layers=2, num_kv_heads=2, head_size=4, dtype=torch.float32)
    return KVLayout.vllm_flash_attn(
        num_layers=2, block_size=4, num_kv_heads=2, head_size=4, dtype=torch.float32
    )


def plan_of(layout: KVLayout) -> TransferPlan:
    kv = layout.allocate_kv_caches(8, generator=torch.Generator().manual_seed(3))
    return layout.plan(kv, torch.randperm(8 * layout.block_size)[: 2 * CHUNK])


def payload(layout: KVLayout, *, layer: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = layout.layer_payload_shape(CHUNK) if layer else layout.payload_shape(CHUNK)
    return torch.zeros(shape, dtype=dtype)


# Each calls one transfer with a first chunk that is fine and a second that cannot be
# moved (a payload of another dtype), so the failure comes after copies were queued.
TRANSFERS: dict[str, Callable[[TransferPlan, KVLayout], None]] = {
    "gather_chunks": lambda plan, layout: plan.gather_chunks(
        [
            (0, CHUNK, payload(layout, layer=False)),
            (CHUNK, 2 * CHUNK, payload(layout, layer=False, dtype=torch.float64)),
        ]
    ),
    "scatter_chunks": lambda plan, layout: plan.scatter_chunks(
        [
            (0, CHUNK, payload(layout, layer=False)),
            (CHUNK, 2 * CHUNK, payload(layout, layer=False, dtype=torch.float64)),
        ]
    ),
    "gather_layer_chunks": lambda plan, layout: plan.gather_layer_chunks(
        1,
        [
            (0, CHUNK, payload(layout, layer=True)),
            (CHUNK, 2 * CHUNK, payload(layout, layer=True, dtype=torch.float64)),
        ],
    ),
    "scatter_layer_chunks": lambda plan, layout: plan.scatter_layer_chunks(
        1,
        [
            (0, CHUNK, payload(layout, layer=True)),
            (CHUNK, 2 * CHUNK, payload(layout, layer=True, dtype=torch.float64)),
        ],
    ),
}


@pytest.mark.parametrize("kind", ["flash_nhd", "vllm_cpu"])
@pytest.mark.parametrize("name", list(TRANSFERS))
def test_a_failed_transfer_settles_before_raising(
    monkeypatch: pytest.MonkeyPatch, kind: str, name: str
) -> None:
    settled: list[BaseException] = []

    def settle(self: TransferPlan, exc: BaseException) -> None:
        settled.append(exc)

    monkeypatch.setattr(TransferPlan, "_settle", settle)
    layout = make_layout(kind)
    with pytest.raises(RuntimeError) as raised:
        TRANSFERS[name](plan_of(layout), layout)
    assert settled == [raised.value]


def test_settling_waits_for_the_current_stream_of_cuda_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = install(monkeypatch)
    plan = plan_of(make_layout("flash_nhd"))
    plan._device = CUDA  # as built over CUDA caches
    error = RuntimeError("copy failed")
    plan._settle(error)
    assert cuda.log == [("sync", "default")]

    def broken(self: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(cuda.Stream, "synchronize", broken)
    plan._settle(error)  # the first error stays the news; the second is noted on it
    assert any("device lost" in note for note in error.__notes__)


def test_settling_makes_no_cuda_call_for_cpu_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda(*args: Any) -> None:
        raise AssertionError("torch.cuda was called for CPU caches")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    plan_of(make_layout("flash_nhd"))._settle(RuntimeError("copy failed"))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per_layer"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunks_go_there_and_back_bit_for_bit(kind: str, per_layer: bool, copy_path: str) -> None:
    """Chunks gathered from one request's slots and scattered at another's: the second
    request's slots then hold the first's bytes, and its skipped token's slot nothing new."""
    layout = layout_of(kind, torch.bfloat16)
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    source = layout.allocate_kv_caches(8, generator=gen)
    target = layout.allocate_kv_caches(8, generator=gen)
    slots = torch.randperm(8 * layout.block_size, generator=gen)[: 4 * CHUNK + 3]
    src_slots, dst_slots = slots[: 2 * CHUNK + 1], slots[2 * CHUNK + 1 :].clone()
    dst_slots[CHUNK + 1] = -1
    n = int(src_slots.shape[0])
    src, dst = layout.plan(source, src_slots), layout.plan(target, dst_slots)
    assert (src._native is not None) == (copy_path == "native")
    bounds = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]  # the last one short
    shape = layout.layer_payload_shape if per_layer else layout.payload_shape
    jobs = [(s, e, torch.empty(shape(e - s), dtype=layout.dtype)) for s, e in bounds]
    untouched = layout.plan(target, dst_slots[CHUNK + 1 : CHUNK + 2].clamp(min=0))
    before = torch.empty(shape(1), dtype=layout.dtype)
    if per_layer:
        untouched.gather_layer(1, 0, 1, before)
        src.gather_layer_chunks(1, jobs)
        dst.scatter_layer_chunks(1, jobs)
    else:
        untouched.gather(0, 1, before)
        src.gather_chunks(jobs)
        dst.scatter_chunks(jobs)
    after = torch.empty_like(before)
    if per_layer:
        untouched.gather_layer(1, 0, 1, after)
    else:
        untouched.gather(0, 1, after)
    assert raw(after) == raw(before)
    kept = [(0, CHUNK), (CHUNK, CHUNK + 1), (CHUNK + 2, n)]
    for start, end in kept:
        there = torch.empty(shape(end - start), dtype=layout.dtype)
        back = torch.empty_like(there)
        if per_layer:
            src.gather_layer(1, start, end, there)
            dst.gather_layer(1, start, end, back)
        else:
            src.gather(start, end, there)
            dst.gather(start, end, back)
        assert raw(back) == raw(there)
