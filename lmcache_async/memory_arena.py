"""The host arena of a memory pool: one ``torch.uint8`` tensor, allocated (pinned when
asked, so host<->device copies can run asynchronously) or viewed over a caller's buffer,
and starting on an OS-page boundary.

:class:`~lmcache_async.memory.MemoryPool` cuts it into pages.
"""

from __future__ import annotations

from typing import TypeAlias

import torch

from lmcache_async.errors import InvalidInputError

__all__ = ["ARENA_ALIGNMENT", "Buffer", "alignment_skip", "buffer_tensor", "host_arena"]

ARENA_ALIGNMENT = 4096
"""The arena starts on an OS-page boundary, so page boundaries are absolute addresses."""

Buffer: TypeAlias = memoryview | bytearray
"""A writable buffer an arena may be carved from (e.g. ``SharedMemory.buf``)."""


def host_arena(
    size: int, pin_memory: bool | None, buffer: Buffer | None
) -> tuple[torch.Tensor, int, bool]:
    """An arena of ``size`` bytes: carved from ``buffer`` when given, else allocated
    (``torch.empty``: pages are not touched until used) and pinned when ``pin_memory`` is
    true, or is None and CUDA is available. Returns the arena, where it starts in the
    allocation or buffer (bytes), and whether it is pinned.

    Raises:
        InvalidInputError: pinned memory was asked for on a system that cannot provide it
            (or together with ``buffer``), or ``buffer`` is not writable, contiguous
            memory that holds ``size`` bytes past its alignment.
    """
    if buffer is not None:
        if pin_memory:
            raise InvalidInputError("pin_memory cannot be combined with a given buffer")
        pin = False
        raw = buffer_tensor(buffer)
        if raw.numel() < alignment_skip(raw) + size:
            raise InvalidInputError(
                f"buffer of {raw.numel()} bytes cannot hold an arena of {size} bytes "
                f"starting on a {ARENA_ALIGNMENT}-byte boundary"
            )
    else:
        pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        try:
            raw = torch.empty(size + ARENA_ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:
            raise InvalidInputError(f"cannot allocate the host arena: {exc}") from exc
    # The host allocator only promises 64-byte alignment; start the arena on a 4 KiB
    # boundary so every page, and so every payload, is at least 256-byte aligned.
    skip = alignment_skip(raw)
    return raw[skip : skip + size], skip, pin


def buffer_tensor(buffer: Buffer) -> torch.Tensor:
    """A uint8 tensor sharing ``buffer``'s memory.

    Raises:
        InvalidInputError: ``buffer`` is not a non-empty, writable, contiguous bytes-like
            object.
    """
    try:
        view = memoryview(buffer)
    except TypeError:
        raise InvalidInputError(
            f"buffer must be a bytes-like object, got {type(buffer).__name__}"
        ) from None
    if view.readonly:
        raise InvalidInputError("buffer must be writable")
    if not view.c_contiguous or view.nbytes == 0:
        raise InvalidInputError("buffer must be a non-empty contiguous buffer")
    return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


def alignment_skip(raw: torch.Tensor) -> int:
    """Bytes to skip from the start of ``raw`` to reach an arena-aligned address."""
    return -raw.data_ptr() % ARENA_ALIGNMENT
