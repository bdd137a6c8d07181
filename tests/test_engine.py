"""CacheEngine end to end on CPU: round trips for every layout and dtype, masks, shared
prefixes, pins, events, freeze / hot-cache switches, bad input, cancellation and shutdown.

Every check is bit-exact: the target KV caches are filled with a random sentinel pattern
first, and after a retrieve each layer must equal, bit for bit, that pattern with exactly
the retrieved tokens' KV written at their slots.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import (
    CacheEngine,
    ConfigError,
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
)
from lmcache_async.core.store import StoreCore

NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_SIZE = 8
LATENT_DIM = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 24
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
CHUNK = 16
SMALL_POOL_GB = 0.01
TIMEOUT = 20

KINDS = ("flash_nhd", "flash_hnd", "flashinfer", "mla", "vllm_cpu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


# ---------------------------------------------------------------------------- helpers


def make_layout(kind: str, dtype: torch.dtype) -> KVLayout:
    """A tiny layout of ``kind``: 2 layers, 2 heads of 8 (MLA: latent 16), blocks of 16."""
    if kind in ("flash_nhd", "flash_hnd"):
        return KVLayout.vllm_flash_attn(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
            hnd=kind == "flash_hnd",
        )
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
        )
    if kind == "mla":
        return KVLayout.mla(
            num_layers=NUM_LAYERS, block_size=BLOCK_SIZE, latent_dim=LATENT_DIM, dtype=dtype
        )
    if kind == "vllm_cpu":
        return KVLayout.vllm_cpu(
            num_layers=NUM_LAYERS,
            num_kv_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
            block_size=BLOCK_SIZE,
        )
    raise AssertionError(kind)


def documented_shape(kind: str) -> tuple[int, ...]:
    """Per-layer logical shape the architecture documents for ``kind``."""
    if kind in ("flash_nhd", "flash_hnd"):
        return (2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    if kind == "flashinfer":
        return (NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    if kind == "mla":
        return (NUM_BLOCKS, BLOCK_SIZE, LATENT_DIM)
    return (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)


def token_views(kind: str, layer: torch.Tensor, slot: int) -> list[torch.Tensor]:
    """Views of everything one token owns in one layer tensor (written through)."""
    block, offset = divmod(slot, BLOCK_SIZE)
    if kind in ("flash_nhd", "flash_hnd"):
        return [layer[:, block, offset]]
    if kind == "flashinfer":
        return [layer[block, :, offset]]
    if kind == "mla":
        return [layer[block, offset]]
    # vLLM CPU: per block and head, keys [head_size, block_size] (a token is a column),
    # then values [block_size, head_size] (a token is a row).
    nb = layer.shape[0]
    keys = layer.view(nb, NUM_HEADS, 2, HEAD_SIZE, BLOCK_SIZE)[block, :, 0, :, offset]
    values = layer.view(nb, NUM_HEADS, 2, BLOCK_SIZE, HEAD_SIZE)[block, :, 1, offset]
    return [keys, values]


def same_token(kind: str, a: torch.Tensor, b: torch.Tensor, slot: int) -> bool:
    """Whether the token at ``slot`` holds the same bits in layers ``a`` and ``b``."""
    pairs = zip(token_views(kind, a, slot), token_views(kind, b, slot), strict=True)
    return all(torch.equal(bits(x), bits(y)) for x, y in pairs)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory reinterpreted as integers, so equality is bit equality."""
    return t.view(_INT_OF[t.dtype])


def new_caches(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return layout.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)


def clone_caches(kv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in kv]


def random_slots(n: int, seed: int) -> torch.Tensor:
    """``n`` distinct slots in a random order (so blocks are scattered)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_SLOTS, generator=gen)[:n].to(torch.int64)


def random_tokens(n: int, seed: int, vocab: int = 50_000) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def expected_target(
    kind: str,
    *,
    before: Sequence[torch.Tensor],
    source: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    loaded: torch.Tensor,
) -> list[torch.Tensor]:
    """``before`` with the KV of every loaded token copied from its source slot."""
    out = clone_caches(before)
    for i in torch.nonzero(loaded).view(-1).tolist():
        dst = int(dst_slots[i])
        if dst < 0:
            continue
        src = int(src_slots[i])
        for out_layer, src_layer in zip(out, source, strict=True):
            dst_views = token_views(kind, out_layer, dst)
            for out_view, src_view in zip(
                dst_views, token_views(kind, src_layer, src), strict=True
            ):
                out_view.copy_(src_view)
    return out


def assert_same_caches(
    kind: str, actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
) -> None:
    """Bit equality of two cache lists; on failure, name the slots that differ."""
    assert len(actual) == len(expected)
    for layer, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape
        assert a.dtype == e.dtype
        if torch.equal(bits(a), bits(e)):
            continue
        bad = [s for s in range(NUM_SLOTS) if not same_token(kind, a, e, s)]
        raise AssertionError(f"layer {layer}: slots differ from expected: {bad[:20]}")


def prefix_mask(n: int, start: int, stop: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[start:stop] = True
    return mask


def config(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": SMALL_POOL_GB}
    values.update(overrides)
    return EngineConfig(**values)


@asynccontextmanager
async def open_engine(
    layout: KVLayout, model_name: str = "test-model", **overrides: Any
) -> AsyncIterator[CacheEngine]:
    async with CacheEngine.open(config(**overrides), layout, model_name=model_name) as engine:
        yield engine


@dataclass
class Scene:
    """A source cache holding one prompt's KV and a sentinel-filled target cache."""

    kind: str
    layout: KVLayout
    source: list[torch.Tensor]
    target: list[torch.Tensor]
    tokens: list[int]
    src_slots: torch.Tensor
    dst_slots: torch.Tensor

    @classmethod
    def build(cls, kind: str, dtype: torch.dtype, n: int, seed: int) -> Scene:
        layout = make_layout(kind, dtype)
        return cls(
            kind=kind,
            layout=layout,
            source=new_caches(layout, seed),
            target=new_caches(layout, seed + 1),
            tokens=random_tokens(n, seed + 2),
            src_slots=random_slots(n, seed + 3),
            dst_slots=random_slots(n, seed + 4),
        )

    async def store(self, engine: CacheEngine, mask: torch.Tensor | None = None) -> int:
        return await engine.store(
            self.tokens, kv_caches=self.source, slot_mapping=self.src_slots, mask=mask
        )

    async def retrieve_and_check(
        self, engine: CacheEngine, expected_loaded: torch.Tensor, mask: torch.Tensor | None = None
    ) -> None:
        """Retrieve into the target; the mask and every bit of the target must be as expected."""
        before = clone_caches(self.target)
        loaded = await engine.retrieve(
            self.tokens, kv_caches=self.target, slot_mapping=self.dst_slots, mask=mask
        )
        assert loaded.dtype == torch.bool
        assert loaded.device.type == "cpu"
        assert loaded.tolist() == expected_loaded.tolist()
        want = expected_target(
            self.kind,
            before=before,
            source=self.source,
            src_slots=self.src_slots,
            dst_slots=self.dst_slots,
            loaded=expected_loaded,
        )
        assert_same_caches(self.kind, self.target, want)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_have_the_documented_shapes(kind: str) -> None:
    layout = make_layout(kind, torch.float16)
    caches = layout.allocate_kv_caches(NUM_BLOCKS)
    assert len(caches) == NUM_LAYERS
    assert all(tuple(c.shape) == documented_shape(kind) for c in caches)


