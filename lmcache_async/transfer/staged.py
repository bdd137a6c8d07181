"""Staged transfers: a batch of chunks moved with a few kernel launches per layer and part.

:meth:`TransferPlan.gather_chunks <lmcache_async.transfer.plan.TransferPlan.gather_chunks>` on a
device launches one ``index_select`` per chunk, layer and part, and copies each chunk to
the host on its own. :class:`StagedPlan` moves the same bytes through one device
:class:`~lmcache_async.transfer.staging.StagingBuffer` laid out as the host payloads are:

- each job's payload is one range of the buffer, in the payload's byte order (part-major,
  then layer-major blocks of the token rows, as ``TransferPlan._blocks`` cuts it), the
  jobs one after the other, each taking its own bytes (or, with a host granule, its
  allocation's);
- a gather takes, per layer and part, the rows of all jobs of one length with **one**
  indexing kernel, which writes each job's block of that layer and part in place through
  a strided view of the buffer (``index_select`` when the length has a single job); then
  one ``copy_(non_blocking=True)`` per contiguous host range moves the payloads out:
  payloads back to back in host memory (adjacent pool allocations) are one range;
- a scatter copies each host range in, then writes, per layer and part, the rows of all
  jobs of one length with one ``index_put_`` (``index_copy_`` for a single job); tokens
  with a negative slot are dropped from both sides, once per batch, at the cost of one
  more kernel per layer and part.

A request's chunks have at most two lengths (the chunk size, and a partial last chunk),
so a batch costs about ``2 * layers * parts`` launches plus one copy per host range,
whatever its number of chunks. The code is plain torch and device-agnostic: on the CPU it
runs the same operations (the test suite checks it there against the per-chunk path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.transfer.plan import (
    PlanPart,
    TransferPlan,
    negatives_in,
    refuse_negatives,
    settle,
)
from lmcache_async.transfer.staging import StagingBuffer

__all__ = ["Job", "Pass", "StagedPlan", "host_runs"]

Job = tuple[int, int, torch.Tensor]
"""``(start, end, payload)``: tokens ``[start, end)`` and their contiguous chunk payload."""

_index_out = torch.ops.aten.index.Tensor_out
"""``out[i, j] = src[index[i, j]]`` into any (strided) ``out``: a gather whose output rows
are grouped by job, with the jobs' blocks apart in the staging buffer."""

_index = torch.ops.aten.index.Tensor


def host_runs(payloads: Sequence[torch.Tensor], *, granule: int | None = None) -> list[range]:
    """Cut ``payloads`` (contiguous, in order) into runs that lie back to back in memory:
    payload ``i + 1`` of a run starts where payload ``i`` ends, on one device and in one
    storage (so one tensor can view the run's bytes). With ``granule``, where it ends
    rounded up to a multiple of ``granule`` bytes (payloads that are allocations of whole
    granules, see :class:`~lmcache_async.transfer.staging.StagingBuffer`).

    Returns the runs as ranges of positions in ``payloads``, covering them all in order.
    """
    runs: list[range] = []
    first = 0
    for i in range(1, len(payloads)):
        if not _follows(payloads[i - 1], payloads[i], granule):
            runs.append(range(first, i))
            first = i
    if payloads:
        runs.append(range(first, len(payloads)))
    return runs


