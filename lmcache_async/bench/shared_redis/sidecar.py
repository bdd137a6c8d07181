"""``lmcache-async serve`` as a child process for the shared-Redis benchmark: one host's
sidecar, its RAM tier in front of a shared Redis, with Prometheus metrics to read its
counters from.

:class:`SidecarProcess` starts ``python -m lmcache_async.cli serve`` on an ipc socket,
waits for a PING answer (a PING needs no session, so the namespace stays for the first
real client, vLLM's connector, to fix), reads ``GET /metrics`` into a flat mapping, and
ends by pid (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from lmcache_async.bench.routing.ports import free_port, live_pid, log_tail
from lmcache_async.bench.routing.server import ServerError

__all__ = ["READY_TIMEOUT", "SidecarProcess", "parse_metrics"]

READY_TIMEOUT: Final = 90.0
"""Seconds a sidecar gets to answer a PING (importing torch takes a while on two cores)."""
STOP_TIMEOUT: Final = 20.0
METRICS_TIMEOUT: Final = 10.0
_PING_TIMEOUT: Final = 0.5


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{"name{labels}": value}`` (comments skipped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


class SidecarProcess:
    """One sidecar on ``ipc://<directory>/<name>.sock`` with ``--remote-url redis_url``, a
    RAM tier of ``cpu_gb`` GB and ``chunk_size``; its log goes to ``<name>.log``."""

    def __init__(
        self, directory: Path, name: str, *, redis_url: str, cpu_gb: float, chunk_size: int
    ) -> None:
        self.directory = directory
        self.name = name
        self.redis_url = redis_url
        self.cpu_gb = cpu_gb
        self.chunk_size = chunk_size
        self.url = f"ipc://{directory / (name + '.sock')}"
        self.log_path = directory / f"{name}.log"
        self.metrics_port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The process's id while it runs (its children are its own)."""
        return live_pid(self._process)

    def log_tail(self, size: int = 4000) -> str:
        return log_tail(self.log_path, size)

    def _command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lmcache_async.cli",
            "--log-level",
            "WARNING",
            "serve",
            "--listen",
            self.url,
            "--metrics-port",
            str(self.metrics_port),
            "--remote-url",
            self.redis_url,
            "--max-local-cpu-size",
            repr(self.cpu_gb),
            "--chunk-size",
            str(self.chunk_size),
            "--save-unfull-chunk",
            "false",
        ]

    def start(self) -> SidecarProcess:
        """Start the sidecar and wait, bounded by :data:`READY_TIMEOUT`, for a PING answer.

        Raises:
            ServerError: it exited or never answered (the message holds its log's end).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metrics_port = free_port()
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise ServerError(f"sidecar {self.name} exited with {code}: {self.log_tail()}")
            if _ping(self.url):
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"sidecar {self.name} did not answer: {self.log_tail()}")

    def stop(self) -> None:
        """End the sidecar by pid: SIGTERM, then SIGKILL."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT)

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def metrics(self) -> Mapping[str, float]:
        """The sidecar's metrics now (:func:`parse_metrics`).

        Raises:
            ServerError: an error status.
            httpx.HTTPError: no answer within :data:`METRICS_TIMEOUT`.
        """
        import httpx  # noqa: PLC0415  (vLLM's dependency)

        async with httpx.AsyncClient(timeout=METRICS_TIMEOUT, trust_env=False) as client:
            response = await client.get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if response.is_error:
            raise ServerError(f"sidecar {self.name} /metrics -> {response.status_code}")
        return parse_metrics(response.text)


def _ping(url: str) -> bool:
    """One PING round trip within :data:`_PING_TIMEOUT`: whether the sidecar answered."""
    import zmq  # noqa: PLC0415

    from lmcache_async.rpc.protocol import MessageType, decode, encode  # noqa: PLC0415

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        # Queued until the connection is up (not IMMEDIATE: a fresh socket's first send
        # would find no peer yet and every attempt would fail); dropped at close if the
        # sidecar is not there.
        sock.send_multipart(encode(MessageType.PING, None, request_id=1), flags=zmq.NOBLOCK)
        if not sock.poll(int(_PING_TIMEOUT * 1000)):
            return False
        return decode(sock.recv_multipart()).type is MessageType.PING
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)
        context.term()