# A small CPU request runs in the caller's task; inline_copy_bytes=0 sends every request
# through the pipeline's stage tasks instead. Both paths must give the same bytes.
PATHS = {"inline": {}, "pipeline": {"inline_copy_bytes": 0}}


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("save_unfull", [True, False], ids=["unfull", "full-only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_is_bit_exact(
    kind: str, dtype: torch.dtype, save_unfull: bool, path: str
) -> None:
    n = 3 * CHUNK + 5  # three full chunks and a short last one
    seed = 100 * KINDS.index(kind) + 10 * DTYPES.index(dtype) + int(save_unfull)
    scene = Scene.build(kind, dtype, n, seed=seed)
    cached = n if save_unfull else 3 * CHUNK
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            scene.layout, save_unfull_chunk=save_unfull, **PATHS[path]
        ) as engine:
            assert await scene.store(engine) == cached
            assert await engine.lookup(scene.tokens) == cached
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, cached))
            stats = engine.stats()
            assert stats.cached_chunks == (4 if save_unfull else 3)
            assert stats.stored_tokens == cached
            assert stats.retrieved_tokens == cached


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_caches_given_other_memory_in_place_are_written_there(kind: str) -> None:
    """The engine reuses its checked views of the caches from one request to the next:
    never after the very same tensors were given other memory."""
    n = 2 * CHUNK
    scene = Scene.build(kind, torch.float16, n, seed=7)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await scene.store(engine) == n
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))  # views remembered
            for layer, fresh in zip(scene.target, new_caches(scene.layout, 8), strict=True):
                layer.set_(fresh)  # same tensor objects, other memory
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))  # written there


@pytest.mark.anyio
async def test_small_cpu_requests_skip_the_stage_tasks(tmp_path: Path) -> None:
    """Small work runs in the caller's task; large copies and requests that reach a slow
    tier go through the pipeline (where copies may hop to a thread and tiers may wait)."""
    scene = Scene.build("flash_nhd", torch.float16, 2 * CHUNK, seed=21)
    small = scene.layout.token_bytes * 2 * CHUNK + 1
    submitted: list[str] = []

    def count(engine: CacheEngine) -> None:
        for pipe in (engine._parts.store_pipe, engine._parts.retrieve_pipe):
            submit = pipe.submit

            async def counted(item: Any, pipe: Any = pipe, submit: Any = submit) -> None:
                submitted.append(pipe.name)
                await submit(item)

            pipe.submit = counted  # type: ignore[method-assign]

    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, inline_copy_bytes=small) as engine:
            count(engine)
            assert await scene.store(engine) == 2 * CHUNK
            await scene.retrieve_and_check(engine, prefix_mask(2 * CHUNK, 0, 2 * CHUNK))
            assert submitted == []
        async with open_engine(scene.layout, inline_copy_bytes=small - 1) as engine:
            count(engine)
            assert await scene.store(engine) == 2 * CHUNK
            await scene.retrieve_and_check(engine, prefix_mask(2 * CHUNK, 0, 2 * CHUNK))
            assert len(submitted) == 2
        submitted.clear()
        async with open_engine(
            scene.layout, inline_copy_bytes=small, local_disk=str(tmp_path)
        ) as engine:
            count(engine)
            assert await scene.store(engine) == 2 * CHUNK
            await scene.retrieve_and_check(engine, prefix_mask(2 * CHUNK, 0, 2 * CHUNK))
            assert len(submitted) == 2
            submitted.clear()
            mask = await engine.retrieve(
                scene.tokens,
                kv_caches=scene.target,
                slot_mapping=scene.dst_slots,
                retrieve_locations=["cpu"],
            )
            assert mask.all() and submitted == []  # the CPU tier alone: inline again


@pytest.mark.anyio
@pytest.mark.parametrize("save_unfull", [True, False], ids=["unfull", "full-only"])
async def test_lookup_by_digests_matches_lookup_by_tokens(save_unfull: bool) -> None:
    n = 3 * CHUNK + 5
    scene = Scene.build("flash_nhd", torch.float16, n, seed=24)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, save_unfull_chunk=save_unfull) as engine:
            await scene.store(engine)
            hasher = engine.key_hasher
            for length in (0, 1, CHUNK, CHUNK + 3, 3 * CHUNK, n):
                tokens = scene.tokens[:length]
                digests = hasher.digests(tokens) if length else []
                by_digests = await engine.lookup_digests(digests, length)
                assert by_digests == await engine.lookup(tokens), length
                joined = memoryview(b"".join(digests))  # as a wire frame carries them
                assert await engine.lookup_digests(joined, length) == by_digests, length
            digests = hasher.digests(scene.tokens)
            assert await engine.lookup_digests(digests, n, lookup_id="p", pin=True) > 0
            assert engine.stats().pinned_chunks == (4 if save_unfull else 3)
            await engine.lookup_unpin("p")
            with pytest.raises(InvalidInputError, match="digests"):
                await engine.lookup_digests(digests[:-1], n)
            with pytest.raises(InvalidInputError, match="32 bytes"):
                await engine.lookup_digests([*digests[:-1], b"short"], n)
            with pytest.raises(InvalidInputError, match="32 bytes"):  # the 16-byte form
                await engine.lookup_digests([digest[16:] for digest in digests], n)
            with pytest.raises(InvalidInputError, match="multiple of 32"):
                await engine.lookup_digests(b"".join(digests)[:-1], n)
            with pytest.raises(InvalidInputError, match="digests"):
                await engine.lookup_digests(b"".join(digests[:-1]), n)
            with pytest.raises(InvalidInputError, match="num_tokens"):
                await engine.lookup_digests(digests, -1)
            with pytest.raises(InvalidInputError, match="lookup_id"):
                await engine.lookup_digests(digests, n, pin=True)


