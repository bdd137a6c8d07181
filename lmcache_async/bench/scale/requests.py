"""The requests the scale benchmark makes of an engine: the KV caches they copy from and
into, their prompts, the first RAM hit after an open, and the timed store / lookup /
retrieve of a 1k-token request."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any, Final, NamedTuple, TextIO

import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.backends.record import RecordSpec
from lmcache_async.bench import EVERY_TIER_WAITED, percentiles
from lmcache_async.bench.baselines import slots_over
from lmcache_async.bench.scale.options import (
    CHUNK_TOKENS,
    FILL_PROMPT_CHUNKS,
    REQUEST_TOKENS,
    ScaleOptions,
    scale_layout,
)
from lmcache_async.config import GB
from lmcache_async.keys.chunks import ChunkKey

__all__ = [
    "MODEL_NAME",
    "OPERATIONS",
    "SLOW_TIER_CPU_BYTES",
    "RequestKit",
    "ScaleRun",
    "prompt_stream",
    "scale_config",
]

MODEL_NAME: Final = "lmcache-async-bench-scale"
"""The namespace of every key the benchmark stores."""

OPERATIONS: Final = ("store", "lookup", "retrieve")
"""The operations timed at each size, in the order each request makes them."""

_VOCAB: Final = 50_000

SLOW_TIER_CPU_BYTES: Final = 64 << 20
"""Host memory of an engine whose disk or Redis tier is measured: staging, and the chunks
the measured retrieves bring into RAM."""


def scale_config(
    base: EngineConfig,
    *,
    cpu_bytes: int = SLOW_TIER_CPU_BYTES,
    local_disk: str | None = None,
    disk_bytes: int = 0,
    remote_url: str | None = None,
) -> EngineConfig:
    """``base`` with the benchmark's chunk size, ``cpu_bytes`` of host memory and the slow
    tier measured (if any); a store waits until the slow tiers hold its chunks, so that
    its time is the tier's, and every chunk goes to every tier it is stored into.

    Raises:
        ConfigError: the engine refuses the result.
    """
    return base.replace(
        chunk_size=CHUNK_TOKENS,
        local_cpu=True,
        max_local_cpu_size=cpu_bytes / GB,
        local_disk=local_disk,
        max_local_disk_size=max(disk_bytes, 1 << 20) / GB,
        remote_url=remote_url,
        **EVERY_TIER_WAITED,
    )


def prompt_stream(seed: int, *labels: object) -> torch.Generator:
    """A generator of its own for each kind of prompt (``labels``), so that the prompts of
    one kind never depend on how many of another were drawn: the probes of a run are the
    same at every size, the fresh prompts differ from size to size."""
    digest = hashlib.blake2b(repr((seed, *labels)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class RequestKit:
    """KV caches of :func:`~.options.scale_layout` and the slots the requests use: a
    fill prompt (up to :data:`~.options.FILL_PROMPT_CHUNKS` chunks) is copied from the
    first blocks, a measured request stored from the first blocks and retrieved into
    blocks of its own."""

    def __init__(self, seed: int) -> None:
        self.layout = scale_layout()
        bs = self.layout.block_size
        fill_tokens = FILL_PROMPT_CHUNKS * CHUNK_TOKENS
        fill_blocks = fill_tokens // bs
        request_blocks = REQUEST_TOKENS // bs
        self.kv_caches = self.layout.allocate_kv_caches(
            fill_blocks + request_blocks, generator=prompt_stream(seed, "kv"), random=True
        )
        self.fill_slots = slots_over(torch.arange(fill_blocks, dtype=torch.int64), bs, fill_tokens)
        self.src_slots = self.fill_slots[:REQUEST_TOKENS].clone()
        retrieve_blocks = torch.arange(fill_blocks, fill_blocks + request_blocks, dtype=torch.int64)
        self.dst_slots = slots_over(retrieve_blocks, bs, REQUEST_TOKENS)

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one whole chunk."""
        return CHUNK_TOKENS * self.layout.token_bytes

    @staticmethod
    def prompts(
        generator: torch.Generator, count: int, tokens: int = REQUEST_TOKENS
    ) -> torch.Tensor:
        """``count`` random prompts of ``tokens`` tokens, int64 ``[count, tokens]``."""
        return torch.randint(0, _VOCAB, (count, tokens), generator=generator, dtype=torch.int64)

    async def store(
        self, engine: CacheEngine, tokens: torch.Tensor, locations: Sequence[str] | None
    ) -> int:
        """Store ``tokens`` (a request or a fill prompt) into ``locations``; tokens stored."""
        slots = self.fill_slots[: len(tokens)]
        return await engine.store(
            tokens, kv_caches=self.kv_caches, slot_mapping=slots, store_location=locations
        )

    async def first_hit(self, engine: CacheEngine, tokens: torch.Tensor) -> int:
        """Store ``tokens`` into RAM only and look them up: the tokens the lookup found."""
        await self.store(engine, tokens, ["cpu"])
        return await engine.lookup(tokens)

    async def keys_of(self, engine: CacheEngine, prompts: torch.Tensor) -> list[ChunkKey]:
        """The chunk keys ``engine`` gives ``prompts``, prompt after prompt."""
        keys: list[ChunkKey] = []
        for tokens in prompts:
            spans, _ = await engine.chunk_spans(tokens)
            keys.extend(span.key for span in spans)
        return keys

    async def measure(
        self,
        engine: CacheEngine,
        fresh: torch.Tensor,
        probes: torch.Tensor,
        *,
        store_location: Sequence[str],
        warmup: int,
    ) -> tuple[dict[str, Any], list[str]]:
        """Request by request: store ``fresh[i]`` into ``store_location``, look up
        ``probes[i]`` (held by the tier measured only) and retrieve it. Returns the
        percentiles of each operation in ms (the first ``warmup`` requests left out) and
        what went wrong (a short store, a lookup or retrieve that missed)."""
        times: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        short = dict.fromkeys(OPERATIONS, 0)
        for i, (new, probe) in enumerate(zip(fresh, probes, strict=True)):
            t0 = time.perf_counter()
            stored = await self.store(engine, new, store_location)
            t1 = time.perf_counter()
            hit = await engine.lookup(probe)
            t2 = time.perf_counter()
            mask = await engine.retrieve(
                probe, kv_caches=self.kv_caches, slot_mapping=self.dst_slots
            )
            t3 = time.perf_counter()
            short["store"] += stored != REQUEST_TOKENS
            short["lookup"] += hit != REQUEST_TOKENS
            short["retrieve"] += not bool(mask.all())
            if i >= warmup:
                times["store"].append(t1 - t0)
                times["lookup"].append(t2 - t1)
                times["retrieve"].append(t3 - t2)
        figures = {
            op: {k: v * 1000 if k != "count" else int(v) for k, v in percentiles(ts).items()}
            for op, ts in times.items()
        }
        problems = [
            f"{count} of {len(fresh)} {op}s did not cover the whole request"
            for op, count in short.items()
            if count
        ]
        return figures, problems


class ScaleRun(NamedTuple):
    """What the measurements of every tier at every size share."""

    options: ScaleOptions
    base: EngineConfig
    """The settings the benchmark does not fix (codec, encryption, timeouts)."""
    kit: RequestKit
    spec: RecordSpec
    """The records of the engines measured, as the fills write them."""
    first: torch.Tensor
    """The prompt stored into RAM and looked up right after each open."""
    probes: torch.Tensor
    """The prompts looked up and retrieved at each size, ``[probes, REQUEST_TOKENS]``."""
    probe_keys: list[ChunkKey]
    """Their chunk keys, prompt after prompt (the disk and Redis fills write them first)."""
    stream: TextIO | None
    """Where progress goes (None: nowhere)."""
