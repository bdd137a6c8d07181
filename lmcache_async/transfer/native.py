"""Row copies in C for transfer plans on the CPU: one call moves every chunk x layer x K/V
part of a gather or a scatter.

:func:`native_rows` describes a plan to :mod:`lmcache_async.transfer._rows`'s ``gather_rows`` /
``scatter_rows`` once per plan: an int64 table (each part's row geometry; each part and
layer's view as base address, row count and row stride), each part's row index as a
buffer, and the tokens a scatter skips. A plan qualifies when its memory is on the CPU and
each part's rows are at most four strided dimensions of contiguous segments, the same in
every layer: every layout of :mod:`lmcache_async.layouts` is. A call then reads only its
jobs (O(jobs) Python work); the C side checks sizes and every row number against its
views before a byte moves, releases the GIL and spreads large copies over threads.

A call with a payload the C copies do not take (on another device, of another dtype, not
contiguous) copies nothing and returns False: the plan then copies with torch, which raises
what it raises for such payloads. A payload of the wrong size is refused with an
:class:`~lmcache_async.errors.InvalidInputError`, where torch would resize it.
"""

from __future__ import annotations

import array
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, cast

import torch

from lmcache_async.errors import InvalidInputError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    RowCopy = Callable[
        [
            ReadableBuffer,
            Sequence[ReadableBuffer],
            Sequence[tuple[int, int, int, int]],
            int,
            ReadableBuffer | None,
            int,
            int,
            int,
        ],
        None,
    ]

_gather_rows: RowCopy | None
_scatter_rows: RowCopy | None
try:
    from lmcache_async.transfer._rows import gather_rows as _gather_rows
    from lmcache_async.transfer._rows import scatter_rows as _scatter_rows
except ImportError:  # built without a C compiler (or before them): plans copy with torch
    _gather_rows = _scatter_rows = None

__all__ = [
    "DEFAULT_COPY_THREADS",
    "MAX_ROW_DIMS",
    "NATIVE_ROWS",
    "STREAM_BYTES",
    "THREAD_BYTES",
    "NativeRows",
    "native_rows",
    "row_geometry",
]

NATIVE_ROWS: Final = _gather_rows is not None and _scatter_rows is not None
"""Whether the C row copies are built (plans made while it is false copy with torch)."""

MAX_ROW_DIMS: Final = 4
"""Strided dimensions a row may have around its contiguous segments (the C side's limit)."""


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


DEFAULT_COPY_THREADS: Final = min(4, _cpus())
"""Threads one copy may use, its caller's included."""

THREAD_BYTES: Final = 4 * 1024 * 1024
"""Bytes each copy thread gets at least: a thread's start (tens of microseconds) is then a
small part of its share, and a small request runs on its caller's thread alone."""

STREAM_BYTES: Final = 32 * 1024 * 1024
"""From this many bytes on, a copy's stores go around the caches: its destination would not
fit them, and a cached store first reads each line it writes. A copy alone at 64 MiB and
below was as fast cached as streamed (and leaves what it wrote in the caches for its
reader), but the engine copies a large request in batches of 64 MiB one after another
(``pipeline_batch_chunks`` 8, 8,192 tokens of 8 x 8 x 128 bf16 in four), and there
streaming from 32 MiB on took a store from 0.74-0.87x of a plain copy_ of the same bytes
to 0.90-0.96x, and a retrieve from 0.80-0.87x to 0.97-1.01x (``bench --micro``, three
runs each way)."""

Job = tuple[int, int, torch.Tensor]
RowJob = tuple[int, int, int, int]
"""A job as the C copies take it: ``(start, end, payload address, payload bytes)``."""


def row_geometry(view: torch.Tensor) -> tuple[int, int, list[int], list[int]] | None:
    """A row of ``view`` (``[rows, *row_shape]``) as ``(row_bytes, seg_bytes, counts,
    strides)``: ``counts`` strided dimensions, outermost first, ``strides`` apart in bytes,
    of contiguous segments of ``seg_bytes``; the row's elements in order. None when the
    row has more than :data:`MAX_ROW_DIMS` such dimensions or a stride that is not
    positive."""
    item = view.element_size()
    dims: list[tuple[int, int]] = []
    for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True):
        if size == 1:
            continue
        if stride <= 0:
            return None
        if dims and dims[-1][1] == size * stride:  # the outer one steps over this one
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    seg = item
    if dims and dims[-1][1] == 1:
        seg = dims.pop()[0] * item
    if len(dims) > MAX_ROW_DIMS:
        return None
    counts = [size for size, _ in dims]
    return seg * math.prod(counts), seg, counts, [stride * item for _, stride in dims]


