"""Fixtures for the rpc tests: worker processes (tests/rpc/lookup_worker.py) and their
socket directory. Every process started is stopped and reaped when the test ends."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

WORKER_SCRIPT = Path(__file__).with_name("lookup_worker.py")
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


def prompt(length: int) -> list[int]:
    """The token ids the workers store (the same formula as lookup_worker.prompt)."""
    return [(i * 7919 + 13) % 50_000 for i in range(length)]


@dataclass
class Worker:
    """One running lookup_worker.py process."""

    rank: int
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]
    endpoint: str = ""
    log_file: IO[bytes] | None = field(default=None, repr=False)
    terminating: bool = False
    killed: bool = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the socket file stays behind, as after a crash."""
        self.killed = True
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT)

    def terminate(self) -> None:
        """SIGTERM, once: the worker closes its server (removing the socket) and exits."""
        if self.alive() and not self.terminating:
            self.terminating = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit); returns the exit status."""
        self.terminate()
        if self.alive():
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.log_file is not None:
            self.log_file.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_ready(workers: list[Worker]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    pending = {w.process.stdout.fileno(): w for w in workers if w.process.stdout is not None}
    lines = dict.fromkeys(pending, b"")
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = [w.rank for w in pending.values()]
            raise TimeoutError(f"workers {ranks} not ready in {READY_TIMEOUT}s")
        readable, _, _ = select.select(list(pending), [], [], left)
        for fd in readable:
            chunk = os.read(fd, 4096)
            worker = pending[fd]
            if not chunk:
                raise RuntimeError(f"worker {worker.rank} exited early:\n{worker.log()}")
            lines[fd] += chunk
            if b"\n" in lines[fd]:
                first = lines[fd].split(b"\n", 1)[0].decode()
                tag, _, endpoint = first.partition(" ")
                if tag != "READY":
                    raise RuntimeError(f"worker {worker.rank} said {first!r}")
                worker.endpoint = endpoint
                del pending[fd]


class Launcher:
    """Starts lookup_worker.py processes and stops every one of them in :meth:`stop_all`."""

    def __init__(self, log_dir: Path, socket_dir: Path) -> None:
        self._log_dir = log_dir
        self.socket_dir = socket_dir
        self._started: list[Worker] = []

    def __call__(
        self,
        instance: str,
        specs: list[tuple[int, int]],
        *extra: str,
        prompt_len: int = 0,
    ) -> list[Worker]:
        """Start one worker per ``(rank, tokens to store)`` at once; wait until each serves.

        ``extra`` are more lookup_worker.py options."""
        workers = []
        for rank, store in specs:
            args = [
                sys.executable,
                str(WORKER_SCRIPT),
                "--instance",
                instance,
                "--rank",
                str(rank),
                "--socket-dir",
                str(self.socket_dir),
                "--prompt-len",
                str(max(prompt_len, store)),
                "--store",
                str(store),
                *extra,
            ]
            log_path = self._log_dir / f"worker-{instance}-{rank}-{len(self._started)}.log"
            log_file = log_path.open("wb")
            process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log_file)
            worker = Worker(rank, args, log_path, process, log_file=log_file)
            self._started.append(worker)
            workers.append(worker)
        _wait_ready(workers)
        return workers

    def stop_all(self) -> None:
        """Stop every worker; fail if one that was not killed on purpose did not exit 0."""
        for worker in self._started:  # all at once: each takes a while to close
            worker.terminate()
        failed = []
        for worker in self._started:
            if worker.stop() != 0 and not worker.killed:
                failed.append(
                    f"worker {worker.rank} exited {worker.process.returncode}:\n"
                    f"{worker.log()[-3000:]}"
                )
        assert not failed, "\n".join(failed)


def _no_sockets_left(path: Path) -> None:
    left = sorted(p.name for p in path.iterdir() if p.suffix == ".lookup")
    assert not left, f"socket files left behind: {left}"


@pytest.fixture
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for ipc sockets; the test fails if a socket file is left in it."""
    path = tmp_path_factory.mktemp("ipc")
    yield path
    _no_sockets_left(path)


@pytest.fixture
def start_workers(tmp_path_factory: pytest.TempPathFactory, socket_dir: Path) -> Iterator[Launcher]:
    """Starts workers for one test, ``start_workers(instance, [(rank, tokens to store)])``,
    with their sockets in ``socket_dir``."""
    launcher = Launcher(tmp_path_factory.mktemp("logs"), socket_dir)
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def module_socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """As ``socket_dir``, shared by a module's tests."""
    path = tmp_path_factory.mktemp("ipc")
    yield path
    _no_sockets_left(path)


@pytest.fixture(scope="module")
def module_workers(
    tmp_path_factory: pytest.TempPathFactory, module_socket_dir: Path
) -> Iterator[Launcher]:
    """As ``start_workers``, for workers shared by a module's tests."""
    launcher = Launcher(tmp_path_factory.mktemp("logs"), module_socket_dir)
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.fixture(scope="session")
def prompt_tokens() -> Callable[[int], list[int]]:
    """The prompt formula the workers use."""
    return prompt


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp, removed after the test: ipc socket paths must fit in
    107 bytes, which pytest's own temporary directories can exceed."""
    path = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
