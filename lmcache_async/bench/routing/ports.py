"""Free loopback TCP ports and log tails for the child processes the benchmarks start."""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["free_port", "log_tail"]


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