@pytest.mark.anyio
async def test_lookup_digests_now_answers_from_the_cpu_tier_or_leaves_it_to_the_await(
    tmp_path: Path,
) -> None:
    n = 3 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, n, seed=25)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            await scene.store(engine)
            digests = engine.key_hasher.digests(scene.tokens)
            assert engine.lookup_digests_now(digests, n) == n
            assert engine.lookup_digests_now(digests[:1], CHUNK) == CHUNK
            assert engine.lookup_digests_now(digests, n, lookup_id="a", pin=True) == n
            assert engine.stats().pinned_chunks == 3
            assert engine.stats().lookup_requests == 3
            await engine.lookup_unpin("a")
            with pytest.raises(InvalidInputError, match="lookup_id"):
                engine.lookup_digests_now(digests, n, pin=True)
            with pytest.raises(InvalidInputError, match="digests"):
                engine.lookup_digests_now(digests[:-1], n)
        async with open_engine(scene.layout, local_disk=str(tmp_path / "disk")) as engine:
            await scene.store(engine)
            assert await engine.flush()  # the disk writes behind the CPU tier
            assert engine.lookup_digests_now(digests, n) == n  # the CPU tier holds it all
            await engine.clear(["cpu"])
            before = engine.stats()
            # Only the disk has it: nothing answered, pinned or counted without the await.
            assert engine.lookup_digests_now(digests, n, lookup_id="b", pin=True) is None
            after = engine.stats()
            assert after.pinned_chunks == 0
            assert after.lookup_requests == before.lookup_requests
            assert await engine.lookup_digests(digests, n, lookup_id="b", pin=True) == n
            await engine.lookup_unpin("b")


@pytest.mark.anyio
async def test_cancelling_an_inline_store_waiting_for_memory_returns_it() -> None:
    scene = Scene.build("flash_nhd", torch.float16, CHUNK, seed=22)
    other = Scene.build("flash_nhd", torch.float16, 3 * CHUNK, seed=23)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, allocation_timeout=30.0) as engine:
            pool = engine.stats().pool
            chunks = pool.capacity_bytes // await one_chunk_bytes(engine, scene)
            for i in range(chunks):  # fill the pool with pinned chunks
                filler = random_tokens(CHUNK, seed=1000 + i)
                stored = await engine.store(
                    filler, kv_caches=scene.source, slot_mapping=scene.src_slots
                )
                assert stored == CHUNK
                await engine.lookup(filler, lookup_id=f"hold-{i}", pin=True)
            used = engine.stats().pool.used_bytes
            with anyio.move_on_after(0.3) as scope:
                await other.store(engine)  # waits for memory that pinned chunks hold
            assert scope.cancelled_caught
            assert engine.stats().pool.used_bytes == used
            assert engine.stats().pool.num_objects == chunks
            for i in range(chunks):
                await engine.lookup_unpin(f"hold-{i}")
            assert await other.store(engine) == 3 * CHUNK
            await other.retrieve_and_check(engine, prefix_mask(3 * CHUNK, 0, 3 * CHUNK))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_with_chunks_larger_than_blocks(kind: str) -> None:
    n = 2 * 32 + 7
    scene = Scene.build(kind, torch.bfloat16, n, seed=11)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, chunk_size=32) as engine:
            assert await scene.store(engine) == n
            assert await engine.lookup(scene.tokens) == n
            assert await engine.lookup(scene.tokens[:40]) == 32
            assert await engine.lookup(scene.tokens[:32]) == 32
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))


@pytest.mark.anyio
async def test_token_tensor_input_matches_list_input() -> None:
    n = 2 * CHUNK
    scene = Scene.build("flash_nhd", torch.float32, n, seed=21)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            as_tensor = torch.tensor(scene.tokens, dtype=torch.int64)
            assert (
                await engine.store(as_tensor, kv_caches=scene.source, slot_mapping=scene.src_slots)
                == n
            )
            assert await engine.lookup(scene.tokens) == n
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))


@pytest.mark.anyio
async def test_miss_writes_nothing() -> None:
    scene = Scene.build("flashinfer", torch.float16, 40, seed=31)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await engine.lookup(scene.tokens) == 0
            await scene.retrieve_and_check(engine, prefix_mask(40, 0, 0))


@pytest.mark.anyio
async def test_retrieve_of_a_longer_prompt_loads_only_the_cached_prefix() -> None:
    n = 4 * CHUNK
    scene = Scene.build("flash_hnd", torch.float16, n, seed=41)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            stored = await engine.store(
                scene.tokens[: 2 * CHUNK],
                kv_caches=scene.source,
                slot_mapping=scene.src_slots[: 2 * CHUNK],
            )
            assert stored == 2 * CHUNK
            assert await engine.lookup(scene.tokens) == 2 * CHUNK
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, 2 * CHUNK))


@pytest.mark.anyio
async def test_negative_target_slots_are_never_written() -> None:
    n = 3 * CHUNK
    scene = Scene.build("vllm_cpu", torch.bfloat16, n, seed=51)
    skipped = [0, 5, CHUNK, 2 * CHUNK + 3, n - 1]
    scene.dst_slots[skipped] = -1
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await scene.store(engine) == n
            before = clone_caches(scene.target)
            loaded = await engine.retrieve(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots
            )
            keep = scene.dst_slots >= 0
            assert loaded[keep].all()
            want = expected_target(
                scene.kind,
                before=before,
                source=scene.source,
                src_slots=scene.src_slots,
                dst_slots=scene.dst_slots,
                loaded=keep,
            )
            assert_same_caches(scene.kind, scene.target, want)


@pytest.mark.anyio
async def test_round_trip_keyed_by_engine_block_hashes() -> None:
    """Block hashes with end offsets stand in for tokens in store, lookup and retrieve."""
    n = 2 * CHUNK + 8
    scene = Scene.build("flash_nhd", torch.float16, n, seed=55)
    hashes: list[int | bytes] = [123456789, b"block-two", -42]
    offsets = [CHUNK, 2 * CHUNK, n]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            stored = await engine.store(
                hashes=hashes,
                offsets=offsets,
                kv_caches=scene.source,
                slot_mapping=scene.src_slots,
            )
            assert stored == n
            assert await engine.lookup(hashes=hashes, offsets=offsets) == n
            assert await engine.lookup(hashes=hashes[:2], offsets=offsets[:2]) == 2 * CHUNK
            assert await engine.lookup(hashes=[9, *hashes[1:]], offsets=offsets) == 0
            assert await engine.lookup(scene.tokens) == 0  # token keys are another space
            before = clone_caches(scene.target)
            loaded = await engine.retrieve(
                hashes=hashes,
                offsets=offsets,
                kv_caches=scene.target,
                slot_mapping=scene.dst_slots,
            )
            assert loaded.tolist() == [True] * n
            want = expected_target(
                scene.kind,
                before=before,
                source=scene.source,
                src_slots=scene.src_slots,
                dst_slots=scene.dst_slots,
                loaded=loaded,
            )
            assert_same_caches(scene.kind, scene.target, want)


