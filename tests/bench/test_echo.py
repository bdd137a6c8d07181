"""The bare ZeroMQ echo the sidecar benchmark measures its transport against: a real
process, every wait bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import zmq

from lmcache_async.bench.echo import STOP, main, round_trips
from lmcache_async.rpc.stream import StreamSocket, connect_stream

WAIT_MS = 60_000  # a loaded CI machine takes a while to start Python


@pytest.fixture
def url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="lmc-echo-", dir="/tmp") as directory:
        yield f"ipc://{Path(directory) / 'echo.sock'}"


def start(url: str, lifetime: float) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "lmcache_async.bench.echo", url, str(lifetime)]
    return subprocess.Popen(command)


@pytest.mark.subprocess
def test_every_message_comes_back_whole_until_stop(url: str) -> None:
    process = start(url, 120)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(url)
    try:
        for message in ([b"one"], [b"\x05", b"header", b"x" * 100_000], [b"", b"last"]):
            socket.send_multipart(message)
            assert socket.poll(WAIT_MS), "no echo in time"
            assert socket.recv_multipart() == message
        socket.send(STOP)
        assert process.wait(timeout=WAIT_MS / 1000) == 0
    finally:
        socket.close(linger=0)
        context.term()
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.subprocess
def test_it_ends_by_itself_when_its_lifetime_is_over(url: str) -> None:
    process = start(url, 0.5)
    try:
        assert process.wait(timeout=WAIT_MS / 1000) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("args", [[], ["ipc:///tmp/x.sock"], ["ipc:///tmp/x.sock", "soon"]])
def test_bad_arguments_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert "LIFETIME_SECONDS" in capsys.readouterr().err


def echo_once(url: str) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(url)
    try:
        socket.send(b"ready?")
        assert socket.poll(WAIT_MS), "no echo in time"
        assert socket.recv_multipart() == [b"ready?"]
    finally:
        socket.close(linger=0)
        context.term()


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_the_stream_socket_echoes_too_and_stop_there_ends_it(url: str) -> None:
    process = start(url, 120)
    path = url.removeprefix("ipc://") + ".stream"
    inbox: list[list[bytes]] = []
    arrived = anyio.Event()

    def on_message(frames: list[bytes | memoryview]) -> None:
        inbox.append([bytes(frame) for frame in frames])
        arrived.set()

    try:
        with anyio.fail_after(WAIT_MS / 1000):
            # One echo over ZeroMQ first: the stream socket is bound before it answers.
            await anyio.to_thread.run_sync(echo_once, url)
            stream = StreamSocket(connect_stream(path), on_message, max_frame_bytes=1 << 20)
            try:
                for message in ([b"one"], [b"\x05", b"header", b"x" * 100_000], [b"", b"last"]):
                    arrived = anyio.Event()
                    await stream.send(message)
                    await arrived.wait()
                    assert inbox.pop() == message
                await stream.send([STOP])
            finally:
                stream.close()
            assert await anyio.to_thread.run_sync(process.wait) == 0
        assert not await anyio.Path(path).exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_round_trips_time_each_transport() -> None:
    with tempfile.TemporaryDirectory(prefix="lmc-rt-", dir="/tmp") as directory:
        with anyio.fail_after(WAIT_MS / 1000):
            trips = await round_trips(
                directory,
                [b"\x0d", b"{}"],
                count=3,
                warmup=1,
                startup_timeout=60,
                request_timeout=10,
            )
        assert len(trips.zeromq) == 3 and len(trips.stream) == 3
        assert all(t > 0 for t in trips.zeromq + trips.stream)
        assert "echo.sock.stream" not in os.listdir(directory)  # removed by the echo
