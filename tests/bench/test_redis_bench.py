"""``bench --redis``: its settings, the plain socket it is measured against, the figures on
made-up timings, and tiny real runs (a redis-server, a sidecar) whose figures are all
there, positive where measured, and whose ratios are the medians of the rounds' ratios."""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from lmcache_async.bench.redis import GOALS, RedisBenchOptions, format_redis, run_redis_bench
from lmcache_async.bench.redis.first_store import plain_fault_in
from lmcache_async.bench.redis.plain import PlainRedis
from lmcache_async.bench.redis.report import summarise_first_stores, summarise_wire
from lmcache_async.bench.redis.wire import READS, WRITES
from lmcache_async.cli import main
from lmcache_async.errors import ConfigError, InvalidInputError, TierError
from tests.servers import RedisServer

TINY = ["--redis-chunks", "2", "--chunk-size", "8", "--redis-rounds", "2"]
"""Two chunks of 8 tokens (96 KiB each), two rounds."""


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"chunks": 0}, "chunks must be an int >= 1"),
        ({"chunk_tokens": -1}, "chunk_tokens must be an int >= 1"),
        ({"rounds": True}, "rounds must be an int >= 1"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"redis_url": "rediss://127.0.0.1:6379"}, "not rediss://"),
        ({"redis_url": "redis-cluster://127.0.0.1:7000"}, "not redis-cluster://"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        RedisBenchOptions(**settings).validate()


def test_a_malformed_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Port out of range"):
        RedisBenchOptions(redis_url="redis://127.0.0.1:99999").validate()


def test_the_defaults_are_eight_chunks_of_three_mib() -> None:
    options = RedisBenchOptions()
    options.validate()
    assert (options.chunks, options.chunk_bytes, options.rounds) == (8, 3 << 20, 10)
    assert options.request_bytes == 24 << 20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--redis-chunks", "0"], "chunks must be an int >= 1"),
        (["--redis-rounds", "-2"], "rounds must be an int >= 1"),
        (["--chunk-size", "0"], "chunk_size: must be > 0"),
        (["--redis-url", "rediss://127.0.0.1:6379"], "plain socket"),
        (["--redis-url", "redis://127.0.0.1:0"], "bad port"),
        (["--redis-chunks", "two"], "invalid int value"),
    ],
)
def test_cli_refuses_bad_flags_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    assert main(["bench", "--redis", *argv]) == 2
    assert message in capsys.readouterr().err


def test_wire_figures_are_medians_and_median_ratios_of_the_rounds() -> None:
    times = {name: [0.010, 0.020, 0.030] for name in (*WRITES, *READS)}
    times["plain_get"] = [0.010, 0.010, 0.020]
    times["embedded_retrieve"] = [0.030, 0.011, 0.020]  # ratios 3, 1.1, 1
    times["embedded_store"] = [0.050, 0.040, 0.040]
    times["embedded_ram_store"] = [0.010, 0.020, 0.010]  # writes 40, 20, 30 ms
    times["plain_set"] = [0.020, 0.010, 0.030]  # write ratios 2, 2, 1
    figures = summarise_wire(times)
    embedded = figures["embedded"]
    assert embedded["retrieve_ms"] == pytest.approx(20.0)
    assert embedded["retrieve_ratio"] == pytest.approx(1.1)
    assert embedded["writes_ms"] == pytest.approx([40.0, 20.0, 30.0])
    assert embedded["write_ms"] == pytest.approx(30.0)
    assert embedded["write_ratio"] == pytest.approx(2.0)
    assert figures["median_ms"]["plain_get"] == pytest.approx(10.0)
    assert figures["sidecar"]["retrieve_ratio"] == pytest.approx(1.5)  # of 1, 2, 1.5


def test_first_store_ratio_is_the_median_of_the_trials_ratios() -> None:
    kinds = {"on": {"first_s": [0.004, 0.009, 0.003], "steady_s": [0.002, 0.003, 0.003]}}
    figures = summarise_first_stores(kinds)["on"]
    assert figures["first_median_ms"] == pytest.approx(4.0)
    assert figures["steady_median_ms"] == pytest.approx(3.0)
    assert figures["ratio"] == pytest.approx(2.0)  # of 2, 3, 1


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_the_plain_socket_moves_exact_bytes_and_says_what_went_wrong(
    redis_server: RedisServer,
) -> None:
    values = [memoryview(bytes(range(256)) * 300), memoryview(b"x"), memoryview(b"\r\n" * 70_000)]
    keys = [b"plain:a", b"plain:b", b"plain:c"]
    dests = [memoryview(bytearray(len(v) + 10)) for v in values]

    def round_trip() -> list[int]:
        with PlainRedis.connect(redis_server.url, timeout=10) as plain:
            plain.sets(keys, values)
            sizes = plain.gets(keys, dests)
            with pytest.raises(TierError, match="found the key there"):
                plain.sets(keys[:1], values[:1])
            with pytest.raises(TierError, match="-1 bytes"):
                plain.gets([b"plain:missing"], dests[:1])
            # A value too large for its buffer stops the client (its reply is left unread).
            with pytest.raises(TierError, match="for a buffer of 1"):
                plain.gets(keys[:1], [memoryview(bytearray(1))])
        with PlainRedis.connect(redis_server.url, timeout=10) as plain:
            assert plain.delete([*keys, b"plain:missing"]) == 3
        return sizes

    with anyio.fail_after(30):
        sizes = await anyio.to_thread.run_sync(round_trip)
    assert sizes == [len(v) for v in values]
    for value, dest in zip(values, dests, strict=True):
        assert dest[: len(value)] == value


