"""What a trace allows: its hit rate with an unbounded cache and with a plain block LRU of a
given capacity, from the hash ids alone (no tokens, no KV).

Definitions, the same for these bounds and for what an engine serves (:mod:`.replay`):

- a *block* is ``block_size`` prompt tokens; only full blocks are cached (the engine runs
  with ``save_unfull_chunk`` off, so a prompt's partial last block is never stored nor
  found). A block is identified by its hash id *and everything before it*: two requests
  share block ``j`` when their first ``j + 1`` hash ids are equal, as the engine's
  prefix-chained chunk keys have it. Blocks past a request's ``hash_ids`` are its own;
- a request's *hit* is the run of its leading full blocks present when it arrives, in
  tokens (blocks x ``block_size``);
- the *hit rate* of a run is the sum of its requests' hits over the sum of their
  ``input_length``: hit tokens / prompt tokens (None when there is no request).

The unbounded cache keeps every full block it saw. The block LRU holds ``capacity`` blocks
and, for each request in arrival order, does what the engine's CPU tier does with a lookup,
a retrieve of the hit and a store of the whole prompt (one request at a time):

1. the hit blocks become the most recent, in prompt order (lookup, retrieve);
2. the other blocks it holds become the most recent, in prompt order (the store holds
   the chunks it already has before it takes memory for the others);
3. each missing block is inserted, in prompt order, evicting the least recently used
   block first when full; when the least recently used is one of steps 2-3's blocks (the
   prompt is longer than the tier), the store ends there (a partial store).

This is the engine's order exactly, which a plain "touch or insert each block in order"
is not: a block the store already has (behind a block that was evicted) is made recent
before the missing ones take memory, so it is not evicted for them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lmcache_async.bench.trace.parse import TraceRequest, read_trace

__all__ = [
    "BlockKeys",
    "BlockLRU",
    "Bounds",
    "LruBound",
    "TraceScan",
    "bounds_of_file",
    "compute_bounds",
    "hit_rate",
    "scan_trace",
]

_ROOT = 0
_ID_BITS = 62


def hit_rate(hit_tokens: int, prompt_tokens: int) -> float | None:
    """Hit tokens over prompt tokens; None when there were no prompt tokens."""
    return hit_tokens / prompt_tokens if prompt_tokens else None


class BlockKeys:
    """Keys of the full blocks of requests, chained as the engine's chunk keys are: the key
    of block ``j`` stands for hash ids ``0..j``. Keys are small ints; a block past a
    request's ``hash_ids`` gets a key of its own that no other block has."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: dict[int, int] = {}
        self._next = _ROOT + 1

    def __len__(self) -> int:
        """Distinct blocks of hash ids seen (full blocks, each with its prefix)."""
        return len(self._keys)

    def keys(self, request: TraceRequest) -> tuple[list[int], int]:
        """The keys of ``request``'s full blocks, and how many leading ones were seen
        before (the request's hit in an unbounded cache, in blocks)."""
        full = request.full_blocks(self.block_size)
        ids = request.hash_ids
        known = self._keys
        out: list[int] = []
        seen = 0
        leading = True
        parent = _ROOT
        for block_id in ids[:full]:
            chained = (parent << _ID_BITS) | block_id
            key = known.get(chained)
            if key is None:
                key = known[chained] = self._next
                self._next += 1
                leading = False
            elif leading:
                seen += 1
            out.append(key)
            parent = key
        for _ in range(len(ids), full):
            out.append(self._next)
            self._next += 1
        return out, seen


class BlockLRU:
    """A block LRU of ``capacity`` blocks, accessed as the engine's CPU tier is (see the
    module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evictions = 0
        self.partial_stores = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def access(self, keys: Sequence[int]) -> int:
        """One request's lookup, retrieve and store; returns its hit in blocks."""
        blocks = self._blocks
        touch = blocks.move_to_end
        hit = 0
        for key in keys:
            if key not in blocks:
                break
            hit += 1
        for key in keys[:hit]:
            touch(key)
        rest = keys[hit:]
        missing = []
        for key in rest:
            if key in blocks:
                touch(key)
            else:
                missing.append(key)
        if not missing:
            return hit
        protected = set(rest)
        for key in missing:
            if len(blocks) >= self.capacity:
                oldest = next(iter(blocks), None)
                if oldest is None or oldest in protected:
                    self.partial_stores += 1
                    break
                del blocks[oldest]
                self.evictions += 1
            blocks[key] = None
        return hit


