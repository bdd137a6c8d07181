"""Tests for the C extensions (``lmcache_async.keys._native``, ``lmcache_async.transfer._rows``):
the blake3 key chain in C gives the blake3 package's keys, the CPU tier's prefix walk in C
does what its Python fallback does, and the row copies of transfer plans run from several
threads at once and let other threads run meanwhile (their bytes:
tests/transfer/test_native.py)."""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.backends import lru
from lmcache_async.keys import hashing
from lmcache_async.keys.chunks import (
    DIGEST_SIZE,
    LINK_SIZE,
    NATIVE_CHAIN,
    ChunkHasher,
    ChunkKey,
    HashAlgorithm,
    Namespace,
)
from lmcache_async.layouts import KVLayout
from lmcache_async.transfer import native as transfer_native
from lmcache_async.transfer.plan import TransferPlan
from tests.test_native_build import require_compiler

native = pytest.mark.skipif(not NATIVE_CHAIN, reason="lmcache_async.keys._native was not built")

# BLAKE3 hashes 1024-byte chunks of 64-byte blocks: pieces around those sizes (the piece
# plus its 16-byte link) take every path of the C code.
STEPS = [1, 4, 48, 64, 1004, 1008, 1012, 1020, 1024, 1028, 2032, 2048, 2064, 3072, 4096, 8196]


def formula(seed: bytes, data: bytes, step: int) -> list[bytes]:
    """The chain written from its definition with the blake3 package, one call a piece."""
    out, prev = [], seed
    for offset in range(0, len(data), step):
        prev = blake3.blake3(data[offset : offset + step] + prev).digest(length=LINK_SIZE)
        out.append(prev)
    return out


def test_the_chain_is_built_where_a_c_compiler_is() -> None:
    require_compiler()  # without one the package falls back to blake3
    assert NATIVE_CHAIN, "a C compiler is here but lmcache_async.keys._native was not built"
    assert hashing._chain_blake3 is hashing._native_chain


@native
@pytest.mark.parametrize("step", STEPS)
def test_every_piece_size_gives_the_blake3_keys(step: int) -> None:
    assert hashing._native_chain is not None
    rng = np.random.default_rng(step)
    seed = rng.bytes(LINK_SIZE)
    # Lengths around whole pieces, and enough pieces to fill the lanes and leave a rest.
    for length in (0, 1, step - 1, step, step + 1, 3 * step + 5, 11 * step, 11 * step + 3):
        if length < 0 or length > 300_000:
            continue
        data = rng.bytes(length)
        expected = formula(seed, data, step)
        assert hashing._native_chain(seed, data, step) == expected, (step, length)
        assert hashing._chain_blake3_py(seed, memoryview(data), step) == expected, (step, length)


@native
@pytest.mark.parametrize("tag", [b"", b"\x01", b"tag!", bytes(range(16))])
def test_a_tag_goes_ahead_of_every_whole_link(tag: bytes) -> None:
    assert hashing._native_chain is not None
    rng = np.random.default_rng(len(tag))
    seed, data = rng.bytes(LINK_SIZE), rng.bytes(9 * 1024 + 17)
    links = formula(seed, data, 1024)
    expected = [tag + link for link in links]
    assert hashing._native_chain(seed, data, 1024, tag) == expected
    assert hashing._chain_blake3_py(seed, memoryview(data), 1024, tag) == expected
    assert all(len(key) == len(tag) + LINK_SIZE for key in expected)
    if len(tag) == 16:  # a tenant's tag: whole key digests, the chain's bytes all kept
        assert all(len(key) == DIGEST_SIZE for key in expected)
        assert hashing.with_tag(links, tag) == expected
    with pytest.raises(ValueError, match="tag must be at most 16 bytes"):
        hashing._native_chain(seed, data, 1024, bytes(17))


@native
@settings(max_examples=150, deadline=None)
@given(
    seed=st.binary(min_size=LINK_SIZE, max_size=LINK_SIZE),
    data=st.binary(max_size=20_000),
    step=st.one_of(st.sampled_from(STEPS), st.integers(1, 5000)),
)
def test_random_input_gives_the_blake3_keys(seed: bytes, data: bytes, step: int) -> None:
    assert hashing._native_chain is not None
    assert hashing._native_chain(seed, data, step) == formula(seed, data, step)


@native
def test_a_long_prompt_gives_the_blake3_keys_from_any_buffer() -> None:
    # 32k int32 tokens in chunks of 256: 128 pieces of exactly one BLAKE3 chunk each, past
    # the size where the C code lets other threads run.
    tokens = np.random.default_rng(7).integers(0, 2**31, 32768, dtype=np.int64).astype("<i4")
    data = tokens.tobytes()
    seed = os.urandom(LINK_SIZE)
    expected = formula(seed, data, 1024)
    assert hashing._native_chain is not None
    for buffer in (data, memoryview(data), tokens.data.cast("B"), bytearray(data)):
        assert hashing._native_chain(seed, buffer, 1024) == expected


@native
def test_threads_hash_at_once_and_agree() -> None:
    data = os.urandom(1 << 20)
    seed = os.urandom(LINK_SIZE)
    expected = formula(seed, data, 1024)
    results: list[list[bytes]] = []
    assert hashing._native_chain is not None
    chain = hashing._native_chain

    def work() -> None:
        results.append(chain(seed, data, 1024))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 4
    assert all(result == expected for result in results)


