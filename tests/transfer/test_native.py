"""The C row copies (:mod:`lmcache_async.transfer.native`, ``_native.gather_rows`` /
``scatter_rows``) move exactly the bytes of the torch path for every layout, dtype, slot
mapping (negative slots included), chunking and start, in one thread or several; a transfer
plan on the CPU takes them in one call per transfer and falls back to torch where they
cannot go; and the C functions refuse bad arguments before a byte moves."""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import KVLayout
from lmcache_async.transfer import native as transfer_native
from lmcache_async.transfer.native import NATIVE_ROWS, NativeRows, native_rows, row_geometry
from lmcache_async.transfer.plan import TransferPlan
from tests.test_engine import CHUNK, TIMEOUT, Scene, open_engine, prefix_mask
from tests.test_engine import KINDS as ENGINE_KINDS

pytestmark = pytest.mark.skipif(
    not NATIVE_ROWS, reason="lmcache_async.transfer._rows was not built"
)

KINDS = (
    "flash_nhd",
    "flash_hnd",
    "flashinfer",
    "mla",
    "vllm_cpu",
    "vllm_cpu_token_rows",
    "vllm_cpu_amx",
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_LAYERS = 3
NUM_BLOCKS = 10

# One thread as a small request runs; and three threads with streamed stores, which the
# defaults keep for copies of megabytes.
SPREADS: dict[str, dict[str, int]] = {
    "one_thread": {"threads": 1},
    "threads_streamed": {"threads": 3, "thread_bytes": 1, "stream_bytes": 1},
}

Job = tuple[int, int, torch.Tensor]


def make_layout(kind: str, dtype: torch.dtype) -> KVLayout:
    """A small layout of ``kind`` (the AMX packing only holds bf16, in blocks of 32)."""
    if kind == "vllm_cpu_amx":
        return KVLayout.vllm_cpu(
            num_layers=NUM_LAYERS,
            num_kv_heads=2,
            head_size=32,
            dtype=torch.bfloat16,
            block_size=32,
            packing="amx",
        )
    if kind.startswith("vllm_cpu"):
        packing = "token_rows" if kind == "vllm_cpu_token_rows" else "keys_transposed"
        return KVLayout.vllm_cpu(
            num_layers=NUM_LAYERS,
            num_kv_heads=3,
            head_size=4,
            dtype=dtype,
            block_size=8,
            packing=packing,
        )
    if kind == "mla":
        return KVLayout.mla(num_layers=NUM_LAYERS, block_size=8, latent_dim=12, dtype=dtype)
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=NUM_LAYERS, block_size=8, num_kv_heads=2, head_size=4, dtype=dtype
        )
    return KVLayout.vllm_flash_attn(
        num_layers=NUM_LAYERS,
        block_size=8,
        num_kv_heads=3,
        head_size=4,
        dtype=dtype,
        hnd=kind == "flash_hnd",
    )