@pytest.mark.anyio
async def test_store_stops_at_the_first_chunk_with_a_negative_slot() -> None:
    n = 4 * CHUNK
    scene = Scene.build("flash_nhd", torch.float32, n, seed=57)
    scene.src_slots[2 * CHUNK + 3] = -1
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await scene.store(engine) == 2 * CHUNK
            assert await engine.lookup(scene.tokens) == 2 * CHUNK
            assert engine.stats().cached_chunks == 2
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, 2 * CHUNK))


@pytest.mark.anyio
@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_with_device_caches(kind: str) -> None:
    n = 3 * CHUNK + 5
    layout = make_layout(kind, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(61)
    source = layout.allocate_kv_caches(NUM_BLOCKS, device="cuda", generator=gen)
    target = layout.allocate_kv_caches(NUM_BLOCKS, device="cuda", generator=gen)
    before = clone_caches(target)
    tokens = random_tokens(n, 62)
    src_slots = random_slots(n, 63)
    dst_slots = random_slots(n, 64)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(layout) as engine:
            assert await engine.store(tokens, kv_caches=source, slot_mapping=src_slots.cuda()) == n
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=dst_slots)
            assert loaded.device.type == "cpu"
            assert bool(loaded.all())
    want = expected_target(
        kind,
        before=[t.cpu() for t in before],
        source=[t.cpu() for t in source],
        src_slots=src_slots,
        dst_slots=dst_slots,
        loaded=loaded,
    )
    assert_same_caches(kind, [t.cpu() for t in target], want)


# ---------------------------------------------------------------------------- masks


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["flash_nhd", "mla"])
async def test_store_and_retrieve_with_masks(kind: str) -> None:
    n = 4 * CHUNK + 3
    scene = Scene.build(kind, torch.float32, n, seed=61)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            # Store only from chunk 1: chunk 0 is not cached, so no prefix from token 0 is.
            assert await scene.store(engine, mask=prefix_mask(n, CHUNK, n)) == n - CHUNK
            assert await engine.lookup(scene.tokens) == 0
            assert engine.stats().cached_chunks == 4
            # An unmasked retrieve starts at chunk 0, which misses: nothing is loaded.
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, 0))
            # A retrieve masked from chunk 2 loads exactly chunks 2.. and nothing before.
            await scene.retrieve_and_check(
                engine, prefix_mask(n, 2 * CHUNK, n), mask=prefix_mask(n, 2 * CHUNK, n)
            )
            # Completing the prefix makes the whole prompt a hit.
            assert await scene.store(engine) == n
            assert await engine.lookup(scene.tokens) == n
            await scene.retrieve_and_check(
                engine, prefix_mask(n, CHUNK, n), mask=prefix_mask(n, CHUNK, n)
            )
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))


@pytest.mark.anyio
async def test_all_false_mask_stores_and_loads_nothing() -> None:
    n = 2 * CHUNK
    scene = Scene.build("flashinfer", torch.float32, n, seed=71)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            nothing = torch.zeros(n, dtype=torch.bool)
            assert await scene.store(engine, mask=nothing) == 0
            assert engine.stats().pool.used_bytes == 0
            assert await scene.store(engine) == n
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, 0), mask=nothing)


# ---------------------------------------------------------------------------- shared prefixes


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["flash_nhd", "vllm_cpu"])
async def test_shared_prefixes(kind: str) -> None:
    """Two prompts share 2.5 chunks; the shared full chunks are cached once and hit for both."""
    shared = 2 * CHUNK + 8
    n = 4 * CHUNK
    a = Scene.build(kind, torch.float16, n, seed=81)
    b_tokens = a.tokens[:shared] + random_tokens(n - shared, seed=82)
    # b's shared tokens live in the same source slots as a's, so their KV is the same.
    taken = set(a.src_slots.tolist())
    free = [s for s in random_slots(NUM_SLOTS, 84).tolist() if s not in taken]
    b_src = torch.cat([a.src_slots[:shared], torch.tensor(free[: n - shared], dtype=torch.int64)])
    b = Scene(
        kind, a.layout, a.source, new_caches(a.layout, 85), b_tokens, b_src, random_slots(n, 86)
    )
    with anyio.fail_after(TIMEOUT):
        async with open_engine(a.layout) as engine:
            assert await a.store(engine) == n
            chunks_after_a = engine.stats().cached_chunks
            assert chunks_after_a == 4
            assert await engine.lookup(b.tokens) == 2 * CHUNK
            assert await b.store(engine) == n
            # Chunks 0 and 1 are shared; chunks 2 and 3 differ.
            assert engine.stats().cached_chunks == chunks_after_a + 2
            assert await engine.lookup(a.tokens) == n
            assert await engine.lookup(b.tokens) == n
            await a.retrieve_and_check(engine, prefix_mask(n, 0, n))
            await b.retrieve_and_check(engine, prefix_mask(n, 0, n))
            # A third prompt sharing only the first 2.5 chunks loads exactly 2 chunks.
            c = Scene(
                kind,
                a.layout,
                a.source,
                new_caches(a.layout, 87),
                a.tokens[:shared] + random_tokens(n - shared, seed=88),
                a.src_slots,
                random_slots(n, 89),
            )
            await c.retrieve_and_check(engine, prefix_mask(n, 0, 2 * CHUNK))


@pytest.mark.anyio
async def test_namespaces_are_separate() -> None:
    """The same tokens under another model name are a different cache entry."""
    n = 2 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, n, seed=91)
    layout = scene.layout
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(), layout, model_name="model-a") as engine:
            assert await scene.store(engine) == n
            events_a = engine.take_events()
        async with CacheEngine.open(config(), layout, model_name="model-b") as engine:
            assert await scene.store(engine) == n
            events_b = engine.take_events()
        async with CacheEngine.open(config(), layout, model_name="model-a") as engine:
            assert await scene.store(engine) == n
            events_a2 = engine.take_events()
    hashes_a = [h for e in events_a for h in e.block_hashes]
    hashes_b = [h for e in events_b for h in e.block_hashes]
    hashes_a2 = [h for e in events_a2 for h in e.block_hashes]
    assert len(hashes_a) == 2
    assert hashes_a == hashes_a2  # deterministic across engines
    assert not set(hashes_a) & set(hashes_b)


# ---------------------------------------------------------------------------- accounting


async def one_chunk_bytes(engine: CacheEngine, scene: Scene) -> int:
    """Pool bytes one cached full chunk holds (pages included), measured then cleared."""
    assert engine.stats().pool.used_bytes == 0
    stored = await engine.store(
        scene.tokens[:CHUNK], kv_caches=scene.source, slot_mapping=scene.src_slots[:CHUNK]
    )
    assert stored == CHUNK
    used = engine.stats().pool.used_bytes
    assert used >= CHUNK * scene.layout.token_bytes
    assert await engine.clear() == 1
    assert engine.stats().pool.used_bytes == 0
    return used