@native
def test_bad_arguments_raise() -> None:
    chain = hashing._native_chain
    assert chain is not None
    with pytest.raises(ValueError, match="seed must be 16 bytes, got 15"):
        chain(bytes(15), b"abcd", 4)
    with pytest.raises(ValueError, match="step must be positive, got 0"):
        chain(bytes(LINK_SIZE), b"abcd", 0)
    with pytest.raises(ValueError, match="step must be positive"):
        chain(bytes(LINK_SIZE), b"abcd", -4)
    with pytest.raises(TypeError):
        chain(bytes(LINK_SIZE), "text", 4)  # type: ignore[arg-type]
    with pytest.raises(BufferError):
        chain(bytes(LINK_SIZE), memoryview(bytes(64))[::2], 4)  # strided memory


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_the_hasher_gives_the_same_keys_with_and_without_the_c_chain(
    algorithm: HashAlgorithm, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = Namespace("org/model", "layout-v1")
    tokens = np.random.default_rng(3).integers(0, 50_000, 5000).tolist()
    with_default = ChunkHasher(namespace, chunk_size=256, algorithm=algorithm).digests(tokens)
    monkeypatch.setattr(hashing, "_chain_blake3", hashing._chain_blake3_py)
    without = ChunkHasher(namespace, chunk_size=256, algorithm=algorithm).digests(tokens)
    assert with_default == without
    assert len(with_default) == 20


# -- the CPU tier's prefix walk ---------------------------------------------------------------


@native
@settings(max_examples=150, deadline=None)
@given(
    held=st.lists(st.booleans(), min_size=0, max_size=40),
    order=st.randoms(use_true_random=False),
    as_tuple=st.booleans(),
)
def test_the_prefix_walk_in_c_counts_and_reorders_as_the_python_one(
    held: list[bool], order: Any, as_tuple: bool
) -> None:
    assert lru.held_prefix_count is not lru.held_prefix_count_py
    keys_asked = [ChunkKey(bytes([i]) * DIGEST_SIZE) for i in range(len(held))]
    stored = [key for key, h in zip(keys_asked, held, strict=True) if h]
    stored += [ChunkKey(bytes([200 + i]) * DIGEST_SIZE) for i in range(5)]  # never asked
    order.shuffle(stored)
    # Asked as bare digests (a lookup's wire form) of keys stored as ChunkKeys.
    asked: Any = [bytes(key) for key in keys_asked]
    asked = tuple(asked) if as_tuple else asked
    for walk, python in (
        (lru.held_prefix_count, lru.held_prefix_count_py),
        (lru.held_prefix_values, lru.held_prefix_values_py),
    ):
        index = collections.OrderedDict((key, f"obj-{key.hex()[:4]}") for key in stored)
        again = collections.OrderedDict(index)
        assert walk(index, asked) == python(again, asked)
        assert list(index.items()) == list(again.items())  # hits moved to the end alike


@native
def test_the_prefix_walk_refuses_what_is_not_an_index_or_keys() -> None:
    index: collections.OrderedDict[bytes, int] = collections.OrderedDict({b"k" * DIGEST_SIZE: 1})
    for walk in (lru.held_prefix_count, lru.held_prefix_values):
        with pytest.raises(TypeError, match="must be an OrderedDict"):
            walk([], [b"k" * DIGEST_SIZE])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="sequence"):
            walk(index, 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            walk(index, [[1]])  # an unhashable key
        with pytest.raises(TypeError, match="2 arguments"):
            walk(index)  # type: ignore[call-arg]
        assert walk(index, []) in (0, [])
    assert list(index.values()) == [1]


# -- the row copies of transfer plans ---------------------------------------------------------


def test_the_row_copies_come_with_the_chain() -> None:
    assert transfer_native.NATIVE_ROWS == NATIVE_CHAIN


def _large_plan() -> tuple[KVLayout, TransferPlan, list[tuple[int, int]]]:
    """A plan of 2048 tokens, 16 MiB of payload, in chunks of 256 tokens."""
    layout = KVLayout.vllm_flash_attn(
        num_layers=4, block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16
    )
    gen = torch.Generator().manual_seed(5)
    kv = layout.allocate_kv_caches(256, generator=gen)
    plan = layout.plan(kv, torch.randperm(256 * 16, generator=gen)[:2048])
    return layout, plan, [(start, start + 256) for start in range(0, 2048, 256)]


@native
def test_threads_copy_rows_at_once_and_agree() -> None:
    layout, plan, bounds = _large_plan()
    assert plan._native is not None

    def gathered() -> list[torch.Tensor]:
        outs = [torch.empty(layout.payload_shape(e - s), dtype=layout.dtype) for s, e in bounds]
        plan.gather_chunks([(s, e, out) for (s, e), out in zip(bounds, outs, strict=True)])
        return outs

    results: list[list[torch.Tensor]] = []
    threads = [threading.Thread(target=lambda: results.append(gathered())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    native = plan._native
    plan._native = None  # the torch path's bytes
    expected = gathered()
    plan._native = native
    assert len(results) == 4
    for outs in results:
        for a, b in zip(outs, expected, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@native
def test_a_large_copy_lets_other_threads_run() -> None:
    """A thread woken while the copy starts runs before it ends: the copy let go of the
    GIL (with a switch interval of minutes, nothing else would make this thread give it up)."""
    layout, plan, bounds = _large_plan()
    outs = [(s, e, torch.empty(layout.payload_shape(e - s), dtype=layout.dtype)) for s, e in bounds]
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    ran: list[bool] = []

    def other() -> None:
        ready.set()
        go.wait(timeout=60)
        ran.append(True)
        done.wait(timeout=60)

    thread = threading.Thread(target=other)
    interval = sys.getswitchinterval()
    thread.start()
    try:
        assert ready.wait(timeout=60)
        sys.setswitchinterval(300.0)
        go.set()
        for _ in range(100):  # each copy hands the GIL over; the thread needs one of them
            plan.gather_chunks(outs)
            if ran:
                break
        assert ran
    finally:
        sys.setswitchinterval(interval)
        done.set()
        thread.join(timeout=60)
