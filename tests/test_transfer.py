"""A :class:`~lmcache_async.transfer.TransferPlan` that fails mid-transfer waits for the
copies it queued before its error reaches the caller, who hands the payloads back then."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_async.layouts import KVLayout
from lmcache_async.transfer import TransferPlan
from tests.fake_cuda import CUDA, install

CHUNK = 4


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
