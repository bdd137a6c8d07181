"""The host arena of a memory pool: one ``torch.uint8`` tensor, allocated (and page-locked
for CUDA when asked, so host<->device copies can run asynchronously) or viewed over a
caller's buffer, and starting on an OS-page boundary.

:class:`~lmcache_async.memory.pool.MemoryPool` cuts it into pages.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple, TypeAlias

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.memory.pinning import HostRegistration, register_host
from lmcache_async.memory.prefault import advise_huge_pages

__all__ = [
    "ARENA_ALIGNMENT",
    "Buffer",
    "HostArena",
    "alignment_skip",
    "buffer_tensor",
    "host_arena",
]

ARENA_ALIGNMENT = 4096
"""The arena starts on an OS-page boundary, so page boundaries are absolute addresses."""

Buffer: TypeAlias = memoryview | bytearray
"""A writable buffer an arena may be carved from (e.g. ``SharedMemory.buf``)."""


class HostArena(NamedTuple):
    """An arena and where it came from."""

    tensor: torch.Tensor
    """The arena: ``size`` bytes, ``torch.uint8``, one dimension."""
    offset: int
    """Where the arena starts in the allocation or buffer it was carved from (bytes)."""
    registration: HostRegistration | None
    """Its registration with CUDA (exactly ``size`` bytes) when it is pinned, else None."""


def host_arena(size: int, pin_memory: bool | None, buffer: Buffer | None) -> HostArena:
    """An arena of ``size`` bytes: carved from ``buffer`` when given, else allocated as
    ordinary host memory (``torch.empty``: pages are touched only when used, or locked)
    and, when ``pin_memory`` is true, or is None and CUDA is available, page-locked by
    registering exactly its ``size`` bytes with CUDA. An arena left pageable is advised to
    use transparent huge pages (:func:`~lmcache_async.memory.prefault.advise_huge_pages`).
    When CUDA cannot lock it, the arena is returned unpinned (a warning is logged): copies
    are then synchronous, but nothing fails.

    Raises:
        InvalidInputError: pinned memory was asked for without CUDA (or together with
            ``buffer``), the host memory cannot be allocated, or ``buffer`` is not writable,
            contiguous memory that holds ``size`` bytes past its alignment.
    """
    pin = False
    if buffer is not None:
        if pin_memory:
            raise InvalidInputError("pin_memory cannot be combined with a given buffer")
        raw = buffer_tensor(buffer)
        if raw.numel() < alignment_skip(raw) + size:
            raise InvalidInputError(
                f"buffer of {raw.numel()} bytes cannot hold an arena of {size} bytes "
                f"starting on a {ARENA_ALIGNMENT}-byte boundary"
            )
        skip = alignment_skip(raw)
    else:
        cuda = torch.cuda.is_available()
        pin = cuda if pin_memory is None else bool(pin_memory)
        if pin and not cuda:
            raise InvalidInputError("cannot pin the host arena: CUDA is not available")
        raw, skip = _pinnable(size) if pin else _plain(size)
    arena = raw[skip : skip + size]
    if not pin:
        # Before any page is touched, so first writes fault in 2 MiB at a time.
        advise_huge_pages(arena)
    registration = register_host(arena.data_ptr(), size) if pin else None
    return HostArena(arena, skip, registration)


def _plain(size: int) -> tuple[torch.Tensor, int]:
    """Host memory for an arena of ``size`` bytes, and where the arena starts in it."""
    raw = _empty(size + ARENA_ALIGNMENT)
    # The host allocator only promises 64-byte alignment; start the arena on a 4 KiB
    # boundary so every page, and so every payload, is at least 256-byte aligned.
    return raw, alignment_skip(raw)


def _pinnable(size: int) -> tuple[torch.Tensor, int]:
    """As :func:`_plain`, but every OS page the arena touches lies inside this allocation:
    CUDA locks whole OS pages, and a page shared with another registered range (another
    small arena next to this one on the heap) would make the second registration fail."""
    page = max(ARENA_ALIGNMENT, mmap.PAGESIZE)
    raw = _empty(-(-size // page) * page + page)
    return raw, -raw.data_ptr() % page


def _empty(nbytes: int) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError as exc:
        raise InvalidInputError(f"cannot allocate the host arena: {exc}") from exc


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
