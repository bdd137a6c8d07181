"""Payload shapes: what every payload of one shape and dtype in a pool shares, checked
once and kept by each :class:`~lmcache_async.memory.objects.MemoryObj`.

A payload is a run of pages; its tensor is a view of the arena, made when asked for from
the payload's first page and its :class:`PayloadShape` (dims, strides, the arena viewed as
its dtype). No payload keeps a tensor of its own: a view costs about 700 bytes (most of
them torch's, unseen by :mod:`tracemalloc`), several times what the rest of a cached chunk
costs the CPU tier.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lmcache_async.errors import InvalidInputError

__all__ = ["PayloadShape", "PayloadShapes"]

_MAX_REMEMBERED_SHAPES = 256


class PayloadShape(NamedTuple):
    """A checked ``shape``/``dtype`` of one pool's payloads."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    """Contiguous strides of ``dims``, in elements."""
    dtype: torch.dtype
    nbytes: int
    """Exact bytes of a payload."""
    npages: int
    """Pages a payload takes."""
    page_size: int
    """Bytes per page of the pool."""
    arena: torch.Tensor
    """The pool's arena viewed as ``dtype``."""
    origin: int
    """Where page 0 starts in ``arena``'s storage, in elements."""
    page_items: int
    """Elements of ``dtype`` per page."""
    arena_bytes: memoryview
    """The arena's bytes (page 0 first), writable."""

    def view(self, page: int) -> torch.Tensor:
        """The payload that starts at ``page``: ``dims`` of ``dtype``, in the arena."""
        return self.arena.as_strided(self.dims, self.strides, self.origin + page * self.page_items)

    def bytes_at(self, page: int) -> memoryview:
        """The bytes of the payload that starts at ``page`` (no tensor made: a slice of
        :attr:`arena_bytes`, a fraction of a microsecond against tens for a tensor's)."""
        start = page * self.page_size
        return self.arena_bytes[start : start + self.nbytes]


class PayloadShapes:
    """Allocation requests checked against one arena's pages; payload shapes repeat (one
    per chunk length), so each one's check is remembered."""

    def __init__(self, arena: torch.Tensor, page_size: int, num_pages: int) -> None:
        self._arena = arena
        self._page_size = page_size
        self._num_pages = num_pages
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._bytes = arena.view(torch.uint8).reshape(-1).numpy().data.cast("B")
        self._known: dict[tuple[tuple[int, ...], torch.dtype], PayloadShape] = {}

    def check(self, shape: Sequence[int], dtype: torch.dtype) -> PayloadShape:
        """The request's dims, strides, exact byte size and page count.

        Raises:
            InvalidInputError: a bad shape or dtype, or more than the whole arena.
        """
        key = (shape, dtype) if type(shape) is tuple else None
        if key is not None and (known := self._known.get(key)) is not None:
            return known
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"dtype must be a torch.dtype, got {dtype!r}")
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError as exc:
            raise InvalidInputError(f"shape must be a sequence of ints, got {shape!r}") from exc
        if any(d < 0 for d in dims):
            raise InvalidInputError(f"shape has a negative dimension: {dims}")
        typed = self._typed_arena(dtype)
        itemsize = dtype.itemsize
        nbytes = math.prod(dims) * itemsize
        if nbytes == 0:
            raise InvalidInputError(f"zero-size allocations are not supported: shape {dims}")
        npages = -(-nbytes // self._page_size)
        if npages > self._num_pages:
            raise InvalidInputError(
                f"request of {nbytes} bytes exceeds the pool capacity of "
                f"{self._num_pages * self._page_size} bytes"
            )
        strides = [1] * len(dims)
        for i in range(len(dims) - 2, -1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
        # as_strided takes an offset into the whole storage, which begins before the arena.
        checked = PayloadShape(
            dims,
            tuple(strides),
            dtype,
            nbytes,
            npages,
            self._page_size,
            typed,
            int(typed.storage_offset()),
            self._page_size // itemsize,
            self._bytes,
        )
        if key is not None and len(self._known) < _MAX_REMEMBERED_SHAPES:
            self._known[key] = checked
        return checked

    def _typed_arena(self, dtype: torch.dtype) -> torch.Tensor:
        typed = self._typed.get(dtype)
        if typed is None:
            try:
                typed = self._arena.view(dtype)
            except RuntimeError as exc:
                raise InvalidInputError(f"unsupported dtype {dtype}: {exc}") from exc
            if dtype.itemsize <= 0:
                raise InvalidInputError(f"unsupported dtype {dtype}")
            self._typed[dtype] = typed
        return typed
