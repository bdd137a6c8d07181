"""A same-host sidecar's stream socket (``PATH.stream`` beside ``ipc://PATH``) with real
``lmcache-async serve`` processes: clients take it when it is there, read the same bytes
as ZeroMQ clients, and fall back to ZeroMQ when it is not (or is a dead file)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_async import RemoteCacheEngine
from tests.rpc.test_sidecar import (
    LAYOUT,
    READY_TIMEOUT,
    Sidecars,
    connect,
    kv_for,
    left_behind,
    payload_of,
    prompt,
    server_state,
    wait_ready,
)

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

NUM_TOKENS = 3 * 16 + 5


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-st-", dir="/tmp"))  # ipc paths: 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    launcher = Sidecars(tmp_path_factory.mktemp("stream-logs"))
    try:
        yield launcher
    finally:
        launcher.stop_all()


async def round_trip(writer: RemoteCacheEngine, reader: RemoteCacheEngine, seed: int) -> None:
    """``writer`` stores a prompt, ``reader`` finds it and loads exactly its bytes."""
    kv, slots = kv_for(NUM_TOKENS, seed)
    tokens = prompt(NUM_TOKENS, 1000 + seed)
    assert await writer.store(tokens, kv_caches=kv, slot_mapping=slots) == NUM_TOKENS
    # The writer's own lookup waits for its commit (sent without waiting) on the sidecar.
    assert await writer.lookup(tokens) == NUM_TOKENS
    assert await reader.lookup(tokens) == NUM_TOKENS
    target = LAYOUT.allocate_kv_caches(4, random=False)
    mask = await reader.retrieve(tokens, kv_caches=target, slot_mapping=slots)
    assert bool(mask.all())
    assert torch.equal(payload_of(target, slots), payload_of(kv, slots))


async def test_a_same_host_client_takes_the_stream_and_reads_the_bytes_zeromq_wrote(
    sidecars: Sidecars, short_dir: Path
) -> None:
    url = f"ipc://{short_dir}/fast.sock"
    started = sidecars.start(url)
    await wait_ready(started)
    stream_file = f"{started.socket_path}.stream"
    assert stat.S_ISSOCK(os.stat(stream_file).st_mode)
    assert stat.S_IMODE(os.stat(stream_file).st_mode) == 0o600
    async with connect(url) as fast, connect(url, stream=False) as plain:
        assert fast.uses_stream and not plain.uses_stream
        assert (await fast.stats())["client"]["stream"] is True
        assert (await plain.stats())["client"]["stream"] is False
        await round_trip(fast, plain, seed=1)
        await round_trip(plain, fast, seed=2)
        _, server = await server_state(fast)
        assert server["sessions"] == 2 and server["transactions"] == 0
    assert started.terminate() == 0
    assert left_behind(started, server["shm"]) == []


async def test_without_a_live_stream_the_client_uses_zeromq(
    sidecars: Sidecars, short_dir: Path
) -> None:
    """A stream file nobody listens on (left by a sidecar that was killed) and a sidecar
    started with ``--no-stream``: the client says hello over ZeroMQ and works as before."""
    url = f"ipc://{short_dir}/plain.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(f"{short_dir}/plain.sock.stream")
    dead.close()  # the file stays; a connect to it is refused
    started = sidecars.start(url, "--no-stream")
    await wait_ready(started)
    async with connect(url) as engine:
        assert not engine.uses_stream
        await round_trip(engine, engine, seed=3)
    assert started.terminate() == 0


async def test_a_client_started_before_its_sidecar_ends_on_the_stream(
    sidecars: Sidecars, short_dir: Path
) -> None:
    """A client that says hello while its sidecar is still starting (no socket file yet)
    waits on ZeroMQ; once the sidecar answers, the client moves to its stream."""
    url = f"ipc://{short_dir}/late.sock"
    started = sidecars.start(url)  # its Python and torch take a while to import
    async with connect(url, timeout=READY_TIMEOUT) as engine:
        assert engine.uses_stream
        await round_trip(engine, engine, seed=4)
    assert started.terminate() == 0
