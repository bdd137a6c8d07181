"""The Redis part of ``bench --redis``: a request's chunks written to and read from Redis by
an embedded engine and through a sidecar, beside a plain socket moving the same records.

Three clients, one server, one request of ``chunks`` chunks, in rounds (one warm-up round
first, not counted). Each round, in an order that reverses from one round to the next:

- **writes**, each on a server where the values before it were just deleted (``DEL``: a
  server serves a write faster from memory it has just freed than from fresh pages, so
  every side gets the same): the plain socket's ``SET`` s of the very records the engine
  stores, sent from memory; the embedded :class:`~lmcache_async.CacheEngine`'s store
  into RAM and Redis (``wait_for_slow_tiers``: it returns once Redis holds every chunk)
  and its store into RAM only; the same two through the sidecar
  (:class:`~lmcache_async.RemoteCacheEngine` → ``lmcache-async serve`` with the same
  settings). The engine's write to Redis is the first store less the second, its copy
  out of the KV caches and its hashing being in both;
- **reads** of the chunks only in Redis (each engine's RAM tier emptied before its
  retrieve): the plain socket's ``GET`` s, each value received into its own preallocated
  buffer; the embedded engine's ``retrieve`` into the KV caches; the sidecar's.

The plain socket's calls run in a worker thread (the event loop keeps serving the sidecar
client's heartbeats) and are timed there. After the rounds, one retrieve through each
engine is compared with the KV stored, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread
import numpy as np
import torch

from lmcache_async import CacheEngine, EngineConfig, KVCacheClient, RemoteCacheEngine
from lmcache_async.bench import EVERY_TIER_WAITED
from lmcache_async.bench.baselines import slots_over
from lmcache_async.bench.redis.options import MODEL_NAME, RedisBenchOptions
from lmcache_async.bench.redis.plain import PlainRedis
from lmcache_async.bench.sidecar import sidecar_process, wait_sidecar_ready
from lmcache_async.config import GB
from lmcache_async.layouts import KVLayout

__all__ = ["READS", "WRITES", "measure_wire", "wire_config"]

WRITES: Final = (
    "plain_set",
    "embedded_store",
    "embedded_ram_store",
    "sidecar_store",
    "sidecar_ram_store",
)
"""The timed writes of a round, in the order of even rounds."""
READS: Final = ("plain_get", "embedded_retrieve", "sidecar_retrieve")
"""The timed reads of a round, in the order of even rounds."""

_VOCAB: Final = 32000
_PLAIN_PREFIX: Final = b"lmca-bench-plain:"
_RAM_SLACK: Final = 16 << 20
_MIN_REMOTE_TIMEOUT: Final = 10.0


def wire_config(base: EngineConfig, url: str, options: RedisBenchOptions) -> EngineConfig:
    """``base`` with a RAM tier of twice the request (and some slack) in front of the
    Redis tier at ``url``; a store waits until Redis holds its chunks, and every chunk
    stored goes to every tier.

    Raises:
        ConfigError: the engine refuses the result.
    """
    return base.replace(
        chunk_size=options.chunk_tokens,
        local_cpu=True,
        max_local_cpu_size=(2 * options.request_bytes + _RAM_SLACK) / GB,
        local_disk=None,
        remote_url=url,
        remote_timeout=max(base.remote_timeout, _MIN_REMOTE_TIMEOUT),
        **EVERY_TIER_WAITED,
    )


@dataclass(slots=True)
class _Work:
    """The request, the KV caches it is stored from (``src``) and retrieved into (``dst``),
    and the plain socket's keys, values and receive buffers."""

    tokens: torch.Tensor
    kv: list[torch.Tensor]
    src: torch.Tensor
    dst: torch.Tensor
    dst_blocks: torch.Tensor
    tier_keys: list[bytes]
    plain_keys: list[bytes]
    values: list[memoryview]
    dests: list[memoryview]


