"""Administration of a running sidecar: the stats table, ``AdminClient`` and ``lmcache-async
ctl`` / ``stats`` against a sidecar in this process and against ``lmcache-async serve``
(with its KV events and Prometheus endpoint) as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import zmq

from lmcache_async import EngineConfig, KVLayout, RemoteCacheEngine
from lmcache_async.cli import main
from lmcache_async.errors import (
    ConfigError,
    EngineClosedError,
    EraseIncompleteError,
    InvalidInputError,
    ProtocolError,
    TierUnavailableError,
)
from lmcache_async.rpc.admin import AdminClient, format_health, format_stats, format_tenants
from lmcache_async.rpc.erase import erase_result, format_erase
from lmcache_async.rpc.event_subscriber import EventSubscriber
from lmcache_async.rpc.kv_wire import AllBlocksCleared, BlockStored
from lmcache_async.rpc.protocol import MessageType
from lmcache_async.rpc.sidecar import SidecarServer, SidecarSettings, serve
from lmcache_async.rpc.sidecar.access import AccessList
from lmcache_async.tenancy.tenants import tenant_tag

CHUNK = 16
TIMEOUT = 60
MODEL = "admin-test"
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=CHUNK, dtype=torch.float16
)

# The CLI configures logging for its process: put it back after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + 13 + salt) % 50_000 for i in range(length)]


def kv_for(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-num_tokens // CHUNK)
    return LAYOUT.allocate_kv_caches(blocks, generator=generator), torch.arange(num_tokens)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (unix socket paths hold at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="lmc-adm-", dir="/tmp") as path:
        yield Path(path)


# -- the table --------------------------------------------------------------------------------


def _reply() -> dict[str, Any]:
    return {
        "uptime_s": 10.0,
        "server": {"endpoint": "ipc:///tmp/s.sock", "pid": 42, "sessions": 2},
        "stats": {
            "healthy": True,
            "frozen": False,
            "hot_cache": True,
            "pool": {"capacity_bytes": 4 << 20, "used_bytes": 1 << 20, "num_objects": 3},
            "store_requests": 4,
            "retrieve_requests": 2,
            "lookup_requests": 8,
            "stored_tokens": 2000,
            "retrieved_tokens": 1000,
            "lookup_tokens": 4000,
            "lookup_hit_tokens": 1000,
            "tiers": {
                "cpu": {"chunks": 12, "bytes": 3 << 20, "hits": 5, "misses": 1, "puts": 12},
                "disk": {"chunks": 30, "bytes": 1536, "hits": 0, "misses": 2, "puts": 30},
            },
            "tier_health": {"cpu": True, "disk": False},
            "events_dropped": 7,
        },
        "latency": {
            "lookup": {
                "count": 8,
                "window": 8,
                "p50": 0.0002,
                "p90": 0.0005,
                "p99": 0.001,
                "max": 0.002,
            },
            "store": {"count": 0, "window": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0},
        },
        "events": {"endpoint": "ipc:///tmp/e.sock", "published": 9, "subscribers": 1},
    }


def test_the_stats_table_shows_usage_hit_rate_throughput_tiers_and_latency() -> None:
    lines = format_stats(_reply()).splitlines()
    text = "\n".join(lines)
    assert lines[0].split() == [
        "sidecar", "ipc:///tmp/s.sock", "pid", "42", "up", "10.0", "s", "sessions", "2", "model",
        "-",
    ]  # fmt: skip
    assert "engine      healthy  frozen off  hot cache on" in lines
    assert "pool        1.0 MiB / 4.0 MiB used (25.0%)  objects 3  pinned 0  waiters 0" in lines
    assert "lookup hits 1000 / 4000  hit rate 25.0%" in text
    assert (
        "throughput  stored 200 tok/s  retrieved 100 tok/s  looked up 400 tok/s  (since start)"
        in lines
    )
    tiers = lines.index("tiers")
    assert lines[tiers + 1].split() == [
        "TIER", "HEALTH", "CHUNKS", "BYTES", "HITS", "MISSES", "PUTS", "EVICTED", "CORRUPT",
        "ERRORS",
    ]  # fmt: skip
    assert lines[tiers + 2].split() == [
        "cpu",
        "up",
        "12",
        "3.0",
        "MiB",
        "5",
        "1",
        "12",
        "0",
        "0",
        "0",
    ]
    assert lines[tiers + 3].split() == [
        "disk",
        "DOWN",
        "30",
        "1.5",
        "KiB",
        "0",
        "2",
        "30",
        "0",
        "0",
        "0",
    ]
    assert "latency (ms, latest 8 requests per operation)" in lines
    latency = lines.index("latency (ms, latest 8 requests per operation)")
    assert lines[latency + 2].split() == ["lookup", "8", "0.200", "0.500", "1.000", "2.000"]
    assert not any(line.split()[:1] == ["store"] for line in lines[latency + 1 :])
    assert lines[-1].split() == [
        "kv", "events", "ipc:///tmp/e.sock", "published", "9", "subscribers", "1", "buffer",
        "drops", "7",
    ]  # fmt: skip


def test_throughput_over_an_interval_uses_the_difference() -> None:
    before, after = _reply(), _reply()
    after["stats"]["stored_tokens"] = 2000 + 500
    text = format_stats(after, previous=before, interval=2.0)
    assert "stored 250 tok/s  retrieved 0 tok/s  looked up 0 tok/s  (over the last 2 s)" in text


def test_a_server_without_engine_or_tracking_says_so() -> None:
    text = format_stats({"server": {"endpoint": "ipc:///x", "pid": 1}, "stats": None})
    assert "engine      not open (no client has said hello yet)" in text
    assert "latency     not tracked by this server" in text
    assert "kv events   not published" in text
    assert format_health({"healthy": True, "tiers": {}, "engine": False}).splitlines() == [
        "healthy     yes",
        "engine      not open (no client has said hello yet)",
    ]
    assert format_health({"healthy": False, "tiers": {"cpu": True, "redis": False}}) == (
        "healthy     NO\n  cpu       up\n  redis     DOWN"
    )


def test_the_tenant_table_shows_each_tenants_lookups_and_usage_by_tier() -> None:
    reply = _reply()
    reply["stats"]["tenants"] = {
        "a": {
            "tag": "01cd9670",
            "lookup_requests": 3,
            "lookup_tokens": 400,
            "lookup_hit_tokens": 100,
            "chunks": 6,
            "bytes": 3 << 10,
            "tiers": {
                "cpu": {"chunks": 4, "bytes": 2 << 10, "evictions": 1, "erased": 0},
                "disk": {"chunks": 2, "bytes": 1 << 10, "erased": 5, "quota_bytes": 1 << 20},
            },
        },
        "tag:deadbeef": {"tag": "deadbeef", "chunks": 0, "tiers": {}},
    }
    lines = format_tenants(reply).splitlines()
    assert lines[0] == "tenants     2"
    assert lines[1].split() == [
        "TENANT", "TAG", "LOOKUPS", "HIT", "TOKENS", "TOKENS", "HIT", "RATE", "CHUNKS", "BYTES",
    ]  # fmt: skip
    assert lines[2].split() == ["a", "01cd9670", "3", "100", "400", "25.0%", "6", "3.0", "KiB"]
    assert lines[3].split() == ["tag:deadbeef", "deadbeef", "0", "0", "0", "-", "0", "0", "B"]
    assert lines[4] == "tenant usage by tier"
    assert lines[5].split() == ["TENANT", "TIER", "CHUNKS", "BYTES", "QUOTA", "EVICTED", "ERASED"]
    assert lines[6].split() == ["a", "cpu", "4", "2.0", "KiB", "-", "1", "0"]
    assert lines[7].split() == ["a", "disk", "2", "1.0", "KiB", "1.0", "MiB", "0", "5"]
    assert len(lines) == 8
    assert "none yet" in format_tenants(_reply())
    assert "not open" in format_tenants({"stats": None})


def test_an_erase_reply_is_read_back_as_the_engine_reports_it() -> None:
    assert erase_result({"removed": {"cpu": 2, "disk": 3}, "failed": {}}) == {"cpu": 2, "disk": 3}
    with pytest.raises(EraseIncompleteError) as caught:
        erase_result({"removed": {"cpu": 2}, "failed": {"redis": "down"}})
    assert (caught.value.removed, caught.value.failed) == ({"cpu": 2}, {"redis": "down"})
    for bad in ({}, {"removed": {"cpu": -1}, "failed": {}}, {"removed": {}, "failed": []}):
        with pytest.raises(ProtocolError):
            erase_result(bad)
    secret = "cache-salt-of-a"
    assert format_erase(secret, {"cpu": 2, "disk": 3}).splitlines() == [
        f"erased tenant {tenant_tag(secret).hex()}: 5 chunks removed",  # never the name
        "  cpu              2 chunks",
        "  disk             3 chunks",
    ]
    assert format_erase(None, {"cpu": 1}, {"cpu": "slow", "redis": "down"}).splitlines() == [
        "erased the engine's own tenant: 1 chunks removed, INCOMPLETE",
        "  cpu              1 chunks  FAILED: slow",
        "  redis            -  FAILED: down",
    ]


# -- no server --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_no_answer_within_the_timeout_is_a_clear_error(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/nobody.sock"
    with anyio.fail_after(10):
        with (
            AdminClient(url, timeout=0.2) as client,
            pytest.raises(TierUnavailableError, match=r"did not answer STATS within 0.2 s"),
        ):
            await client.stats()
    with pytest.raises(InvalidInputError, match="url"):
        AdminClient("http://x")
    with pytest.raises(InvalidInputError, match="timeout"):
        AdminClient(url, timeout=0)


def test_ctl_and_stats_exit_1_when_the_server_does_not_answer(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"ipc://{short_dir}/nobody.sock"
    assert main(["ctl", "health", "--url", url, "--timeout", "0.2"]) == 1
    assert "error: the sidecar at" in capsys.readouterr().err
    assert main(["stats", "--url", url, "--timeout", "0.2"]) == 1
    assert "did not answer STATS within 0.2 s" in capsys.readouterr().err
    assert main(["ctl", "freeze", "--url", url]) == 2  # freeze needs on|off
    assert main(["ctl", "clear", "on", "--url", url]) == 2
    assert "takes no state" in capsys.readouterr().err


def test_event_and_metrics_settings_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="beyond loopback") as refused:
        SidecarSettings(listen="ipc:///tmp/x.sock", events="tcp://0.0.0.0:5000")
    assert refused.value.field == "events"
    public, secret = zmq.curve_keypair()
    remote = SidecarSettings(
        events="tcp://0.0.0.0:5000",
        allow_remote=True,
        curve_secret_key=secret,
        access=AccessList(frozenset({public})),
    )
    assert remote.events is not None
    for port in (-1, 65536, True):
        with pytest.raises(ConfigError) as refused:
            SidecarSettings(metrics_port=port)
        assert refused.value.field == "metrics_port"
    assert main(["serve", "--listen", "ipc:///tmp/x.sock", "--events", "http://x"]) == 2
    assert "error: events:" in capsys.readouterr().err


# -- a sidecar in this process ----------------------------------------------------------------


@pytest.mark.anyio
async def test_admin_requests_switch_and_report_a_live_sidecar(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"ipc://{short_dir}/side.sock"
    events_url = f"ipc://{short_dir}/ev.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01),
        events=events_url,
        metrics_port=0,
    )
    servers: list[SidecarServer] = []
    ready = anyio.Event()

    def on_ready(server: SidecarServer) -> None:
        servers.append(server)
        ready.set()

    tokens = prompt(4 * CHUNK)
    kv, slots = kv_for(4 * CHUNK, 1)
    cli_out: dict[str, str] = {}
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(settings, on_ready=on_ready, handle_signals=False))
            await ready.wait()
            server = servers[0]
            with AdminClient(url, timeout=10) as admin, EventSubscriber(events_url) as sub:
                before = await admin.stats()
                assert before["stats"] is None
                with pytest.raises(EngineClosedError, match="no engine yet"):
                    await admin.freeze(True)
                assert server.publisher is not None
                await server.publisher.wait_subscribed()
                async with RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL) as engine:
                    assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 64
                    assert await engine.lookup(tokens) == 64
                    stored = await sub.receive()
                    assert await admin.freeze(True) is True
                    assert (
                        await engine.store(
                            prompt(CHUNK, 1), kv_caches=kv, slot_mapping=slots[:CHUNK]
                        )
                        == 0
                    )
                    assert await admin.freeze(False) is False
                    assert await admin.set_hot_cache(False) is False
                    assert server.engine is not None and not server.engine.stats().hot_cache
                    assert await admin.set_hot_cache(True) is True
                    health = await admin.health()
                    stats = await admin.stats()
                    scrape = await _scrape(server)
                    for argv in (["stats"], ["ctl", "health"]):
                        assert await anyio.to_thread.run_sync(main, [*argv, "--url", url]) == 0
                        cli_out[argv[-1]] = capsys.readouterr().out
                    assert await admin.clear() == 4
                    removed = await sub.receive()
            server.stopping.set()
    (block,) = stored.events
    assert isinstance(block, BlockStored) and list(block.token_ids) == tokens
    assert removed.events == (AllBlocksCleared(),)  # every tier was cleared
    assert health == {"healthy": True, "tiers": {"cpu": True}}
    engine_stats = stats["stats"]
    assert (engine_stats["stored_tokens"], engine_stats["lookup_hit_tokens"]) == (64, 64)
    assert stats["latency"]["lookup"]["count"] == 1
    assert stats["latency"]["store"]["count"] == 2  # the frozen store is timed too
    assert stats["events"]["subscribers"] == 1 and stats["events"]["published"] >= 1
    assert stats["uptime_s"] > 0
    assert "lmcache_async_stored_tokens_total 64.0" in scrape
    assert 'lmcache_async_request_latency_seconds_count{op="lookup"} 1.0' in scrape
    assert 'lmcache_async_tier_healthy{tier="cpu"} 1.0' in scrape
    assert "lmcache_async_sidecar_sessions 1.0" in scrape
    assert "hit rate 100.0%" in cli_out["stats"] and "tiers" in cli_out["stats"]
    assert cli_out["health"].splitlines() == ["healthy     yes", "  cpu       up"]


@pytest.mark.anyio
async def test_erase_reaches_the_sidecars_tiers_from_an_admin_client_a_remote_and_ctl(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sidecar whose Redis tier is down: each erasure removes the tenant's chunks from the
    CPU tier and reports the Redis tier as failed, through AdminClient, RemoteCacheEngine
    and ``ctl erase`` (exit 1); a bad tenant is refused."""
    url = f"ipc://{short_dir}/erase.sock"
    config = EngineConfig(
        chunk_size=CHUNK, max_local_cpu_size=0.01, remote_url="redis://127.0.0.1:1"
    )
    settings = SidecarSettings(listen=url, config=config, events=None)
    servers: list[SidecarServer] = []
    ready = anyio.Event()

    def on_ready(server: SidecarServer) -> None:
        servers.append(server)
        ready.set()

    tokens = prompt(4 * CHUNK)
    kv, slots = kv_for(4 * CHUNK, 1)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(settings, on_ready=on_ready, handle_signals=False))
            await ready.wait()
            with AdminClient(url, timeout=10) as admin:
                with pytest.raises(EngineClosedError, match="no engine yet"):
                    await admin.erase("a")
                with pytest.raises(InvalidInputError, match="timeout"):
                    await admin.erase("a", timeout=0)
                async with RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL) as engine:
                    for tenant in ("a", "b", None):
                        stored = await engine.store(
                            tokens, kv_caches=kv, slot_mapping=slots, tenant=tenant
                        )
                        assert stored == 64
                    with pytest.raises(EraseIncompleteError) as by_admin:
                        await admin.erase("a")
                    assert by_admin.value.removed == {"cpu": 4}
                    assert list(by_admin.value.failed) == ["redis"]
                    assert await engine.lookup(tokens, tenant="a") == 0
                    assert await engine.lookup(tokens, tenant="b") == 64
                    with pytest.raises(EraseIncompleteError) as by_remote:
                        await engine.erase("b")
                    assert by_remote.value.removed == {"cpu": 4}
                    assert await engine.lookup(tokens, tenant="b") == 0
                    with pytest.raises(InvalidInputError, match="tenant"):
                        await engine.erase(7)  # type: ignore[arg-type]
                    with pytest.raises(InvalidInputError, match="tenant"):
                        await admin.request(MessageType.ERASE, {"tenant": 7})
                    assert await engine.lookup(tokens) == 64  # the engine's own tenant
                    argv = ["ctl", "erase", "--own-tenant", "--url", url]
                    assert await anyio.to_thread.run_sync(main, argv) == 1
                    assert await engine.lookup(tokens) == 0
            servers[0].stopping.set()
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == [
        "erased the engine's own tenant: 4 chunks removed, INCOMPLETE",
        "  cpu              4 chunks",
        out[-1],
    ]
    assert out[-1].startswith("  redis            -  FAILED: ")


