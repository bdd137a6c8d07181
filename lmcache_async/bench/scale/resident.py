"""The CPU tier's resident bytes per chunk, measured in a fresh process.

:func:`~lmcache_async.backends.footprint.measure_resident` counts what resident memory
grows by while a tier fills; in a process that freed memory before (the benchmark's own
engine runs) the fill reuses it unseen. :func:`resident_in_child` therefore runs it in a
child interpreter of its own (:data:`_CHILD`), which prints the figure (``-`` where
``/proc`` does not say).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Final

import anyio

__all__ = ["resident_in_child"]

CHILD_TIMEOUT: Final = 600.0
"""Seconds the child may take (a fill of 200k chunks takes tens of seconds)."""

_CHILD: Final = """
import sys, anyio
from lmcache_async.backends.footprint import measure_resident
chunks, chunk_tokens, token_bytes = map(int, sys.argv[1:4])
figure = anyio.run(
    lambda: measure_resident(chunks, chunk_tokens=chunk_tokens, token_bytes=token_bytes)
)
print("-" if figure is None else f"{figure:.1f}")
"""


async def resident_in_child(chunks: int, *, chunk_tokens: int, token_bytes: int) -> float | None:
    """Resident bytes per chunk of a CPU tier of ``chunks`` chunks, measured in a child
    process; None where it cannot be measured.

    Raises:
        RuntimeError: the child failed or printed something else.
        TimeoutError: it took longer than :data:`CHILD_TIMEOUT`.
    """
    command = [sys.executable, "-c", _CHILD, str(chunks), str(chunk_tokens), str(token_bytes)]
    with anyio.fail_after(CHILD_TIMEOUT):
        done = await anyio.run_process(command, check=False, stderr=subprocess.PIPE)
    text = done.stdout.decode().strip()
    if done.returncode != 0:
        raise RuntimeError(f"the resident-memory child failed: {done.stderr.decode()[-2000:]}")
    if text == "-":
        return None
    try:
        return float(text)
    except ValueError:
        raise RuntimeError(f"the resident-memory child printed {text[:200]!r}") from None
