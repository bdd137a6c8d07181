"""The sidecar benchmark: the same work through a sidecar and in-process, in one run.

A sidecar is started as a subprocess (``lmcache-async serve`` on an ``ipc://`` socket in a
temporary directory, with the same engine configuration) and driven by a
:class:`~lmcache_async.RemoteCacheEngine` whose KV moves through the sidecar's shared
memory. Next to it, in the same run, an embedded :class:`~lmcache_async.CacheEngine` does
the same work:

- **store** GB/s: ``store`` of ``tokens`` tokens into an emptied cache;
- **retrieve** GB/s: ``retrieve`` of those tokens into other blocks;
- **lookup** round trip of a fully cached ``lookup_tokens``-token prompt (tokens as a
  tensor), repeated (the digests are remembered) and first sight (every prompt new), next
  to the round trip of an empty PING through the same client and those of a bare echo
  over ZeroMQ and over the same-host stream (:mod:`lmcache_async.bench.echo`, read from
  asyncio at both ends as the sidecar and its client are): what a round trip costs before
  the sidecar does any work.

Each copy figure is the median of ``repeat`` runs after a warm-up run. Targets: the
sidecar at least 0.9x the in-process throughput, a 32k-token lookup p50 at most 0.5 ms.

With ``curve`` a second sidecar serves the same work on loopback tcp under CURVE with an
allow-list (:mod:`.sidecar_curve`), and its figures are set beside the plain sidecar's.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import anyio
import torch
import yaml

from lmcache_async import CacheEngine, EngineConfig, KVCacheClient, KVLayout, RemoteCacheEngine
from lmcache_async.bench import format_table, gbps, parse_dtype, percentiles
from lmcache_async.bench.baselines import slots_over
from lmcache_async.bench.echo import round_trips
from lmcache_async.bench.sidecar_curve import CurveFiles, free_loopback_port, make_curve_files
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError, TierUnavailableError
from lmcache_async.rpc.protocol import MessageType, encode

__all__ = [
    "TARGETS",
    "SidecarBenchOptions",
    "format_sidecar",
    "run_sidecar_bench",
    "sidecar_process",
    "wait_sidecar_ready",
]

TARGETS: Final[Mapping[str, float]] = {"throughput_ratio": 0.9, "lookup_p50_ms": 0.5}
"""The sidecar at least 0.9x the in-process store and retrieve GB/s; a lookup round trip
p50 of at most 0.5 ms."""

_WARMUP: Final = 1
_LOOKUP_WARMUP: Final = 20
_FIRST_SIGHT_LOOKUPS: Final = 16
_VOCAB: Final = 32000
_MODEL: Final = "lmcache-async-bench-sidecar"
_STOP_TIMEOUT: Final = 30.0


@dataclass(frozen=True, slots=True)
class SidecarBenchOptions:
    """Sizes and model shape of the sidecar benchmark."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve."""
    repeat: int = 5
    """Measured store/retrieve runs (after one warm-up run)."""
    lookup_tokens: int = 32768
    lookup_iterations: int = 200
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    startup_timeout: float = 120.0
    """Seconds the sidecar process may take to start answering."""
    request_timeout: float = 30.0
    """The client's per-request timeout."""
    curve: bool = False
    """Also run the work through a CURVE sidecar with an allow-list, beside the plain one."""

    def validate(self) -> None:
        """Check the options.

        Raises:
            InvalidInputError: a count, size or timeout is not positive, or the dtype is
                unknown.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype", "curve"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        parse_dtype(self.dtype)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the benchmark."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )


async def _timed(fn: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await fn()
    return time.perf_counter() - t0, result


@dataclass(slots=True)
class _Work:
    """The tensors and prompts both engines are given."""

    layout: KVLayout
    kv: list[torch.Tensor]
    tokens: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    dst_blocks: torch.Tensor
    lookup_prompt: torch.Tensor
    lookup_kv: list[torch.Tensor]
    lookup_slots: torch.Tensor
    fresh_prompts: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return int(self.tokens.numel()) * self.layout.token_bytes


def _make_work(options: SidecarBenchOptions) -> _Work:
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    bs = options.block_size
    blocks_needed = math.ceil(options.tokens / bs)
    num_blocks = 2 * blocks_needed
    kv = layout.allocate_kv_caches(num_blocks, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    src_blocks, dst_blocks = perm[:blocks_needed], perm[blocks_needed:]
    lookup_blocks = math.ceil(options.lookup_tokens / bs)
    # The long prompt's KV only has to be stored once: its content does not matter.
    lookup_kv = layout.allocate_kv_caches(lookup_blocks, random=False)

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(0, _VOCAB, (length,), generator=gen, dtype=torch.int32)

    return _Work(
        layout=layout,
        kv=kv,
        tokens=prompt(options.tokens),
        src_slots=slots_over(src_blocks, bs, options.tokens),
        dst_slots=slots_over(dst_blocks, bs, options.tokens),
        dst_blocks=dst_blocks,
        lookup_prompt=prompt(options.lookup_tokens),
        lookup_kv=lookup_kv,
        lookup_slots=torch.arange(options.lookup_tokens, dtype=torch.int64),
        fresh_prompts=[prompt(options.lookup_tokens) for _ in range(_FIRST_SIGHT_LOOKUPS)],
    )


async def _measure(
    engine: KVCacheClient, work: _Work, options: SidecarBenchOptions, problems: list[str], name: str
) -> dict[str, Any]:
    """Store/retrieve times and lookup latencies of one engine (in-process or sidecar)."""
    times: dict[str, list[float]] = {"store": [], "retrieve": []}
    n = int(work.tokens.numel())
    kv, tokens = work.kv, work.tokens
    for run in range(_WARMUP + options.repeat):
        await engine.clear()
        t_store, stored = await _timed(
            lambda: engine.store(tokens, kv_caches=kv, slot_mapping=work.src_slots)
        )
        if stored != n:
            problems.append(f"{name}: store returned {stored} of {n} tokens")
        t_retrieve, mask = await _timed(
            lambda: engine.retrieve(tokens, kv_caches=kv, slot_mapping=work.dst_slots)
        )
        if not isinstance(mask, torch.Tensor) or not bool(mask.all()):
            problems.append(f"{name}: retrieve did not load every token")
        if run >= _WARMUP:
            times["store"].append(t_store)
            times["retrieve"].append(t_retrieve)

    # Bit-exactness, outside the timings: blank the destination, load it, compare. The
    # big copies run in a thread: a client's event loop must keep up its heartbeats.
    def blank() -> None:
        for layer in kv:
            layer.index_fill_(1, work.dst_blocks, 0)

    def compare() -> bool:
        expected = torch.empty(work.layout.payload_shape(n), dtype=work.layout.dtype)
        got = torch.empty_like(expected)
        work.layout.gather(kv, work.src_slots, expected)
        work.layout.gather(kv, work.dst_slots, got)
        return torch.equal(expected.view(torch.uint8), got.view(torch.uint8))

    await anyio.to_thread.run_sync(blank)
    await engine.retrieve(tokens, kv_caches=kv, slot_mapping=work.dst_slots)
    exact = await anyio.to_thread.run_sync(compare)
    if not exact:
        problems.append(f"{name}: retrieved KV differs from the stored KV")

    await engine.clear()
    long_prompt = work.lookup_prompt
    stored = await engine.store(
        long_prompt, kv_caches=work.lookup_kv, slot_mapping=work.lookup_slots
    )
    if stored != long_prompt.numel():
        problems.append(f"{name}: the lookup prompt stored {stored} of {long_prompt.numel()}")
    latencies: list[float] = []
    for i in range(_LOOKUP_WARMUP + options.lookup_iterations):
        elapsed, hits = await _timed(lambda: engine.lookup(long_prompt))
        if hits != long_prompt.numel():
            problems.append(f"{name}: lookup found {hits} of {long_prompt.numel()} tokens")
            break
        if i >= _LOOKUP_WARMUP:
            latencies.append(elapsed)
    first_sight: list[float] = []
    for fresh in work.fresh_prompts:
        elapsed, _ = await _timed(lambda: engine.lookup(fresh))  # noqa: B023 (awaited here)
        first_sight.append(elapsed)
    await engine.clear()
    return {
        "store_times": times["store"],
        "retrieve_times": times["retrieve"],
        "exact": exact,
        "lookup": _latency(latencies),
        "lookup_first_sight": _latency(first_sight),
    }


async def _ping_latency(
    engine: RemoteCacheEngine, options: SidecarBenchOptions
) -> dict[str, float]:
    """Round trips of an empty request: what any sidecar call costs before its work."""
    latencies: list[float] = []
    for i in range(_LOOKUP_WARMUP + options.lookup_iterations):
        elapsed, _ = await _timed(engine.ping)
        if i >= _LOOKUP_WARMUP:
            latencies.append(elapsed)
    return _latency(latencies)


async def _echo_latency(
    directory: str, options: SidecarBenchOptions
) -> tuple[dict[str, float], dict[str, float]]:
    """Round trips of a PING's frames to a bare echo server (:mod:`.echo`) in its own
    process, over ZeroMQ and over the same-host stream, read from the event loop as the
    sidecar's client reads its replies.

    Raises:
        TimeoutError: the echo did not answer within ``startup_timeout`` at first, or
            within ``request_timeout`` later.
    """
    trips = await round_trips(
        directory,
        encode(MessageType.PING, None, request_id=1),
        count=options.lookup_iterations,
        warmup=_LOOKUP_WARMUP,
        startup_timeout=options.startup_timeout,
        request_timeout=options.request_timeout,
    )
    return _latency(trips.zeromq), _latency(trips.stream)


async def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop ``process``: SIGTERM, then SIGKILL after ``_STOP_TIMEOUT``."""
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        await anyio.to_thread.run_sync(process.wait, _STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        await anyio.to_thread.run_sync(process.wait, _STOP_TIMEOUT)


def _latency(seconds: list[float]) -> dict[str, float]:
    stat = percentiles([s * 1e3 for s in seconds], (50, 99))
    return {"p50_ms": stat["p50"], "p99_ms": stat["p99"], "mean_ms": stat["mean"]}


def _serve_command() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


def _start_sidecar(
    config: EngineConfig, directory: str, curve: CurveFiles | None = None
) -> tuple[str, subprocess.Popen[bytes]]:
    """Start ``lmcache-async serve`` with ``config`` on an ipc socket in ``directory``
    (with ``curve``: on loopback tcp, serving that allow-list)."""
    name = "sidecar" if curve is None else "curve-sidecar"
    config_path = os.path.join(directory, f"{name}.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config.to_dict(), f)
    url = f"ipc://{os.path.join(directory, 'sidecar.sock')}"
    if curve is not None:
        url = f"tcp://127.0.0.1:{free_loopback_port()}"
    command = [*_serve_command(), "--log-level", "WARNING", "serve"]
    command += ["--listen", url, "--config", config_path]
    command += [] if curve is None else curve.serve_flags()
    with open(os.path.join(directory, f"{name}.log"), "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    return url, process


@contextlib.asynccontextmanager
async def sidecar_process(
    config: EngineConfig, directory: str, curve: CurveFiles | None = None
) -> AsyncIterator[str]:
    """A sidecar process: ``lmcache-async serve`` with ``config`` on an ipc socket in
    ``directory`` (with ``curve``: on loopback tcp, serving that allow-list), its log in
    ``directory``; yields its URL and stops it (SIGTERM, then SIGKILL) on exit."""
    url, process = _start_sidecar(config, directory, curve)
    try:
        yield url
    finally:
        await _stop(process)


def _keys(curve: CurveFiles | None) -> dict[str, Any]:
    """The client's CURVE arguments for a sidecar with ``curve``'s allow-list."""
    if curve is None:
        return {}
    return {"server_public_key": curve.server_public_key, "client_certificate": curve.client_secret}


async def wait_sidecar_ready(
    url: str,
    layout: KVLayout,
    *,
    model_name: str,
    timeout: float,
    curve: CurveFiles | None = None,
) -> None:
    """Retry the handshake until the sidecar at ``url`` answers (it imports torch first).

    Raises:
        TimeoutError: not within ``timeout`` seconds.
    """
    with anyio.fail_after(timeout):
        while True:
            try:
                async with RemoteCacheEngine.connect(
                    url, layout, model_name=model_name, timeout=1.0, **_keys(curve)
                ):
                    return
            except TierUnavailableError:
                continue  # each attempt waited for an answer: retry at once


async def _wait_ready(
    url: str, layout: KVLayout, options: SidecarBenchOptions, curve: CurveFiles | None = None
) -> None:
    await wait_sidecar_ready(
        url, layout, model_name=_MODEL, timeout=options.startup_timeout, curve=curve
    )


def _entry(nbytes: int, sidecar: list[float], inprocess: list[float]) -> dict[str, Any]:
    side = gbps(nbytes, statistics.median(sidecar))
    local = gbps(nbytes, statistics.median(inprocess))
    ratio = side / local
    return {
        "sidecar_gbps": side,
        "inprocess_gbps": local,
        "ratio": ratio,
        "sidecar_best_gbps": gbps(nbytes, min(sidecar)),
        "inprocess_best_gbps": gbps(nbytes, min(inprocess)),
        "target_ratio": TARGETS["throughput_ratio"],
        "ok": ratio >= TARGETS["throughput_ratio"],
    }


async def run_sidecar_bench(
    options: SidecarBenchOptions | None = None, config: EngineConfig | None = None
) -> dict[str, Any]:
    """Run the benchmark and return every figure as plain data (see the module docstring).

    ``config`` is the engine configuration of both engines; its host cache size is raised
    to hold the work. The result's ``problems`` lists anything that went wrong (a partial
    store, a retrieve that is not bit-exact, a lookup that missed).

    Raises:
        InvalidInputError: bad options.
        TimeoutError: the sidecar did not answer within ``startup_timeout``.
    """
    options = options or SidecarBenchOptions()
    options.validate()
    work = _make_work(options)
    copy_bytes = work.nbytes
    lookup_bytes = options.lookup_tokens * work.layout.token_bytes
    cache_bytes = 2 * max(copy_bytes, lookup_bytes) + 64 * 1024**2
    base = config or EngineConfig()
    cfg = base.replace(local_cpu=True, max_local_cpu_size=cache_bytes / GB, local_disk=None)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as directory:
        async with sidecar_process(cfg, directory) as url:
            await _wait_ready(url, work.layout, options)
            # In-process first, while the sidecar idles; then the same work through it.
            async with CacheEngine.open(cfg, work.layout, model_name=_MODEL) as local:
                inprocess = await _measure(local, work, options, problems, "in-process")
            async with RemoteCacheEngine.connect(
                url, work.layout, model_name=_MODEL, timeout=options.request_timeout
            ) as remote:
                shared = remote.uses_shared_memory
                sidecar = await _measure(remote, work, options, problems, "sidecar")
                ping = await _ping_latency(remote, options)
                stream = remote.uses_stream
                echo, stream_echo = await _echo_latency(directory, options)
        curve = None
        if options.curve:
            curve = await _measure_curve(cfg, directory, work, options, problems)
    lookup_ok = sidecar["lookup"]["p50_ms"] <= TARGETS["lookup_p50_ms"]
    return {
        "options": asdict(options),
        "tokens": options.tokens,
        "bytes": copy_bytes,
        "runs": options.repeat,
        "shared_memory": shared,
        "stream": stream,
        "store": _entry(copy_bytes, sidecar["store_times"], inprocess["store_times"]),
        "retrieve": _entry(copy_bytes, sidecar["retrieve_times"], inprocess["retrieve_times"]),
        "verified_bit_exact": bool(sidecar["exact"] and inprocess["exact"]),
        "lookup": {
            "tokens": options.lookup_tokens,
            "sidecar": sidecar["lookup"],
            "sidecar_first_sight": sidecar["lookup_first_sight"],
            "inprocess": inprocess["lookup"],
            "inprocess_first_sight": inprocess["lookup_first_sight"],
            "sidecar_ping": ping,
            "echo": echo,
            "stream_echo": stream_echo,
            "target_p50_ms": TARGETS["lookup_p50_ms"],
            "ok": lookup_ok,
        },
        "curve": None if curve is None else _curve_entry(copy_bytes, curve, sidecar),
        "problems": problems,
    }


async def _measure_curve(
    config: EngineConfig,
    directory: str,
    work: _Work,
    options: SidecarBenchOptions,
    problems: list[str],
) -> dict[str, Any]:
    """The work through a sidecar under CURVE with an allow-list (loopback tcp)."""
    files = make_curve_files(os.path.join(directory, "curve"))
    async with sidecar_process(config, directory, files) as url:
        await _wait_ready(url, work.layout, options, files)
        async with RemoteCacheEngine.connect(
            url, work.layout, model_name=_MODEL, timeout=options.request_timeout, **_keys(files)
        ) as remote:
            return await _measure(remote, work, options, problems, "CURVE sidecar")


def _curve_entry(nbytes: int, curve: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The CURVE sidecar's figures, each with its ratio to the plain sidecar's."""
    entries: dict[str, Any] = {}
    for name in ("store", "retrieve"):
        side = gbps(nbytes, statistics.median(curve[f"{name}_times"]))
        base = gbps(nbytes, statistics.median(plain[f"{name}_times"]))
        entries[name] = {"curve_gbps": side, "plain_gbps": base, "ratio": side / base}
    ours, theirs = curve["lookup"]["p50_ms"], plain["lookup"]["p50_ms"]
    entries["lookup"] = {
        "curve_p50_ms": ours,
        "plain_p50_ms": theirs,
        "curve_p99_ms": curve["lookup"]["p99_ms"],
        "ratio": ours / theirs if theirs > 0 else math.inf,
    }
    return entries


def _f(value: float, spec: str) -> str:
    return "n/a" if not math.isfinite(value) else format(value, spec)


def _status(ok: bool) -> str:
    return "ok" if ok else "MISS"


def format_sidecar(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`run_sidecar_bench` results."""
    mib = results["bytes"] / 1024**2
    rows: list[list[str]] = []
    for name in ("store", "retrieve"):
        e = results[name]
        rows.append(
            [
                f"{name} {results['tokens']} tok ({mib:.0f} MiB)",
                f"sidecar {_f(e['sidecar_gbps'], '.2f')} GB/s",
                f"in-process {_f(e['inprocess_gbps'], '.2f')} GB/s",
                f"{_f(e['ratio'], '.2f')}x",
                f">= {e['target_ratio']:.1f}x",
                _status(e["ok"]),
            ]
        )
    lookup = results["lookup"]
    for key, label, target in (
        ("sidecar", "sidecar", True),
        ("sidecar_first_sight", "sidecar, first sight", False),
        ("inprocess", "in-process", False),
        ("sidecar_ping", "sidecar, empty PING", False),
        ("echo", "bare ZeroMQ echo, same frames", False),
        ("stream_echo", "bare stream echo, same frames", False),
    ):
        e = lookup[key]
        rows.append(
            [
                f"lookup {lookup['tokens']} tok ({label}) p50"
                if key not in ("sidecar_ping", "echo", "stream_echo")
                else f"round trip ({label}) p50",
                f"{_f(e['p50_ms'], '.3f')} ms",
                f"p99 {_f(e['p99_ms'], '.3f')} ms",
                "",
                f"<= {lookup['target_p50_ms']:g} ms" if target else "(info)",
                _status(lookup["ok"]) if target else "",
            ]
        )
    header = ["sidecar benchmark", "figure", "beside", "ratio", "target", ""]
    curve = results.get("curve")
    if curve is not None:
        for name in ("store", "retrieve"):
            e = curve[name]
            rows.append(
                [
                    f"{name} (CURVE sidecar, allow-list)",
                    f"{_f(e['curve_gbps'], '.2f')} GB/s",
                    f"plain sidecar {_f(e['plain_gbps'], '.2f')} GB/s",
                    f"{_f(e['ratio'], '.2f')}x",
                    "(info)",
                    "",
                ]
            )
        e = curve["lookup"]
        rows.append(
            [
                "lookup (CURVE sidecar) p50",
                f"{_f(e['curve_p50_ms'], '.3f')} ms",
                f"plain sidecar {_f(e['plain_p50_ms'], '.3f')} ms",
                f"{_f(e['ratio'], '.2f')}x",
                "(info)",
                "",
            ]
        )
    lines = [format_table(header, rows)]
    transport = "shared memory" if results["shared_memory"] else "inline frames"
    requests = "the same-host stream" if results.get("stream") else "ZeroMQ"
    exact = "bit-exact" if results["verified_bit_exact"] else "NOT bit-exact"
    lines.append(f"requests over {requests}, payloads through {transport}; retrieves {exact}")
    lines.extend(f"problem: {p}" for p in results["problems"])
    return "\n".join(lines)
