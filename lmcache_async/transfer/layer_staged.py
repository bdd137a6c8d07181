"""Staged per-layer transfers: one layer of a request's chunks with a kernel or two and one
host copy per run of adjacent payloads.

:meth:`TransferPlan.scatter_layer_chunks
<lmcache_async.transfer.plan.TransferPlan.scatter_layer_chunks>` on a device copies each
chunk's per-layer payload over and writes it with an ``index_copy_`` of its own: a
32-layer, 32-chunk layerwise load issues 1,024 host copies and 1,024 kernels.
:class:`StagedLayers` moves one layer of all the request's chunks through a device staging
buffer instead. The per-layer payloads (``[tokens, parts, width]``, token-major) of
consecutive jobs, put one after the other, are the per-layer payload of all their tokens,
so the buffer is laid out as one such payload:

- a scatter copies each run of payloads that lie back to back in host memory (a
  layerwise store lays each layer's payloads out so, :mod:`lmcache_async.pipelines.layerwise`)
  into its range of the buffer, then writes the layer with **one** ``index_copy_`` (one per
  part when parts have row views of their own); tokens with a negative slot cost one
  ``index_select`` more;
- a gather takes the layer's rows with one ``index_select`` (per part), then copies each
  host run out.

The row index of the jobs' tokens (and, for a scatter, of those kept) is built once, when
the object is made, and serves every layer: a request's launches are O(layers + chunks),
not O(layers x chunks). A layer's payloads move in one pass (the buffer grows to one
layer's bytes). The code is plain torch and device-agnostic (the tests run it on the CPU
against the per-chunk path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.transfer.plan import TransferPlan, negatives_in, refuse_negatives, settle
from lmcache_async.transfer.staged import Job, _span, host_runs
from lmcache_async.transfer.staging import StagingBuffer

__all__ = ["StagedLayers"]


class StagedLayers:
    """The per-layer transfers of one request's jobs, through a staging buffer.

    ``ranges`` are the jobs' token ranges ``[start, end)``, in the order every layer's jobs
    come in (the payloads differ per layer, the ranges do not).

    Raises:
        InvalidInputError: a range out of the plan's tokens.
    """

    __slots__ = ("_device", "_dtype", "_index", "_kept", "_numel", "_plan", "_ranges", "_tokens")

    def __init__(self, plan: TransferPlan, ranges: Sequence[tuple[int, int]]) -> None:
        num_tokens = int(plan._parts[0].index.shape[0]) // plan._rpt
        for start, end in ranges:
            if not 0 <= start <= end <= num_tokens:
                raise InvalidInputError(f"range [{start}, {end}): out of {num_tokens} tokens")
        self._plan = plan
        self._ranges = [(start, end) for start, end in ranges]
        self._tokens = sum(end - start for start, end in ranges)
        first = plan._parts[0].views[0]
        self._device = first.device
        self._dtype = first.dtype
        # Elements of one token's per-layer payload.
        self._numel = len(plan._parts) * plan._rpt * math.prod(plan._parts[0].row_shape)
        self._index = self._build_index()
        self._kept = self._build_kept()

    # -- built once ------------------------------------------------------------------------

    def _follow(self) -> bool:
        ranges = [r for r in self._ranges if r[1] > r[0]]
        return all(ranges[i][0] == ranges[i - 1][1] for i in range(1, len(ranges)))

    def _build_index(self) -> list[torch.Tensor]:
        """The rows of the jobs' tokens, in staging order: one index for fused parts (in
        per-layer payload order), else one per part. A view when the ranges follow."""
        plan, ranges = self._plan, [r for r in self._ranges if r[1] > r[0]]
        if not ranges:
            return []
        if plan._fused:
            if self._follow():
                return [plan._layer_rows(ranges[0][0], ranges[-1][1])]
            return [torch.cat([plan._layer_rows(s, e) for s, e in ranges])]
        rpt = plan._rpt
        if self._follow():
            begin, end = ranges[0][0] * rpt, ranges[-1][1] * rpt
            return [part.index[begin:end] for part in plan._parts]
        return [
            torch.cat([part.index[s * rpt : e * rpt] for s, e in ranges]) for part in plan._parts
        ]

    def _build_kept(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """For a scatter with negative slots among the jobs' tokens: the staged rows kept
        (positions in the buffer's rows) and, per index, the engine rows they go to. None
        when every token is written."""
        negative = self._plan._negative
        keep = np.ones(self._tokens, dtype=bool)
        offset = 0
        for start, end in self._ranges:
            for token in negatives_in(negative, start, end):
                keep[offset + token - start] = False
            offset += end - start
        if keep.all():
            return None
        step = len(self._plan._parts) * self._plan._rpt if self._plan._fused else 1
        rows = np.nonzero(np.repeat(keep, step))[0].astype(np.int64)
        positions = torch.from_numpy(rows).to(self._device)
        return positions, [index.index_select(0, positions) for index in self._index]

    # -- per layer -------------------------------------------------------------------------

    def gather(self, layer: int, jobs: Sequence[Job], staging: StagingBuffer) -> None:
        """Copy layer ``layer`` of each job's tokens into its per-layer payload, through
        ``staging``; the copies to the payloads are queued with ``non_blocking=True`` on
        the current stream. Gives exactly :meth:`TransferPlan.gather_layer_chunks`'s bytes.
        On a failure the copies already queued are waited for before it is raised.

        Raises:
            InvalidInputError: a token of a job has a negative slot, or the jobs are not
                this object's ranges with well-formed payloads (nothing queued).
            EngineClosedError: ``staging`` was closed.
        """
        refuse_negatives(self._plan._negative, jobs)
        payloads = self._checked(jobs, staging)
        if not self._tokens:
            return
        with staging.use(self._tokens * self._numel * self._dtype.itemsize) as buffer:
            try:
                rows = self._rows(buffer)
                plan = self._plan
                if plan._fused:
                    torch.index_select(plan._parts[0].views[layer], 0, self._index[0], out=rows)
                else:
                    for p, part in enumerate(plan._parts):
                        out = plan._part_rows(rows, p)
                        torch.index_select(part.views[layer], 0, self._index[p], out=out)
                for host, begin, end in self._host_ranges(payloads):
                    host.copy_(buffer[begin:end], non_blocking=True)
            except BaseException as exc:
                settle(self._device, exc)
                raise

    def scatter(self, layer: int, jobs: Sequence[Job], staging: StagingBuffer) -> None:
        """Write each job's per-layer payload into layer ``layer`` at its tokens, through
        ``staging``; tokens with a negative slot are not written. The payloads are read
        with ``non_blocking=True`` copies: keep them unchanged until the current stream has
        finished. Gives exactly :meth:`TransferPlan.scatter_layer_chunks`'s result. On a
        failure the copies already queued are waited for before it is raised.

        Raises:
            InvalidInputError: the jobs are not this object's ranges with well-formed
                payloads (nothing queued).
            EngineClosedError: ``staging`` was closed.
        """
        payloads = self._checked(jobs, staging)
        if not self._tokens:
            return
        with staging.use(self._tokens * self._numel * self._dtype.itemsize) as buffer:
            try:
                for host, begin, end in self._host_ranges(payloads):
                    buffer[begin:end].copy_(host, non_blocking=True)
                self._write(layer, self._rows(buffer))
            except BaseException as exc:
                settle(self._device, exc)
                raise

    def _write(self, layer: int, rows: torch.Tensor) -> None:
        plan, kept = self._plan, self._kept
        if plan._fused:
            dst = plan._parts[0].views[layer]
            if kept is None:
                dst.index_copy_(0, self._index[0], rows)
            elif kept[0].numel():
                dst.index_copy_(0, kept[1][0], rows.index_select(0, kept[0]))
            return
        for p, part in enumerate(plan._parts):
            source = plan._part_rows(rows, p)
            if kept is None:
                part.views[layer].index_copy_(0, self._index[p], source)
            elif kept[0].numel():
                part.views[layer].index_copy_(0, kept[1][p], source.index_select(0, kept[0]))

    def _rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer as the per-layer payload of the jobs' tokens, seen as rows: of the
        shared row shape (fused parts), else ``[tokens, parts, width]``."""
        plan = self._plan
        typed = buffer[: self._tokens * self._numel * self._dtype.itemsize].view(self._dtype)
        if plan._fused:
            return typed.view(-1, *plan._parts[0].row_shape)
        return typed.view(self._tokens, len(plan._parts), -1)

    def _checked(self, jobs: Sequence[Job], staging: StagingBuffer) -> list[torch.Tensor]:
        """The jobs' payloads, once checked against the ranges and the staging device.

        Raises:
            InvalidInputError: see :meth:`gather`.
        """
        if staging.device != self._device:
            raise InvalidInputError(
                f"staging: on {staging.device}, the KV caches are on {self._device}"
            )
        if [(start, end) for start, end, _ in jobs] != self._ranges:
            raise InvalidInputError("jobs: not the token ranges these transfers were built for")
        for start, end, payload in jobs:
            if (
                payload.dtype != self._dtype
                or payload.numel() != (end - start) * self._numel
                or not payload.is_contiguous()
            ):
                raise InvalidInputError(
                    f"job [{start}, {end}): expected a contiguous {self._dtype} payload of "
                    f"{(end - start) * self._numel} elements, got {payload.dtype} "
                    f"{tuple(payload.shape)}"
                )
        return [payload for start, end, payload in jobs if end > start]

    def _host_ranges(self, payloads: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
        """Per run of payloads back to back in host memory: its bytes (``uint8``) and the
        byte range of the buffer they fill."""
        itemsize = self._dtype.itemsize
        out: list[tuple[torch.Tensor, int, int]] = []
        begin = 0
        for run in host_runs(payloads):
            nbytes = sum(payloads[i].numel() for i in run) * itemsize
            out.append((_span(payloads[run[0]], nbytes), begin, begin + nbytes))
            begin += nbytes
        return out