class NativeRows:
    """A plan's arguments for the C row copies, made once per plan by :func:`native_rows`."""

    __slots__ = (
        "_dtype",
        "_gather",
        "_index",
        "_layers",
        "_scatter",
        "_skip",
        "_stream_bytes",
        "_table",
        "_thread_bytes",
        "_threads",
    )

    def __init__(
        self,
        *,
        gather: RowCopy,
        scatter: RowCopy,
        table: array.array[int],
        index: list[ReadableBuffer],
        skip: bytes | None,
        dtype: torch.dtype,
        layers: int,
        threads: int,
        thread_bytes: int,
        stream_bytes: int,
    ) -> None:
        self._gather = gather
        self._scatter = scatter
        self._table = table
        self._index = index
        self._skip = skip
        self._dtype = dtype
        self._layers = layers
        self._threads = threads
        self._thread_bytes = thread_bytes
        self._stream_bytes = stream_bytes

    def gather(self, jobs: Sequence[Job], layer: int = -1) -> bool:
        """Copy each job's tokens into its payload: whole payloads (``layer`` -1) or one
        layer's (``layer``). False, and nothing copied, when a payload does not qualify.

        Raises:
            InvalidInputError: a payload of the wrong size, or tokens out of the plan's or
                with a negative slot; nothing was copied.
        """
        return self._run(self._gather, jobs, layer)

    def scatter(self, jobs: Sequence[Job], layer: int = -1) -> bool:
        """Copy each job's payload into its tokens' rows (see :meth:`gather`); tokens with
        a negative slot are not written.

        Raises:
            InvalidInputError: a payload of the wrong size, or tokens out of the plan's;
                nothing was copied.
        """
        return self._run(self._scatter, jobs, layer)

    def _run(self, copy: RowCopy, jobs: Sequence[Job], layer: int) -> bool:
        if layer != -1 and (type(layer) is not int or not 0 <= layer < self._layers):
            return False  # torch says what is wrong with it
        dtype = self._dtype
        args: list[RowJob] = []
        for start, end, payload in jobs:
            if payload.dtype != dtype or not payload.is_cpu or not payload.is_contiguous():
                return False
            args.append((start, end, payload.data_ptr(), payload.nbytes))
        try:
            copy(
                self._table,
                self._index,
                args,
                layer,
                self._skip,
                self._threads,
                self._thread_bytes,
                self._stream_bytes,
            )
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from exc
        return True


def _describe(
    views: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[list[int], list[int]] | None:
    """The table's fields for a part's row geometry and for its views, one per layer
    (base address, rows, row stride); None when the views do not qualify: not all on the
    CPU, of ``dtype`` and of one shape and strides."""
    first = views[0]
    geometry = row_geometry(first)
    shape, stride = first.shape, first.stride()
    if geometry is None or not shape or stride[0] <= 0:
        return None
    row_bytes, seg, counts, strides = geometry
    pad = [0] * (MAX_ROW_DIMS - len(counts))
    rows, row_stride = shape[0], stride[0] * first.element_size()
    layers: list[int] = []
    for view in views:
        if view.shape != shape or view.stride() != stride or view.dtype != dtype:
            return None
        if not view.is_cpu:
            return None
        layers += (view.data_ptr(), rows, row_stride)
    return [row_bytes, seg, len(counts), *counts, *pad, *strides, *pad], layers


def native_rows(
    parts: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor]],
    *,
    rows_per_token: int,
    token_part_bytes: int,
    negative: Sequence[int],
    threads: int | None = None,
    thread_bytes: int | None = None,
    stream_bytes: int | None = None,
) -> NativeRows | None:
    """The C copies' arguments for a plan's ``parts`` (each: per layer a view ``[rows,
    *row_shape]``, and the int64 row index of every token, ``rows_per_token`` per token),
    ``token_part_bytes`` a token's bytes in one part and layer; tokens ``negative`` are
    skipped. None when the C copies are not built or the plan does not qualify.

    ``threads`` (:data:`DEFAULT_COPY_THREADS`) and ``thread_bytes``
    (:data:`THREAD_BYTES`): how far a large copy spreads; ``stream_bytes``
    (:data:`STREAM_BYTES`, 0: never): from what size its stores go around the caches.
    """
    if _gather_rows is None or _scatter_rows is None or not NATIVE_ROWS:
        return None
    if not parts or rows_per_token < 1 or not parts[0][0]:
        return None
    dtype = parts[0][0][0].dtype
    num_layers = len(parts[0][0])
    num_tokens = parts[0][1].numel() // rows_per_token
    fields = [len(parts), num_layers, num_tokens, rows_per_token]
    layer_fields: list[int] = []
    index: list[ReadableBuffer] = []
    described: dict[int, tuple[list[int], list[int]] | None] = {}
    for views, rows in parts:
        if len(views) != num_layers or rows.numel() != num_tokens * rows_per_token:
            return None
        if rows.dtype != torch.int64 or not rows.is_cpu:
            return None
        # Parts on one list of views (K and V of most layouts) share its description.
        key = id(views)
        if key not in described:
            described[key] = _describe(views, dtype)
        description = described[key]
        if description is None or description[0][0] * rows_per_token != token_part_bytes:
            return None
        fields += description[0]
        layer_fields += description[1]
        # An ndarray is a buffer (its stubs say so from Python 3.12 on); it keeps the tensor.
        index.append(cast("ReadableBuffer", rows.contiguous().numpy()))
    skip = None
    if negative:
        mask = bytearray(num_tokens)
        for token in negative:
            mask[token] = 1
        skip = bytes(mask)
    return NativeRows(
        gather=_gather_rows,
        scatter=_scatter_rows,
        table=array.array("q", fields + layer_fields),
        index=index,
        skip=skip,
        dtype=dtype,
        layers=num_layers,
        threads=DEFAULT_COPY_THREADS if threads is None else threads,
        thread_bytes=THREAD_BYTES if thread_bytes is None else thread_bytes,
        stream_bytes=STREAM_BYTES if stream_bytes is None else stream_bytes,
    )
