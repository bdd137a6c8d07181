"""``bench --tiers``: each tier measured in the clear and encrypted in the same run, with the
encrypted tier's ratio to the clear one next to it."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from lmcache_async.bench.tiers import bench_disk, bench_redis, format_tiers, run_tiers_bench
from lmcache_async.bench.tiers.common import ENCRYPTION_TARGETS, bench_spec, interleaved
from tests.servers import RedisServer

ENCRYPTED = ("encrypted_put_gbps", "encrypted_get_gbps")


@pytest.mark.anyio
async def test_interleaved_rotates_who_goes_first() -> None:
    calls: list[tuple[str, int]] = []

    def side(name: str) -> object:
        async def run(lo: int, hi: int) -> None:
            calls.append((name, lo))

        return run

    spans = [(0, 2), (2, 4), (4, 6)]
    times = await interleaved([side("a"), side("b"), side("c")], spans, 1)  # type: ignore[list-item]
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert [name for name, _ in calls] == list("bcacababc")
    assert [lo for _, lo in calls] == [0] * 3 + [2] * 3 + [4] * 3


def test_bench_spec_seals_only_with_a_cipher() -> None:
    from lmcache_async.bench.tiers.common import bench_cipher

    assert bench_spec("disk", 64 * 1024).cipher is None
    cipher = bench_cipher()
    assert bench_spec("disk", 64 * 1024, cipher).cipher is cipher
    assert bench_cipher().key_id != cipher.key_id, "a random key per run"


@pytest.mark.anyio
async def test_bench_disk_measures_the_encrypted_tier_in_the_same_run(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        result = await bench_disk(tmp_path, chunk_bytes=64 * 1024, chunks=6, repeats=2, batch=4)
    assert result["encrypted"] is True
    for run in result["runs"]:
        assert all(run[name] > 0 for name in ENCRYPTED)
    for op in ("put", "get"):
        assert result[f"encrypted_{op}_ratio"] == pytest.approx(
            result[f"encrypted_{op}_gbps"] / result[f"{op}_gbps"]
        )
    assert result["targets"]["encrypted_put_ratio"] == ENCRYPTION_TARGETS["encrypted_put_ratio"]
    assert os.listdir(tmp_path) == [], "the benchmark left files behind"
    with anyio.fail_after(60):
        clear = await bench_disk(
            tmp_path, chunk_bytes=64 * 1024, chunks=2, repeats=1, encrypted=False
        )
    assert not any(name.startswith("encrypted_") for name in clear)
    assert "encrypted_put_ratio" not in clear["targets"]


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_bench_redis_measures_the_encrypted_tier_in_the_same_run(
    redis_server: RedisServer,
) -> None:
    with anyio.fail_after(60):
        result = await bench_redis(
            redis_server.url, chunk_bytes=64 * 1024, chunks=8, repeats=2, call_bytes=256 * 1024
        )
    for run in result["runs"]:
        assert all(run[name] > 0 for name in ENCRYPTED)
        assert run["encrypted_put_ratio"] == pytest.approx(
            run["encrypted_put_gbps"] / run["put_gbps"]
        )
    assert result["encrypted_get_ratio"] > 0
    assert redis_server.command("DBSIZE") == b":0\r\n", "the benchmark left keys behind"


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_tiers_bench_table_puts_each_encrypted_tier_beside_its_clear_one(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with anyio.fail_after(120):
        results = await run_tiers_bench(
            directory=tmp_path,
            redis_url=redis_server.url,
            chunk_bytes=64 * 1024,
            chunks=4,
            repeats=1,
        )
    lines = format_tiers(results).splitlines()
    labels = [line.split()[:2] for line in lines[1:] if not line.startswith(("note", "below"))]
    assert labels == [
        ["disk", "put"],
        ["disk+aes", "put"],
        ["disk", "get"],
        ["disk+aes", "get"],
        ["redis", "put"],
        ["redis+aes", "put"],
        ["redis", "get"],
        ["redis+aes", "get"],
    ]
    aes_put = next(line for line in lines if line.startswith("disk+aes   put"))
    assert aes_put.split()[3] == "disk"
    assert f"{results['disk']['encrypted_put_ratio']:5.2f}".strip() in aes_put
    assert aes_put.endswith(">= 0.8")
    below = results.get("below_target", [])
    ratio = results["redis"]["encrypted_get_ratio"]
    assert (ratio < 0.8) == any(item.startswith("redis encrypted_get_ratio") for item in below)
