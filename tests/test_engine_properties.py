"""Property-based tests of CacheEngine against a plain model of what is cached.

The model: a chunk is identified by the whole token prefix up to its end (the keys are
prefix-chained), a store adds the chunks from its mask start on (the short last one only
with ``save_unfull_chunk``), a lookup is the longest run of cached chunks from token 0 and
a retrieve the longest run from its mask start. KV bytes are a function of the token prefix
(every distinct prefix owns one slot of a shared source cache), so whichever store put a
chunk, the bytes a retrieve loads are known exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_async import CacheEngine, EngineConfig, KVLayout

BLOCK_SIZE = 16
NUM_BLOCKS = 48
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
MAX_EXTRA = 24
MAX_PROMPTS = 5
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}

SETTINGS = settings(
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def make_layout(kind: str) -> KVLayout:
    if kind == "mla":
        return KVLayout.mla(
            num_layers=2, block_size=BLOCK_SIZE, latent_dim=16, dtype=torch.bfloat16
        )
    return KVLayout.vllm_flash_attn(
        num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16
    )


def token_view(kind: str, layer: torch.Tensor, slot: int) -> torch.Tensor:
    block, offset = divmod(slot, BLOCK_SIZE)
    return layer[block, offset] if kind == "mla" else layer[:, block, offset]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF[t.dtype])


@dataclass
class Scenario:
    kind: str
    chunk_size: int
    save_unfull: bool
    prompts: list[list[int]]
    stores: list[tuple[int, int]]
    """(prompt index, mask start in chunks, clipped to the prompt)."""
    queries: list[tuple[int, int, int]]
    """(prompt index, length kept, mask start in chunks, clipped)."""


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    kind = draw(st.sampled_from(["flash_nhd", "mla"]))
    chunk_size = draw(st.sampled_from([4, 8, 16]))
    save_unfull = draw(st.booleans())
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, MAX_PROMPTS))):
        base: list[int] = []
        share = draw(st.booleans())
        if prompts and share:
            parent = draw(st.sampled_from(prompts))
            base = parent[: draw(st.integers(0, len(parent)))]
        # A tiny vocabulary makes unrelated prompts share prefixes too.
        extra = draw(st.lists(st.integers(0, 3), min_size=0 if base else 1, max_size=MAX_EXTRA))
        prompts.append(base + extra)
    count = len(prompts)
    stores = draw(
        st.lists(st.tuples(st.integers(0, count - 1), st.integers(0, 3)), min_size=1, max_size=6)
    )
    queries = draw(
        st.lists(
            st.tuples(st.integers(0, count - 1), st.integers(1, 10_000), st.integers(0, 3)),
            min_size=1,
            max_size=6,
        )
    )
    return Scenario(kind, chunk_size, save_unfull, prompts, stores, queries)


@dataclass
class Model:
    chunk_size: int
    save_unfull: bool
    cached: set[tuple[int, ...]] = field(default_factory=set)

    def spans(self, tokens: list[int], start: int) -> list[tuple[int, int]]:
        n = len(tokens)
        return [(s, min(s + self.chunk_size, n)) for s in range(start, n, self.chunk_size)]

    def store(self, tokens: list[int], start: int) -> int:
        end = start
        for s, e in self.spans(tokens, start):
            if e - s < self.chunk_size and not self.save_unfull:
                break
            self.cached.add(tuple(tokens[:e]))
            end = e
        return end - start

    def run(self, tokens: list[int], start: int) -> int:
        """End of the run of cached chunks from ``start``."""
        end = start
        for _, e in self.spans(tokens, start):
            if tuple(tokens[:e]) not in self.cached:
                break
            end = e
        return end


class World:
    """Every distinct token prefix owns one slot of the source cache."""

    def __init__(self, seed: int) -> None:
        self._free = list(range(NUM_SLOTS))
        random.Random(seed).shuffle(self._free)
        self._slot: dict[tuple[int, ...], int] = {}

    def slots(self, tokens: list[int]) -> torch.Tensor:
        out = []
        for i in range(len(tokens)):
            key = tuple(tokens[: i + 1])
            if key not in self._slot:
                self._slot[key] = self._free.pop()
            out.append(self._slot[key])
        return torch.tensor(out, dtype=torch.int64)


def clip_start(chunks: int, n: int, chunk_size: int) -> int:
    """A mask start of ``chunks`` chunks, kept below ``n`` so the mask has a True."""
    return min(chunks * chunk_size, (n - 1) // chunk_size * chunk_size)


def mask_from(n: int, start: int) -> torch.Tensor | None:
    if start == 0:
        return None
    mask = torch.zeros(n, dtype=torch.bool)
    mask[start:] = True
    return mask


@pytest.mark.anyio
@SETTINGS
@given(scenario=scenarios(), seed=st.integers(0, 2**16))
async def test_engine_matches_the_model(scenario: Scenario, seed: int) -> None:
    layout = make_layout(scenario.kind)
    gen = torch.Generator().manual_seed(seed)
    source = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)
    target = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)
    world = World(seed)
    model = Model(scenario.chunk_size, scenario.save_unfull)
    config = EngineConfig(
        chunk_size=scenario.chunk_size,
        save_unfull_chunk=scenario.save_unfull,
        max_local_cpu_size=0.05,
    )
    with anyio.fail_after(20):
        async with CacheEngine.open(config, layout, model_name="prop") as engine:
            for index, start_chunks in scenario.stores:
                tokens = scenario.prompts[index]
                start = clip_start(start_chunks, len(tokens), scenario.chunk_size)
                expected = model.store(tokens, start)
                got = await engine.store(
                    tokens,
                    kv_caches=source,
                    slot_mapping=world.slots(tokens),
                    mask=mask_from(len(tokens), start),
                )
                assert got == expected, (tokens, start)
                assert engine.stats().cached_chunks == len(model.cached)

            for tokens in scenario.prompts:
                assert await engine.lookup(tokens) == model.run(tokens, 0), tokens

            for index, keep, start_chunks in scenario.queries:
                tokens = scenario.prompts[index][:keep]
                n = len(tokens)
                start = clip_start(start_chunks, n, scenario.chunk_size)
                assert await engine.lookup(tokens) == model.run(tokens, 0)
                src_slots = world.slots(tokens)
                dst_slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
                before = [t.clone() for t in target]
                loaded = await engine.retrieve(
                    tokens,
                    kv_caches=target,
                    slot_mapping=dst_slots,
                    mask=mask_from(n, start),
                )
                end = model.run(tokens, start)
                want_mask = [start <= i < end for i in range(n)]
                assert loaded.tolist() == want_mask, (tokens, start)
                for i in range(start, end):
                    for exp, src in zip(before, source, strict=True):
                        token_view(scenario.kind, exp, int(dst_slots[i])).copy_(
                            token_view(scenario.kind, src, int(src_slots[i]))
                        )
                for got_layer, want_layer in zip(target, before, strict=True):
                    assert torch.equal(bits(got_layer), bits(want_layer))

            stats = engine.stats()
            assert stats.pinned_chunks == 0
            assert stats.pool.num_objects == len(model.cached)
            assert await engine.clear() == len(model.cached)
            assert engine.stats().pool.used_bytes == 0
            for tokens in scenario.prompts:
                assert await engine.lookup(tokens) == 0


@pytest.mark.anyio
@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    ops=st.lists(
        st.tuples(st.sampled_from(["pin", "unpin", "retrieve", "store"]), st.integers(0, 3)),
        max_size=12,
    ),
)
async def test_pins_never_outlive_their_lookup_id(
    lengths: list[int], ops: list[tuple[str, int]]
) -> None:
    """Any mix of pinned lookups, unpins, retrieves and stores leaves no pin behind once
    every lookup id is released, and clear() then returns every byte."""
    layout = make_layout("flash_nhd")
    gen = torch.Generator().manual_seed(len(lengths))
    source = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)
    target = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)
    prompts = [[p, *range(n - 1)] for p, n in enumerate(lengths)]
    world = World(0)
    config = EngineConfig(chunk_size=8, max_local_cpu_size=0.05)
    with anyio.fail_after(20):
        async with CacheEngine.open(config, layout, model_name="pins") as engine:
            for tokens in prompts[::2]:
                await engine.store(tokens, kv_caches=source, slot_mapping=world.slots(tokens))
            ids: set[str] = set()
            for op, k in ops:
                tokens = prompts[k % len(prompts)]
                lookup_id = f"id{k}"
                if op == "pin":
                    await engine.lookup(tokens, lookup_id=lookup_id, pin=True)
                    ids.add(lookup_id)
                elif op == "unpin":
                    await engine.lookup_unpin(lookup_id)
                    ids.discard(lookup_id)
                elif op == "retrieve":
                    await engine.retrieve(
                        tokens,
                        kv_caches=target,
                        slot_mapping=torch.randperm(NUM_SLOTS, generator=gen)[: len(tokens)],
                        lookup_id=lookup_id,
                    )
                    ids.discard(lookup_id)
                else:
                    await engine.store(tokens, kv_caches=source, slot_mapping=world.slots(tokens))
            for lookup_id in sorted(ids):
                await engine.lookup_unpin(lookup_id)
            stats = engine.stats()
            assert stats.pinned_chunks == 0
            assert stats.pool.pinned_objects == 0
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0
