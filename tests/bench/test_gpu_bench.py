"""The GPU benchmark: its CPU path end to end, its figures against scripted times and the
scene's bytes, option checks, the table, and (on a GPU) the CUDA path at small sizes."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import EngineConfig
from lmcache_async.bench.gpu import (
    CPU_NOTE,
    TARGETS,
    GpuOptions,
    format_gpu,
    run_gpu_bench_async,
)
from lmcache_async.bench.gpu import copies as gpu_copies
from lmcache_async.bench.gpu import layerwise as gpu_layerwise
from lmcache_async.bench.gpu import staged as gpu_staged
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

TINY = ["--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", "64"]
NUMBER = r"(-?[0-9.]+)"


# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _slot_bytes(options: GpuOptions) -> int:
    """Bytes one token slot takes in the KV cache tensors of ``options``' layout."""
    layout = options.layout()
    kv = layout.allocate_kv_caches(1, random=False)
    return sum(t.numel() * t.element_size() for t in kv) // layout.block_size


def test_cpu_path_prints_consistent_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "gpu.json"
    argv = ["bench", "--gpu", "--device", "cpu", *TINY, "--tokens", "512", "--repeat", "2"]

    assert main([*argv, "--json", str(out_path)]) == 0

    results: dict[str, Any] = json.loads(out_path.read_text())
    assert results["cuda"] is False
    assert results["device"] == "cpu"
    assert results["note"] == CPU_NOTE
    assert results["problems"] == []
    slot_bytes = _slot_bytes(GpuOptions(num_layers=2, num_kv_heads=2, head_size=16))
    assert results["token_bytes"] == slot_bytes
    copy = results["copy"]
    assert (copy["tokens"], copy["bytes"], copy["runs"]) == (512, 512 * slot_bytes, 2)
    for key in ("d2h", "h2d"):
        entry = copy[key]
        for name in ("engine_gbps", "raw_gbps", "ratio", "engine_best_gbps", "raw_best_gbps"):
            assert _positive(entry[name]), (key, name)
        assert entry["target_ratio"] == TARGETS["copy_ratio"] == 0.9
    assert _positive(copy["memcpy_d2h_gbps"])
    assert _positive(copy["memcpy_h2d_gbps"])
    assert copy["verified_bit_exact"] is True

    lw = results["layerwise"]
    assert (lw["tokens"], lw["layers"], lw["bytes"], lw["runs"]) == (512, 2, 512 * slot_bytes, 2)
    for name in ("transfer_ms", "compute_ms", "serial_ms", "overlap_ms", "matmul_ms"):
        assert _positive(lw[name]), name
    assert isinstance(lw["matmuls_per_layer"], int)
    assert lw["matmuls_per_layer"] >= 1
    assert lw["target_hidden"] == TARGETS["hidden_fraction"] == 0.7
    assert lw["verified_bit_exact"] is True

    staged = results["staged"]
    assert (staged["tokens"], staged["bytes"], staged["runs"]) == (512, 512 * slot_bytes, 2)
    assert (staged["chunks"], staged["chunk_size"]) == (8, 64)
    for key in ("gather", "scatter"):
        entry = staged[key]
        for name in ("per_chunk_gbps", "staged_gbps", "staged_apart_gbps"):
            assert _positive(entry[name]), (key, name)
    # The payloads back to back go in one copy, apart in one copy each.
    assert staged["host_copies"] == {"together": 1, "apart": 8}
    assert staged["staging_bytes"] >= staged["bytes"]
    assert staged["verified_bit_exact"] is True

    # The table prints the same numbers, and says the targets do not apply on the CPU.
    table = capsys.readouterr().out
    assert "NOTE: no CUDA device" in table
    assert "need a GPU" in table
    for key, name in (("d2h", "D2H store"), ("h2d", "H2D retrieve")):
        match = re.search(
            rf"{name} 512 tok .*?{NUMBER} GB/s\s+pinned copy_ {NUMBER} GB/s\s+{NUMBER}x"
            r"\s+>= 0\.9x\s+n/a \(cpu\)",
            table,
        )
        assert match is not None, table
        entry = copy[key]
        assert match.groups() == (
            f"{entry['engine_gbps']:.2f}",
            f"{entry['raw_gbps']:.2f}",
            f"{entry['ratio']:.2f}",
        )
    match = re.search(
        rf"layerwise retrieve 2 layers\s+{NUMBER}% hidden\s+serial {NUMBER} ms, "
        rf"overlap {NUMBER} ms\s+>= 70%\s+n/a \(cpu\)",
        table,
    )
    assert match is not None, table
    assert match.groups() == (
        f"{lw['hidden_fraction'] * 100:.1f}",
        f"{lw['serial_ms']:.2f}",
        f"{lw['overlap_ms']:.2f}",
    )
    for key in ("gather", "scatter"):
        entry = staged[key]
        match = re.search(
            rf"staged {key} 8 chunks\s+{NUMBER} GB/s\s+per chunk {NUMBER} GB/s\s+{NUMBER}x"
            r"\s+\(info\)",
            table,
        )
        assert match is not None, table
        assert match.groups() == (
            f"{entry['staged_gbps']:.2f}",
            f"{entry['per_chunk_gbps']:.2f}",
            f"{entry['speedup']:.2f}",
        )
        assert re.search(rf"staged {key} 8 chunks, payloads apart\s+{NUMBER} GB/s", table)
    assert "host copies per batch 1 (payloads back to back), 8 (apart)" in table
    assert "bit-exact: retrieve yes, layerwise retrieve yes, staged yes" in table


