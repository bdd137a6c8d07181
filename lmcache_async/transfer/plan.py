"""Transfer plans: one request's prepared copies between engine memory and chunk payloads.

:meth:`KVLayout.plan <lmcache_async.layouts.KVLayout.plan>` validates the caches and slots
once and computes, for each payload part (K, V or the MLA latent), a row view of every layer
and the rows of every token (:class:`PlanPart`); a :class:`TransferPlan` then moves any
chunks' tokens with no further checks: on the CPU with one call of the C row copies for
every chunk, layer and part (:mod:`lmcache_async.transfer.native`), else (no C compiler,
CUDA caches, a payload the C copies do not take) with one ``index_select`` /
``index_copy_`` per chunk, layer and part. Both move the same bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.transfer.native import NativeRows, native_rows

__all__ = [
    "PlanLayout",
    "PlanPart",
    "TransferPlan",
    "negatives_in",
    "refuse_negatives",
    "settle",
]


class PlanLayout(Protocol):
    """What a plan reads of its layout (a :class:`~lmcache_async.layouts.KVLayout`, which
    builds plans and so is not imported here)."""

    @property
    def width(self) -> int: ...
    @property
    def num_layers(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PlanPart:
    """Where one payload part (K, V or the MLA latent) of a request lives in engine memory.

    ``views`` holds, per layer, a view of the layer's memory shaped ``[rows, *row_shape]``;
    ``index`` (int64, on the caches' device) lists the rows of every token of the request,
    ``rows_per_token`` consecutive entries per token, token-major. A token's values in the
    payload (``H * D`` elements) are its rows, in order, flattened. Parts that share one
    ``views`` list and ``row_shape`` are moved together by the per-layer transfers; parts
    with views of their own must have one row per token.
    """

    views: list[torch.Tensor]
    index: torch.Tensor
    row_shape: tuple[int, ...]


class TransferPlan:
    """One request's transfers between engine memory and chunk payloads.

    Built by :meth:`KVLayout.plan`, which validates and computes everything that does not
    depend on the chunk; :meth:`gather` and :meth:`scatter` move the tokens
    ``[start, end)`` of the request with no further checks: on the CPU in one call of the C
    row copies, else with one ``index_select`` / ``index_copy_`` per layer and K/V part.
    """

    __slots__ = (
        "_common_shape",
        "_device",
        "_fused",
        "_layer_index",
        "_layout",
        "_native",
        "_negative",
        "_parts",
        "_rpt",
        "_width",
    )

    def __init__(
        self,
        layout: PlanLayout,
        *,
        parts: Sequence[PlanPart],
        rows_per_token: int,
        negative: list[int],
        device: torch.device,
    ) -> None:
        first = parts[0]
        self._layout = layout
        self._parts = tuple(parts)
        self._width = layout.width
        self._rpt = rows_per_token
        self._negative = negative
        self._device = device
        # Parts on one row view move together, one index per layer, in per-layer transfers.
        self._fused = all(p.views is first.views and p.row_shape == first.row_shape for p in parts)
        # With one row shape for all parts, a chunk payload is cut into its rows by one view
        # per chunk instead of one per layer and part.
        same_shape = all(p.row_shape == first.row_shape for p in parts)
        self._common_shape = first.row_shape if same_shape else None
        self._layer_index: torch.Tensor | None = None  # built on first per-layer transfer
        self._native: NativeRows | None = None
        if device.type == "cpu" and first.views:
            self._native = native_rows(
                [(part.views, part.index) for part in parts],
                rows_per_token=rows_per_token,
                token_part_bytes=self._width * first.views[0].element_size(),
                negative=negative,
            )

    @property
    def device(self) -> torch.device:
        """Where the serving engine's KV memory lives."""
        return self._device

    @property
    def threads_inside(self) -> bool:
        """Whether a transfer spreads its copies over threads itself (the native path):
        then it is called once per batch, not split by chunk over copy threads."""
        return self._native is not None

    def first_skipped(self, start: int) -> int | None:
        """The first token at or after ``start`` whose slot is negative, if any."""
        negative = self._negative
        index = bisect.bisect_left(negative, start)
        return negative[index] if index < len(negative) else None

    def _refuse_negatives(self, jobs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        refuse_negatives(self._negative, jobs)

    def _negatives_in(self, start: int, end: int) -> list[int]:
        return negatives_in(self._negative, start, end)

    def _kept(self, start: int, end: int) -> torch.Tensor | None:
        """Positions (within ``[start, end)``) of the tokens whose slot is not negative, or
        ``None`` when no token of the range is skipped."""
        skipped = self._negatives_in(start, end)
        if not skipped:
            return None
        keep = sorted(set(range(end - start)) - {p - start for p in skipped})
        return torch.tensor(keep, dtype=torch.int64, device=self._device)

    def _keep_rows(self, keep: torch.Tensor, step: int) -> torch.Tensor:
        """Entries of a token-major index with ``step`` entries per token for tokens ``keep``."""
        per_token = torch.arange(step, device=self._device)
        return (keep.unsqueeze(1) * step + per_token).view(-1)

    def gather(self, start: int, end: int, out: torch.Tensor) -> None:
        """Copy tokens ``[start, end)`` into ``out`` (``payload_shape(end - start)``).

        ``out`` may be on the host while the caches are on a device: the copy to it is
        queued with ``non_blocking=True`` on the current stream.

        Raises:
            InvalidInputError: a token in the range has a negative slot.
        """
        self.gather_chunks([(start, end, out)])

    def gather_chunks(self, jobs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Gather several chunks ``(start, end, out)`` layer by layer.

        Going layer-major keeps one layer's memory in cache while every chunk takes its
        rows from it, instead of sweeping all layers once per chunk. On a failure the
        copies already queued into the payloads are waited for before it is raised: the
        caller may then hand the payloads back.

        Raises:
            InvalidInputError: a token in one of the ranges has a negative slot, or (C row
                copies) a payload has the wrong size or a range is out of the plan's.
        """
        self._refuse_negatives(jobs)
        native = self._native
        if native is not None and native.gather(jobs):
            return
        num_layers = self._layout.num_layers
        parts = self._parts
        staged: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start, end, out in jobs:
            dst = out
            if out.device != self._device:
                dst = torch.empty_like(out, device=self._device)
                copies.append((out, dst))
            staged.append((self._blocks(dst), self._slice_rows(start, end)))
        common = self._common_shape
        try:
            for layer in range(num_layers):
                for p, part in enumerate(parts):
                    src = part.views[layer]
                    for dst_parts, rows in staged:
                        dst_rows = dst_parts[p * num_layers + layer]
                        if common is None:
                            dst_rows = dst_rows.view(-1, *part.row_shape)
                        torch.index_select(src, 0, rows[p], out=dst_rows)
            for out, dst in copies:
                out.copy_(dst, non_blocking=True)
        except BaseException as exc:
            self._settle(exc)
            raise

    def scatter(self, payload: torch.Tensor, start: int, end: int) -> None:
        """Write ``payload`` (``payload_shape(end - start)``) at tokens ``[start, end)``.

        Tokens with a negative slot are skipped. A payload on another device is copied
        over with ``non_blocking=True``: keep it unchanged until the stream has finished.
        """
        self.scatter_chunks([(start, end, payload)])

    def scatter_chunks(self, jobs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Scatter several chunks ``(start, end, payload)`` layer by layer (see
        :meth:`gather_chunks`); tokens with a negative slot are skipped.

        On a failure the copies already queued (payloads read with ``non_blocking``) are
        waited for before it is raised: the caller may then hand the payloads back.

        Raises:
            InvalidInputError: (C row copies) a payload has the wrong size or a range is out
                of the plan's; nothing was written.
        """
        native = self._native
        if native is not None and native.scatter(jobs):
            return
        num_layers = self._layout.num_layers
        parts = self._parts
        staged: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        try:
            for start, end, payload in jobs:
                rows = self._slice_rows(start, end)
                source = payload
                if payload.device != self._device:
                    source = payload.to(device=self._device, non_blocking=True)
                keep = self._kept(start, end)
                if keep is not None:
                    if not keep.numel():
                        continue
                    source = source.index_select(2, keep)
                    keep_rows = self._keep_rows(keep, self._rpt)
                    rows = [index.index_select(0, keep_rows) for index in rows]
                if not source.is_contiguous():
                    source = source.contiguous()
                staged.append((self._blocks(source), rows))
            common = self._common_shape
            for layer in range(num_layers):
                for p, part in enumerate(parts):
                    dst = part.views[layer]
                    for src_parts, rows in staged:
                        src_rows = src_parts[p * num_layers + layer]
                        if common is None:
                            src_rows = src_rows.view(-1, *part.row_shape)
                        dst.index_copy_(0, rows[p], src_rows)
        except BaseException as exc:
            self._settle(exc)
            raise

    def _settle(self, exc: BaseException) -> None:
        settle(self._device, exc)

    def _blocks(self, payload: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A contiguous chunk payload cut into its part-major, then layer-major blocks: as
        ``[rows, *row_shape]`` when every part has one row shape, else as
        ``[tokens, width]``."""
        count = len(self._parts) * self._layout.num_layers
        shape = self._common_shape or (self._width,)
        return payload.view(count, -1, *shape).unbind(0)

    def _slice_rows(self, start: int, end: int) -> list[torch.Tensor]:
        rpt = self._rpt
        return [part.index[start * rpt : end * rpt] for part in self._parts]

    # -- per layer (layerwise payloads) -----------------------------------------------------

    def _layer_rows(self, start: int, end: int) -> torch.Tensor:
        """Row indices of tokens ``[start, end)`` in per-layer payload order (fused parts).

        A per-layer payload ``[tokens, parts, width]`` seen as rows of the shared row shape
        lists, for each token, each part's rows in turn; the index for all tokens is built
        once per plan and sliced per chunk.
        """
        index = self._layer_index
        if index is None:
            rows = [part.index for part in self._parts]
            if len(rows) == 1 or rows[0].numel() == 0:
                index = rows[0]
            else:
                index = torch.stack([part.view(-1, self._rpt) for part in rows], dim=1).view(-1)
            self._layer_index = index
        step = len(self._parts) * self._rpt
        return index[start * step : end * step]

    def _part_rows(self, out: torch.Tensor, part: int) -> torch.Tensor:
        """Part ``part`` of a per-layer payload ``out`` (``[tokens, parts, width]``) as rows
        of that part's row shape: a view, strided when there are several parts."""
        row_shape = self._parts[part].row_shape
        if len(self._parts) == 1:
            return out.view(-1, *row_shape)
        # Unfused parts have one row per token (KVLayout.plan builds them so).
        return out[:, part].view(out.shape[0], *row_shape)

    def gather_layer(self, layer: int, start: int, end: int, out: torch.Tensor) -> None:
        """Copy layer ``layer`` of tokens ``[start, end)`` into the per-layer payload ``out``.

        ``out`` is contiguous, ``layer_payload_shape(end - start)`` of the layout's dtype:
        ``[tokens, 2, heads * head_size]`` (``KV_T2D``) or ``[tokens, latent]`` for MLA.

        Raises:
            InvalidInputError: a token in the range has a negative slot.
        """
        self.gather_layer_chunks(layer, [(start, end, out)])

    def gather_layer_chunks(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Gather one layer of several chunks ``(start, end, out)`` (see :meth:`gather_layer`).

        Payloads on another device than the caches are filled from one staging tensor on
        the caches' device with ``non_blocking=True`` copies, queued on the current stream;
        on a failure those already queued are waited for before it is raised.

        Raises:
            InvalidInputError: a token in one of the ranges has a negative slot, or (C row
                copies) a payload has the wrong size or a range is out of the plan's.
        """
        self._refuse_negatives(jobs)
        native = self._native
        if native is not None and native.gather(jobs, layer):
            return
        try:
            if self._fused:
                self._gather_layer_fused(layer, jobs)
            else:
                self._gather_layer_parts(layer, jobs)
        except BaseException as exc:
            self._settle(exc)
            raise

    def _gather_layer_fused(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Per-layer gather for parts on one row view: one ``index_select`` per chunk on
        the device, or one into a staging tensor for all payloads elsewhere."""
        src = self._parts[0].views[layer]
        row_shape = self._parts[0].row_shape
        remote = [job for job in jobs if job[2].device != self._device]
        for start, end, out in jobs:
            if out.device == self._device:
                rows = self._layer_rows(start, end)
                torch.index_select(src, 0, rows, out=out.view(-1, *row_shape))
        if not remote:
            return
        if all(remote[i][0] == remote[i - 1][1] for i in range(1, len(remote))):
            index = self._layer_rows(remote[0][0], remote[-1][1])
        else:
            index = torch.cat([self._layer_rows(start, end) for start, end, _ in remote])
        staging = torch.index_select(src, 0, index)
        offset = 0
        for _, _, out in remote:
            flat = out.view(-1, *row_shape)
            count = flat.shape[0]
            flat.copy_(staging[offset : offset + count], non_blocking=True)
            offset += count

    def _gather_layer_parts(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Per-layer gather for parts on different row views: one ``index_select`` per part
        and chunk, into that part's strided slice of the payload."""
        rpt = self._rpt
        for start, end, out in jobs:
            dst = out if out.device == self._device else torch.empty_like(out, device=self._device)
            for p, part in enumerate(self._parts):
                rows = part.index[start * rpt : end * rpt]
                torch.index_select(part.views[layer], 0, rows, out=self._part_rows(dst, p))
            if dst is not out:
                out.copy_(dst, non_blocking=True)

    def scatter_layer(self, layer: int, payload: torch.Tensor, start: int, end: int) -> None:
        """Write the per-layer ``payload`` (see :meth:`gather_layer`) into layer ``layer`` at
        tokens ``[start, end)``; tokens with a negative slot are skipped.

        A payload on another device is copied over with ``non_blocking=True``: keep it
        unchanged until the stream has finished.
        """
        self.scatter_layer_chunks(layer, [(start, end, payload)])

    def scatter_layer_chunks(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Scatter one layer of several chunks ``(start, end, payload)`` (see
        :meth:`scatter_layer`). On a failure the copies already queued are waited for
        before it is raised (see :meth:`scatter_chunks`, which says what is raised)."""
        native = self._native
        if native is not None and native.scatter(jobs, layer):
            return
        try:
            if self._fused:
                self._scatter_layer_fused(layer, jobs)
            else:
                self._scatter_layer_parts(layer, jobs)
        except BaseException as exc:
            self._settle(exc)
            raise

    def _scatter_layer_fused(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Per-layer scatter for parts on one row view: one ``index_copy_`` per chunk."""
        dst = self._parts[0].views[layer]
        row_shape = self._parts[0].row_shape
        step = len(self._parts) * self._rpt
        for start, end, payload in jobs:
            rows = self._layer_rows(start, end)
            source = payload.reshape(-1, *row_shape)
            if source.device != self._device:
                source = source.to(device=self._device, non_blocking=True)
            keep = self._kept(start, end)
            if keep is not None:
                if not keep.numel():
                    continue
                keep_rows = self._keep_rows(keep, step)
                source = source.index_select(0, keep_rows)
                rows = rows.index_select(0, keep_rows)
            dst.index_copy_(0, rows, source)

    def _scatter_layer_parts(
        self, layer: int, jobs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Per-layer scatter for parts on different row views (see :meth:`_gather_layer_parts`)."""
        rpt = self._rpt
        for start, end, payload in jobs:
            source = payload
            if source.device != self._device:
                source = source.to(device=self._device, non_blocking=True)
            keep = self._kept(start, end)
            if keep is not None:
                if not keep.numel():
                    continue
                source = source.index_select(0, keep)
            if not source.is_contiguous():
                source = source.contiguous()
            for p, part in enumerate(self._parts):
                rows = part.index[start * rpt : end * rpt]
                if keep is not None:
                    rows = rows.index_select(0, self._keep_rows(keep, rpt))
                part.views[layer].index_copy_(0, rows, self._part_rows(source, p))


def negatives_in(negative: Sequence[int], start: int, end: int) -> list[int]:
    """The tokens of ``negative`` (sorted: those whose slot is negative) in
    ``[start, end)``."""
    if not negative:
        return []
    lo = bisect.bisect_left(negative, start)
    return list(negative[lo : bisect.bisect_left(negative, end, lo)])


def refuse_negatives(
    negative: Sequence[int], jobs: Sequence[tuple[int, int, torch.Tensor]]
) -> None:
    """InvalidInputError if a job's range holds a token of ``negative`` (a gather cannot
    read a token that has no slot)."""
    if negative:
        for start, end, _ in jobs:
            if negatives_in(negative, start, end):
                raise InvalidInputError(f"tokens [{start}, {end}) include a negative slot")


def settle(device: torch.device, exc: BaseException) -> None:
    """After ``exc`` ended a transfer on ``device``: wait for the copies it queued on the
    current stream, so that no copy reads or writes a payload once the caller, told of the
    failure, hands it back. Nothing to wait for on the CPU."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.current_stream(device).synchronize()
    except Exception as error:  # the device failed: the first error is the news
        exc.add_note(f"waiting for the copies already queued failed too: {error!r}")
