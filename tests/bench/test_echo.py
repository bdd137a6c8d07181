"""The bare ZeroMQ echo the sidecar benchmark measures its transport against: a real
process, every wait bounded."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from lmcache_async.bench.echo import STOP, main

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