async def _scrape(server: SidecarServer) -> str:
    assert server.metrics is not None
    async with await anyio.connect_tcp("127.0.0.1", server.metrics.port) as stream:
        await stream.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    return body.decode()


# -- lmcache-async serve as a real process ----------------------------------------------------


def _command(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]
    return [*base, *args]


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_serve_publishes_events_and_serves_metrics_and_admin(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/serve.sock"
    events_url = f"ipc://{short_dir}/serve-ev.sock"
    layout = json.dumps(LAYOUT.to_dict())
    serve_args = ["serve", "--listen", url, "--events", events_url, "--metrics-port", "0"]
    serve_args += ["--chunk-size", str(CHUNK), "--max-local-cpu-size", "0.02"]
    serve_args += ["--model-name", MODEL, "--layout", layout]
    tokens = prompt(3 * CHUNK, 5)
    kv, slots = kv_for(3 * CHUNK, 2)
    log_path = short_dir / "serve.log"
    with log_path.open("wb") as log_file, anyio.fail_after(TIMEOUT):
        sidecar = await anyio.open_process(
            _command(*serve_args), stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            tail_command = _command("events", "--connect", events_url, "--json", "--count", "1")
            with AdminClient(url, timeout=1) as admin:
                async with await anyio.open_process(tail_command) as tail:
                    while True:  # the server and the tail start together; wait for both
                        try:
                            stats = await admin.stats()
                        except TierUnavailableError:
                            assert sidecar.returncode is None, log_path.read_text()
                            continue
                        if stats["events"]["subscribers"]:
                            break
                        await anyio.sleep(0.05)
                    async with RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL) as engine:
                        assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 48
                    assert tail.stdout is not None
                    line = b""
                    async for chunk in tail.stdout:
                        line += chunk
                    assert await tail.wait() == 0
                    stats = await admin.stats()
                    assert await admin.freeze(True) is True
        finally:
            sidecar.terminate()
            returncode = await sidecar.wait()
    assert returncode == 0, log_path.read_text()
    event = json.loads(line)
    assert event["type"] == "BlockStored" and event["token_ids"] == tokens
    assert event["medium"] == "CPU" and event["block_size"] == LAYOUT.block_size
    assert len(event["block_hashes"]) == len(tokens) // LAYOUT.block_size
    assert stats["metrics"].startswith("http://127.0.0.1:")
    assert stats["stats"]["stored_tokens"] == 48
