"""The transformers helpers: DynamicCache <-> paged copies, store and retrieve through a real
engine, and prefill from a cached prefix with a small random-weight Llama (bit-exact logits
in float32 with eager attention)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.errors import InvalidInputError
from lmcache_async.integrations.transformers import (
    dynamic_cache_to_paged,
    kv_layout_for,
    paged_to_dynamic_cache,
    prefill,
    retrieve_dynamic_cache,
    store_dynamic_cache,
)

CHUNK = 32
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
VOCAB = 256


def tiny_config(**overrides: Any) -> LlamaConfig:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HEADS * HEAD_DIM,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 1024,
        "attn_implementation": "eager",
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    built = LlamaForCausalLM(tiny_config())  # type: ignore[no-untyped-call]
    built.eval()  # type: ignore[no-untyped-call]
    return built


@pytest.fixture
def layout() -> KVLayout:
    return kv_layout_for(tiny_config(), torch.float32, block_size=8)


@pytest.fixture
async def engine(layout: KVLayout) -> AsyncIterator[CacheEngine]:
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.05)
    async with CacheEngine.open(config, layout, model_name="tiny-llama") as opened:
        yield opened


def random_cache(num_tokens: int, seed: int = 0) -> DynamicCache:
    gen = torch.Generator().manual_seed(seed)
    data = [
        (
            torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM, generator=gen),
            torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM, generator=gen),
        )
        for _ in range(LAYERS)
    ]
    return DynamicCache(ddp_cache_data=data)


def kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer of a cache."""
    keys, values = cache.layers[layer].keys, cache.layers[layer].values  # type: ignore[union-attr]
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    return keys, values


def tokens_of(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int64)


def test_layout_follows_the_model_config() -> None:
    layout = kv_layout_for(tiny_config(), torch.bfloat16, block_size=4)
    assert layout == KVLayout.vllm_flash_attn(
        num_layers=LAYERS,
        block_size=4,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_DIM,
        dtype=torch.bfloat16,
        hnd=True,
    )
    # Without head_dim and kv heads: hidden // heads, and as many kv heads as heads.
    plain = kv_layout_for(
        tiny_config(num_key_value_heads=None, head_dim=None), torch.float32, block_size=4
    )
    assert (plain.num_kv_heads, plain.head_size) == (HEADS, HEAD_DIM)


def test_layout_refuses_sliding_window_layers() -> None:
    config = tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=64)
    with pytest.raises(InvalidInputError, match="sliding_attention"):
        kv_layout_for(config, torch.float32)


def test_paged_round_trip_is_exact(layout: KVLayout) -> None:
    cache = random_cache(29)  # 3 full blocks of 8 and 5 tokens in a fourth
    kv_caches, slots = dynamic_cache_to_paged(cache, layout)
    assert [tuple(t.shape) for t in kv_caches] == [layout.kv_cache_shape(4)] * LAYERS
    assert torch.equal(slots, torch.arange(29))
    # Token 13 of layer 1 sits in block 1 at offset 5, K at index 0 and V at index 1.
    keys, values = kv(cache, 1)
    assert torch.equal(kv_caches[1][0, 1, 5], keys[0, :, 13])
    assert torch.equal(kv_caches[1][1, 1, 5], values[0, :, 13])

    back = paged_to_dynamic_cache(kv_caches, layout, 20)
    for layer in range(LAYERS):
        (keys, values), (got_keys, got_values) = kv(cache, layer), kv(back, layer)
        assert torch.equal(got_keys, keys[:, :, :20])
        assert torch.equal(got_values, values[:, :, :20])


def test_paged_copy_checks_the_cache_against_the_layout(layout: KVLayout) -> None:
    with pytest.raises(InvalidInputError, match="batch size 1"):
        dynamic_cache_to_paged(
            DynamicCache(ddp_cache_data=[(torch.zeros(2, KV_HEADS, 4, HEAD_DIM),) * 2] * LAYERS),
            layout,
        )
    with pytest.raises(InvalidInputError, match="1 layers"):
        dynamic_cache_to_paged(
            DynamicCache(ddp_cache_data=[(torch.zeros(1, 2, 4, 16),) * 2]), layout
        )
    half = DynamicCache(
        ddp_cache_data=[(torch.zeros(1, KV_HEADS, 4, HEAD_DIM, dtype=torch.float16),) * 2] * 2
    )
    with pytest.raises(InvalidInputError, match="float16"):
        dynamic_cache_to_paged(half, layout)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        dynamic_cache_to_paged(random_cache(4), layout, 5)


