"""``bench --scale``: its settings, the growth exponent and the text on made-up figures, and
a real run of every tier at two tiny sizes whose figures are all there and consistent."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from lmcache_async.bench.scale import (
    ScaleOptions,
    format_scale,
    growth_exponent,
    parse_sizes,
    run_scale_bench,
)
from lmcache_async.bench.scale.report import growth_exponents
from lmcache_async.bench.scale.resident import resident_in_child
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

TINY = (200, 800)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sizes": ()}, "at least one size"),
        ({"sizes": (1000, 1000)}, "sizes must differ"),
        ({"sizes": (100,)}, "each size must be an int >= 880"),
        ({"sizes": (1000.0,)}, "each size must be an int"),
        ({"tiers": ("cpu", "ssd")}, "unknown tier 'ssd'"),
        ({"tiers": ("cpu", "cpu")}, "each once"),
        ({"tiers": ()}, "each once"),
        ({"requests": 0}, "requests must be an int >= 1"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"repeats": True}, "repeats must be an int >= 1"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        ScaleOptions(**settings).validate()


def test_the_defaults_are_valid_and_sizes_run_smallest_first() -> None:
    ScaleOptions().validate()
    assert ScaleOptions().sizes == (10_000, 50_000, 200_000)
    assert ScaleOptions(sizes=(5000, 1000, 2000)).ordered_sizes() == (1000, 2000, 5000)


def test_sizes_parse_with_a_thousands_suffix() -> None:
    assert parse_sizes("10k, 50_000,200K") == (10_000, 50_000, 200_000)
    with pytest.raises(InvalidInputError, match="whole numbers"):
        parse_sizes("10k,ten")
    with pytest.raises(InvalidInputError, match="whole numbers"):
        parse_sizes("1.5k")


def test_cli_refuses_bad_settings_before_starting_anything(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    assert main(["bench", "--scale", "--scale-sizes", "10"]) == 2
    assert "each size must be an int" in capsys.readouterr().err
    assert main(["bench", "--scale", "--scale-tiers", "cpu,tape"]) == 2
    assert "unknown tier 'tape'" in capsys.readouterr().err


def test_growth_exponent_is_the_slope_on_log_log() -> None:
    assert growth_exponent((1000, 2.0), (100_000, 2.0)) == 0.0
    assert growth_exponent((1000, 1.0), (100_000, 100.0)) == pytest.approx(1.0)
    assert growth_exponent((10_000, 1.0), (200_000, 2.0)) == pytest.approx(
        math.log(2) / math.log(20)
    )
    assert growth_exponent((1000, 2.0), (100_000, 1.0)) < 0
    for small, large in [
        ((1000, 0.0), (2000, 1.0)),
        ((1000, 1.0), (2000, math.nan)),
        ((1000, 1.0), (1000, 2.0)),
        ((0, 1.0), (1000, 2.0)),
    ]:
        assert math.isnan(growth_exponent(small, large))


def _ops(store: float, lookup: float, retrieve: float) -> dict[str, Any]:
    return {"store": {"p50": store}, "lookup": {"p50": lookup}, "retrieve": {"p50": retrieve}}


def test_growth_exponents_take_the_smallest_and_largest_sizes() -> None:
    rows = [
        {"chunks": 50_000, "ops": _ops(9.0, 9.0, 9.0)},  # the middle size is not used
        {"chunks": 200_000, "ops": _ops(1.0, 2.0, 20.0)},
        {"chunks": 10_000, "ops": _ops(1.0, 1.0, 1.0)},
    ]
    growth = growth_exponents(rows)
    assert growth["store"] == 0.0
    assert growth["lookup"] == pytest.approx(math.log(2) / math.log(20))
    assert growth["retrieve"] == pytest.approx(1.0)
    assert all(math.isnan(v) for v in growth_exponents(rows[:1]).values())


def _fake_results() -> dict[str, Any]:
    load = (1.5, 1.25, 1.0)
    ops = _ops(0.2, 0.05, 0.18)
    cpu_row = {
        "chunks": 10_000,
        "open_s": 0.001,
        "first_hit_s": 0.002,
        "fill_chunks_per_s": 40_000.0,
        "ops": ops,
        "index_bytes_per_chunk": 300.0,
        "loadavg": load,
    }
    tier = {"open_s": 0.001, "index_s": 0.3, "index_over_walk": 2.5, "headers_read": 10_000}
    disk_row = {
        "chunks": 10_000,
        "walk_s": 0.12,
        "tier": {"no_manifest": tier, "manifest": {**tier, "index_over_walk": 1.75}},
        "engine": {
            "no_manifest": {"open_s": 0.002, "first_hit_s": 0.003},
            "manifest": {
                "open_s": 0.002,
                "first_hit_s": 0.003,
                "indexed_s": 0.0204,
                "audited_s": 0.05,
            },
        },
        "ops": ops,
        "index_bytes_per_chunk": 170.0,
        "loadavg": load,
    }
    redis_row = {
        "chunks": 10_000,
        "open_s": 0.003,
        "first_hit_s": 0.004,
        "ops": ops,
        "index": "none (server side)",
        "server_bytes_per_key": 5300.0,
        "loadavg": load,
    }
    growth = {"store": 0.01, "lookup": math.nan, "retrieve": -0.02}
    return {
        "layout": {"chunk_bytes": 4096, "chunk_tokens": 256, "request_tokens": 1024},
        "loadavg_start": load,
        "tiers": {
            "cpu": {"rows": [cpu_row, {**cpu_row, "chunks": 200_000}], "growth": growth},
            "disk": {"rows": [disk_row], "growth": growth},
            "redis": {"rows": [redis_row], "growth": growth},
        },
        "problems": ["disk 10000: something"],
    }


def test_the_text_has_every_tier_its_growth_and_the_load() -> None:
    text = format_scale(_fake_results())
    assert "load average at the start 1.50 1.25 1.00" in text
    assert "CPU tier" in text and "disk tier" in text and "Redis tier" in text
    assert "growth exponent 10000 -> 200000 chunks" in text
    assert "store +0.01, lookup -, retrieve -0.02" in text
    assert "growth exponent: - (one size)" in text
    assert "1.75x" in text and "2.50x" in text  # the index over the walk, each manifest
    assert "<= 2x the walk at 10000 chunks: 1.75x (met)" in text
    assert "complete / audited, ms after the open: 20.4 / 50.0 (10000)" in text
    assert "none (server side)" in text
    assert text.rstrip().endswith("problem: disk 10000: something")


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_tiny_run_measures_every_tier_at_each_size(tmp_path: Path) -> None:
    """Every figure present and consistent at N = 200 and 800 (no timing is asserted);
    a second run with the same settings in the same work directory uses its disk
    directories again."""
    options = ScaleOptions(sizes=TINY, requests=4, warmup=1, repeats=2, work_dir=str(tmp_path))
    with anyio.fail_after(120):
        results = await run_scale_bench(options, progress_stream=None)
    assert results["problems"] == []
    assert list(results["tiers"]) == ["cpu", "disk", "redis"]
    assert len(results["loadavg_start"]) == 3
    for tier, section in results["tiers"].items():
        assert [row["chunks"] for row in section["rows"]] == list(TINY), tier
        assert all(math.isfinite(v) for v in section["growth"].values()), tier
        for row in section["rows"]:
            assert len(row["loadavg"]) == 3
            for op in ("store", "lookup", "retrieve"):
                assert row["ops"][op]["count"] == 4
                assert 0 < row["ops"][op]["p50"] < math.inf
            if tier != "disk":
                assert 0 < row["open_s"] <= row["first_hit_s"]
    for row in results["tiers"]["cpu"]["rows"]:
        assert row["held"] == row["chunks"]
        assert row["index_bytes_per_chunk"] > 0
        assert row["pool_bytes_per_chunk"] == 4096
        if sys.platform.startswith("linux"):  # a tiny tier may fit in memory already mapped
            assert row["resident_bytes_per_chunk"] >= 0
    for row in results["tiers"]["disk"]["rows"]:
        n = row["chunks"]
        assert row["files"] == n and row["walk_s"] > 0
        assert row["fill"]["reused"] is False
        bare, kept = row["tier"]["no_manifest"], row["tier"]["manifest"]
        assert bare["manifest"] == "missing" and kept["manifest"] == "used"
        assert bare["headers_read"] == n and kept["from_manifest"] == n
        assert len(kept["index_s_runs"]) == 2 and kept["index_s"] == min(kept["index_s_runs"])
        for figures in (bare, kept):
            assert figures["complete"] and figures["chunks"] == n
            assert 0 < figures["open_s"] <= figures["index_s"] <= figures["audited_s"]
            assert 0 < figures["index_over_walk"] < math.inf
        for engine in row["engine"].values():
            assert 0 < engine["open_s"] <= engine["first_hit_s"]
        measured = row["engine"]["manifest"]
        assert measured["first_hit_s"] <= measured["indexed_s"] <= measured["audited_s"]
        assert row["index_bytes_per_chunk"] == kept["bytes_per_chunk"] > 0
    for row in results["tiers"]["redis"]["rows"]:
        assert row["keys"] == row["chunks"]
        assert row["index_bytes_per_chunk"] == 0 and row["index"] == "none (server side)"
    text = format_scale(results)
    assert "problem" not in text
    json.dumps(results)  # plain data throughout

    with anyio.fail_after(60):
        again = await run_scale_bench(
            dataclasses.replace(options, tiers=("disk",)), progress_stream=None
        )
    assert again["problems"] == []
    assert all(row["fill"]["reused"] for row in again["tiers"]["disk"]["rows"])


def test_cli_prints_the_tables_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    out = tmp_path / "scale.json"
    argv = ["bench", "--scale", "--scale-sizes", "200,800", "--scale-tiers", "cpu"]
    argv += ["--scale-requests", "3", "--json", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "CPU tier" in captured.out and "growth exponent 200 -> 800" in captured.out
    assert "bench: scale cpu 800: storing" in captured.err
    written = json.loads(out.read_text())
    assert [row["chunks"] for row in written["tiers"]["cpu"]["rows"]] == [200, 800]
    assert written["options"]["requests"] == 3
    assert main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
async def test_resident_bytes_see_what_tracemalloc_cannot() -> None:
    """Resident memory, measured in a fresh process, counts everything a chunk holds: a
    torch view per chunk (its C++ structures, unseen by tracemalloc) would show here."""
    with anyio.fail_after(300):
        figure = await resident_in_child(20_000, chunk_tokens=256, token_bytes=16)
    assert figure is not None
    assert 0 < figure < 768