@pytest.mark.anyio
async def test_clear_returns_every_byte() -> None:
    n = 3 * CHUNK + 1
    scene = Scene.build("flash_nhd", torch.bfloat16, n, seed=101)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await scene.store(engine) == n
            assert await engine.lookup(scene.tokens, lookup_id="x", pin=True) == n
            await engine.lookup_unpin("x")
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))
            stats = engine.stats()
            assert stats.cached_chunks == 4
            assert stats.pool.num_objects == 4
            assert stats.pool.used_bytes > 0
            assert await engine.clear() == 4
            stats = engine.stats()
            assert stats.pool.used_bytes == 0
            assert stats.pool.num_objects == 0
            assert stats.cached_chunks == 0
            assert await engine.lookup(scene.tokens) == 0
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, 0))
            assert await engine.clear() == 0


@pytest.mark.anyio
async def test_stats_count_requests_and_hits() -> None:
    n = 2 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, n, seed=111)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await engine.lookup(scene.tokens) == 0
            await scene.store(engine)
            assert await engine.lookup(scene.tokens) == n
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))
            s = engine.stats()
            assert s.store_requests == 1
            assert s.retrieve_requests == 1
            assert s.lookup_requests == 2
            assert s.lookup_tokens == 2 * n
            assert s.lookup_hit_tokens == n
            assert s.hit_rate == pytest.approx(0.5)
            assert s.partial_stores == 0
            assert s.failed_requests == 0
            assert s.healthy
            assert engine.is_healthy()
            assert not s.frozen
            assert s.hot_cache


# ---------------------------------------------------------------------------- pins


@pytest.mark.anyio
async def test_pin_is_released_by_unpin() -> None:
    n = 3 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, n, seed=121)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            await scene.store(engine)
            assert await engine.lookup(scene.tokens, lookup_id="L1", pin=True) == n
            assert engine.stats().pinned_chunks == 3
            await engine.lookup_unpin("L1")
            assert engine.stats().pinned_chunks == 0
            await engine.lookup_unpin("L1")  # a second unpin is harmless
            await engine.lookup_unpin("never-pinned")
            assert engine.stats().pinned_chunks == 0
            assert await engine.lookup(scene.tokens) == n
            assert await engine.clear() == 3
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_pin_is_released_by_retrieve_with_the_same_lookup_id() -> None:
    n = 2 * CHUNK
    scene = Scene.build("flashinfer", torch.float16, n, seed=131)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            await scene.store(engine)
            assert await engine.lookup(scene.tokens, lookup_id="L2", pin=True) == n
            assert engine.stats().pinned_chunks == 2
            loaded = await engine.retrieve(
                scene.tokens,
                kv_caches=scene.target,
                slot_mapping=scene.dst_slots,
                lookup_id="L2",
            )
            assert loaded.all()
            assert engine.stats().pinned_chunks == 0
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_forgotten_pin_expires_after_pin_timeout() -> None:
    n = 2 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, n, seed=141)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, pin_timeout=0.2) as engine:
            await scene.store(engine)
            assert await engine.lookup(scene.tokens, lookup_id="lost", pin=True) == n
            assert engine.stats().pinned_chunks == 2
            await poll_until(lambda: engine.stats().pinned_chunks == 0)
            assert await engine.clear() == 2
            assert engine.stats().pool.used_bytes == 0


# ---------------------------------------------------------------------------- KV events


@pytest.mark.anyio
async def test_a_clear_of_some_tiers_names_each_chunk_it_removed(tmp_path: Path) -> None:
    n = 2 * CHUNK
    scene = Scene.build("flash_nhd", torch.float16, 4 * CHUNK, seed=152)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            scene.layout, local_disk=str(tmp_path), wait_for_slow_tiers=True
        ) as engine:
            stored = await engine.store(
                scene.tokens[:n], kv_caches=scene.source, slot_mapping=scene.src_slots[:n]
            )
            assert stored == n
            hashes = {h for e in engine.take_events() if e.medium == "cpu" for h in e.block_hashes}
            assert await engine.clear(["cpu"]) == 2
            removed = engine.take_events()
            assert [(e.kind, e.medium) for e in removed] == [("removed", "cpu")]
            assert set(removed[0].block_hashes) == hashes


@pytest.mark.anyio
async def test_store_and_clear_emit_kv_events() -> None:
    n = 2 * CHUNK + 8
    scene = Scene.build("flash_nhd", torch.float16, 4 * CHUNK, seed=151)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert engine.take_events() == []
            first = await engine.store(
                scene.tokens[:n], kv_caches=scene.source, slot_mapping=scene.src_slots[:n]
            )
            assert first == n
            events = engine.take_events()
            assert events, "a store must emit stored events"
            assert all(e.kind == "stored" for e in events)
            assert all(e.medium == "cpu" and e.block_size == CHUNK for e in events)
            hashes = [h for e in events for h in e.block_hashes]
            assert len(hashes) == 3
            assert len(set(hashes)) == 3
            assert all(isinstance(h, bytes) and len(h) >= 8 for h in hashes)
            assert [t for e in events for t in e.token_ids] == scene.tokens[:n]
            assert events[0].parent_block_hash is None
            for prev, nxt in itertools.pairwise(events):
                assert nxt.parent_block_hash == prev.block_hashes[-1]
            assert engine.take_events() == []

            # Storing it again stores nothing new, so nothing is announced.
            await engine.store(
                scene.tokens[:n], kv_caches=scene.source, slot_mapping=scene.src_slots[:n]
            )
            assert engine.take_events() == []

            # Extending the prompt: chunk 2 is now full (a new key), chunk 3 is new.
            await scene.store(engine)
            more = engine.take_events()
            more_hashes = [h for e in more for h in e.block_hashes]
            assert len(more_hashes) == 2
            assert more_hashes[0] != hashes[2]
            assert more[0].parent_block_hash == hashes[1]
            assert [t for e in more for t in e.token_ids] == scene.tokens[2 * CHUNK :]

            assert await engine.clear() == 5  # every tier: one event says all is gone
            assert [e.kind for e in engine.take_events()] == ["cleared"]


@pytest.mark.anyio
async def test_a_stored_event_built_when_taken_holds_the_tokens_and_time_of_the_store() -> None:
    """Stored events are built when taken: they must say what was stored then, however
    the caller's token tensor changed since."""
    scene = Scene.build("flash_nhd", torch.float16, 2 * CHUNK, seed=157)
    tokens = torch.tensor(scene.tokens, dtype=torch.int32)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            before = time.time()
            assert (
                await engine.store(tokens, kv_caches=scene.source, slot_mapping=scene.src_slots)
                == 2 * CHUNK
            )
            after = time.time()
            tokens.fill_(7)  # the serving engine reuses its buffer
            events = engine.take_events()
            assert [t for e in events for t in e.token_ids] == scene.tokens
            assert all(before <= e.ts <= after for e in events)


