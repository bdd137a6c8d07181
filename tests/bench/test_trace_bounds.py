"""What a trace allows, from its hash ids: the bounds agree with a dictionary written here,
prompts are deterministic and blocks never collide, and the synthetic trace is what its
docstring says."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.bench.trace import (
    BlockLRU,
    TraceShape,
    compute_bounds,
    generate_trace,
    parse_capacities,
    read_trace,
)
from lmcache_async.bench.trace.parse import TraceRequest
from lmcache_async.bench.trace.tokens import BlockTokens, digits_for
from lmcache_async.errors import InvalidInputError

BS = 16


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()]


def unbounded_hits(lines: list[dict[str, Any]], bs: int) -> int:
    """Hit tokens with a cache that keeps every full block (ids are prefix hashes)."""
    seen: set[int] = set()
    hits = 0
    for request in lines:
        blocks = request["hash_ids"][: request["input_length"] // bs]
        hit = 0
        while hit < len(blocks) and blocks[hit] in seen:
            hit += 1
        hits += hit * bs
        seen.update(blocks)
    return hits


def lru_hits(lines: list[dict[str, Any]], bs: int, capacity: int) -> tuple[int, int]:
    """Hit tokens and evictions of a block LRU used as the engine's CPU tier is: hits made
    recent, then the other blocks it holds, then the missing ones inserted in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = evictions = 0
    for request in lines:
        blocks = request["hash_ids"][: request["input_length"] // bs]
        hit = 0
        while hit < len(blocks) and blocks[hit] in cache:
            hit += 1
        hits += hit * bs
        for block in blocks[:hit] + [b for b in blocks[hit:] if b in cache]:
            cache.move_to_end(block)
        for block in [b for b in blocks[hit:] if b not in cache]:
            if len(cache) >= capacity:
                cache.popitem(last=False)
                evictions += 1
            cache[block] = None
    return hits, evictions


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "synthetic.jsonl"
    generate_trace(path, requests=400, seed=7, block_size=BS)
    return path


def test_the_bounds_agree_with_a_plain_dictionary(trace: Path) -> None:
    lines = read_lines(trace)
    prompt_tokens = sum(request["input_length"] for request in lines)
    capacities = [30, 100, 300, 10_000]
    bounds = compute_bounds(read_trace(trace, block_size=BS), block_size=BS, capacities=capacities)
    assert bounds.requests == len(lines) == 400
    assert bounds.unbounded_hit_tokens == unbounded_hits(lines, BS)
    assert bounds.unbounded_hit_rate == unbounded_hits(lines, BS) / prompt_tokens
    for bound in bounds.lru:
        hits, evictions = lru_hits(lines, BS, bound.capacity_blocks)
        assert (bound.hit_tokens, bound.evictions) == (hits, evictions)
        assert bound.hit_rate == hits / prompt_tokens
    rates = [bound.hit_rate for bound in bounds.lru]
    assert rates == sorted(rates)
    assert 0 < rates[0] < rates[-1] == bounds.unbounded_hit_rate


def request(line: int, length: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(line, float(line), length, 1, tuple(ids))


def test_a_block_is_its_hash_id_after_its_prefix() -> None:
    # Id 5 after 1 and id 5 after 2 are different blocks, as the engine's chained keys are.
    requests = [request(1, 2 * BS, [1, 5]), request(2, 2 * BS, [2, 5]), request(3, 2 * BS, [1, 5])]
    bounds = compute_bounds(requests, block_size=BS, capacities=[])
    assert bounds.distinct_blocks == 4
    assert bounds.unbounded_hit_tokens == 2 * BS  # only the third request, both blocks


def test_only_full_blocks_count_and_own_blocks_take_room() -> None:
    # 40 tokens: two full blocks (the second past hash_ids: the request's own), one partial.
    requests = [request(1, 40, [9]), request(2, 40, [9]), request(3, 40, [9, 4, 3])]
    bounds = compute_bounds(requests, block_size=BS, capacities=[2])
    assert bounds.unbounded_hit_tokens == 2 * BS  # block 9 for the second and the third
    # The second request's own block evicts the first's, the third's block 4 the second's.
    assert (bounds.lru[0].hit_tokens, bounds.lru[0].evictions) == (2 * BS, 2)


def test_a_prompt_longer_than_the_lru_stores_what_fits() -> None:
    lru = BlockLRU(3)
    assert lru.access([1, 2]) == 0
    assert lru.access([3, 4, 5, 6, 7]) == 0
    assert (len(lru), lru.partial_stores, lru.evictions) == (3, 1, 2)
    assert lru.access([3, 4, 5]) == 3


def test_prompts_are_deterministic_and_blocks_never_collide() -> None:
    make = BlockTokens(block_size=BS, vocab_size=1000, seed=3)
    first = make.prompt(request(1, 3 * BS + 5, [11, 12]))
    again = make.prompt(request(8, 3 * BS + 5, [11, 12]))
    other_seed = BlockTokens(block_size=BS, vocab_size=1000, seed=4).prompt(request(1, 40, [11]))
    assert first.num_tokens == 3 * BS + 5
    assert int(first.tokens.max()) < 1000
    # Equal ids, equal tokens; the blocks past hash_ids are each request's own.
    assert torch.equal(first.tokens[: 2 * BS], again.tokens[: 2 * BS])
    assert not torch.equal(first.tokens[2 * BS :], again.tokens[2 * BS :])
    assert not torch.equal(first.tokens[:40], other_seed.tokens)
    assert [s.length for s in first.segments] == [BS, BS, BS, 5]
    # Ids that agree in every digit but one still give different blocks.
    ids = [0, 1, 1000, 1000**2, 2**62 - 1, 2**62 - 1000]
    blocks = make.prompt(request(2, BS * len(ids), ids)).tokens.view(len(ids), BS)
    assert len({tuple(block.tolist()) for block in blocks}) == len(ids)
    assert digits_for(1000) == 7
    with pytest.raises(InvalidInputError, match="cannot hold the 7 tokens"):
        BlockTokens(block_size=6, vocab_size=1000, seed=0)


def test_a_prompt_ending_inside_a_block_is_a_prefix_of_a_longer_one() -> None:
    make = BlockTokens(block_size=BS, vocab_size=32000, seed=0)
    short = make.prompt(request(1, BS + 3, [4, 5]))
    long = make.prompt(request(2, 2 * BS, [4, 5]))
    assert torch.equal(short.tokens, long.tokens[: BS + 3])


def test_the_synthetic_trace_is_reproducible_and_mixed(tmp_path: Path) -> None:
    one, two, three = (tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl"))
    generate_trace(one, requests=200, seed=1, block_size=BS)
    generate_trace(two, requests=200, seed=1, block_size=BS)
    generate_trace(three, requests=200, seed=2, block_size=BS)
    assert one.read_bytes() == two.read_bytes() != three.read_bytes()
    lines = read_lines(one)
    stamps = [request["timestamp"] for request in lines]
    assert stamps == sorted(stamps)
    firsts = [request["hash_ids"][0] for request in lines]
    # System prompts shared by many requests, and first blocks seen once (one-offs).
    assert max(firsts.count(first) for first in set(firsts)) > 10
    assert sum(firsts.count(first) == 1 for first in set(firsts)) > 10
    # Follow-ups: a prompt that extends an earlier one's full blocks.
    assert any(
        request["hash_ids"][:3] == earlier["hash_ids"][:3]
        and request["input_length"] > earlier["input_length"]
        for i, request in enumerate(lines)
        for earlier in lines[max(0, i - 20) : i]
    )
    with pytest.raises(InvalidInputError, match="shares"):
        generate_trace(one, requests=1, shape=TraceShape(one_off_share=0.8, new_session_share=0.5))


def test_capacities_read_like_token_counts() -> None:
    assert parse_capacities("0.5M, 1M,3m,512k,2000") == (
        500_000,
        1_000_000,
        3_000_000,
        512_000,
        2000,
    )
    for bad in ("", "lots", "-1M", "0"):
        with pytest.raises(InvalidInputError):
            parse_capacities(bad)
