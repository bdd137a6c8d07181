"""The GPU benchmark keeps each part's figures when another part fails: a part that raises
is recorded with its error, the others still run, and each part's figures are logged and
handed to the checkpoint as soon as it ends (on the CPU path, at tiny sizes)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from lmcache_async import EngineConfig
from lmcache_async.bench.gpu import GpuOptions, format_gpu, run_gpu_bench_async
from lmcache_async.bench.gpu import run as gpu_run
from lmcache_async.cli import main

TINY = GpuOptions(tokens=128, repeat=1, num_layers=2, num_kv_heads=2, head_size=16, device="cpu")
TINY_ARGV = ["--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", "64"]


async def _boom(*args: object) -> dict[str, Any]:
    raise RuntimeError("boom")


@pytest.mark.anyio
async def test_every_part_reaches_the_checkpoint_in_order() -> None:
    seen: list[dict[str, Any]] = []

    def checkpoint(results: Mapping[str, Any]) -> None:
        seen.append(dict(results))

    results = await run_gpu_bench_async(TINY, EngineConfig(chunk_size=64), checkpoint=checkpoint)

    assert gpu_run.PARTS == ("copy", "layerwise", "staged")
    assert len(seen) == 3
    assert seen[0]["copy"]["verified_bit_exact"] is True
    assert seen[0]["layerwise"] is None
    assert seen[1]["copy"] == results["copy"]
    assert seen[1]["layerwise"] == results["layerwise"]
    assert seen[1]["staged"] is None
    assert seen[2]["staged"] == results["staged"]
    assert results["staged"]["verified_bit_exact"] is True
    assert results["problems"] == []


@pytest.mark.anyio
async def test_a_failed_layerwise_part_keeps_the_copy_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu_run, "layerwise_bench", _boom)
    seen: list[dict[str, Any]] = []

    with capture_logs() as logs:
        results = await run_gpu_bench_async(
            TINY, EngineConfig(chunk_size=64), checkpoint=lambda r: seen.append(dict(r))
        )

    assert results["copy"]["verified_bit_exact"] is True
    assert results["copy"]["d2h"]["engine_gbps"] > 0
    assert results["layerwise"] == {
        "error": "RuntimeError: boom",
        "problems": ["layerwise failed: RuntimeError: boom"],
    }
    assert results["problems"] == ["layerwise failed: RuntimeError: boom"]
    assert [r["layerwise"] is None for r in seen] == [True, False, False]
    assert results["staged"]["verified_bit_exact"] is True
    events = [(e["event"], e["part"]) for e in logs if e["event"].startswith("gpu_bench_part")]
    assert events == [
        ("gpu_bench_part_done", "copy"),
        ("gpu_bench_part_failed", "layerwise"),
        ("gpu_bench_part_done", "staged"),
    ]
    done = next(e for e in logs if e["event"] == "gpu_bench_part_done")
    assert done["figures"] == results["copy"]

    text = format_gpu(results)
    assert "D2H store 128 tok" in text
    assert re.search(r"^layerwise retrieve\s+FAILED: RuntimeError: boom\s*$", text, re.M), text
    assert "bit-exact: retrieve yes, layerwise retrieve n/a, staged yes" in text
    assert "problems: layerwise failed: RuntimeError: boom" in text


@pytest.mark.anyio
async def test_a_failed_copy_part_still_runs_the_layerwise_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu_run, "copy_bench", _boom)

    results = await run_gpu_bench_async(TINY, EngineConfig(chunk_size=64))

    assert results["copy"]["error"] == "RuntimeError: boom"
    assert results["layerwise"]["verified_bit_exact"] is True
    assert results["problems"] == ["copy failed: RuntimeError: boom"]
    text = format_gpu(results)
    assert re.search(r"^D2H store / H2D retrieve\s+FAILED: RuntimeError: boom\s*$", text, re.M)
    assert "layerwise retrieve 2 layers" in text
    assert "bit-exact: retrieve n/a, layerwise retrieve yes, staged yes" in text


@pytest.mark.usefixtures("restore_logging")
def test_the_command_writes_the_figures_of_the_part_that_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_run, "layerwise_bench", _boom)
    out_path = tmp_path / "gpu.json"
    argv = ["bench", "--gpu", "--device", "cpu", *TINY_ARGV, "--tokens", "128", "--repeat", "1"]

    assert main([*argv, "--json", str(out_path)]) == 1

    results = json.loads(out_path.read_text())
    assert results["copy"]["verified_bit_exact"] is True
    assert results["layerwise"]["error"] == "RuntimeError: boom"
    assert "FAILED: RuntimeError: boom" in capsys.readouterr().out


@pytest.mark.anyio
async def test_a_failed_staged_part_keeps_the_other_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu_run, "staged_bench", _boom)

    results = await run_gpu_bench_async(TINY, EngineConfig(chunk_size=64))

    assert results["copy"]["verified_bit_exact"] is True
    assert results["layerwise"]["verified_bit_exact"] is True
    assert results["staged"]["error"] == "RuntimeError: boom"
    assert results["problems"] == ["staged failed: RuntimeError: boom"]
    text = format_gpu(results)
    assert re.search(r"^staged gather / scatter\s+FAILED: RuntimeError: boom\s*$", text, re.M)
    assert "bit-exact: retrieve yes, layerwise retrieve yes, staged n/a" in text