@pytest.mark.anyio
async def test_kv_events_can_be_disabled() -> None:
    scene = Scene.build("flash_nhd", torch.float16, CHUNK, seed=161)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, enable_kv_events=False) as engine:
            assert await scene.store(engine) == CHUNK
            await engine.clear()
            assert engine.take_events() == []


# ---------------------------------------------------------------------------- freeze / hot cache


@pytest.mark.anyio
async def test_freeze_stops_writes_but_serves_reads() -> None:
    n = 2 * CHUNK
    a = Scene.build("flash_nhd", torch.bfloat16, n, seed=171)
    b = Scene.build("flash_nhd", torch.bfloat16, n, seed=172)
    b.source = a.source
    with anyio.fail_after(TIMEOUT):
        async with open_engine(a.layout) as engine:
            assert await a.store(engine) == n
            used = engine.stats().pool.used_bytes
            engine.take_events()
            engine.freeze(True)
            assert engine.stats().frozen
            assert await b.store(engine) == 0
            assert await engine.lookup(b.tokens) == 0
            assert engine.stats().pool.used_bytes == used
            assert engine.take_events() == []
            assert await engine.lookup(a.tokens) == n
            await a.retrieve_and_check(engine, prefix_mask(n, 0, n))
            engine.freeze(False)
            assert not engine.stats().frozen
            assert await b.store(engine) == n
            await b.retrieve_and_check(engine, prefix_mask(n, 0, n))


@pytest.mark.anyio
async def test_hot_cache_off_keeps_nothing_new() -> None:
    n = 2 * CHUNK
    a = Scene.build("mla", torch.float16, n, seed=181)
    b = Scene.build("mla", torch.float16, n, seed=182)
    b.source = a.source
    with anyio.fail_after(TIMEOUT):
        async with open_engine(a.layout) as engine:
            assert await a.store(engine) == n
            engine.set_hot_cache(False)
            assert not engine.stats().hot_cache
            assert await b.store(engine) == 0
            assert await engine.lookup(b.tokens) == 0
            await b.retrieve_and_check(engine, prefix_mask(n, 0, 0))
            engine.set_hot_cache(True)
            assert engine.stats().hot_cache
            assert await b.store(engine) == n
            await b.retrieve_and_check(engine, prefix_mask(n, 0, n))


@pytest.mark.anyio
async def test_local_cpu_off_in_config_keeps_nothing() -> None:
    scene = Scene.build("flash_nhd", torch.float16, CHUNK, seed=191)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout, local_cpu=False) as engine:
            assert not engine.stats().hot_cache
            assert await scene.store(engine) == 0
            assert await engine.lookup(scene.tokens) == 0


# ---------------------------------------------------------------------------- bad input

BadCall = Callable[[CacheEngine, Scene], Coroutine[Any, Any, object]]


def _store(**changes: Any) -> BadCall:
    async def call(engine: CacheEngine, s: Scene) -> object:
        args: dict[str, Any] = {
            "kv_caches": s.source,
            "slot_mapping": s.src_slots,
            "mask": None,
        }
        args.update(changes)
        tokens = args.pop("tokens", s.tokens)
        return await engine.store(tokens, **args)

    return call


def _retrieve(**changes: Any) -> BadCall:
    async def call(engine: CacheEngine, s: Scene) -> object:
        args: dict[str, Any] = {
            "kv_caches": s.target,
            "slot_mapping": s.dst_slots,
            "mask": None,
        }
        args.update(changes)
        tokens = args.pop("tokens", s.tokens)
        return await engine.retrieve(tokens, **args)

    return call


N_BAD = 3 * CHUNK
_fp16 = make_layout("flash_nhd", torch.float16)
_fp32 = make_layout("flash_nhd", torch.float32)
_other_heads = KVLayout.vllm_flash_attn(
    num_layers=NUM_LAYERS, block_size=BLOCK_SIZE, num_kv_heads=3, head_size=HEAD_SIZE,
    dtype=torch.float16,
)  # fmt: skip
_bool_mask = prefix_mask(N_BAD, 0, N_BAD)

BAD_CALLS: dict[str, BadCall] = {
    "store-wrong-dtype": _store(kv_caches=_fp32.allocate_kv_caches(NUM_BLOCKS)),
    "store-wrong-shape": _store(kv_caches=_other_heads.allocate_kv_caches(NUM_BLOCKS)),
    "store-too-few-layers": _store(kv_caches=_fp16.allocate_kv_caches(NUM_BLOCKS)[:1]),
    "store-too-many-layers": _store(kv_caches=_fp16.allocate_kv_caches(NUM_BLOCKS) * 2),
    "store-layers-of-different-blocks": _store(
        kv_caches=[_fp16.allocate_kv_caches(NUM_BLOCKS)[0], _fp16.allocate_kv_caches(2)[0]]
    ),
    "store-short-slot-mapping": _store(slot_mapping=torch.arange(N_BAD - 1)),
    "store-long-slot-mapping": _store(slot_mapping=torch.arange(N_BAD + 1)),
    "store-slot-out-of-range": _store(slot_mapping=torch.arange(N_BAD) + NUM_SLOTS - 5),
    "store-float-slots": _store(slot_mapping=torch.arange(N_BAD, dtype=torch.float32)),
    "store-2d-slots": _store(slot_mapping=torch.arange(N_BAD).view(1, N_BAD)),
    "store-mask-wrong-length": _store(mask=prefix_mask(N_BAD - 1, 0, N_BAD - 1)),
    "store-mask-not-bool": _store(mask=torch.ones(N_BAD, dtype=torch.int64)),
    "store-mask-true-then-false": _store(mask=prefix_mask(N_BAD, 0, CHUNK)),
    "store-mask-holes": _store(
        mask=torch.tensor([i < CHUNK or i >= 2 * CHUNK for i in range(N_BAD)])
    ),
    "store-mask-unaligned-start": _store(mask=prefix_mask(N_BAD, 5, N_BAD)),
    "store-hashes-without-offsets": _store(tokens=None, hashes=[1, 2, 3]),
    "store-tokens-and-hashes": _store(hashes=[1, 2, 3], offsets=[CHUNK, 2 * CHUNK, 3 * CHUNK]),
    "store-hashes-and-offsets-differ": _store(tokens=None, hashes=[1, 2, 3], offsets=[CHUNK]),
    "store-hash-block-not-chunk-sized": _store(
        tokens=None, hashes=[1, 2, 3], offsets=[CHUNK, 2 * CHUNK - 1, N_BAD]
    ),
    "store-hash-offsets-short-of-slots": _store(
        tokens=None, hashes=[1, 2], offsets=[CHUNK, 2 * CHUNK]
    ),
    "store-tokens-with-offsets": _store(offsets=[CHUNK, 2 * CHUNK, 3 * CHUNK]),
    "store-2d-tokens": _store(tokens=torch.zeros(1, N_BAD, dtype=torch.int64)),
    "store-float-tokens": _store(tokens=torch.zeros(N_BAD, dtype=torch.float32)),
    "retrieve-wrong-dtype": _retrieve(kv_caches=_fp32.allocate_kv_caches(NUM_BLOCKS)),
    "retrieve-too-few-layers": _retrieve(kv_caches=_fp16.allocate_kv_caches(NUM_BLOCKS)[:1]),
    "retrieve-short-slot-mapping": _retrieve(slot_mapping=torch.arange(N_BAD - 1)),
    "retrieve-slot-out-of-range": _retrieve(slot_mapping=torch.arange(N_BAD) + NUM_SLOTS - 5),
    "retrieve-mask-unaligned-start": _retrieve(mask=prefix_mask(N_BAD, 3, N_BAD)),
    "retrieve-mask-not-bool": _retrieve(mask=torch.ones(N_BAD, dtype=torch.int64)),
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(BAD_CALLS))
async def test_bad_input_raises_and_changes_nothing(name: str) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N_BAD, seed=201)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            if name.startswith("retrieve"):
                assert await scene.store(engine) == N_BAD
                engine.take_events()
            before = engine.stats()
            target_before = clone_caches(scene.target)
            with pytest.raises(InvalidInputError) as info:
                await BAD_CALLS[name](engine, scene)
            assert isinstance(info.value, ValueError)
            assert str(info.value), "the error must say what is wrong"
            after = engine.stats()
            assert after.stored_tokens == before.stored_tokens
            assert after.cached_chunks == before.cached_chunks
            assert after.pool.used_bytes == before.pool.used_bytes
            assert after.pool.num_objects == before.pool.num_objects
            assert after.pinned_chunks == 0
            assert engine.take_events() == []
            assert_same_caches(scene.kind, scene.target, target_before)
            if name.startswith("store"):
                assert await engine.lookup(scene.tokens) == 0
                assert after.pool.used_bytes == 0
            # The engine still works after refusing the call.
            assert await scene.store(engine) == N_BAD