@dataclass(slots=True)
class TraceScan:
    """A trace's sizes, from a pass that checks every line (nothing kept per request)."""

    block_size: int
    requests: int = 0
    prompt_tokens: int = 0
    full_block_tokens: int = 0
    """Tokens in full blocks: the most any cache can hit."""
    output_tokens: int = 0
    max_prompt_tokens: int = 0
    max_full_blocks: int = 0
    first_timestamp_ms: float | None = None
    last_timestamp_ms: float | None = None

    def add(self, request: TraceRequest) -> None:
        full = request.full_blocks(self.block_size)
        self.requests += 1
        self.prompt_tokens += request.input_length
        self.full_block_tokens += full * self.block_size
        self.output_tokens += request.output_length
        self.max_prompt_tokens = max(self.max_prompt_tokens, request.input_length)
        self.max_full_blocks = max(self.max_full_blocks, full)
        if self.first_timestamp_ms is None:
            self.first_timestamp_ms = request.timestamp
        self.last_timestamp_ms = request.timestamp

    @property
    def span_seconds(self) -> float:
        """Seconds from the first arrival to the last (0 for fewer than two requests)."""
        if self.first_timestamp_ms is None or self.last_timestamp_ms is None:
            return 0.0
        return (self.last_timestamp_ms - self.first_timestamp_ms) / 1e3


def scan_trace(
    path: str | os.PathLike[str],
    *,
    block_size: int,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> TraceScan:
    """Read the whole trace (its first ``limit`` requests), checking every line.

    Raises:
        InvalidInputError: a line breaks the format (the message names it).
        OSError: the file cannot be read.
    """
    scan = TraceScan(block_size)
    for request in read_trace(path, block_size=block_size, limit=limit):
        scan.add(request)
        if progress is not None and scan.requests % 1024 == 0:
            progress(1024)
    if progress is not None:
        progress(scan.requests % 1024)
    return scan


@dataclass(slots=True)
class LruBound:
    """A block LRU's figures over a trace."""

    capacity_blocks: int
    hit_tokens: int = 0
    evictions: int = 0
    partial_stores: int = 0
    hit_rate: float | None = None


@dataclass(slots=True)
class Bounds:
    """The unbounded cache's and each block LRU's figures over one trace."""

    requests: int = 0
    prompt_tokens: int = 0
    distinct_blocks: int = 0
    unbounded_hit_tokens: int = 0
    unbounded_hit_rate: float | None = None
    lru: list[LruBound] = field(default_factory=list)
    per_request: list[int] | None = None
    """Each request's hit tokens in the LRU named by ``record`` (arrival order)."""


def compute_bounds(
    requests: Iterable[TraceRequest],
    *,
    block_size: int,
    capacities: Sequence[int],
    record: int | None = None,
) -> Bounds:
    """The unbounded and block-LRU hit rates of ``requests`` (in arrival order), for an LRU
    of each of ``capacities`` blocks at once; with ``record`` (a position in
    ``capacities``) each request's hit in that LRU is kept too."""
    keys_of = BlockKeys(block_size)
    lrus = [BlockLRU(capacity) for capacity in capacities]
    bounds = Bounds(lru=[LruBound(capacity) for capacity in capacities])
    per_request: list[int] | None = [] if record is not None else None
    for request in requests:
        keys, seen = keys_of.keys(request)
        bounds.requests += 1
        bounds.prompt_tokens += request.input_length
        bounds.unbounded_hit_tokens += seen * block_size
        for i, (lru, bound) in enumerate(zip(lrus, bounds.lru, strict=True)):
            hit = lru.access(keys) * block_size
            bound.hit_tokens += hit
            if per_request is not None and i == record:
                per_request.append(hit)
    for lru, bound in zip(lrus, bounds.lru, strict=True):
        bound.evictions = lru.evictions
        bound.partial_stores = lru.partial_stores
        bound.hit_rate = hit_rate(bound.hit_tokens, bounds.prompt_tokens)
    bounds.distinct_blocks = len(keys_of)
    bounds.unbounded_hit_rate = hit_rate(bounds.unbounded_hit_tokens, bounds.prompt_tokens)
    bounds.per_request = per_request
    return bounds


def bounds_of_file(
    path: str | os.PathLike[str],
    *,
    block_size: int,
    limit: int | None,
    capacities: Sequence[int],
    record: int | None = None,
) -> Bounds:
    """:func:`compute_bounds` over the trace file at ``path`` (read as a stream).

    Raises:
        InvalidInputError: a line breaks the format.
        OSError: the file cannot be read.
    """
    requests = read_trace(path, block_size=block_size, limit=limit)
    return compute_bounds(requests, block_size=block_size, capacities=capacities, record=record)