def native_of(plan: TransferPlan, **spread: int) -> NativeRows:
    """The plan's C copies' arguments, made again with ``spread``."""
    parts = plan._parts
    made = native_rows(
        [(part.views, part.index) for part in parts],
        rows_per_token=plan._rpt,
        token_part_bytes=plan._width * parts[0].views[0].element_size(),
        negative=plan._negative,
        **spread,
    )
    assert made is not None
    return made


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def random_bytes(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` filled with random bits (NaNs included)."""
    count = int(np.prod(shape)) * dtype.itemsize
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).view(*shape)
    )


def sentinel(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    count = int(np.prod(shape)) * dtype.itemsize
    return torch.full((count,), 0xA5, dtype=torch.uint8).view(dtype).view(*shape)


# ---------------------------------------------------------------------------- scenes


@st.composite
def scenes(draw: st.DrawFn) -> dict[str, Any]:
    """A layout, caches, a slot mapping (blocks in order or scattered slots, some
    negative) and chunks ``(start, end)`` from a start, the last one maybe short."""
    kind = draw(st.sampled_from(KINDS))
    dtype = torch.bfloat16 if kind == "vllm_cpu_amx" else draw(st.sampled_from(DTYPES))
    layout = make_layout(kind, dtype)
    bs = layout.block_size
    num_tokens = draw(st.integers(1, 4 * bs))
    if draw(st.booleans()):  # a vLLM request: its blocks in some order, tokens in order
        blocks = draw(st.permutations(range(NUM_BLOCKS)))
        slots = [blocks[t // bs] * bs + t % bs for t in range(num_tokens)]
    else:
        slots = draw(st.permutations(range(NUM_BLOCKS * bs)))[:num_tokens]
    negative = draw(st.sets(st.integers(0, num_tokens - 1), max_size=max(1, num_tokens // 4)))
    for t in negative:
        slots[t] = -1
    start = draw(st.integers(0, num_tokens - 1))
    chunk = draw(st.integers(1, 2 * bs))
    bounds = [(s, min(s + chunk, num_tokens)) for s in range(start, num_tokens, chunk)]
    return {
        "kind": kind,
        "layout": layout,
        "slots": torch.tensor(slots, dtype=torch.int64),
        "bounds": bounds,
        "seed": draw(st.integers(0, 2**16)),
        "spread": draw(st.sampled_from(sorted(SPREADS))),
        "layer": draw(st.integers(0, NUM_LAYERS - 1)),
    }


def gatherable(bounds: list[tuple[int, int]], slots: torch.Tensor) -> list[tuple[int, int]]:
    """The chunks cut where a slot is negative: what a gather can take."""
    kept: list[tuple[int, int]] = []
    for start, end in bounds:
        run = start
        for t in range(start, end + 1):
            if t == end or int(slots[t]) < 0:
                if t > run:
                    kept.append((run, t))
                run = t + 1
    return kept


PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- same bytes


@PROPERTY
@given(scene=scenes())
def test_gathers_give_the_torch_paths_bytes(scene: dict[str, Any]) -> None:
    layout: KVLayout = scene["layout"]
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    plan = layout.plan(kv, scene["slots"])
    fast = native_of(plan, **SPREADS[scene["spread"]])
    bounds = gatherable(scene["bounds"], scene["slots"])
    layer = scene["layer"]
    shapes: list[tuple[Callable[[int], tuple[int, ...]], Callable[[list[Job]], None]]] = [
        (layout.payload_shape, plan.gather_chunks),
        (layout.layer_payload_shape, lambda jobs: plan.gather_layer_chunks(layer, jobs)),
    ]
    for shape, gather in shapes:
        results = []
        for path in (fast, None):
            plan._native = path
            outs = [sentinel(shape(end - start), layout.dtype) for start, end in bounds]
            gather([(s, e, out) for (s, e), out in zip(bounds, outs, strict=True)])
            results.append([raw(out) for out in outs])
        assert results[0] == results[1]


@PROPERTY
@given(scene=scenes())
def test_scatters_write_the_torch_paths_bytes(scene: dict[str, Any]) -> None:
    layout: KVLayout = scene["layout"]
    original = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(2))
    bounds = scene["bounds"]
    layer = scene["layer"]
    for per_layer in (False, True):
        shape = layout.layer_payload_shape if per_layer else layout.payload_shape
        payloads = [
            random_bytes(shape(end - start), layout.dtype, scene["seed"] + i)
            for i, (start, end) in enumerate(bounds)
        ]
        jobs_of = [(s, e, p) for (s, e), p in zip(bounds, payloads, strict=True)]
        results = []
        for native in (True, False):
            kv = [t.clone() for t in original]
            plan = layout.plan(kv, scene["slots"])
            plan._native = native_of(plan, **SPREADS[scene["spread"]]) if native else None
            if per_layer:
                plan.scatter_layer_chunks(layer, jobs_of)
            else:
                plan.scatter_chunks(jobs_of)
            results.append([raw(t) for t in kv])
        assert results[0] == results[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_scatter_of_skipped_tokens_only_writes_nothing(kind: str) -> None:
    layout = make_layout(kind, torch.bfloat16)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))
    before = [raw(t) for t in kv]
    plan = layout.plan(kv, torch.full((5,), -1, dtype=torch.int64))
    assert plan._native is not None
    payload = random_bytes(layout.payload_shape(5), layout.dtype, 4)
    plan.scatter_chunks([(0, 2, payload[:, :, :2].contiguous()), (2, 5, payload[:, :, 2:])])
    plan.scatter_layer_chunks(
        1, [(0, 5, random_bytes(layout.layer_payload_shape(5), layout.dtype, 5))]
    )
    assert [raw(t) for t in kv] == before


@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "vllm_cpu"])
def test_a_large_copy_spreads_over_threads_and_keeps_the_bytes(kind: str) -> None:
    """16 MiB with the default spread (threads of their own, on a machine with more than
    one CPU), and again with stores streamed past the caches."""
    layout = KVLayout.vllm_flash_attn(
        num_layers=2,
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.float32,
        hnd=kind == "flash_hnd",
    )
    if kind == "vllm_cpu":
        layout = KVLayout.vllm_cpu(
            num_layers=2, num_kv_heads=8, head_size=128, dtype=torch.float32, block_size=16
        )
    num_tokens = 1024  # 16 MiB in all
    kv = layout.allocate_kv_caches(2 * num_tokens // 16, generator=torch.Generator().manual_seed(6))
    slots = torch.randperm(2 * num_tokens, generator=torch.Generator().manual_seed(7))[:num_tokens]
    plan = layout.plan(kv, slots)
    bounds = [(s, s + 256) for s in range(0, num_tokens, 256)]
    outs = []
    for native in (native_of(plan), native_of(plan, stream_bytes=1), None):
        plan._native = native
        payloads = [sentinel(layout.payload_shape(256), layout.dtype) for _ in bounds]
        plan.gather_chunks([(s, e, p) for (s, e), p in zip(bounds, payloads, strict=True)])
        outs.append([raw(p) for p in payloads])
    assert outs[0] == outs[2]
    assert outs[1] == outs[2]


# ---------------------------------------------------------------------------- row geometry


@settings(max_examples=300, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40)), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.float64]),
)
def test_a_rows_geometry_lists_its_elements_in_order(
    dims: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    shape = [3, *(size for size, _ in dims)]
    strides = [7, *(stride for _, stride in dims)]
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    view = torch.zeros(extent, dtype=dtype).as_strided(shape, strides)
    geometry = row_geometry(view)
    offsets = torch.arange(extent, dtype=torch.int64).as_strided(shape, strides)[0].reshape(-1)
    if geometry is None:  # more strided dimensions than the C copies take
        return
    row_bytes, seg, counts, steps = geometry
    assert row_bytes == offsets.numel() * dtype.itemsize
    item = dtype.itemsize
    listed: list[int] = []
    grid = [[0]]
    for count, step in zip(counts, steps, strict=True):
        grid = [[*g, i * step] for g in grid for i in range(count)]
    for g in grid:
        listed += [(sum(g) // item) + e for e in range(seg // item)]
    assert listed == offsets.tolist()


# ---------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_on_the_cpu_takes_the_c_copies(kind: str) -> None:
    layout = make_layout(kind, torch.bfloat16)
    kv = layout.allocate_kv_caches(NUM_BLOCKS)
    assert layout.plan(kv, torch.arange(4))._native is not None


def test_one_call_moves_every_chunk_layer_and_part(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(name: str, function: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            calls.append(name)
            function(*args)

        return call

    monkeypatch.setattr(
        transfer_native, "_gather_rows", counted("gather", transfer_native._gather_rows)
    )
    monkeypatch.setattr(
        transfer_native, "_scatter_rows", counted("scatter", transfer_native._scatter_rows)
    )
    layout = make_layout("flash_hnd", torch.float16)
    kv = layout.allocate_kv_caches(NUM_BLOCKS)
    plan = layout.plan(kv, torch.randperm(NUM_BLOCKS * 8)[:20])

    def no_torch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(torch, "index_select", no_torch)
    monkeypatch.setattr(torch.Tensor, "index_copy_", no_torch)
    bounds = [(0, 8), (8, 16), (16, 20)]
    full = [
        (s, e, torch.empty(layout.payload_shape(e - s), dtype=torch.float16)) for s, e in bounds
    ]
    per_layer = [
        (s, e, torch.empty(layout.layer_payload_shape(e - s), dtype=torch.float16))
        for s, e in bounds
    ]
    plan.gather_chunks(full)
    plan.scatter_chunks(full)
    plan.gather_layer_chunks(2, per_layer)
    plan.scatter_layer_chunks(2, per_layer)
    assert calls == ["gather", "scatter", "gather", "scatter"]


def test_payloads_the_c_copies_do_not_take_go_through_torch() -> None:
    layout = make_layout("flash_nhd", torch.float32)
    kv = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(8))
    plan = layout.plan(kv, torch.randperm(NUM_BLOCKS * 8)[:6])
    assert plan._native is not None
    # Not contiguous: torch takes the payload (a scatter makes it contiguous first).
    payload = random_bytes(layout.payload_shape(6), torch.float32, 9)
    strided = payload.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    plan.scatter_chunks([(0, 6, strided)])
    out = torch.empty(layout.payload_shape(6))
    plan.gather_chunks([(0, 6, out)])
    assert raw(out) == raw(payload)
    # Another dtype: torch says what is wrong, as it did before the C copies.
    with pytest.raises(RuntimeError):
        plan.gather_chunks([(0, 6, torch.empty(layout.payload_shape(6), dtype=torch.float64))])
    # The wrong size: refused (torch would resize the payload's view with a warning).
    with pytest.raises(InvalidInputError, match=r"job 1: a payload of 1440 bytes .* expected 864"):
        plan.gather_chunks(
            [
                (0, 3, torch.empty(layout.payload_shape(3))),
                (3, 6, torch.empty(layout.payload_shape(5))),
            ]
        )
    with pytest.raises(IndexError):
        plan.gather_layer_chunks(NUM_LAYERS, [(0, 6, torch.empty(layout.layer_payload_shape(6)))])


def test_a_gather_of_a_negative_slot_is_refused_on_both_paths() -> None:
    layout = make_layout("mla", torch.float16)
    kv = layout.allocate_kv_caches(NUM_BLOCKS)
    plan = layout.plan(kv, torch.tensor([3, 4, -1, 5]))
    for native in (plan._native, None):
        plan._native = native
        with pytest.raises(InvalidInputError, match="negative slot"):
            plan.gather_chunks([(0, 4, torch.empty(layout.payload_shape(4), dtype=torch.float16))])


def test_plans_off_the_cpu_or_without_the_c_copies_use_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = make_layout("flash_nhd", torch.float32)
    kv = layout.allocate_kv_caches(NUM_BLOCKS)
    plan = layout.plan(kv, torch.arange(4))
    meta = TransferPlan(
        layout, parts=plan._parts, rows_per_token=1, negative=[], device=torch.device("meta")
    )
    assert meta._native is None
    monkeypatch.setattr(transfer_native, "NATIVE_ROWS", False)
    assert layout.plan(kv, torch.arange(4))._native is None


def test_views_that_differ_from_layer_to_layer_do_not_qualify() -> None:
    layers = [torch.zeros(8, 4), torch.zeros(8, 8)[:, :4]]
    index = torch.arange(4)
    assert (
        native_rows([(layers, index)], rows_per_token=1, token_part_bytes=16, negative=[]) is None
    )
    same = [torch.zeros(8, 4), torch.zeros(8, 4)]
    assert native_rows([(same, index)], rows_per_token=1, token_part_bytes=16, negative=[])
    assert (
        native_rows([(same, index.int())], rows_per_token=1, token_part_bytes=16, negative=[])
        is None
    )
    assert native_rows([(same, index)], rows_per_token=1, token_part_bytes=8, negative=[]) is None


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("kind", ENGINE_KINDS)
async def test_an_engine_round_trip_with_a_mask_and_negative_slots(
    monkeypatch: pytest.MonkeyPatch, kind: str, path: str
) -> None:
    if path == "torch":
        monkeypatch.setattr(transfer_native, "NATIVE_ROWS", False)
    n = 3 * CHUNK + 5
    scene = Scene.build(kind, torch.bfloat16, n, seed=500 + ENGINE_KINDS.index(kind))
    scene.dst_slots[[CHUNK + 3, n - 1]] = -1
    loaded = prefix_mask(n, CHUNK, n)
    loaded[[CHUNK + 3, n - 1]] = False
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, save_unfull_chunk=True) as engine:
            assert await scene.store(engine) == n
            await scene.retrieve_and_check(engine, loaded, mask=prefix_mask(n, CHUNK, n))


# ---------------------------------------------------------------------------- bad arguments


class Call:
    """Valid arguments of the C copies over a small plan, to spoil one at a time."""

    def __init__(self) -> None:
        self.layout = make_layout("flash_nhd", torch.float32)
        self.kv = self.layout.allocate_kv_caches(NUM_BLOCKS)
        plan = self.layout.plan(self.kv, torch.tensor([9, 10, 11, -1, 30, 31]))
        native = plan._native
        assert native is not None
        self.outs = [sentinel(self.layout.payload_shape(3), torch.float32) for _ in range(2)]
        self.args: dict[str, Any] = {
            "table": native._table,
            "index": native._index,
            "jobs": [(0, 3, self.outs[0]), (3, 6, self.outs[1])],
            "layer": -1,
            "skip": native._skip,
            "threads": 1,
            "thread_bytes": 1 << 22,
            "stream_bytes": 0,
        }

    def run(self, function: str = "scatter_rows", **changes: Any) -> None:
        args = {**self.args, **changes}
        args["jobs"] = [
            (job[0], job[1], job[2].data_ptr(), job[2].nbytes)
            if isinstance(job[-1], torch.Tensor)
            else job
            for job in args["jobs"]
        ]
        getattr(transfer_native, f"_{function.removesuffix('_rows')}_rows")(*args.values())

    def untouched(self) -> bool:
        return all(raw(out) == raw(sentinel(out.shape, torch.float32)) for out in self.outs)


def spoiled_table(table: array.array[int], field: int, value: int) -> array.array[int]:
    copy = array.array("q", table)
    copy[field] = value
    return copy


def test_the_valid_arguments_copy() -> None:
    call = Call()
    written = random_bytes(call.outs[0].shape, torch.float32, 10)
    call.outs[0].copy_(written)
    call.run("scatter_rows")
    call.outs[0].copy_(sentinel(written.shape, torch.float32))
    call.run("gather_rows", jobs=[(0, 3, call.outs[0])])
    assert raw(call.outs[0]) == raw(written)


BAD: dict[str, tuple[Callable[[Call], dict[str, Any]], type[Exception], str]] = {
    "a short table": (
        lambda c: {"table": array.array("q", c.args["table"][:-1])},
        ValueError,
        r"table has \d+ fields, expected \d+ for 2 parts and 3 layers",
    ),
    "a table of bytes not fields": (
        lambda c: {"table": bytes(c.args["table"])[:-3]},
        ValueError,
        "table must hold int64 fields",
    ),
    "no parts": (
        lambda c: {"table": spoiled_table(c.args["table"], 0, 0)},
        ValueError,
        "out of range",
    ),
    "rows of another size": (
        lambda c: {"table": spoiled_table(c.args["table"], 4, 8)},
        ValueError,
        "part 0: rows of 8 bytes, but its geometry holds 48",
    ),
    "one index for two parts": (
        lambda c: {"index": c.args["index"][:1]},
        ValueError,
        "1 index buffers for 2 parts",
    ),
    "a short index": (
        lambda c: {"index": [np.zeros(5, dtype=np.int64), c.args["index"][1]]},
        ValueError,
        "index 0 has 40 bytes, expected 6 aligned int64 row numbers",
    ),
    "a row past the views": (
        lambda c: {"index": [np.array([9, 10, 11, 0, 30, 10**6]), c.args["index"][1]]},
        ValueError,
        r"part 0: row 1000000 of token 5 is out of its views' 160 rows",
    ),
    "a negative row": (
        lambda c: {"index": [c.args["index"][0], np.array([1, 2, 3, 0, -4, 5])]},
        ValueError,
        r"part 1: row -4 of token 4 is out of its views' 160 rows",
    ),
    "a payload of the wrong size": (
        lambda c: {"jobs": [(0, 3, c.outs[0]), (3, 6, c.outs[1].data_ptr(), 100)]},
        ValueError,
        r"job 1: a payload of 100 bytes at .*, expected 864 bytes for tokens \[3, 6\)",
    ),
    "tokens past the plan's": (
        lambda c: {"jobs": [(0, 3, c.outs[0]), (4, 7, c.outs[1])]},
        ValueError,
        r"job 1: tokens \[4, 7\) out of \[0, 6\)",
    ),
    "tokens backwards": (
        lambda c: {"jobs": [(3, 0, c.outs[0])]},
        ValueError,
        r"job 0: tokens \[3, 0\) out of \[0, 6\)",
    ),
    "a job that is no tuple": (
        lambda c: {"jobs": [[0, 3, 0, 0]]},
        TypeError,
        "job 0 must be a tuple",
    ),
    "a layer past the last": (lambda c: {"layer": 3}, ValueError, r"layer 3 out of \[-1, 3\)"),
    "a short skip mask": (
        lambda c: {"skip": bytes(5)},
        ValueError,
        r"skip has 5 bytes, expected one per token \(6\)",
    ),
    "no thread": (lambda c: {"threads": 0}, ValueError, "threads and thread_bytes must be"),
}


@pytest.mark.parametrize("function", ["gather_rows", "scatter_rows"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_are_refused_before_a_byte_moves(case: str, function: str) -> None:
    call = Call()
    before = [raw(t) for t in call.kv]
    change, error, message = BAD[case]
    changes = change(call)
    if function == "gather_rows":  # else it refuses the skipped token before the others
        changes.setdefault("skip", None)
    with pytest.raises(error, match=message):
        call.run(function, **changes)
    assert call.untouched()
    assert [raw(t) for t in call.kv] == before


def test_a_run_of_rows_stops_at_a_skipped_token() -> None:
    """Rows 9..14 follow each other in memory; token 3 (row 12) is skipped."""
    call = Call()
    payload = random_bytes(call.layout.payload_shape(6), torch.float32, 11)
    before = [t.clone() for t in call.kv]
    rows = np.arange(9, 15, dtype=np.int64)
    call.run("scatter_rows", index=[rows, call.args["index"][1]], jobs=[(0, 6, payload)])
    for layer, (after, old) in enumerate(zip(call.kv, before, strict=True)):
        written = after.view(-1, call.layout.width)
        assert torch.equal(written[12], old.view(-1, call.layout.width)[12])
        for token, row in enumerate(rows.tolist()):
            if token != 3:
                assert raw(written[row]) == raw(payload[0, layer, token])


def test_a_gather_of_a_skipped_token_is_refused_by_the_c_copies() -> None:
    call = Call()
    with pytest.raises(ValueError, match="gather_rows: token 3 has a negative slot"):
        call.run("gather_rows")
    assert call.untouched()