def _fake_results(*, cuda: bool, d2h_ratio: float, hidden: float) -> dict[str, Any]:
    def entry(ratio: float) -> dict[str, Any]:
        return {
            "engine_gbps": 40.0 * ratio,
            "raw_gbps": 40.0,
            "ratio": ratio,
            "target_ratio": 0.9,
            "ok": ratio >= 0.9,
        }

    return {
        "cuda": cuda,
        "note": None if cuda else CPU_NOTE,
        "device": "cuda:0" if cuda else "cpu",
        "device_name": "Test GPU" if cuda else "cpu",
        "torch_version": "2.x",
        "torch_cuda": "13.0" if cuda else None,
        "options": {
            "num_layers": 32,
            "num_kv_heads": 8,
            "head_size": 128,
            "dtype": "bfloat16",
            "block_size": 16,
        },
        "token_bytes": 131072,
        "method": "median",
        "copy": {
            "tokens": 8192,
            "bytes": 8192 * 131072,
            "d2h": entry(d2h_ratio),
            "h2d": entry(0.95),
            "memcpy_d2h_gbps": 50.0,
            "memcpy_h2d_gbps": 55.0,
            "verified_bit_exact": True,
        },
        "layerwise": {
            "layers": 32,
            "hidden_fraction": hidden,
            "serial_ms": 40.0,
            "overlap_ms": 40.0 - 20.0 * hidden,
            "transfer_ms": 20.0,
            "transfer_gbps": 53.7,
            "compute_ms": 20.0,
            "matmuls_per_layer": 12,
            "matmul_dim": 2048,
            "matmul_dtype": "bfloat16",
            "hideable_fraction": 1.0,
            "target_hidden": 0.7,
            "ok": hidden >= 0.7,
            "verified_bit_exact": False,
        },
        "problems": ["layerwise retrieved KV differs from the stored KV"],
        "seconds": 12.0,
    }


def test_table_judges_cuda_figures_against_the_targets() -> None:
    text = format_gpu(_fake_results(cuda=True, d2h_ratio=0.5, hidden=0.75))
    lines = text.splitlines()
    assert not any(line.startswith("NOTE") for line in lines)
    assert "device: cuda:0 (Test GPU), torch 2.x, CUDA 13.0" in lines
    d2h = next(line for line in lines if line.startswith("D2H store 8192 tok (1024 MiB)"))
    assert re.search(
        r"20\.00 GB/s\s+pinned copy_ 40\.00 GB/s\s+0\.50x\s+>= 0\.9x\s+below target$", d2h
    )
    h2d = next(line for line in lines if line.startswith("H2D retrieve"))
    assert re.search(r"38\.00 GB/s\s+pinned copy_ 40\.00 GB/s\s+0\.95x\s+>= 0\.9x\s+ok$", h2d)
    overlap = next(line for line in lines if line.startswith("layerwise retrieve 32 layers"))
    assert re.search(r"75\.0% hidden\s+serial 40\.00 ms, overlap 25\.00 ms\s+>= 70%\s+ok$", overlap)
    assert "bit-exact: retrieve yes, layerwise retrieve NO, staged n/a" in lines
    assert any(re.match(r"staged gather / scatter\s+not run$", line) for line in lines)
    assert "problems: layerwise retrieved KV differs from the stored KV" in lines