@pytest.mark.anyio
async def test_bad_lookup_input_raises() -> None:
    layout = make_layout("flash_nhd", torch.float16)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(layout) as engine:
            with pytest.raises(InvalidInputError):
                await engine.lookup(torch.zeros(2, 8, dtype=torch.int64))
            with pytest.raises(InvalidInputError):
                await engine.lookup([1, 2, 3], pin=True)  # a pin needs a lookup id


@pytest.mark.parametrize(
    "field, value",
    [
        ("chunk_size", -16),
        ("chunk_size", 0),
        ("max_local_cpu_size", -1.0),
        ("pin_timeout", -1.0),
        ("allocation_timeout", -0.5),
        ("pipeline_queue_size", -1),
        ("pipeline_batch_chunks", 0),
        ("max_kv_events", -3),
    ],
)
def test_negative_config_sizes_raise_config_error(field: str, value: float) -> None:
    bad: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as info:
        EngineConfig(**bad)
    assert info.value.field == field
    assert isinstance(info.value, InvalidInputError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(environ={}, **bad)
    assert info.value.field == field


# ---------------------------------------------------------------------------- cancellation


async def poll_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait, bounded by ``timeout``, until ``condition()`` holds (checked every 5 ms)."""
    with anyio.fail_after(timeout):
        while True:
            if condition():
                return
            await anyio.sleep(0.005)


async def wait_until_settled(engine: CacheEngine, chunk_bytes: int, timeout: float = 10) -> None:
    """Wait (bounded) until the pool holds exactly the cached chunks and nothing else."""

    def settled() -> bool:
        s = engine.stats()
        return (
            s.pool.num_objects == s.cached_chunks
            and s.pool.used_bytes == s.cached_chunks * chunk_bytes
            and s.pool.waiters == 0
        )

    try:
        await poll_until(settled, timeout=timeout)
    except TimeoutError:
        s = engine.stats()
        raise AssertionError(
            f"pool never settled: {s.pool}, cached_chunks={s.cached_chunks}, "
            f"pinned_chunks={s.pinned_chunks}"
        ) from None


@pytest.mark.anyio
async def test_cancelled_store_returns_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store cancelled while its batches are spread over the pipeline (one committed,
    later ones reserved and copied) leaves the pool holding exactly the cached chunks, and
    what it cached is whole."""
    layout = make_layout("flash_nhd", torch.float32)
    n_chunks = 96
    n = n_chunks * CHUNK
    gen = torch.Generator().manual_seed(211)
    source = layout.allocate_kv_caches(n // BLOCK_SIZE, generator=gen)
    tokens = random_tokens(n, 212)
    slots = torch.randperm(n, generator=gen)
    probe = Scene.build("flash_nhd", torch.float32, CHUNK, seed=213)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            layout,
            max_local_cpu_size=0.05,
            pipeline_queue_size=1,
            pipeline_batch_chunks=1,
            inline_copy_bytes=0,
            inline_hash_tokens=0,
        ) as engine:
            chunk_bytes = await one_chunk_bytes(engine, probe)
            finished: list[int] = []
            # The commit stage holds after its first batch, so the batches behind it stay
            # reserved (and copied) in the pipeline while the caller is cancelled.
            committed, go_on = anyio.Event(), anyio.Event()
            real_commit = StoreCore.commit

            async def held_commit(core: StoreCore, *args: Any) -> int:
                kept = await real_commit(core, *args)
                committed.set()
                await go_on.wait()
                return kept

            monkeypatch.setattr(StoreCore, "commit", held_commit)

            caller = anyio.CancelScope()

            async def big_store() -> None:
                with caller:
                    stored = await engine.store(tokens, kv_caches=source, slot_mapping=slots)
                    finished.append(stored)

            async with anyio.create_task_group() as tg:
                tg.start_soon(big_store)
                await committed.wait()
                await anyio.wait_all_tasks_blocked()  # the stages behind the commit are full
                in_flight = engine.stats().pool.used_bytes // chunk_bytes - 1
                assert in_flight >= 3, in_flight
                caller.cancel()
                # The cancelled caller waits for its batches (their copies read its KV).
                await anyio.wait_all_tasks_blocked()
                go_on.set()
            assert caller.cancelled_caught and not finished
            monkeypatch.undo()

            await wait_until_settled(engine, chunk_bytes)
            cached = engine.stats().cached_chunks
            assert cached < n_chunks
            assert await engine.lookup(tokens) == cached * CHUNK
            # What was cached is correct and complete: a fresh store tops it up exactly.
            assert await engine.store(tokens, kv_caches=source, slot_mapping=slots) == n
            assert engine.stats().pool.used_bytes == n_chunks * chunk_bytes
            assert await engine.clear() == n_chunks
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_store_cancelled_while_waiting_for_memory_returns_it() -> None:
    """A store blocked on a full pool of pinned chunks is cancelled; nothing of it remains."""
    layout = make_layout("flash_nhd", torch.float32)
    probe = Scene.build("flash_nhd", torch.float32, CHUNK, seed=221)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(layout, allocation_timeout=30.0) as engine:
            chunk_bytes = await one_chunk_bytes(engine, probe)
        size_gb = (6 * chunk_bytes + chunk_bytes // 2) / 1024**3
        async with open_engine(
            layout, max_local_cpu_size=size_gb, allocation_timeout=30.0
        ) as engine:
            capacity_chunks = engine.stats().pool.capacity_bytes // chunk_bytes
            assert capacity_chunks >= 2
            a = Scene.build("flash_nhd", torch.float32, capacity_chunks * CHUNK, seed=222)
            assert await a.store(engine) == capacity_chunks * CHUNK
            assert await engine.lookup(a.tokens, lookup_id="hold", pin=True) == len(a.tokens)
            used = engine.stats().pool.used_bytes
            assert used == capacity_chunks * chunk_bytes
            b = Scene.build("flash_nhd", torch.float32, 4 * CHUNK, seed=223)
            b.source = a.source
            finished: list[int] = []

            async def blocked_store() -> None:
                finished.append(await b.store(engine))

            async with anyio.create_task_group() as tg:
                tg.start_soon(blocked_store)
                await poll_until(lambda: engine.stats().pool.waiters > 0)
                tg.cancel_scope.cancel()
            assert not finished
            try:
                # Well within allocation_timeout: the cancelled request's wait must end now.
                await wait_until_settled(engine, chunk_bytes, timeout=3)
                assert engine.stats().pool.used_bytes == used
                assert await engine.lookup(b.tokens) == 0
                assert await engine.lookup(a.tokens) == len(a.tokens)
            finally:
                await engine.lookup_unpin("hold")
            assert engine.stats().pinned_chunks == 0
            # With the pin gone the pool can make room again.
            assert await b.store(engine) == len(b.tokens)
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
@pytest.mark.parametrize("checkpoints", [0, 1, 3, 10, 30])
async def test_cancelled_retrieve_releases_its_references(checkpoints: int) -> None:
    layout = make_layout("flash_nhd", torch.float32)
    n = 20 * CHUNK
    scene = Scene.build("flash_nhd", torch.float32, n, seed=231)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            layout, pipeline_queue_size=1, pipeline_batch_chunks=1, inline_copy_bytes=0
        ) as engine:
            assert await scene.store(engine) == n
            used = engine.stats().pool.used_bytes
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def retrieve() -> None:
                        await engine.retrieve(
                            scene.tokens,
                            kv_caches=scene.target,
                            slot_mapping=scene.dst_slots,
                            lookup_id="r",
                        )

                    tg.start_soon(retrieve)
                    for _ in range(checkpoints):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
            await poll_until(lambda: engine.stats().pool.used_bytes == used)
            # The cache is intact and a full retrieve still works bit for bit.
            assert await engine.lookup(scene.tokens) == n
            scene.target = new_caches(layout, 232)
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))
            assert await engine.clear() == 20
            await poll_until(lambda: engine.stats().pool.used_bytes == 0)
            assert engine.stats().pool.num_objects == 0


