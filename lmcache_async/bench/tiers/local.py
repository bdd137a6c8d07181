"""Scratch space and a throwaway ``redis-server`` for a tier benchmark run."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from lmcache_async import InvalidInputError

__all__ = ["local_redis", "tempfile_directory"]


@contextlib.contextmanager
def tempfile_directory() -> Iterator[str]:
    """A temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lmcache-async-bench-") as tmp:
        yield tmp


@contextlib.contextmanager
def local_redis(directory: str, timeout: float = 10.0) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port for the length of the block (no
    persistence), stopped by pid afterwards; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise InvalidInputError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