def test_the_plain_socket_takes_no_tls_url() -> None:
    with pytest.raises(InvalidInputError, match="not rediss://"):
        PlainRedis.connect("rediss://127.0.0.1:1", timeout=1)


def _check_figures(results: dict[str, Any], rounds: int, chunks: int) -> None:
    """Every figure present, every measured time positive, every ratio the median of the
    rounds' own ratios and every median the median of the rounds."""
    assert results["problems"] == []
    wire = results["wire"]
    assert wire["bit_exact"] == {"embedded": True, "sidecar": True}
    assert len(wire["record_bytes"]) == chunks
    assert all(size > results["chunk_bytes"] for size in wire["record_bytes"]), "header too"
    ms = wire["times_ms"]
    assert set(ms) == {*WRITES, *READS}
    for name, values in ms.items():
        assert len(values) == rounds and all(v > 0 for v in values), name
        assert wire["median_ms"][name] == pytest.approx(statistics.median(values))
    for path in ("embedded", "sidecar"):
        figures = wire[path]
        assert figures["retrieve_ms"] > 0
        ratios = [a / b for a, b in zip(ms[f"{path}_retrieve"], ms["plain_get"], strict=True)]
        assert figures["retrieve_ratio"] == pytest.approx(statistics.median(ratios))
        writes = [a - b for a, b in zip(ms[f"{path}_store"], ms[f"{path}_ram_store"], strict=True)]
        assert figures["write_ms"] == pytest.approx(statistics.median(writes))
        ratios = [w / p for w, p in zip(writes, ms["plain_set"], strict=True)]
        assert figures["write_ratio"] == pytest.approx(statistics.median(ratios))
    first = results["first_store"]
    assert set(first["kinds"]) == {"off", "on", "on_done"}
    for figures in first["kinds"].values():
        assert len(figures["first_ms"]) == len(figures["steady_ms"]) == rounds
        assert all(v > 0 for v in figures["first_ms"] + figures["steady_ms"])
        ratios = [a / b for a, b in zip(figures["first_ms"], figures["steady_ms"], strict=True)]
        assert figures["ratio"] == pytest.approx(statistics.median(ratios))
    floor = first["plain"]
    assert len(floor["first_ms"]) == len(floor["steady_ms"]) == rounds
    assert all(v > 0 for v in floor["first_ms"] + floor["steady_ms"])
    assert results["goals"] == dict(GOALS)


def test_the_plain_fault_in_writes_the_bytes_twice_and_unmaps_them() -> None:
    before = _mapped_bytes()
    seen: list[str] = []
    first, again = plain_fault_in(64 << 20, lambda address: seen.append(_mode_at(address)))
    assert first > 0 and again > 0
    # Private, as the pool's host memory: a shared map is shmem, under other huge-page rules.
    assert seen == ["rw-p"]
    assert _mapped_bytes() < before + (64 << 20)  # the mapping is gone


def _mode_at(address: int) -> str:
    """The permissions column of ``/proc/self/maps`` for the mapping holding ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, mode = line.split()[:2]
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            return mode
    pytest.skip("no /proc/self/maps here")


def _mapped_bytes() -> int:
    """The process's virtual memory size (``VmSize``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status here")


@pytest.mark.subprocess
def test_cli_runs_against_a_server_it_starts_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    out = tmp_path / "redis.json"
    assert main(["bench", "--redis", *TINY, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    written = json.loads(out.read_text())
    _check_figures(written, rounds=2, chunks=2)
    assert written["chunk_bytes"] == 8 * 12 * 1024
    assert "(started for the run)" in written["server"]
    rows = {line.partition("  ")[0]: line.split() for line in captured.out.splitlines()}
    for op in ("retrieve", "write"):
        for path in ("embedded", "sidecar"):
            *_, ratio, _, goal = rows[f"{op}, {path}"]
            assert ratio == f"{written['wire'][path][f'{op}_ratio']:.2f}"
            assert goal == "1.3"
    assert "on (default), store at once" in captured.out and "<= 1.5" in captured.out
    floor = written["first_store"]["plain"]
    assert f"asked for) {floor['first_median_ms']:.2f} ms" in captured.out
    assert "bench: redis round 2/2" in captured.err
    assert "bench: redis first stores, trial 2/2" in captured.err
    port = int(written["server"].split(":")[2].split()[0])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # the server it started is gone


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_run_on_a_given_server_leaves_no_key_behind(redis_server: RedisServer) -> None:
    options = RedisBenchOptions(chunks=2, chunk_tokens=4, rounds=1, redis_url=redis_server.unix_url)
    with anyio.fail_after(240):
        results = await run_redis_bench(options, progress_stream=None)
    _check_figures(results, rounds=1, chunks=2)
    assert results["server"] == redis_server.unix_url
    assert "retrieve, sidecar" in format_redis(results)

    def keys_left() -> bytes:
        with PlainRedis.connect(redis_server.url, timeout=10) as plain:
            return plain.command(b"DBSIZE")

    assert await anyio.to_thread.run_sync(keys_left) == b":0"