# ---------------------------------------------------------------------------- shutdown


def _engine_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive, except anyio's worker pool.

    anyio keeps its idle worker threads for reuse by any caller of ``to_thread`` until the
    event loop closes; they belong to the loop, not to the engine.
    """
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.is_alive() and not t.name.startswith("AnyIO worker thread")
    ]


@pytest.mark.anyio
async def test_aclose_stops_every_task_and_thread() -> None:
    n = 8 * CHUNK
    scene = Scene.build("flash_nhd", torch.float32, n, seed=241)
    threads_before = set(threading.enumerate())
    tasks_before = asyncio.all_tasks()
    with anyio.fail_after(TIMEOUT):
        engine_cm = CacheEngine.open(
            config(inline_copy_bytes=0, inline_hash_tokens=0, pin_timeout=0.5),
            scene.layout,
            model_name="m",
        )
        async with engine_cm as engine:
            assert await scene.store(engine) == n
            assert await engine.lookup(scene.tokens, lookup_id="p", pin=True) == n
            await scene.retrieve_and_check(engine, prefix_mask(n, 0, n))
            # inline_copy_bytes=0 sends every copy to the copy threads: they must exist now
            assert any(t.name.startswith("lmcache-copy") for t in _engine_threads(threads_before))
        left_tasks = asyncio.all_tasks() - tasks_before
        assert not left_tasks, f"tasks outlived the engine: {left_tasks}"
        left_threads = _engine_threads(threads_before)
        assert not left_threads, f"threads outlived the engine: {left_threads}"


@pytest.mark.anyio
async def test_every_method_raises_after_close() -> None:
    scene = Scene.build("flash_nhd", torch.float16, CHUNK, seed=251)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            await scene.store(engine)
        with pytest.raises(EngineClosedError):
            await scene.store(engine)
        with pytest.raises(EngineClosedError):
            await engine.lookup(scene.tokens)
        with pytest.raises(EngineClosedError):
            await engine.retrieve(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots
            )
        with pytest.raises(EngineClosedError):
            await engine.lookup_unpin("x")
        with pytest.raises(EngineClosedError):
            await engine.clear()
        with pytest.raises(EngineClosedError):
            engine.freeze(True)
        with pytest.raises(EngineClosedError):
            engine.set_hot_cache(False)
        assert not engine.is_healthy()
        await engine.aclose()  # closing twice is harmless


@pytest.mark.anyio
async def test_aclose_inside_the_block() -> None:
    """``await engine.aclose()`` inside the block stops the engine and nothing else: the
    caller's own code after it keeps running (it is not cancelled with the engine's tasks).
    """
    scene = Scene.build("flash_nhd", torch.float16, CHUNK, seed=261)
    threads_before = set(threading.enumerate())
    tasks_before = asyncio.all_tasks()
    reached: list[str] = []
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            assert await scene.store(engine) == CHUNK
            await engine.aclose()
            assert not engine.is_healthy()
            with pytest.raises(EngineClosedError):
                await engine.lookup(scene.tokens)
            await anyio.lowlevel.checkpoint()
            reached.append("after-checkpoint")
            await anyio.sleep(0.01)
            reached.append("after-sleep")
            assert not asyncio.all_tasks() - tasks_before
            assert not _engine_threads(threads_before)
    assert reached == ["after-checkpoint", "after-sleep"]
    assert not asyncio.all_tasks() - tasks_before
