"""The pool's page: the granule every allocation is rounded up to, chosen from the size of
the payloads the pool holds.

A chunk of the layout's ``chunk_size`` tokens is the payload a pool holds nearly always (a
prompt's short last chunk is the exception), so the page is fitted to it: a whole chunk
should waste nothing to rounding, and whole chunks should tile the arena, so that any
free page (or run of pages) a chunk leaves holds the next one.
"""

from __future__ import annotations

from typing import Final

from lmcache_async.errors import InvalidInputError

__all__ = ["DEFAULT_PAGE_SIZE", "MAX_PAGE_SIZE", "PAGE_ALIGNMENT", "page_size_for"]

DEFAULT_PAGE_SIZE: Final = 64 * 1024
"""The page size of a pool built without one (bytes)."""

MAX_PAGE_SIZE: Final = DEFAULT_PAGE_SIZE
"""The largest page :func:`page_size_for` chooses: what a short chunk may waste at most."""

PAGE_ALIGNMENT: Final = 256
"""Page sizes are a multiple of this, so every page offset is aligned for any dtype."""


def page_size_for(payload_bytes: int) -> int:
    """The page size for a pool of payloads of ``payload_bytes`` (a whole chunk's).

    The multiple of :data:`PAGE_ALIGNMENT`, at most :data:`MAX_PAGE_SIZE`, whose whole pages
    hold the payload with the fewest bytes to spare, the largest of those. So a chunk of up
    to 64 KiB that is a multiple of 256 bytes gets a page of exactly its size (a 4 KiB
    chunk takes 4 KiB, not a 64 KiB page): whole chunks tile the arena, any page eviction
    frees holds a chunk, and a prompt's short last chunk takes one chunk's room. A larger
    chunk gets the largest page that divides it (64 KiB for the power-of-two chunks of
    real models), a page of at most 64 KiB bounding what a short chunk wastes.

    Raises:
        InvalidInputError: ``payload_bytes`` is not a positive int.
    """
    if isinstance(payload_bytes, bool) or not isinstance(payload_bytes, int) or payload_bytes <= 0:
        raise InvalidInputError(f"payload_bytes must be a positive int, got {payload_bytes!r}")
    best, least = PAGE_ALIGNMENT, PAGE_ALIGNMENT
    for page in range(PAGE_ALIGNMENT, MAX_PAGE_SIZE + 1, PAGE_ALIGNMENT):
        spare = -payload_bytes % page
        if spare <= least:
            best, least = page, spare
    return best
