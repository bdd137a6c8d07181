"""``lmcache-async bench --micro``: every figure present, sane and consistent, and the
checks that make a run fail."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, EngineConfig, InvalidInputError
from lmcache_async.bench.micro import MicroOptions, format_micro, run_micro
from lmcache_async.bench.micro.options import SMALL_SHAPE, TARGETS, WIDE_SHAPE
from lmcache_async.bench.micro.small import ROUND, small_bench
from lmcache_async.cli import main

TINY_SHAPE = ["--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", "64"]

# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def _numbers(results: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every figure a run must give as a positive finite float, by name."""
    for part in ("copy", "copy_wide"):
        copy = results[part]
        for op in ("store", "retrieve"):
            for key in ("engine_gbps", "raw_gbps", "ratio", "plain_gbps", "plain_ratio"):
                yield f"{part}.{op}.{key}", copy[op][key]
            yield f"{part}.{op}.engine_best_gbps", copy[op]["engine_best_gbps"]
            yield f"{part}.{op}.plain_best_gbps", copy[op]["plain_best_gbps"]
    small = results["small"]
    for op in ("store", "retrieve"):
        for key in ("p50_ms", "p99_ms", "raw_p50_ms", "raw_p99_ms", "raw_chunks_p50_ms", "ratio"):
            yield f"small.{op}.{key}", small[op][key]
    lookup, hashing = results["lookup"], results["hashing"]
    for name in ("tensor", "list", "tensor_first_sight"):
        yield f"lookup.{name}.p50_ms", lookup[name]["p50_ms"]
        yield f"lookup.{name}.p99_ms", lookup[name]["p99_ms"]
    for algorithm in ("blake3", "xxh3_128"):
        for key in ("list_mtps", "tensor_mtps", "tensor_plain_mtps"):
            yield f"hash.{algorithm}.{key}", hashing[algorithm][key]


def _check_copy(copy: dict[str, Any], *, shape: str, tokens: int, token_bytes: int) -> None:
    assert copy["shape"] == shape
    assert copy["tokens"] == tokens
    assert copy["token_bytes"] == token_bytes
    assert copy["bytes"] == tokens * token_bytes
    assert copy["verified_bit_exact"] is True
    assert copy["problems"] == []
    # Each baseline was timed in every measured run, beside the engine.
    timed = ("store", "retrieve", "raw_gather", "raw_scatter", "plain_copy")
    lengths = {name: len(values) for name, values in copy["times_s"].items()}
    assert lengths == dict.fromkeys(timed, copy["runs"])
    for op in ("store", "retrieve"):
        e = copy[op]
        assert math.isclose(e["ratio"], e["engine_gbps"] / e["raw_gbps"])
        assert math.isclose(e["plain_ratio"], e["engine_gbps"] / e["plain_gbps"])
        assert e["target_ratio"] == TARGETS["copy_raw_ratio"]
        assert e["plain_target_ratio"] == TARGETS["copy_plain_ratio"]
        assert e["ok"] == (e["ratio"] >= e["target_ratio"])
        assert e["plain_ok"] == (e["plain_ratio"] >= e["plain_target_ratio"])
        assert e["engine_best_gbps"] >= e["engine_gbps"]
        assert e["plain_best_gbps"] >= e["plain_gbps"]
    # Store and retrieve are measured against the same plain copy of the same bytes.
    assert copy["store"]["plain_gbps"] == copy["retrieve"]["plain_gbps"]