class _Round:
    """One round's timings and the problems met, for one engine pair and plain socket."""

    def __init__(
        self, work: _Work, engines: dict[str, KVCacheClient], plain: PlainRedis, timeout: float
    ) -> None:
        self.work = work
        self.engines = engines
        self.plain = plain
        self.timeout = timeout
        self.problems: list[str] = []

    async def _plain(self, call: Callable[[], object]) -> float:
        def timed() -> float:
            began = time.perf_counter()
            call()
            return time.perf_counter() - began

        with anyio.fail_after(self.timeout):
            return await anyio.to_thread.run_sync(timed)

    async def _timed(self, call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
        with anyio.fail_after(self.timeout):
            began = time.perf_counter()
            result = await call()
            return time.perf_counter() - began, result

    async def _delete(self, keys: list[bytes], what: str) -> None:
        with anyio.fail_after(self.timeout):
            gone = await anyio.to_thread.run_sync(self.plain.delete, keys)
        if gone != len(keys):
            self.problems.append(f"{what}: Redis held {gone} of {len(keys)} chunks")

    async def write(self, name: str) -> float:
        """Time the write ``name``, then delete what it wrote."""
        work = self.work
        if name == "plain_set":
            took = await self._plain(lambda: self.plain.sets(work.plain_keys, work.values))
            await self._delete(work.plain_keys, name)
            return took
        engine = self.engines[name.partition("_")[0]]
        ram_only = name.endswith("_ram_store")
        took, stored = await self._timed(
            lambda: engine.store(
                work.tokens,
                kv_caches=work.kv,
                slot_mapping=work.src,
                store_location=["cpu"] if ram_only else None,
            )
        )
        if stored != len(work.tokens):
            self.problems.append(f"{name}: stored {stored} of {len(work.tokens)} tokens")
        await engine.clear(["cpu"])
        if not ram_only:
            await self._delete(work.tier_keys, name)
        return took

    async def fill(self) -> None:
        """Put the request's chunks in Redis (through the embedded engine, then out of its
        RAM) and the plain socket's values beside them."""
        work = self.work
        engine = self.engines["embedded"]
        with anyio.fail_after(self.timeout):
            stored = await engine.store(work.tokens, kv_caches=work.kv, slot_mapping=work.src)
        if stored != len(work.tokens):
            self.problems.append(f"fill: stored {stored} of {len(work.tokens)} tokens")
        await engine.clear(["cpu"])
        await self._plain(lambda: self.plain.sets(work.plain_keys, work.values))

    async def read(self, name: str) -> float:
        """Time the read ``name`` of chunks only in Redis."""
        work = self.work
        if name == "plain_get":
            return await self._plain(lambda: self.plain.gets(work.plain_keys, work.dests))
        engine = self.engines[name.partition("_")[0]]
        await engine.clear(["cpu"])
        took, mask = await self._timed(
            lambda: engine.retrieve(work.tokens, kv_caches=work.kv, slot_mapping=work.dst)
        )
        if not bool(mask.all()):
            self.problems.append(f"{name}: loaded {int(mask.sum())} of {len(work.tokens)} tokens")
        return took

    async def empty(self) -> None:
        """Remove the chunks from Redis and every RAM tier."""
        await self._delete(self.work.tier_keys, "reads")
        await self._delete(self.work.plain_keys, "plain reads")
        for engine in self.engines.values():
            await engine.clear(["cpu"])


async def measure_wire(
    options: RedisBenchOptions,
    base: EngineConfig,
    url: str,
    directory: str,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Run the Redis part against the server at ``url`` (the sidecar's files in
    ``directory``); returns ``times_s`` (each write and read, a list over the counted
    rounds), ``record_bytes`` (the records' sizes in Redis), ``bit_exact`` and
    ``problems``.

    Raises:
        InvalidInputError: ``url`` is not one a plain socket can reach.
        ConfigError: the engine refuses the settings.
        TierError: the server answered a plain command with an error.
        OSError: the server cannot be reached.
        TimeoutError: the sidecar did not answer within ``startup_timeout``, or a call
            took longer than ``timeout``.
    """
    config = wire_config(base, url, options)
    layout = options.layout()
    async with contextlib.AsyncExitStack() as stack:
        plain = await anyio.to_thread.run_sync(
            lambda: PlainRedis.connect(url, timeout=options.timeout)
        )
        stack.callback(plain.close)
        _say(progress, "opening the engine and starting the sidecar")
        embedded = await stack.enter_async_context(
            CacheEngine.open(config, layout, model_name=MODEL_NAME)
        )
        sidecar_url = await stack.enter_async_context(sidecar_process(config, directory))
        await wait_sidecar_ready(
            sidecar_url, options.layout(), model_name=MODEL_NAME, timeout=options.startup_timeout
        )
        remote = await stack.enter_async_context(
            RemoteCacheEngine.connect(
                sidecar_url, layout, model_name=MODEL_NAME, timeout=options.timeout
            )
        )
        engines: dict[str, KVCacheClient] = {"embedded": embedded, "sidecar": remote}
        work = await _make_work(options, embedded, plain)
        run = _Round(work, engines, plain, options.timeout)
        times: dict[str, list[float]] = {name: [] for name in (*WRITES, *READS)}
        for r in range(options.rounds + 1):
            _say(progress, f"round {r}/{options.rounds}" + (" (warm-up)" if r == 0 else ""))
            order = 1 if r % 2 == 0 else -1
            took = {name: await run.write(name) for name in WRITES[::order]}
            await run.fill()
            took.update({name: await run.read(name) for name in READS[::order]})
            await run.empty()
            if r:
                for name, seconds in took.items():
                    times[name].append(seconds)
        exact = {name: await _bit_exact(run, layout, name) for name in engines}
    return {
        "times_s": times,
        "record_bytes": [len(value) for value in work.values],
        "bit_exact": exact,
        "problems": run.problems,
    }


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        print(f"bench: redis {text}", file=progress, flush=True)


async def _make_work(options: RedisBenchOptions, engine: CacheEngine, plain: PlainRedis) -> _Work:
    """The request and its KV; the plain socket's values are the records the engine
    writes to Redis, read back once from a first store."""
    # Here, not at the top: redis-py (which the tier's module imports) is an optional extra.
    from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX  # noqa: PLC0415

    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    bs = layout.block_size
    blocks = math.ceil(options.tokens / bs)
    kv = layout.allocate_kv_caches(2 * blocks, generator=gen, random=True)
    src_blocks = torch.arange(blocks, dtype=torch.int64)
    dst_blocks = torch.arange(blocks, 2 * blocks, dtype=torch.int64)
    tokens = torch.randint(0, _VOCAB, (options.tokens,), generator=gen, dtype=torch.int64)
    spans, _ = await engine.chunk_spans(tokens)
    tier_keys = [(DEFAULT_KEY_PREFIX + span.key.to_str()).encode() for span in spans]
    plain_keys = [_PLAIN_PREFIX + b"%d" % i for i in range(len(spans))]
    src = slots_over(src_blocks, bs, options.tokens)
    await engine.store(tokens, kv_caches=kv, slot_mapping=src)
    await engine.clear(["cpu"])
    room = options.chunk_bytes + (64 << 10)  # a record is its payload and a short header
    scratch = [np.empty(room, dtype=np.uint8).data for _ in spans]
    sizes = await anyio.to_thread.run_sync(plain.gets, tier_keys, scratch)
    await anyio.to_thread.run_sync(plain.delete, tier_keys)
    values = [
        np.array(buf[:size], dtype=np.uint8).data for buf, size in zip(scratch, sizes, strict=True)
    ]
    # Distinct buffers for the plain GETs, touched once so that no page fault is timed.
    dests = [np.ones(size, dtype=np.uint8).data for size in sizes]
    return _Work(
        tokens=tokens,
        kv=kv,
        src=src,
        dst=slots_over(dst_blocks, bs, options.tokens),
        dst_blocks=dst_blocks,
        tier_keys=tier_keys,
        plain_keys=plain_keys,
        values=values,
        dests=dests,
    )


async def _bit_exact(run: _Round, layout: KVLayout, name: str) -> bool:
    """Whether a retrieve through ``name`` of the chunks only in Redis loads exactly the
    KV that was stored (the destination blocks zeroed first)."""
    work = run.work
    await run.fill()

    def blank() -> None:
        for layer in work.kv:
            layer.index_fill_(1, work.dst_blocks, 0)

    def compare() -> bool:
        n = len(work.tokens)
        expected = torch.empty(layout.payload_shape(n), dtype=layout.dtype)
        got = torch.empty_like(expected)
        layout.gather(work.kv, work.src, expected)
        layout.gather(work.kv, work.dst, got)
        return torch.equal(expected.view(torch.uint8), got.view(torch.uint8))

    await anyio.to_thread.run_sync(blank)
    await run.read(f"{name}_retrieve")
    exact = await anyio.to_thread.run_sync(compare)
    await run.empty()
    if not exact:
        run.problems.append(f"{name}: the KV retrieved from Redis differs from the KV stored")
    return exact