def _padded(nbytes: int, granule: int | None) -> int:
    return nbytes if granule is None else -(-nbytes // granule) * granule


def _follows(prev: torch.Tensor, nxt: torch.Tensor, granule: int | None) -> bool:
    step = _padded(prev.numel() * prev.element_size(), granule)
    return (
        nxt.data_ptr() - prev.data_ptr() == step
        and nxt.device == prev.device
        and nxt.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
    )


def _span(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``first``'s storage from where ``first`` starts, as ``uint8``
    (bounds-checked against the storage by ``as_strided``)."""
    flat = first.view(-1).view(torch.uint8)
    if flat.numel() == nbytes:
        return flat
    return flat.as_strided((nbytes,), (1,), flat.storage_offset())


@dataclass(frozen=True, slots=True)
class _Group:
    """Consecutive jobs of one length: ``count`` payloads of ``tokens`` tokens, the first
    at element ``offset`` of the staging buffer, each ``stride`` elements after the last."""

    first: int
    count: int
    tokens: int
    offset: int
    stride: int


@dataclass(frozen=True, slots=True)
class _Range:
    """One host range: ``host`` (``uint8``) is bytes ``[begin, end)`` of the staging buffer."""

    host: torch.Tensor
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Pass:
    """Jobs moved through the staging buffer at once: their groups and host ranges."""

    jobs: Sequence[Job]
    groups: list[_Group]
    ranges: list[_Range]
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Kept:
    """The rows of a group a scatter writes (tokens with a negative slot dropped):
    ``jobs[i], rows[i]`` index the group's ``[count, rows]`` grid, ``index[p]`` the rows of
    part ``p`` in engine memory they go to."""

    jobs: torch.Tensor
    rows: torch.Tensor
    index: list[torch.Tensor]


class StagedPlan:
    """Staged :meth:`gather_chunks` / :meth:`scatter_chunks` over one request's plan parts.

    Takes what a :class:`~lmcache_async.transfer.plan.TransferPlan` holds (:meth:`from_plan`):
    ``parts`` (per part a :class:`~lmcache_async.transfer.plan.PlanPart`: per layer a row view
    ``[rows, *row_shape]``, the int64 row ``index`` of every token), ``rows_per_token`` and
    the sorted positions of the tokens whose slot is negative (``negative``). A payload of
    ``T`` tokens is ``parts * layers`` blocks of ``T * rows_per_token`` rows, part-major.

    Raises:
        InvalidInputError: no parts, parts with different numbers of layers, or a row shape
            that does not split a token's values into ``rows_per_token`` rows.
    """

    __slots__ = ("_device", "_dtype", "_negative", "_num_tokens", "_parts", "_row", "_rpt")

    def __init__(
        self, parts: Sequence[PlanPart], *, rows_per_token: int, negative: Sequence[int] = ()
    ) -> None:
        if not parts:
            raise InvalidInputError("parts: a plan has at least one part")
        num_layers = len(parts[0].views)
        if num_layers == 0 or any(len(p.views) != num_layers for p in parts):
            raise InvalidInputError("parts: every part needs one view per layer, >= 1 layer")
        row = math.prod(parts[0].row_shape)
        if rows_per_token <= 0 or any(math.prod(p.row_shape) != row for p in parts):
            raise InvalidInputError(
                f"parts: row shapes {[p.row_shape for p in parts]} with {rows_per_token} rows "
                "per token do not all hold one width"
            )
        self._parts = tuple(parts)
        self._rpt = rows_per_token
        self._row = row
        self._negative = negative
        self._num_tokens = int(parts[0].index.shape[0]) // rows_per_token
        first = parts[0].views[0]
        self._device = first.device
        self._dtype = first.dtype

    @classmethod
    def from_plan(cls, plan: TransferPlan) -> StagedPlan:
        """The staged transfers of ``plan``'s request (reads the plan's parts, rows per
        token and negative slots)."""
        return cls(plan._parts, rows_per_token=plan._rpt, negative=plan._negative)

    @property
    def device(self) -> torch.device:
        """Where the engine's KV memory lives."""
        return self._device

    @property
    def num_layers(self) -> int:
        """Layers of the engine's KV memory (each part has one row view per layer)."""
        return len(self._parts[0].views)

    def payload_numel(self, num_tokens: int) -> int:
        """Elements of the payload of ``num_tokens`` tokens."""
        return len(self._parts) * self.num_layers * num_tokens * self._rpt * self._row

    def host_copies(self, jobs: Sequence[Job], staging: StagingBuffer) -> int:
        """How many host copies a transfer of ``jobs`` through ``staging`` queues: one per
        run of payloads back to back in host memory, in each pass through the buffer.

        Raises:
            InvalidInputError: as :meth:`gather_chunks` does for a malformed job.
        """
        return sum(len(batch.ranges) for batch in self.passes(jobs, staging))

    def refuse_negatives(self, jobs: Sequence[Job]) -> None:
        """InvalidInputError if a job's range holds a token whose slot is negative (a
        gather cannot read it)."""
        refuse_negatives(self._negative, jobs)

    # -- the transfers ------------------------------------------------------------------

    def gather_chunks(self, jobs: Sequence[Job], staging: StagingBuffer) -> None:
        """Copy each job's tokens into its payload, through ``staging``; the copies to the
        payloads are queued with ``non_blocking=True`` on the current stream (complete once
        it is). Gives exactly :meth:`TransferPlan.gather_chunks`'s bytes. On a failure the
        copies already queued are waited for before it is raised.

        Raises:
            InvalidInputError: a token of a job has a negative slot, a job's range or
                payload is malformed, or ``staging`` is on another device (nothing queued).
            EngineClosedError: ``staging`` was closed.
        """
        refuse_negatives(self._negative, jobs)
        self._run(jobs, staging, self._gather_pass)

    def scatter_chunks(self, jobs: Sequence[Job], staging: StagingBuffer) -> None:
        """Write each job's payload at its tokens, through ``staging``; tokens with a
        negative slot are not written. The payloads are read with ``non_blocking=True``
        copies: keep them unchanged until the current stream has finished. Gives exactly
        :meth:`TransferPlan.scatter_chunks`'s result. On a failure the copies already
        queued are waited for before it is raised.

        Raises:
            InvalidInputError: a job's range or payload is malformed, or ``staging`` is on
                another device (nothing queued).
            EngineClosedError: ``staging`` was closed.
        """
        self._run(jobs, staging, self._scatter_pass)

    def _run(
        self,
        jobs: Sequence[Job],
        staging: StagingBuffer,
        run_pass: Callable[[Pass, torch.Tensor], None],
    ) -> None:
        """Lay the jobs out in passes through ``staging`` and run each; on a failure wait
        for what was queued before raising."""
        passes = self.passes(jobs, staging)
        if not passes:
            return
        with staging.use(max(p.nbytes for p in passes)) as buffer:
            try:
                for batch in passes:
                    run_pass(batch, buffer)
            except BaseException as exc:
                self._settle(exc)
                raise

    def _settle(self, exc: BaseException) -> None:
        settle(self._device, exc)

    def _gather_pass(self, batch: Pass, buffer: torch.Tensor) -> None:
        self.gather_kernels(batch, buffer)
        self.copy_out(batch, buffer)

    def gather_kernels(self, batch: Pass, buffer: torch.Tensor) -> None:
        """The pass's rows into ``buffer``: one indexing kernel per layer, part and length."""
        typed = buffer[: batch.nbytes].view(self._dtype)
        index = [self._group_index(batch.jobs, group) for group in batch.groups]
        for layer in range(self.num_layers):
            for p, part in enumerate(self._parts):
                src = part.views[layer]
                for group, rows in zip(batch.groups, index, strict=True):
                    out = self._grid(typed, group, p, layer)
                    if group.count == 1:
                        torch.index_select(src, 0, rows[p].reshape(-1), out=out[0])
                    else:
                        _index_out(src, [rows[p]], out=out)

    @staticmethod
    def copy_out(batch: Pass, buffer: torch.Tensor) -> None:
        """The pass's payloads out of ``buffer``: one copy per host range."""
        for r in batch.ranges:
            r.host.copy_(buffer[r.begin : r.end], non_blocking=True)

    @staticmethod
    def copy_in(batch: Pass, buffer: torch.Tensor) -> None:
        """The pass's payloads into ``buffer``: one copy per host range."""
        for r in batch.ranges:
            buffer[r.begin : r.end].copy_(r.host, non_blocking=True)

    def _scatter_pass(self, batch: Pass, buffer: torch.Tensor) -> None:
        self.copy_in(batch, buffer)
        self.scatter_kernels(batch, buffer)

    def scatter_kernels(self, batch: Pass, buffer: torch.Tensor) -> None:
        """The pass's rows out of ``buffer`` into engine memory: one indexing kernel per
        layer, part and length (two with negative slots)."""
        typed = buffer[: batch.nbytes].view(self._dtype)
        index = [self._group_index(batch.jobs, group) for group in batch.groups]
        groups = zip(batch.groups, index, strict=True)
        kept = [self._kept(batch.jobs, group, rows) for group, rows in groups]
        for layer in range(self.num_layers):
            for p, part in enumerate(self._parts):
                dst = part.views[layer]
                for group, rows, keep in zip(batch.groups, index, kept, strict=True):
                    grid = self._grid(typed, group, p, layer)
                    if keep is None:
                        if group.count == 1:
                            dst.index_copy_(0, rows[p].reshape(-1), grid[0])
                        else:
                            dst.index_put_((rows[p],), grid)
                    elif keep.rows.numel():
                        dst.index_copy_(0, keep.index[p], _index(grid, [keep.jobs, keep.rows]))

    # -- the batch's layout in the staging buffer ----------------------------------------

    def _grid(self, typed: torch.Tensor, group: _Group, part: int, layer: int) -> torch.Tensor:
        """Block ``(part, layer)`` of every payload of ``group`` in the staging buffer:
        ``[count, rows, *row_shape]``, strided by the payloads' distance."""
        rows = group.tokens * self._rpt
        row_shape = self._parts[part].row_shape
        block = (part * self.num_layers + layer) * rows * self._row
        strides = [1] * len(row_shape)
        for i in range(len(row_shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * row_shape[i + 1]
        return typed.as_strided(
            (group.count, rows, *row_shape),
            (group.stride, self._row, *strides),
            typed.storage_offset() + group.offset + block,
        )

    def _group_index(self, jobs: Sequence[Job], group: _Group) -> list[torch.Tensor]:
        """Per part, the engine rows of the group's tokens as ``[count, rows]``: a view of
        the part's index when the jobs' tokens follow each other, else one ``cat``."""
        rpt = self._rpt
        chosen = jobs[group.first : group.first + group.count]
        shape = (group.count, group.tokens * rpt)
        if all(chosen[i][0] == chosen[i - 1][1] for i in range(1, len(chosen))):
            begin, end = chosen[0][0] * rpt, chosen[-1][1] * rpt
            return [part.index[begin:end].reshape(shape) for part in self._parts]
        return [
            torch.cat([part.index[s * rpt : e * rpt] for s, e, _ in chosen]).view(shape)
            for part in self._parts
        ]

    def _kept(self, jobs: Sequence[Job], group: _Group, index: list[torch.Tensor]) -> _Kept | None:
        """The rows a scatter of ``group`` writes, or None when it writes them all."""
        chosen = jobs[group.first : group.first + group.count]
        skipped = [(i, self._negatives_in(s, e), s) for i, (s, e, _) in enumerate(chosen)]
        if not any(neg for _, neg, _ in skipped):
            return None
        # Built on the host (numpy: no device work), moved once.
        keep = np.ones((group.count, group.tokens), dtype=bool)
        for i, negatives, start in skipped:
            keep[i, [token - start for token in negatives]] = False
        jobs_np, rows_np = np.nonzero(np.repeat(keep, self._rpt, axis=1))
        jobs_at = torch.from_numpy(jobs_np.astype(np.int64)).to(self._device)
        rows_at = torch.from_numpy(rows_np.astype(np.int64)).to(self._device)
        return _Kept(jobs_at, rows_at, [rows[jobs_at, rows_at] for rows in index])

    def _negatives_in(self, start: int, end: int) -> list[int]:
        return negatives_in(self._negative, start, end)

    def passes(
        self, jobs: Sequence[Job], staging: StagingBuffer, bound: int | None = None
    ) -> list[Pass]:
        """Check the jobs and lay them out in the staging buffer, in passes of at most
        ``bound`` bytes (default ``staging.max_bytes``; a larger payload is a pass of its
        own).

        Raises:
            InvalidInputError: a malformed job, or ``staging`` on another device.
        """
        if staging.device != self._device:
            raise InvalidInputError(
                f"staging: on {staging.device}, the KV caches are on {self._device}"
            )
        kept = [job for job in jobs if self._checked(job)]
        granule = staging.host_granule
        limit = staging.max_bytes if bound is None else bound
        passes: list[Pass] = []
        first, used = 0, 0
        for i, (_, _, payload) in enumerate(kept):
            nbytes = payload.numel() * payload.element_size()
            if i > first and used + nbytes > limit:
                passes.append(self._layout(kept[first:i], granule))
                first, used = i, 0
            used += _padded(nbytes, granule)
        if kept:
            passes.append(self._layout(kept[first:], granule))
        return passes

    def _checked(self, job: Job) -> bool:
        """Whether ``job`` moves any token (an empty range moves nothing).

        Raises:
            InvalidInputError: the range is out of the request, or the payload is not a
                contiguous tensor of the caches' dtype holding the range's tokens.
        """
        start, end, payload = job
        if not 0 <= start <= end <= self._num_tokens:
            raise InvalidInputError(
                f"job [{start}, {end}): out of the request's {self._num_tokens} tokens"
            )
        if (
            payload.dtype != self._dtype
            or payload.numel() != self.payload_numel(end - start)
            or not payload.is_contiguous()
        ):
            raise InvalidInputError(
                f"job [{start}, {end}): expected a contiguous {self._dtype} payload of "
                f"{self.payload_numel(end - start)} elements, got {payload.dtype} "
                f"{tuple(payload.shape)}"
            )
        return end > start

    def _layout(self, jobs: Sequence[Job], granule: int | None) -> Pass:
        """Where ``jobs``' payloads go in the staging buffer: one after the other, each
        taking its granule-rounded size, so that a host range is one range of the buffer
        and the jobs of one length sit at one stride."""
        itemsize = self._dtype.itemsize
        offsets: list[int] = []
        offset = 0
        for _, _, payload in jobs:
            offsets.append(offset)
            offset += _padded(payload.numel() * itemsize, granule)
        groups: list[_Group] = []
        first = 0
        for i in range(1, len(jobs) + 1):
            if i == len(jobs) or jobs[i][1] - jobs[i][0] != jobs[first][1] - jobs[first][0]:
                tokens = jobs[first][1] - jobs[first][0]
                stride = _padded(self.payload_numel(tokens) * itemsize, granule)
                groups.append(
                    _Group(first, i - first, tokens, offsets[first] // itemsize, stride // itemsize)
                )
                first = i
        ranges: list[_Range] = []
        payloads = [payload for _, _, payload in jobs]
        for run in host_runs(payloads, granule=granule):
            last = payloads[run[-1]]
            begin = offsets[run[0]]
            end = offsets[run[-1]] + last.numel() * itemsize
            ranges.append(_Range(_span(payloads[run[0]], end - begin), begin, end))
        nbytes = offsets[-1] + payloads[-1].numel() * itemsize
        return Pass(jobs, groups, ranges, nbytes)