def test_micro_produces_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "micro.json"
    argv = [
        "bench",
        "--micro",
        *TINY_SHAPE,
        "--tokens",
        "512",
        "--lookup-tokens",
        "4096",
        "--repeat",
        "1",
        "--json",
        str(out_path),
    ]

    assert main(argv) == 0

    results: dict[str, Any] = json.loads(out_path.read_text())
    for name, value in _numbers(results):
        assert isinstance(value, float), name
        assert math.isfinite(value), name
        assert value > 0, name
    assert results["token_bytes"] == 2 * 2 * 2 * 16 * 2
    other = results["other_work"]
    assert set(other) == {"other_share", "steal_share"}
    assert all(0 <= share <= 1 for share in other.values())
    _check_copy(
        results["copy"],
        shape="2x2x16 bfloat16",
        tokens=512,
        token_bytes=results["token_bytes"],
    )
    _check_copy(results["copy_wide"], shape=WIDE_SHAPE.label, tokens=512, token_bytes=32 * 1024)
    assert results["copy"]["runs"] == 1

    small = results["small"]
    assert small["shape"] == SMALL_SHAPE.label == "2x1x32 bfloat16"
    assert small["token_bytes"] == 2 * 2 * 1 * 32 * 2
    assert small["tokens"] == 512  # the CLI bounds the small request by --tokens
    # The small request is chunked by 256 whatever --chunk-size says.
    assert small["chunk_size"] == 256
    assert small["chunks"] == 2
    assert small["iterations"] == MicroOptions().overhead_iterations
    assert small["raw_calls"] == 4
    timed = ("store", "retrieve", "raw_gather", "raw_scatter")
    lengths = {name: len(values) for name, values in small["times_s"].items()}
    chunked = ("raw_chunk_gather", "raw_chunk_scatter")
    assert lengths == dict.fromkeys((*timed, *chunked), small["iterations"])
    assert small["problems"] == []  # every store stored and every retrieve loaded it all
    assert small["verified_bit_exact"] is True
    for op in ("store", "retrieve"):
        e = small[op]
        assert e["p50_ms"] <= e["p99_ms"]
        assert e["raw_p50_ms"] <= e["raw_p99_ms"]
        assert math.isclose(e["ratio"], e["p50_ms"] / e["raw_p50_ms"])
        assert math.isclose(e["overhead_ms"], e["p50_ms"] - e["raw_p50_ms"])
        assert e["ok"] == (e["p50_ms"] <= small["target_p50_ms"])
    assert small["target_p50_ms"] == TARGETS["small_p50_ms"]

    assert results["lookup"]["tokens"] == 4096
    hashing = results["hashing"]
    assert hashing["tokens"] == 4096
    for algorithm in ("blake3", "xxh3_128"):
        entry = hashing[algorithm]
        assert math.isclose(
            entry["tensor_ratio"], entry["tensor_mtps"] / entry["tensor_plain_mtps"]
        )
    assert hashing["problems"] == []  # the plain chains gave the hasher's digests
    assert results["problems"] == []

    table = capsys.readouterr().out
    needles = (
        "store 512 tok 2x2x16 bfloat16",
        "retrieve 512 tok 8x8x128 bfloat16",
        "plain copy_",
        "raw index_select(out=)",
        "raw index_copy_",
        "store 512 tok 2x1x32 bfloat16, chunk 256 p50",
        "retrieve 512 tok 2x1x32 bfloat16, chunk 256 p99",
        "raw 4 x index_select",
        "2 chunks vs 1 buffer (store)",
        "lookup 4096 tok",
        "plain chain",
    )
    for needle in needles:
        assert needle in table, needle
    bit_exact = "retrieve bit-exact: 2x2x16 bfloat16 yes, 8x8x128 bfloat16 yes, 2x1x32 bfloat16 yes"
    assert bit_exact in table


def test_micro_on_the_wide_shape_measures_it_once() -> None:
    options = MicroOptions(
        tokens=64,
        lookup_tokens=512,
        repeat=1,
        overhead_tokens=64,
        overhead_iterations=ROUND,
        lookup_iterations=5,
        hash_iterations=2,
        num_layers=WIDE_SHAPE.num_layers,
        num_kv_heads=WIDE_SHAPE.num_kv_heads,
        head_size=WIDE_SHAPE.head_size,
        dtype=WIDE_SHAPE.dtype,
    )

    results = run_micro(options, EngineConfig())

    assert results["copy"]["shape"] == WIDE_SHAPE.label
    assert results["copy_wide"] is None
    assert results["small"]["iterations"] == ROUND
    assert results["problems"] == []
    table = format_micro(results)
    assert table.count("store 64 tok 8x8x128 bfloat16") == 1
    assert "retrieve bit-exact: 8x8x128 bfloat16 yes, 2x1x32 bfloat16 yes\n" in table


@pytest.mark.anyio
async def test_small_bench_reports_retrieves_that_load_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def load_nothing(self: CacheEngine, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(len(tokens), dtype=torch.bool)

    monkeypatch.setattr(CacheEngine, "retrieve", load_nothing)
    options = MicroOptions(overhead_tokens=300, overhead_iterations=ROUND)

    with anyio.fail_after(60):
        small = await small_bench(options, EngineConfig(), torch.Generator().manual_seed(0))

    # Warm-up and measured rounds alike: every retrieve is counted.
    assert small["problems"] == [
        f"small: {2 * ROUND} retrieves did not load every token",
        "small: retrieved KV differs from the stored KV",
    ]
    assert small["verified_bit_exact"] is False
    assert small["chunks"] == 2  # 256 + a partial chunk of 44 tokens


def test_micro_options_refuse_a_count_that_is_not_positive() -> None:
    with pytest.raises(InvalidInputError, match="overhead_iterations must be > 0"):
        MicroOptions(overhead_iterations=0).validate()