def test_table_on_cpu_says_the_targets_need_a_gpu() -> None:
    text = format_gpu(_fake_results(cuda=False, d2h_ratio=2.0, hidden=0.0))
    assert text.splitlines()[1] == "NOTE: " + CPU_NOTE
    assert "below target" not in text
    assert text.count("n/a (cpu)") == 3


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tokens": 0}, "tokens must be > 0"),
        ({"num_layers": -1}, "num_layers must be > 0"),
        ({"compute_ratio": 0.0}, "compute_ratio must be > 0"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_options_are_checked(changes: dict[str, Any], match: str) -> None:
    options = GpuOptions(**changes)
    with pytest.raises(InvalidInputError, match=match):
        options.validate()


def test_default_model_is_a_realistic_vllm_layout() -> None:
    layout = GpuOptions().layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (32, 8, 128)
    assert layout.dtype is torch.bfloat16
    assert layout.block_size == 16
    assert layout.token_bytes == 128 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_asking_for_cuda_without_a_gpu_is_a_clear_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(InvalidInputError, match="no CUDA device"):
        GpuOptions(device="cuda").torch_device()
    assert GpuOptions(device="auto").torch_device() == torch.device("cpu")
    assert main(["bench", "--gpu", "--device", "cuda", *TINY, "--tokens", "64"]) == 2
    assert "error: device 'cuda': no CUDA device" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.anyio
async def test_cuda_path_at_small_sizes() -> None:
    options = GpuOptions(
        tokens=1024, repeat=2, num_layers=4, num_kv_heads=2, head_size=64, device="cuda"
    )
    results = await run_gpu_bench_async(options, EngineConfig(chunk_size=256))
    assert results["cuda"] is True
    assert results["note"] is None
    assert results["problems"] == []
    assert results["copy"]["verified_bit_exact"] is True
    assert results["layerwise"]["verified_bit_exact"] is True
    assert results["staged"]["verified_bit_exact"] is True
    for key in ("d2h", "h2d"):
        assert _positive(results["copy"][key]["engine_gbps"])
        assert _positive(results["copy"][key]["raw_gbps"])
    for key in ("gather", "scatter"):
        assert _positive(results["staged"][key]["staged_gbps"])
        assert _positive(results["staged"][key]["per_chunk_gbps"])
    assert results["staged"]["host_copies"] == {"together": 1, "apart": 4}
    assert _positive(results["layerwise"]["overlap_ms"])


# The staged part's ways, in the order it times them in each run.
STAGED_WAYS = (
    "gather_per_chunk",
    "gather_staged",
    "gather_staged_apart",
    "scatter_per_chunk",
    "scatter_staged",
    "scatter_staged_apart",
)
WARM = 100.0  # the warm-up run's seconds: far off, so that counting it shows


class ScriptedClock:
    """Stands in for the benchmark's timers: runs what is timed and returns the seconds
    scripted for it, by the name of the function timed (the staged part's ways by their
    order within a run), one after the other."""

    def __init__(self, script: dict[str, list[float]]) -> None:
        self.left = {name: list(seconds) for name, seconds in script.items()}
        self._staged = 0

    def _seconds(self, fn: Callable[[], object]) -> float:
        name = getattr(fn, "__name__", "")
        if name == "<lambda>":
            name = STAGED_WAYS[self._staged % len(STAGED_WAYS)]
            self._staged += 1
        return self.left[name].pop(0)

    def timed(self, fn: Callable[[], object], device: torch.device | None = None) -> float:
        fn()
        return self._seconds(fn)

    async def atimed(self, device: torch.device, fn: Callable[[], Awaitable[object]]) -> float:
        await fn()
        return self._seconds(fn)


def _runs(*seconds: float) -> list[float]:
    """The seconds of a warm-up run and then of the measured ``seconds``."""
    return [WARM, *seconds]


@pytest.mark.anyio
async def test_figures_are_the_scenes_bytes_over_the_measured_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every timer scripted, each figure is the bytes of the scene's KV over the median
    of the measured runs (the warm-up left out), the best the fastest run, a ratio the figure
    over its baseline, the overlap's hidden share (serial - overlap) / transfer, the compute
    sized to the transfer; and the table prints those numbers."""
    options = GpuOptions(
        tokens=128, repeat=3, num_layers=2, num_kv_heads=2, head_size=16, device="cpu"
    )
    clock = ScriptedClock(
        {
            # copy: store at half the baseline's rate, retrieve at 1.25 times.
            "store": _runs(0.004, 0.001, 0.002),
            "raw_d2h": _runs(0.001, 0.001, 0.001),
            "retrieve": _runs(0.001, 0.001, 0.001),
            "raw_h2d": _runs(0.00125, 0.00125, 0.00125),
            "memcpy_d2h": _runs(0.0005, 0.0005, 0.0005),
            "memcpy_h2d": _runs(0.00025, 0.00025, 0.00025),
            # layerwise: three calibration transfers (the first a warm-up: 4 ms a request,
            # 2 ms a layer), 50 matmuls in 25 ms (4 a layer), then the runs.
            "transfer": [WARM, 0.004, 0.004, *_runs(0.004, 0.006, 0.005)],
            "burst": [0.025],
            "compute_all": _runs(0.004, 0.004, 0.004),
            "serial": _runs(0.009, 0.009, 0.009),
            "overlap": _runs(0.006, 0.0055, 0.0065),
            # staged: twice, half and three times the per-chunk rate.
            "gather_per_chunk": _runs(0.004, 0.004, 0.004),
            "gather_staged": _runs(0.002, 0.001, 0.002),
            "gather_staged_apart": _runs(0.008, 0.008, 0.008),
            "scatter_per_chunk": _runs(0.003, 0.003, 0.003),
            "scatter_staged": _runs(0.001, 0.001, 0.001),
            "scatter_staged_apart": _runs(0.0015, 0.0015, 0.0015),
        }
    )
    for module in (gpu_copies, gpu_layerwise, gpu_staged):
        monkeypatch.setattr(module, "timed", clock.timed)
    for module in (gpu_copies, gpu_layerwise):
        monkeypatch.setattr(module, "atimed", clock.atimed)

    results = await run_gpu_bench_async(options, EngineConfig(chunk_size=64))

    assert {name: left for name, left in clock.left.items() if left} == {}
    assert results["problems"] == []
    nbytes = 128 * _slot_bytes(options)
    assert results["token_bytes"] * 128 == nbytes

    def rate(seconds: float) -> Any:
        return pytest.approx(nbytes / seconds / 1e9)

    copy = results["copy"]
    assert copy["bytes"] == nbytes
    assert copy["d2h"] == {
        "engine_gbps": rate(0.002),
        "raw_gbps": rate(0.001),
        "ratio": pytest.approx(0.5),
        "engine_best_gbps": rate(0.001),
        "raw_best_gbps": rate(0.001),
        "target_ratio": 0.9,
        "ok": False,
    }
    assert copy["h2d"]["ratio"] == pytest.approx(1.25)
    assert copy["h2d"]["ok"] is True
    assert copy["memcpy_d2h_gbps"] == rate(0.0005)
    assert copy["memcpy_h2d_gbps"] == rate(0.00025)

    lw = results["layerwise"]
    assert lw["bytes"] == nbytes
    assert lw["matmuls_per_layer"] == 4
    assert lw["matmul_ms"] == pytest.approx(0.5)
    expected_ms = {"transfer_ms": 5.0, "compute_ms": 4.0, "serial_ms": 9.0, "overlap_ms": 6.0}
    assert {name: lw[name] for name in expected_ms} == pytest.approx(expected_ms)
    assert lw["transfer_gbps"] == rate(0.005)
    assert lw["hidden_fraction"] == pytest.approx(0.6)
    assert lw["hideable_fraction"] == pytest.approx(0.8)
    assert lw["ok"] is False

    staged = results["staged"]
    assert staged["bytes"] == nbytes
    assert staged["gather"] == pytest.approx(
        {
            "per_chunk_gbps": nbytes / 0.004 / 1e9,
            "staged_gbps": nbytes / 0.002 / 1e9,
            "staged_apart_gbps": nbytes / 0.008 / 1e9,
            "speedup": 2.0,
            "apart_speedup": 0.5,
        }
    )
    assert staged["scatter"]["speedup"] == pytest.approx(3.0)
    assert staged["scatter"]["apart_speedup"] == pytest.approx(2.0)

    table = format_gpu(results)
    d2h = f"{nbytes / 0.002 / 1e9:.2f} GB/s +pinned copy_ {nbytes / 0.001 / 1e9:.2f} GB/s"
    assert re.search(rf"D2H store 128 tok .*{d2h} +0\.50x +>= 0\.9x", table), table
    assert re.search(r"H2D retrieve 128 tok .* 1\.25x +>= 0\.9x", table), table
    assert re.search(r"60\.0% hidden +serial 9\.00 ms, overlap 6\.00 ms +>= 70%", table), table
    assert re.search(r"staged gather 2 chunks .* 2\.00x", table), table
    assert re.search(r"staged scatter 2 chunks, payloads apart .* 2\.00x", table), table
    assert "(4 x 64^2 float32 matmul per layer)" in table
