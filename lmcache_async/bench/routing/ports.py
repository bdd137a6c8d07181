"""Free loopback TCP ports, log tails and process ids for the child processes the
benchmarks start."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

__all__ = ["free_port", "live_pid", "log_tail"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used:
    callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(path: Path, size: int) -> str:
    """The last ``size`` characters of the log at ``path`` ("" when there is none yet),
    for failure messages."""
    try:
        return path.read_text(errors="replace")[-size:]
    except OSError:
        return ""


def live_pid(process: subprocess.Popen[bytes] | None) -> int | None:
    """``process``'s id while it runs (its children are its own), else None."""
    return None if process is None or process.poll() is not None else process.pid