@pytest.mark.anyio
async def test_store_then_retrieve_gives_the_whole_chunks_back(
    engine: CacheEngine, layout: KVLayout
) -> None:
    tokens = tokens_of(3 * CHUNK + 10)
    cache = random_cache(3 * CHUNK + 10, seed=1)
    with anyio.fail_after(30):
        stored = await store_dynamic_cache(engine, tokens, cache, layout)
        assert stored >= 3 * CHUNK
        # A new request sharing the first 2.5 chunks: the two whole chunks come back.
        other = torch.cat([tokens[: 2 * CHUNK + 16], tokens_of(40, seed=9)])
        got, n = await retrieve_dynamic_cache(engine, other, layout)
    assert n == 2 * CHUNK
    assert got is not None
    assert got.get_seq_length() == 2 * CHUNK
    for layer in range(LAYERS):
        (keys, values), (got_keys, got_values) = kv(cache, layer), kv(got, layer)
        assert torch.equal(got_keys, keys[:, :, : 2 * CHUNK])
        assert torch.equal(got_values, values[:, :, : 2 * CHUNK])


class StallingRetrieve:
    """The engine, whose retrieve waits until cancelled."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine
        self.retrieving = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def retrieve(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.retrieving.set()
        await anyio.sleep_forever()
        raise AssertionError("not reached")


@pytest.mark.anyio
async def test_a_retrieve_cancelled_after_its_lookup_leaves_nothing_pinned(
    engine: CacheEngine, layout: KVLayout
) -> None:
    tokens = tokens_of(2 * CHUNK, seed=7)
    stalling = StallingRetrieve(engine)
    with anyio.fail_after(30):
        await store_dynamic_cache(engine, tokens, random_cache(2 * CHUNK, seed=7), layout)
        async with anyio.create_task_group() as group:
            group.start_soon(retrieve_dynamic_cache, stalling, tokens, layout)
            await stalling.retrieving.wait()
            assert engine.stats().pinned_chunks == 2  # the lookup pinned the hit
            group.cancel_scope.cancel()
    stats = engine.stats()
    assert (stats.pinned_chunks, stats.active_lookup_ids) == (0, 0)


@pytest.mark.anyio
async def test_retrieve_misses_and_limits(engine: CacheEngine, layout: KVLayout) -> None:
    with anyio.fail_after(30):
        assert await retrieve_dynamic_cache(engine, tokens_of(100, seed=5), layout) == (None, 0)
        tokens = tokens_of(2 * CHUNK, seed=6)
        await store_dynamic_cache(engine, tokens, random_cache(2 * CHUNK, seed=6), layout)
        got, n = await retrieve_dynamic_cache(engine, tokens, layout, max_tokens=CHUNK + 3)
        assert n == CHUNK + 3
        assert got is not None and got.get_seq_length() == CHUNK + 3
        assert await retrieve_dynamic_cache(engine, tokens, layout, max_tokens=0) == (None, 0)
    with pytest.raises(InvalidInputError, match="max_tokens"):
        await retrieve_dynamic_cache(engine, tokens, layout, max_tokens=-1)


@pytest.mark.anyio
async def test_prefill_from_a_cached_prefix_matches_a_full_prefill(
    model: LlamaForCausalLM, engine: CacheEngine, layout: KVLayout
) -> None:
    prefix = tokens_of(3 * CHUNK + 7, seed=2)
    first = torch.cat([prefix, tokens_of(20, seed=3)])
    second = torch.cat([prefix, tokens_of(12, seed=4)])
    with anyio.fail_after(60):
        cold = await prefill(model, first, engine, layout)
        warm = await prefill(model, second.unsqueeze(0), engine, layout, store=False)
    assert cold.reused_tokens == 0
    assert cold.stored_tokens == first.numel()  # save_unfull_chunk: the short chunk too
    assert cold.logits.shape == (1, first.numel(), VOCAB)
    assert warm.reused_tokens == 3 * CHUNK
    assert warm.stored_tokens == 0
    assert warm.past_key_values.get_seq_length() == second.numel()
    with torch.inference_mode():
        full = model(input_ids=second.unsqueeze(0), use_cache=False).logits
    assert warm.logits.shape == (1, second.numel() - 3 * CHUNK, VOCAB)
    assert torch.equal(warm.logits, full[:, 3 * CHUNK :])


@pytest.mark.anyio
async def test_prefill_of_a_fully_cached_prompt_still_computes_the_last_token(
    model: LlamaForCausalLM, engine: CacheEngine, layout: KVLayout
) -> None:
    prompt = tokens_of(2 * CHUNK, seed=8)
    with anyio.fail_after(60):
        await prefill(model, prompt, engine, layout)
        again = await prefill(model, prompt, engine, layout)
    assert again.reused_tokens == 2 * CHUNK - 1
    # The reference runs the last token alone on the model's own cache of the rest: a
    # one-row matmul takes other BLAS kernels than a long prefill (last bits differ), so
    # that is the computation the reused prefix must reproduce exactly.
    with torch.inference_mode():
        own = model(input_ids=prompt[None, :-1], use_cache=True).past_key_values
        ref = model(input_ids=prompt[None, -1:], past_key_values=own, use_cache=True).logits
    assert torch.equal(again.logits, ref)


@pytest.mark.anyio
async def test_prefill_rejects_a_batch(
    model: LlamaForCausalLM, engine: CacheEngine, layout: KVLayout
) -> None:
    with pytest.raises(InvalidInputError, match="input_ids"):
        await prefill(model, torch.zeros(2, 8, dtype=torch.int64), engine, layout)
