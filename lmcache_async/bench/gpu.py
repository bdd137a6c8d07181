"""GPU benchmark: the engine's device copies next to plain pinned copies, and layerwise overlap.

Every figure is measured in the same run, on the same tensors, as its baseline:

- **D2H** GB/s: ``engine.store`` of ``T`` tokens out of KV caches on the device into an
  emptied cache (pinned host arena), against the plain way of moving the same bytes: per
  layer and K/V one ``index_select`` into a preallocated device buffer ``[2, L, T, H*D]``,
  then one ``copy_(non_blocking=True)`` into a pinned host tensor;
- **H2D** GB/s: ``engine.retrieve`` of those tokens into other blocks, against one pinned
  ``copy_(non_blocking=True)`` into the device buffer followed by one ``index_copy_`` per
  layer and K/V;
- **layerwise overlap**: ``engine.retrieve_layer`` driven the way a serving engine drives it
  (await layer *i*, then queue layer *i*'s compute on the compute stream, which is the
  current stream as in vLLM), with a simulated compute per layer (square matmuls, as many as
  take about as long as one layer's transfer) against the transfer and the compute run back
  to back. The fraction of transfer time hidden is ``(serial - overlap) / transfer``.

Times are wall clock around each call with the device synchronized before and after, so the
engine (which returns once its copies have completed) and the baselines are timed alike;
each figure is the median of ``repeat`` runs after one warm-up run.

On the CPU (``device="cpu"``, or ``"auto"`` without CUDA) the same code runs on host tensors
at whatever sizes are given: it checks that the benchmark works, but its figures say nothing
about a GPU and the targets do not apply to them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.bench import format_table, parse_dtype
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError

__all__ = [
    "DEVICES",
    "TARGETS",
    "GpuOptions",
    "format_gpu",
    "run_gpu_bench",
    "run_gpu_bench_async",
]

TARGETS: Final[Mapping[str, float]] = {"copy_ratio": 0.8, "hidden_fraction": 0.7}
"""On a GPU: store and retrieve at least 0.8x the plain pinned copy of the same bytes, and a
layerwise retrieve that hides at least 70% of its transfer time behind the compute."""

DEVICES: Final = ("auto", "cuda", "cpu")
"""Accepted device names (``cuda:N`` is accepted too); ``auto`` is CUDA when available."""

CPU_NOTE: Final = (
    "no CUDA device: these are CPU figures of the benchmark's CPU path; "
    "CUDA D2H/H2D and overlap figures need a GPU, and the targets apply only to them"
)

_WARMUP: Final = 1
_VOCAB: Final = 32000
# Square matmuls of the simulated compute: small enough that a layer's worth is a whole
# number of them to within a few percent, large enough to keep the device busy.
_MATMUL_DIM: Final = {"cuda": 2048, "cpu": 64}
_CALIBRATION_MATMULS: Final = 50


@dataclass(frozen=True, slots=True)
class GpuOptions:
    """Sizes, model shape and device of the GPU benchmark (defaults: a Llama-3-8B-like
    model, 32 layers x 8 KV heads x 128, bf16, 128 KiB of KV per token)."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve."""
    repeat: int = 5
    """Measured runs of each figure (after one warm-up run)."""
    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cuda``, ``cuda:N`` or ``cpu``."""
    compute_ratio: float = 1.0
    """Simulated compute per layer, as a multiple of one layer's transfer time."""

    def validate(self) -> None:
        """Check the options (but not whether the device exists: see :meth:`torch_device`).

        Raises:
            InvalidInputError: a count or size is not positive, the dtype or the device name
                is unknown.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype", "device"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        parse_dtype(self.dtype)
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            allowed = ", ".join((*DEVICES, "cuda:N"))
            raise InvalidInputError(f"unknown device {self.device!r}; expected one of {allowed}")

    def torch_device(self) -> torch.device:
        """The device the KV caches live on.

        Raises:
            InvalidInputError: CUDA was asked for and is not available, or the name is bad.
        """
        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"device {self.device!r}: no CUDA device (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda})"
            )
        try:
            device = torch.device(self.device if self.device != "auto" else "cuda")
        except RuntimeError as exc:
            raise InvalidInputError(f"device {self.device!r}: {exc}") from None
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidInputError(
                f"device {self.device!r}: only {torch.cuda.device_count()} CUDA devices"
            )
        return torch.device("cuda", index)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the benchmark."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds of ``fn()`` with the device synchronized before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


async def _atimed(device: torch.device, fn: Callable[[], Awaitable[object]]) -> float:
    """Seconds of ``await fn()`` with the device synchronized before and after."""
    _sync(device)
    t0 = time.perf_counter()
    await fn()
    _sync(device)
    return time.perf_counter() - t0


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def _cache_gb(nbytes: int) -> float:
    """Arena size in config GB for ``nbytes`` of payload, with room for page rounding."""
    return max(2 * nbytes + 64 * 1024**2, 64 * 1024**2) / GB


def _slots(blocks: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slots of ``num_tokens`` tokens laid over ``blocks`` in order; int64 ``[num_tokens]``."""
    pos = torch.arange(num_tokens, dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def _row_views(layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer, K and V of an NHD flash-attn cache as ``[num_blocks * block_size, H*D]``."""
    return [[layer[k].view(-1, layout.width) for k in range(2)] for layer in kv_caches]


def _gather(views: list[list[torch.Tensor]], rows: torch.Tensor, out: torch.Tensor) -> None:
    """One ``index_select`` per layer and K/V into ``out`` (``[2, L, T, H*D]``, contiguous)."""
    for layer, pair in enumerate(views):
        for k, src in enumerate(pair):
            torch.index_select(src, 0, rows, out=out[k, layer])


def _scatter(views: list[list[torch.Tensor]], rows: torch.Tensor, src: torch.Tensor) -> None:
    """One ``index_copy_`` per layer and K/V from ``src`` (``[2, L, T, H*D]``)."""
    for layer, pair in enumerate(views):
        for k, dst in enumerate(pair):
            dst.index_copy_(0, rows, src[k, layer])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


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


@dataclass(slots=True)
class _Scene:
    """The tensors every part of the benchmark shares."""

    device: torch.device
    layout: KVLayout
    kv: list[torch.Tensor]
    tokens: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    dst_blocks: torch.Tensor
    nbytes: int

    def blank_destination(self) -> None:
        for layer in self.kv:
            layer.index_fill_(1, self.dst_blocks, 0)

    def destination_matches_source(self) -> bool:
        """Whether the destination slots hold exactly the source slots' KV (on the device)."""
        views = _row_views(self.layout, self.kv)
        shape = self.layout.payload_shape(int(self.tokens.shape[0]))
        expected = torch.empty(shape, dtype=self.layout.dtype, device=self.device)
        got = torch.empty_like(expected)
        _gather(views, self.src_slots, expected)
        _gather(views, self.dst_slots, got)
        return torch.equal(_bits(expected), _bits(got))


def _make_scene(options: GpuOptions, device: torch.device) -> _Scene:
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    num_tokens = options.tokens
    bs = options.block_size
    blocks_needed = math.ceil(num_tokens / bs)
    num_blocks = 2 * blocks_needed
    device_gen = torch.Generator(device=device).manual_seed(options.seed)
    kv = layout.allocate_kv_caches(num_blocks, device=device, generator=device_gen, random=True)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    src_blocks, dst_blocks = perm[:blocks_needed], perm[blocks_needed:]
    return _Scene(
        device=device,
        layout=layout,
        kv=kv,
        tokens=torch.randint(0, _VOCAB, (num_tokens,), generator=gen, dtype=torch.int64),
        # On the device, as a serving engine hands them over.
        src_slots=_slots(src_blocks, bs, num_tokens).to(device),
        dst_slots=_slots(dst_blocks, bs, num_tokens).to(device),
        dst_blocks=dst_blocks.to(device),
        nbytes=num_tokens * layout.token_bytes,
    )


async def _copy_bench(engine: CacheEngine, scene: _Scene, repeat: int) -> dict[str, Any]:
    """Store (D2H) and retrieve (H2D) GB/s against plain pinned copies of the same bytes."""
    device, layout = scene.device, scene.layout
    num_tokens = int(scene.tokens.shape[0])
    views = _row_views(layout, scene.kv)
    shape = layout.payload_shape(num_tokens)
    cuda = device.type == "cuda"
    host = torch.empty(shape, dtype=layout.dtype, pin_memory=cuda)
    staging = torch.empty(shape, dtype=layout.dtype, device=device)

    # On the CPU the plain copies gather into and scatter from the host tensor directly:
    # there is no bus to cross.
    def raw_d2h() -> None:
        if cuda:
            _gather(views, scene.src_slots, staging)
            host.copy_(staging, non_blocking=True)
        else:
            _gather(views, scene.src_slots, host)

    def raw_h2d() -> None:
        if cuda:
            staging.copy_(host, non_blocking=True)
            _scatter(views, scene.dst_slots, staging)
        else:
            _scatter(views, scene.dst_slots, host)

    def memcpy_d2h() -> None:
        host.copy_(staging, non_blocking=True)

    def memcpy_h2d() -> None:
        staging.copy_(host, non_blocking=True)

    times: dict[str, list[float]] = {
        name: [] for name in ("store", "raw_d2h", "retrieve", "raw_h2d", "memcpy_d2h", "memcpy_h2d")
    }
    problems: list[str] = []
    stored: list[int] = []
    masks: list[torch.Tensor] = []

    async def store() -> None:
        stored.append(
            await engine.store(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.src_slots)
        )

    async def retrieve() -> None:
        masks.append(
            await engine.retrieve(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
        )

    # Engine and baseline take turns within each run, so that clocks and other load on the
    # machine weigh on both alike.
    for run in range(_WARMUP + repeat):
        await engine.clear()
        sample = {
            "store": await _atimed(device, store),
            "raw_d2h": _timed(device, raw_d2h),
            "retrieve": await _atimed(device, retrieve),
            "raw_h2d": _timed(device, raw_h2d),
            "memcpy_d2h": _timed(device, memcpy_d2h),
            "memcpy_h2d": _timed(device, memcpy_h2d),
        }
        if run >= _WARMUP:
            for name, seconds in sample.items():
                times[name].append(seconds)
    if any(n != num_tokens for n in stored):
        problems.append(f"store returned {min(stored)} of {num_tokens} tokens")
    if not all(bool(mask.all()) for mask in masks):
        problems.append("retrieve did not load every token")

    # Bit-exactness, outside the timings: blank the destination, load it, compare.
    scene.blank_destination()
    await engine.retrieve(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
    _sync(device)
    verified = scene.destination_matches_source()
    if not verified:
        problems.append("retrieved KV differs from the stored KV")
    nbytes = scene.nbytes
    return {
        "tokens": num_tokens,
        "bytes": nbytes,
        "runs": repeat,
        "d2h": _copy_entry(nbytes, times["store"], times["raw_d2h"]),
        "h2d": _copy_entry(nbytes, times["retrieve"], times["raw_h2d"]),
        "memcpy_d2h_gbps": _rate(nbytes, statistics.median(times["memcpy_d2h"])),
        "memcpy_h2d_gbps": _rate(nbytes, statistics.median(times["memcpy_h2d"])),
        "verified_bit_exact": verified,
        "problems": problems,
    }


class _Compute:
    """A simulated layer of model compute: ``reps`` square matmuls on the current stream."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device = device
        # The CPU has no fast bf16 matmul; the stand-in only has to take time.
        self.dtype = dtype if device.type == "cuda" else torch.float32
        self.dim = _MATMUL_DIM[device.type]
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(self.dim, self.dim, generator=gen) / math.sqrt(self.dim)
        self._a = a.to(device=device, dtype=self.dtype)
        self._b = self._a.t().contiguous()
        self._out = torch.empty_like(self._a)
        self.reps = 1
        self.matmul_seconds = math.nan

    def layer(self) -> None:
        for _ in range(self.reps):
            torch.mm(self._a, self._b, out=self._out)

    def calibrate(self, layer_seconds: float) -> None:
        """Choose ``reps`` so that one layer's compute takes about ``layer_seconds``."""
        for _ in range(3):
            torch.mm(self._a, self._b, out=self._out)

        def burst() -> None:
            for _ in range(_CALIBRATION_MATMULS):
                torch.mm(self._a, self._b, out=self._out)

        self.matmul_seconds = _timed(self.device, burst) / _CALIBRATION_MATMULS
        self.reps = max(1, round(layer_seconds / self.matmul_seconds))


async def _retrieve_layers(
    engine: CacheEngine, scene: _Scene, compute: Callable[[], None] | None
) -> torch.Tensor | None:
    """Drive one layerwise retrieve as a serving engine does; the mask it yields last.

    With ``compute``, layer *i*'s compute is queued right after step *i + 1* says layer *i*
    is loaded, while layer *i + 1*'s copy runs.
    """
    it = engine.retrieve_layer(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
    result: torch.Tensor | None = None
    try:
        await anext(it)
        for _ in range(scene.layout.num_layers):
            result = await anext(it)
            if compute is not None:
                compute()
    finally:
        await it.aclose()
    return result


async def _layerwise_bench(
    engine: CacheEngine, scene: _Scene, options: GpuOptions
) -> dict[str, Any]:
    """Layerwise retrieve interleaved with a simulated per-layer compute vs back to back."""
    device, layout = scene.device, scene.layout
    num_layers = layout.num_layers
    num_tokens = int(scene.tokens.shape[0])
    problems: list[str] = []
    await engine.clear()
    stored: int | None = None
    it = engine.store_layer(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.src_slots)
    try:
        for _ in range(num_layers + 1):
            step = await anext(it)
            if step is not None:
                stored = step
    finally:
        await it.aclose()
    if stored != num_tokens:
        problems.append(f"store_layer stored {stored} of {num_tokens} tokens")

    masks: list[torch.Tensor | None] = []

    async def transfer() -> None:
        masks.append(await _retrieve_layers(engine, scene, None))

    compute = _Compute(device, layout.dtype, options.seed)

    def compute_all() -> None:
        for _ in range(num_layers):
            compute.layer()

    async def serial() -> None:
        masks.append(await _retrieve_layers(engine, scene, None))
        compute_all()

    async def overlap() -> None:
        masks.append(await _retrieve_layers(engine, scene, compute.layer))

    # Size the compute to the transfer it should hide.
    calibration = [await _atimed(device, transfer) for _ in range(_WARMUP + 2)][_WARMUP:]
    compute.calibrate(options.compute_ratio * statistics.median(calibration) / num_layers)
    compute_all()  # warm-up of the compute at its final size

    times: dict[str, list[float]] = {"transfer": [], "compute": [], "serial": [], "overlap": []}
    for run in range(_WARMUP + options.repeat):
        sample = {
            "transfer": await _atimed(device, transfer),
            "compute": _timed(device, compute_all),
            "serial": await _atimed(device, serial),
            "overlap": await _atimed(device, overlap),
        }
        if run >= _WARMUP:
            for name, seconds in sample.items():
                times[name].append(seconds)
    if not all(mask is not None and bool(mask.all()) for mask in masks):
        problems.append("retrieve_layer did not load every token")

    scene.blank_destination()
    await _retrieve_layers(engine, scene, None)
    _sync(device)
    verified = scene.destination_matches_source()
    if not verified:
        problems.append("layerwise retrieved KV differs from the stored KV")

    med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    hidden = (med["serial"] - med["overlap"]) / med["transfer"]
    return {
        "tokens": num_tokens,
        "layers": num_layers,
        "bytes": scene.nbytes,
        "runs": options.repeat,
        "matmul_dim": compute.dim,
        "matmul_dtype": str(compute.dtype).removeprefix("torch."),
        "matmul_ms": compute.matmul_seconds * 1e3,
        "matmuls_per_layer": compute.reps,
        "compute_ratio": options.compute_ratio,
        "transfer_ms": med["transfer"],
        "compute_ms": med["compute"],
        "serial_ms": med["serial"],
        "overlap_ms": med["overlap"],
        "transfer_gbps": _rate(scene.nbytes, med["transfer"] / 1e3),
        "hidden_fraction": hidden,
        "hideable_fraction": min(1.0, med["compute"] / med["transfer"]),
        "target_hidden": TARGETS["hidden_fraction"],
        "ok": hidden >= TARGETS["hidden_fraction"],
        "verified_bit_exact": verified,
        "problems": problems,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


async def run_gpu_bench_async(options: GpuOptions, config: EngineConfig) -> dict[str, Any]:
    """Run the copy and layerwise benchmarks and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on) and
    ``max_local_cpu_size`` (sized to the benchmark).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    device = options.torch_device()
    started = time.perf_counter()
    scene = _make_scene(options, device)
    cfg = config.replace(local_cpu=True, max_local_cpu_size=_cache_gb(scene.nbytes))
    async with CacheEngine.open(cfg, scene.layout, model_name="lmcache-async-gpu") as engine:
        copies = await _copy_bench(engine, scene, options.repeat)
        layerwise = await _layerwise_bench(engine, scene, options)
    cuda = device.type == "cuda"
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "device": str(device),
        "device_name": _device_name(device),
        "cuda": cuda,
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "note": None if cuda else CPU_NOTE,
        "method": (
            f"median of {options.repeat} runs after {_WARMUP} warm-up; wall clock around each "
            "call, device synchronized before and after"
        ),
        "token_bytes": scene.layout.token_bytes,
        "copy": copies,
        "layerwise": layerwise,
        "problems": copies["problems"] + layerwise["problems"],
        "seconds": time.perf_counter() - started,
    }


def run_gpu_bench(options: GpuOptions, config: EngineConfig) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_gpu_bench_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_gpu_bench_async(options, config)

    return anyio.run(main)


def _f(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def format_gpu(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`run_gpu_bench` results."""
    cuda = bool(results["cuda"])

    def status(ok: bool) -> str:
        if not cuda:
            return "n/a (cpu)"
        return "ok" if ok else "below target"

    copy = results["copy"]
    mib = copy["bytes"] / 1024**2
    rows: list[list[str]] = []
    for key, name in (("d2h", "D2H store"), ("h2d", "H2D retrieve")):
        e = copy[key]
        rows.append(
            [
                f"{name} {copy['tokens']} tok ({mib:.0f} MiB)",
                f"{_f(e['engine_gbps'], '.2f')} GB/s",
                f"pinned copy_ {_f(e['raw_gbps'], '.2f')} GB/s",
                f"{_f(e['ratio'], '.2f')}x",
                f">= {e['target_ratio']:.1f}x",
                status(e["ok"]),
            ]
        )
    for key, name in (("d2h", "D2H"), ("h2d", "H2D")):
        rows.append(
            [
                f"pinned memcpy {name}, no gather",
                f"{_f(copy[f'memcpy_{key}_gbps'], '.2f')} GB/s",
                "",
                "",
                "(info)",
                "",
            ]
        )
    lw = results["layerwise"]
    rows.append(
        [
            f"layerwise retrieve {lw['layers']} layers",
            f"{_f(lw['hidden_fraction'] * 100, '.1f')}% hidden",
            f"serial {_f(lw['serial_ms'], '.2f')} ms, overlap {_f(lw['overlap_ms'], '.2f')} ms",
            "",
            f">= {lw['target_hidden'] * 100:.0f}%",
            status(lw["ok"]),
        ]
    )
    opts = results["options"]
    lines = ["lmcache-async GPU bench"]
    if results["note"]:
        lines.append("NOTE: " + results["note"])
    lines += [
        f"device: {results['device']} ({results['device_name']}), torch "
        f"{results['torch_version']}, CUDA {results['torch_cuda']}",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), block {opts['block_size']}, "
        f"{results['token_bytes'] / 1024:.1f} KiB per token",
        f"figures: {results['method']}",
        "",
        format_table(["figure", "value", "baseline", "ratio", "target", "status"], rows),
        "",
        f"layerwise: transfer {_f(lw['transfer_ms'], '.2f')} ms "
        f"({_f(lw['transfer_gbps'], '.2f')} GB/s), compute {_f(lw['compute_ms'], '.2f')} ms "
        f"({lw['matmuls_per_layer']} x {lw['matmul_dim']}^2 {lw['matmul_dtype']} matmul per "
        f"layer), hidden = (serial - overlap) / transfer; at most "
        f"{_f(lw['hideable_fraction'] * 100, '.0f')}% can hide behind this compute",
        "bit-exact: retrieve "
        + ("yes" if copy["verified_bit_exact"] else "NO")
        + ", layerwise retrieve "
        + ("yes" if lw["verified_bit_exact"] else "NO"),
    ]
    problems = results["problems"]
    if problems:
        lines.append("problems: " + "; ".join(problems))
    lines.append(f"total {results['seconds']:.1f} s")
    return "\n".join(lines)
