"""Real Redis servers for tests: a standalone server and a 3-node cluster on loopback.

Each server is a ``redis-server`` child process on a free 127.0.0.1 port, with persistence
off and its files in a private directory. :meth:`RedisServer.stop` ends it by pid (SIGTERM,
then SIGKILL) and :meth:`RedisServer.restart` starts it again on the same port, which is how
the fault tests take Redis away and bring it back. The servers run in the foreground as
children of the test process (not ``--daemonize``), so they are reaped on stop and never
linger as zombies; their pid is also written to a pidfile in the directory.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["RedisCluster", "RedisServer", "ServerError", "redis_binaries"]

START_TIMEOUT: Final = 10.0
"""Seconds a server or a cluster gets to answer after it is started."""

STOP_TIMEOUT: Final = 5.0
"""Seconds a server gets to exit after SIGTERM before it is killed."""

_PORT_RANGE: Final = (20000, 50000)
"""Ports tried: below 55535, so that a cluster node's bus port (port + 10000) is valid."""

_START_ATTEMPTS: Final = 5


class ServerError(RuntimeError):
    """A test server could not be started or did not become ready in time."""


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``.

    Raises:
        ServerError: either is missing (the message says to run ``make redis``).
    """
    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if server is None or cli is None:
        raise ServerError(
            "redis-server and redis-cli are needed for the Redis tier tests but were not "
            "found on PATH; run `make redis` (it installs them with apt-get) and retry"
        )
    return server, cli


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nothing listens on now (and its cluster bus port, with ``with_bus``).

    Raises:
        ServerError: no free port was found.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if _bindable(port) and (not with_bus or _bindable(port + 10000)):
            return port
    raise ServerError("no free loopback port found")


def send_command(port: int, *args: str, timeout: float = 1.0) -> bytes:
    """Send one inline command to 127.0.0.1:``port`` and return the raw reply (one read).

    Raises:
        OSError: the server does not accept the connection or does not answer in time.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall((" ".join(args) + "\r\n").encode())
        return sock.recv(65536)


class RedisServer:
    """One ``redis-server`` on a free loopback port, started by :meth:`start`.

    With ``cluster`` the node runs in cluster mode (its ``nodes.conf`` lives in
    ``directory``, so a restarted node rejoins its cluster); ``args`` are more options for
    ``redis-server`` (TLS, ACL users), after the ones set here. Usable as a context
    manager that stops the server on exit.
    """

    def __init__(self, directory: Path, *, cluster: bool = False, args: Sequence[str] = ()) -> None:
        self.directory = directory
        self.cluster = cluster
        self.args = tuple(args)
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def socket_path(self) -> Path:
        """The Unix socket a standalone server also listens on."""
        return self.directory / "redis.sock"

    @property
    def unix_url(self) -> str:
        """``unix://<directory>/redis.sock``."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        server, _ = redis_binaries()
        args = [
            server,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.directory / "redis.log"),
            "--protected-mode",
            "no",
        ]
        if not self.cluster:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.directory / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        return args + list(self.args)

    def start(self) -> RedisServer:
        """Start on a fresh free port (retrying if another process takes it first).

        Raises:
            ServerError: the server is missing, already running, or never became ready.
        """
        redis_binaries()  # a clear error when they are missing, before any retry
        if self.running:
            raise ServerError(f"redis-server already running on port {self.port}")
        last = ""
        for _ in range(_START_ATTEMPTS):
            self.port = free_port(with_bus=self.cluster)
            try:
                self._launch()
            except ServerError as exc:
                last = str(exc)
                continue
            return self
        raise ServerError(f"redis-server did not start after {_START_ATTEMPTS} tries: {last}")

    def restart(self) -> None:
        """Start again on the same port (after :meth:`stop`; stops a running one first).

        Raises:
            ServerError: the server did not come up (the port may have been taken).
        """
        if self.port == 0:
            raise ServerError("restart() of a server that was never started")
        self.stop()
        self._launch()

    def _launch(self) -> None:
        process = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.directory,
        )
        self._process = process
        (self.directory / "redis.pid").write_text(f"{process.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._process = None
                log = self.directory / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise ServerError(
                    f"redis-server on port {self.port} exited with {process.returncode}: {tail}"
                )
            with contextlib.suppress(OSError):
                if send_command(self.port, "PING").startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"redis-server on port {self.port} did not answer PING in time")

    def stop(self) -> None:
        """End the server by pid: SIGTERM, then SIGKILL if it has not exited in time."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "redis.pid").unlink()

    def command(self, *args: str) -> bytes:
        """Send one inline command (e.g. ``"FLUSHALL"``) and return the raw reply."""
        return send_command(self.port, *args)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """A Redis Cluster of ``size`` primaries (no replicas) on loopback, one dir per node."""

    def __init__(self, directory: Path, *, size: int = 3) -> None:
        if size < 3:
            raise ServerError("redis-cli --cluster create needs at least 3 primaries")
        self.nodes = [RedisServer(directory / f"node{i}", cluster=True) for i in range(size)]

    @property
    def url(self) -> str:
        """``redis-cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,...``."""
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> Sequence[int]:
        """The nodes' ports."""
        return [n.port for n in self.nodes]

    def start(self) -> RedisCluster:
        """Start the nodes, join them into a cluster and wait for ``cluster_state:ok``.

        Raises:
            ServerError: a node did not start, ``redis-cli --cluster create`` failed, or
                the cluster did not become ready in time.
        """
        _, cli = redis_binaries()
        try:
            for node in self.nodes:
                node.start()
            result = subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                timeout=START_TIMEOUT * 3,
                check=False,
            )
            if result.returncode != 0:
                raise ServerError(
                    "redis-cli --cluster create failed: "
                    + result.stdout.decode(errors="replace")[-2000:]
                    + result.stderr.decode(errors="replace")[-2000:]
                )
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT * 2) -> None:
        """Wait until every node reports ``cluster_state:ok``.

        Raises:
            ServerError: not ready within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes):
                    return
            time.sleep(0.05)
        raise ServerError("redis cluster did not reach cluster_state:ok in time")

    def flushall(self) -> None:
        """Empty every node."""
        for node in self.nodes:
            node.command("FLUSHALL")

    def stop(self) -> None:
        """Stop every node by pid."""
        for node in self.nodes:
            node.stop()

    def restart(self) -> None:
        """Restart every node on its port (each rejoins from its nodes.conf) and wait."""
        for node in self.nodes:
            node.restart()
        self.wait_ready()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
