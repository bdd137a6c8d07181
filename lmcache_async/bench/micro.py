"""Micro-benchmarks: the engine's copies, lookups and hashing next to plain baselines.

Each figure is measured in the same run, on the same tensors, as its baseline:

- **store** GB/s: ``engine.store`` of ``T`` tokens into an emptied cache, against the best
  plain-torch gather of the same bytes (per layer and K/V one ``index_select`` into one
  preallocated ``[2, L, T, H*D]`` buffer);
- **retrieve** GB/s: ``engine.retrieve`` of those tokens into other blocks, against the
  plain ``index_copy_`` scatter of the same bytes;
- **lookup** latency of a fully cached long prompt, tokens as a tensor and as a list;
- **hashing** tokens/s of :class:`~lmcache_async.keys.ChunkHasher` (blake3, xxh3_128),
  against the plain way to get the same digests from a tensor: convert it to int32 bytes,
  then one ``H(chunk bytes + previous digest)`` call per chunk, with the hash's Python package;
- **per-request overhead** of a short store and retrieve: engine time minus the plain copy
  of the same chunk payloads (per chunk, layer and K/V one ``index_select`` into a
  preallocated chunk buffer; ``index_copy_`` back). Beside it, the cost of chunking: that
  per-chunk copy against one copy of the whole request into a single buffer.

Every figure is the median over ``repeat`` measured runs (lookups and hashing: over many
more iterations) after warm-up runs; the best run is reported beside it in the JSON.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import anyio
import blake3
import torch
import xxhash

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.bench import format_table, parse_dtype, percentiles
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys import DIGEST_SIZE, NATIVE_CHAIN, ChunkHasher, HashAlgorithm, Namespace
from lmcache_async.memory import DEFAULT_PAGE_SIZE

__all__ = [
    "TARGETS",
    "MicroOptions",
    "format_micro",
    "run_micro",
    "run_micro_async",
]

TARGETS: Final[Mapping[str, float]] = {
    "copy_ratio": 0.7,
    "lookup_p50_ms": 0.5,
    "hash_list_mtps": 30.0,
    "hash_tensor_mtps": 100.0,
    "overhead_us": 500.0,
}
"""Targets on a 2-core CPU machine: store/retrieve at least 0.7x the raw copy, a 32k-token
lookup p50 at most 0.5 ms, hashing at least 30 M tokens/s from a list and 100 M from a
tensor, per-request overhead of a few hundred microseconds."""

_WARMUP: Final = 1
_LOOKUP_WARMUP: Final = 20
# Prompts stored for the first-sight lookups (more than the engine's digest memo holds),
# and how many of the oldest are looked up.
_FRESH_PROMPTS: Final = 48
_FRESH_MEASURED: Final = 16
_VOCAB: Final = 32000
_HASH_ALGORITHMS: Final = ("blake3", "xxh3_128")


@dataclass(frozen=True, slots=True)
class MicroOptions:
    """Sizes and model shape of the micro-benchmarks."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve in the copy benchmark."""
    lookup_tokens: int = 32768
    """Prompt length of the lookup and hashing benchmarks."""
    repeat: int = 5
    """Measured runs of the copy benchmark (after one warm-up run)."""
    overhead_tokens: int = 1024
    overhead_iterations: int = 20
    lookup_iterations: int = 200
    hash_iterations: int = 30
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16

    def validate(self) -> None:
        """Check the options.

        Raises:
            InvalidInputError: a count or size is not positive, the dtype is unknown, or
                ``overhead_tokens`` exceeds ``tokens``.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        if self.overhead_tokens > self.tokens:
            raise InvalidInputError(
                f"overhead_tokens must be <= tokens, got {self.overhead_tokens} > {self.tokens}"
            )
        parse_dtype(self.dtype)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the copy benchmark."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )


def _slots(blocks: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slots of ``num_tokens`` tokens laid over ``blocks`` in order; int64 ``[num_tokens]``."""
    pos = torch.arange(num_tokens, dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def _row_views(layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer, K and V of an NHD flash-attn cache as ``[num_blocks * block_size, H*D]``."""
    return [[layer[k].view(-1, layout.width) for k in range(2)] for layer in kv_caches]


def _raw_gather(views: list[list[torch.Tensor]], rows: torch.Tensor, out: torch.Tensor) -> None:
    """The plain baseline of a store: one ``index_select`` per layer and K/V into ``out``.

    ``out`` is ``[2, L, T, H*D]``, contiguous.
    """
    for layer, pair in enumerate(views):
        for k, src in enumerate(pair):
            torch.index_select(src, 0, rows, out=out[k, layer])


def _raw_scatter(views: list[list[torch.Tensor]], rows: torch.Tensor, src: torch.Tensor) -> None:
    """The plain baseline of a retrieve: one ``index_copy_`` per layer and K/V from ``src``."""
    for layer, pair in enumerate(views):
        for k, dst in enumerate(pair):
            dst.index_copy_(0, rows, src[k, layer])


async def _engine_warmup(
    engine: CacheEngine,
    tokens: torch.Tensor,
    kv: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """An untimed store and retrieve of the request, then an empty cache: what comes
    between the raw copies and the next timed engine request.

    A raw copy runs on torch's OpenMP threads, which keep spinning for several
    milliseconds after it: an engine request timed at once would share the two cores with
    them (on this kind of machine a 1k-token store took 12.6-13.4 ms right after the raw
    copies, 9.4-9.5 ms 20 ms later). A pause instead would leave the engine to start cold
    where the raw copies, timed right after it, start warm (idle or busy elsewhere for a
    few milliseconds, a small store's validation here takes four times as long). This
    request runs through the spinning, and the timed one then starts as warm as the raw
    copies do.
    """
    await engine.clear()
    await engine.store(tokens, kv_caches=kv, slot_mapping=src)
    await engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst)
    await engine.clear()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def _atimed(fn: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await fn()
    return time.perf_counter() - t0, result


def _cache_gb(nbytes: int) -> float:
    """Arena size in config GB for ``nbytes`` of payload, with room for page rounding."""
    return max(2 * nbytes + 64 * 1024**2, 64 * 1024**2) / GB


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def _copy_entry(nbytes: int, engine_times: list[float], raw_times: list[float]) -> dict[str, Any]:
    engine = _rate(nbytes, statistics.median(engine_times))
    raw = _rate(nbytes, statistics.median(raw_times))
    ratio = engine / raw
    return {
        "engine_gbps": engine,
        "raw_gbps": raw,
        "ratio": ratio,
        "engine_best_gbps": _rate(nbytes, min(engine_times)),
        "raw_best_gbps": _rate(nbytes, min(raw_times)),
        "target_ratio": TARGETS["copy_ratio"],
        "ok": ratio >= TARGETS["copy_ratio"],
    }


async def _copy_bench(
    options: MicroOptions, config: EngineConfig, layout: KVLayout, gen: torch.Generator
) -> dict[str, Any]:
    """Store/retrieve throughput and per-request overhead against the raw copies."""
    num_tokens = options.tokens
    bs = options.block_size
    blocks_needed = math.ceil(num_tokens / bs)
    num_blocks = 2 * blocks_needed
    kv = layout.allocate_kv_caches(num_blocks, generator=gen, random=True)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    src_blocks, dst_blocks = perm[:blocks_needed], perm[blocks_needed:]
    src_slots = _slots(src_blocks, bs, num_tokens)
    dst_slots = _slots(dst_blocks, bs, num_tokens)
    tokens = torch.randint(0, _VOCAB, (num_tokens,), generator=gen, dtype=torch.int64)
    views = _row_views(layout, kv)
    buf = torch.empty(layout.payload_shape(num_tokens), dtype=layout.dtype)
    nbytes = num_tokens * layout.token_bytes
    cfg = config.replace(local_cpu=True, max_local_cpu_size=_cache_gb(nbytes))

    times: dict[str, list[float]] = {
        "store": [],
        "raw_gather": [],
        "retrieve": [],
        "raw_scatter": [],
    }
    problems: list[str] = []
    async with CacheEngine.open(cfg, layout, model_name="lmcache-async-micro") as engine:
        # Engine and raw runs alternate, so a change in the machine's speed during the
        # measurement weighs on both alike (see _engine_warmup for what comes between).
        for run in range(_WARMUP + options.repeat):
            measured = run >= _WARMUP
            await _engine_warmup(engine, tokens, kv, src_slots, dst_slots)
            t_store, stored = await _atimed(
                lambda: engine.store(tokens, kv_caches=kv, slot_mapping=src_slots)
            )
            if stored != num_tokens:
                problems.append(f"store returned {stored} of {num_tokens} tokens")
            t_retrieve, mask = await _atimed(
                lambda: engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
            )
            if not isinstance(mask, torch.Tensor) or not bool(mask.all()):
                problems.append("retrieve did not load every token")
            t_gather = _timed(lambda: _raw_gather(views, src_slots, buf))
            t_scatter = _timed(lambda: _raw_scatter(views, dst_slots, buf))
            if measured:
                times["store"].append(t_store)
                times["retrieve"].append(t_retrieve)
                times["raw_gather"].append(t_gather)
                times["raw_scatter"].append(t_scatter)

        # Bit-exactness, outside the timings: blank the destination, load it, compare.
        for layer in kv:
            layer.index_fill_(1, dst_blocks, 0)
        await engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
        expected = torch.empty_like(buf)
        _raw_gather(views, src_slots, expected)
        _raw_gather(views, dst_slots, buf)
        verified = torch.equal(expected.view(torch.uint8), buf.view(torch.uint8))
        if not verified:
            problems.append("retrieved KV differs from the stored KV")
        del expected

        overhead = await _overhead_bench(
            options,
            engine=engine,
            layout=layout,
            kv=kv,
            tokens=tokens,
            src_slots=src_slots,
            dst_slots=dst_slots,
        )

    return {
        "tokens": num_tokens,
        "bytes": nbytes,
        "runs": options.repeat,
        "store": _copy_entry(nbytes, times["store"], times["raw_gather"]),
        "retrieve": _copy_entry(nbytes, times["retrieve"], times["raw_scatter"]),
        "verified_bit_exact": verified,
        "overhead": overhead,
        "problems": problems,
    }


async def _overhead_bench(
    options: MicroOptions,
    *,
    engine: CacheEngine,
    layout: KVLayout,
    kv: list[torch.Tensor],
    tokens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> dict[str, Any]:
    """Engine time minus raw copy time of one short store and retrieve, in microseconds."""
    n = options.overhead_tokens
    toks, src, dst = tokens[:n].clone(), src_slots[:n].clone(), dst_slots[:n].clone()
    views = _row_views(layout, kv)
    buf = torch.empty(layout.payload_shape(n), dtype=layout.dtype)
    chunk = engine.config.chunk_size
    bounds = [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
    chunk_bufs = [torch.empty(layout.payload_shape(e - s), dtype=layout.dtype) for s, e in bounds]
    src_parts = [src[s:e].clone() for s, e in bounds]
    dst_parts = [dst[s:e].clone() for s, e in bounds]

    def chunk_gather() -> None:
        for rows, out in zip(src_parts, chunk_bufs, strict=True):
            _raw_gather(views, rows, out)

    def chunk_scatter() -> None:
        for rows, payload in zip(dst_parts, chunk_bufs, strict=True):
            _raw_scatter(views, rows, payload)

    times: dict[str, list[float]] = {
        "store": [],
        "raw_gather": [],
        "raw_chunk_gather": [],
        "retrieve": [],
        "raw_scatter": [],
        "raw_chunk_scatter": [],
    }
    # Engine and raw runs alternate, as in _copy_bench.
    for run in range(2 + options.overhead_iterations):
        await _engine_warmup(engine, toks, kv, src, dst)
        t_store, _ = await _atimed(lambda: engine.store(toks, kv_caches=kv, slot_mapping=src))
        t_retrieve, _ = await _atimed(lambda: engine.retrieve(toks, kv_caches=kv, slot_mapping=dst))
        measured = {
            "store": t_store,
            "retrieve": t_retrieve,
            "raw_chunk_gather": _timed(chunk_gather),
            "raw_chunk_scatter": _timed(chunk_scatter),
            "raw_gather": _timed(lambda: _raw_gather(views, src, buf)),
            "raw_scatter": _timed(lambda: _raw_scatter(views, dst, buf)),
        }
        if run >= 2:
            for name, seconds in measured.items():
                times[name].append(seconds)
    med = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    return {
        "tokens": n,
        "chunks": len(bounds),
        "iterations": options.overhead_iterations,
        "store_engine_us": med["store"],
        "store_raw_us": med["raw_chunk_gather"],
        "store_overhead_us": med["store"] - med["raw_chunk_gather"],
        "store_raw_whole_us": med["raw_gather"],
        "retrieve_engine_us": med["retrieve"],
        "retrieve_raw_us": med["raw_chunk_scatter"],
        "retrieve_overhead_us": med["retrieve"] - med["raw_chunk_scatter"],
        "retrieve_raw_whole_us": med["raw_scatter"],
        "target_us": TARGETS["overhead_us"],
    }


async def _lookup_bench(
    options: MicroOptions, config: EngineConfig, gen: torch.Generator
) -> dict[str, Any]:
    """Latency of a fully cached ``lookup_tokens`` prompt, as a tensor and as a list."""
    n = options.lookup_tokens
    bs = options.block_size
    # Lookup cost does not depend on the payload size: a one-layer, 8-wide model will do.
    tiny = KVLayout.vllm_flash_attn(
        num_layers=1, block_size=bs, num_kv_heads=1, head_size=8, dtype=parse_dtype(options.dtype)
    )
    num_blocks = math.ceil(n / bs)
    kv = tiny.allocate_kv_caches(num_blocks, generator=gen, random=True)
    slots = _slots(torch.arange(num_blocks, dtype=torch.int64), bs, n)
    as_tensor = torch.randint(0, _VOCAB, (n,), generator=gen, dtype=torch.int64)
    as_list = as_tensor.tolist()
    # Each chunk takes whole pages of the pool: size it by pages, not payload bytes.
    chunk_bytes = config.chunk_size * tiny.token_bytes
    chunk_pages = -(-chunk_bytes // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
    prompt_bytes = math.ceil(n / config.chunk_size) * chunk_pages
    cfg = config.replace(
        local_cpu=True, max_local_cpu_size=_cache_gb(prompt_bytes * (_FRESH_PROMPTS + 1))
    )
    out: dict[str, Any] = {"tokens": n, "iterations": options.lookup_iterations}
    problems: list[str] = []
    async with CacheEngine.open(cfg, tiny, model_name="lmcache-async-micro-lookup") as engine:
        stored = await engine.store(as_tensor, kv_caches=kv, slot_mapping=slots)
        if stored != n:
            problems.append(f"lookup prompt: store returned {stored} of {n} tokens")
        prompts: dict[str, torch.Tensor | list[int]] = {"tensor": as_tensor, "list": as_list}
        for name, prompt in prompts.items():
            latencies = []
            for i in range(_LOOKUP_WARMUP + options.lookup_iterations):
                t0 = time.perf_counter()
                hit = await engine.lookup(prompt)
                dt = time.perf_counter() - t0
                if hit != n:
                    problems.append(f"lookup ({name}) hit {hit} of {n} tokens")
                    break
                if i >= _LOOKUP_WARMUP:
                    latencies.append(dt * 1e3)
            stat = percentiles(latencies, (50, 99))
            out[name] = {
                "p50_ms": stat["p50"],
                "p99_ms": stat["p99"],
                "ok": stat["p50"] <= TARGETS["lookup_p50_ms"],
            }
        # The engine remembers the digests of its most recent long prompts, so the figures
        # above are for a prompt asked about again. A prompt seen for the first time is
        # hashed in full: store more prompts than it remembers, then look up the oldest.
        fresh = [
            torch.randint(0, _VOCAB, (n,), generator=gen, dtype=torch.int64)
            for _ in range(_FRESH_PROMPTS)
        ]
        for prompt_tensor in fresh:
            await engine.store(prompt_tensor, kv_caches=kv, slot_mapping=slots)
        latencies = []
        for prompt_tensor in fresh[:_FRESH_MEASURED]:
            t0 = time.perf_counter()
            hit = await engine.lookup(prompt_tensor)
            latencies.append((time.perf_counter() - t0) * 1e3)
            if hit != n:
                problems.append(f"lookup (first sight) hit {hit} of {n} tokens")
        stat = percentiles(latencies, (50, 99))
        out["tensor_first_sight"] = {
            "p50_ms": stat["p50"],
            "p99_ms": stat["p99"],
            "ok": stat["p50"] <= TARGETS["lookup_p50_ms"],
        }
    out["target_p50_ms"] = TARGETS["lookup_p50_ms"]
    out["problems"] = problems
    return out


def _hash_bench(options: MicroOptions, chunk_size: int, gen: torch.Generator) -> dict[str, Any]:
    """Tokens/s of ``ChunkHasher.digests`` on a list and on an int64 tensor."""
    n = options.lookup_tokens
    as_tensor = torch.randint(0, _VOCAB, (n,), generator=gen, dtype=torch.int64)
    as_list = as_tensor.tolist()
    layout = options.layout()
    out: dict[str, Any] = {
        "tokens": n,
        "iterations": options.hash_iterations,
        "chunk_size": chunk_size,
    }
    problems: list[str] = []
    for algorithm in _HASH_ALGORITHMS:
        namespace = Namespace(
            model_name="lmcache-async-micro", layout_fingerprint=layout.fingerprint
        )
        hasher = ChunkHasher(namespace, chunk_size=chunk_size, algorithm=HashAlgorithm(algorithm))
        entry: dict[str, Any] = {}
        plain = _PLAIN_CHAINS[algorithm]
        seed = hasher.seed
        if plain(seed, as_tensor, chunk_size) != hasher.digests(as_tensor):
            problems.append(f"{algorithm}: the plain chain gives other digests than the hasher")
        runs = options.hash_iterations
        from_list, _ = _paired_times(functools.partial(hasher.digests, as_list), None, runs)
        from_tensor, from_plain = _paired_times(
            functools.partial(hasher.digests, as_tensor),
            functools.partial(plain, seed, as_tensor, chunk_size),
            runs,
        )
        samples = {"list": from_list, "tensor": from_tensor}
        for name, times in samples.items():
            rate = n / statistics.median(times) / 1e6
            entry[f"{name}_mtps"] = rate
            entry[f"{name}_ok"] = rate >= TARGETS[f"hash_{name}_mtps"]
        entry["tensor_plain_mtps"] = n / statistics.median(from_plain) / 1e6
        entry["tensor_ratio"] = entry["tensor_mtps"] / entry["tensor_plain_mtps"]
        out[algorithm] = entry
    out["native_chain"] = NATIVE_CHAIN
    out["target_list_mtps"] = TARGETS["hash_list_mtps"]
    out["target_tensor_mtps"] = TARGETS["hash_tensor_mtps"]
    out["problems"] = problems
    return out


def _plain_blake3(seed: bytes, tokens: torch.Tensor, chunk_size: int) -> list[bytes]:
    """The plain way to chain blake3 over a token tensor's chunks, with the blake3
    package (the hashing baseline)."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step = chunk_size * 4
    digests: list[bytes] = []
    prev = seed
    for offset in range(0, len(data), step):
        prev = blake3.blake3(data[offset : offset + step] + prev).digest(length=DIGEST_SIZE)
        digests.append(prev)
    return digests


def _plain_xxh3(seed: bytes, tokens: torch.Tensor, chunk_size: int) -> list[bytes]:
    """As :func:`_plain_blake3`, with xxh3-128 (a loop of its own: a hash function passed
    in would cost the baseline one more call per chunk)."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step = chunk_size * 4
    digests: list[bytes] = []
    prev = seed
    for offset in range(0, len(data), step):
        prev = xxhash.xxh3_128_digest(data[offset : offset + step] + prev)
        digests.append(prev)
    return digests


_PlainChain = Callable[[bytes, torch.Tensor, int], list[bytes]]
_PLAIN_CHAINS: Final[Mapping[str, _PlainChain]] = {
    "blake3": _plain_blake3,
    "xxh3_128": _plain_xxh3,
}


def _paired_times(
    first: Callable[[], object], second: Callable[[], object] | None, runs: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``runs`` calls of ``first`` and of ``second`` (when given), one of each
    in turn after three warm-up calls each: a machine that speeds up or slows down while
    they are measured weighs on both alike."""
    for _ in range(3):
        first()
        if second is not None:
            second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        times[0].append(_timed(first))
        if second is not None:
            times[1].append(_timed(second))
    return times


async def run_micro_async(options: MicroOptions, config: EngineConfig) -> dict[str, Any]:
    """Run every micro-benchmark and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on) and
    ``max_local_cpu_size`` (sized to the benchmark, to bound memory).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    started = time.perf_counter()
    # Hashing and lookups first: the raw copies leave torch's OpenMP threads spinning for a
    # while, which would slow whatever is measured next on a 2-core machine.
    hashing = await anyio.to_thread.run_sync(_hash_bench, options, config.chunk_size, gen)
    lookup = await _lookup_bench(options, config, gen)
    copies = await _copy_bench(options, config, layout, gen)
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "method": (
            f"median of {options.repeat} copy runs after {_WARMUP} warm-up; lookups and "
            "hashing: median (p50) over many iterations after warm-up"
        ),
        "torch_threads": torch.get_num_threads(),
        "token_bytes": layout.token_bytes,
        "copy": copies,
        "lookup": lookup,
        "hashing": hashing,
        "problems": copies["problems"] + lookup["problems"] + hashing["problems"],
        "seconds": time.perf_counter() - started,
    }


def run_micro(options: MicroOptions, config: EngineConfig) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_micro_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_micro_async(options, config)

    return anyio.run(main)


def _status(ok: bool) -> str:
    return "ok" if ok else "below target"


def _f(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def format_micro(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`run_micro` results."""
    copy = results["copy"]
    mib = copy["bytes"] / 1024**2
    rows: list[list[str]] = []
    for name, baseline in (("store", "raw gather"), ("retrieve", "raw scatter")):
        e = copy[name]
        rows.append(
            [
                f"{name} {copy['tokens']} tok ({mib:.0f} MiB)",
                f"{_f(e['engine_gbps'], '.2f')} GB/s",
                f"{baseline} {_f(e['raw_gbps'], '.2f')} GB/s",
                f"{_f(e['ratio'], '.2f')}x",
                f">= {e['target_ratio']:.1f}x",
                _status(e["ok"]),
            ]
        )
    lookup = results["lookup"]
    for name in ("tensor", "list", "tensor_first_sight"):
        e = lookup[name]
        rows.append(
            [
                f"lookup {lookup['tokens']} tok ({name.replace('_', ' ')}) p50",
                f"{_f(e['p50_ms'], '.3f')} ms",
                f"p99 {_f(e['p99_ms'], '.3f')} ms",
                "",
                f"<= {lookup['target_p50_ms']:g} ms",
                _status(e["ok"]),
            ]
        )
    hashing = results["hashing"]
    for algorithm in _HASH_ALGORITHMS:
        entry = hashing[algorithm]
        for name in ("list", "tensor"):
            is_default = algorithm == "blake3"
            target = hashing[f"target_{name}_mtps"]
            plain = name == "tensor"
            rows.append(
                [
                    f"hash {algorithm} ({name})",
                    f"{_f(entry[f'{name}_mtps'], '.1f')} M tok/s",
                    f"plain chain {_f(entry['tensor_plain_mtps'], '.1f')} M/s" if plain else "",
                    f"{_f(entry['tensor_ratio'], '.2f')}x" if plain else "",
                    f">= {target:g} M/s" if is_default else "(info)",
                    _status(entry[f"{name}_ok"]) if is_default else "",
                ]
            )
    over = copy["overhead"]
    for name in ("store", "retrieve"):
        value = over[f"{name}_overhead_us"]
        rows.append(
            [
                f"overhead {over['tokens']}-tok {name}",
                f"{_f(value, '.0f')} us",
                f"engine {_f(over[f'{name}_engine_us'], '.0f')} - raw "
                f"{_f(over[f'{name}_raw_us'], '.0f')} us",
                "",
                f"<= {over['target_us']:g} us",
                _status(value <= over["target_us"]),
            ]
        )
    for name, verb in (("store", "gather"), ("retrieve", "scatter")):
        rows.append(
            [
                f"{over['chunks']} chunks vs 1 buffer ({name})",
                f"{_f(over[f'{name}_raw_us'] - over[f'{name}_raw_whole_us'], '.0f')} us",
                f"raw {verb} {_f(over[f'{name}_raw_whole_us'], '.0f')} us",
                "",
                "(info)",
                "",
            ]
        )
    opts = results["options"]
    lines = [
        "lmcache-async micro bench",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {results['token_bytes'] / 1024:.1f} KiB per "
        f"token; torch threads: {results['torch_threads']}",
        f"figures: {results['method']}",
        "",
        format_table(["figure", "value", "baseline", "ratio", "target", "status"], rows),
        "",
        "retrieve bit-exact: " + ("yes" if copy["verified_bit_exact"] else "NO"),
        "blake3 key chain: "
        + (
            "in C (lmcache_async._native)"
            if hashing.get("native_chain")
            else "the blake3 package (the package was built without its C chain)"
        ),
    ]
    problems = results["problems"]
    if problems:
        lines.append("problems: " + "; ".join(problems))
    lines.append(f"total {results['seconds']:.1f} s")
    return "\n".join(lines)
