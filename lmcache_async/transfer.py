"""Transfer plans: one request's prepared copies between engine memory and chunk payloads.

:meth:`KVLayout.plan <lmcache_async.layouts.KVLayout.plan>` validates the caches and slots
once and computes the row views and row indices; a :class:`TransferPlan` then moves any
chunk's tokens with a few ``index_select`` / ``index_copy_`` calls and no further checks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache_async.errors import InvalidInputError

if TYPE_CHECKING:
    # Only for the annotation: layouts imports this module to build plans.
    from lmcache_async.layouts import KVLayout

__all__ = ["TransferPlan"]


class TransferPlan:
    """One request's transfers between engine memory and chunk payloads.

    Built by :meth:`KVLayout.plan`, which validates and computes everything that does not
    depend on the chunk; :meth:`gather` and :meth:`scatter` move the tokens
    ``[start, end)`` of the request with one ``index_select`` / ``index_copy_`` per layer
    and K/V part, and no further checks.
    """

    __slots__ = (
        "_device",
        "_layer_index",
        "_layout",
        "_negative",
        "_rows",
        "_rpt",
        "_views",
        "_width",
    )

    def __init__(
        self,
        layout: KVLayout,
        *,
        views: list[torch.Tensor],
        rows: list[torch.Tensor],
        width: int,
        rows_per_token: int,
        negative: list[int],
        device: torch.device,
    ) -> None:
        self._layout = layout
        self._views = views
        self._rows = rows
        self._width = width
        self._rpt = rows_per_token
        self._negative = negative
        self._device = device
        self._layer_index: torch.Tensor | None = None  # built on first per-layer transfer

    @property
    def device(self) -> torch.device:
        """Where the serving engine's KV memory lives."""
        return self._device

    def first_skipped(self, start: int) -> int | None:
        """The first token at or after ``start`` whose slot is negative, if any."""
        negative = self._negative
        index = bisect.bisect_left(negative, start)
        return negative[index] if index < len(negative) else None

    def _negatives_in(self, start: int, end: int) -> list[int]:
        negative = self._negative
        if not negative:
            return []
        return negative[bisect.bisect_left(negative, start) : bisect.bisect_left(negative, end)]

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
        rows from it, instead of sweeping all layers once per chunk.

        Raises:
            InvalidInputError: a token in one of the ranges has a negative slot.
        """
        num_layers = self._layout.num_layers
        parts = len(self._rows)
        staged: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start, end, out in jobs:
            if self._negatives_in(start, end):
                raise InvalidInputError(f"tokens [{start}, {end}) include a negative slot")
            dst = out
            if out.device != self._device:
                dst = torch.empty_like(out, device=self._device)
                copies.append((out, dst))
            dst_rows = dst.view(parts * num_layers, -1, self._width).unbind(0)
            staged.append((dst_rows, self._slice_rows(start, end)))
        for layer, src in enumerate(self._views):
            for part in range(parts):
                for dst_rows, rows in staged:
                    torch.index_select(src, 0, rows[part], out=dst_rows[part * num_layers + layer])
        for out, dst in copies:
            out.copy_(dst, non_blocking=True)

    def scatter(self, payload: torch.Tensor, start: int, end: int) -> None:
        """Write ``payload`` (``payload_shape(end - start)``) at tokens ``[start, end)``.

        Tokens with a negative slot are skipped. A payload on another device is copied
        over with ``non_blocking=True``: keep it unchanged until the stream has finished.
        """
        self.scatter_chunks([(start, end, payload)])

    def scatter_chunks(self, jobs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Scatter several chunks ``(start, end, payload)`` layer by layer (see
        :meth:`gather_chunks`); tokens with a negative slot are skipped."""
        num_layers = self._layout.num_layers
        staged: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        for start, end, payload in jobs:
            rows = self._slice_rows(start, end)
            source = payload
            if payload.device != self._device:
                source = payload.to(device=self._device, non_blocking=True)
            skipped = self._negatives_in(start, end)
            if skipped:
                keep_list = sorted(set(range(end - start)) - {p - start for p in skipped})
                if not keep_list:
                    continue
                keep = torch.tensor(keep_list, dtype=torch.int64, device=self._device)
                source = source.index_select(2, keep)
                per_token = torch.arange(self._rpt, device=self._device)
                keep_rows = (keep.unsqueeze(1) * self._rpt + per_token).view(-1)
                rows = [index.index_select(0, keep_rows) for index in rows]
            if not source.is_contiguous():
                source = source.contiguous()
            staged.append((source.view(len(rows) * num_layers, -1, self._width).unbind(0), rows))
        for layer, dst in enumerate(self._views):
            for part in range(len(self._rows)):
                for src_rows, rows in staged:
                    dst.index_copy_(0, rows[part], src_rows[part * num_layers + layer])

    def _slice_rows(self, start: int, end: int) -> list[torch.Tensor]:
        rpt = self._rpt
        return [part[start * rpt : end * rpt] for part in self._rows]

    # -- per layer (layerwise payloads) -----------------------------------------------------

    def _layer_rows(self, start: int, end: int) -> torch.Tensor:
        """Row indices of tokens ``[start, end)`` in per-layer payload order.

        A per-layer payload ``[tokens, parts, width]`` seen as rows of the row width lists,
        for each token, each part's rows in turn; the index for all tokens is built once
        per plan and sliced per chunk.
        """
        index = self._layer_index
        if index is None:
            rows = self._rows
            if len(rows) == 1 or rows[0].numel() == 0:
                index = rows[0]
            else:
                index = torch.stack([part.view(-1, self._rpt) for part in rows], dim=1).view(-1)
            self._layer_index = index
        step = len(self._rows) * self._rpt
        return index[start * step : end * step]

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
        the caches' device with ``non_blocking=True`` copies, queued on the current stream.

        Raises:
            InvalidInputError: a token in one of the ranges has a negative slot.
        """
        src = self._views[layer]
        width = self._width
        for start, end, _ in jobs:
            if self._negatives_in(start, end):
                raise InvalidInputError(f"tokens [{start}, {end}) include a negative slot")
        remote = [job for job in jobs if job[2].device != self._device]
        for start, end, out in jobs:
            if out.device == self._device:
                torch.index_select(src, 0, self._layer_rows(start, end), out=out.view(-1, width))
        if not remote:
            return
        if all(remote[i][0] == remote[i - 1][1] for i in range(1, len(remote))):
            index = self._layer_rows(remote[0][0], remote[-1][1])
        else:
            index = torch.cat([self._layer_rows(start, end) for start, end, _ in remote])
        staging = torch.index_select(src, 0, index)
        offset = 0
        for _, _, out in remote:
            flat = out.view(-1, width)
            count = flat.shape[0]
            flat.copy_(staging[offset : offset + count], non_blocking=True)
            offset += count

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
        :meth:`scatter_layer`)."""
        dst = self._views[layer]
        width = self._width
        step = len(self._rows) * self._rpt
        for start, end, payload in jobs:
            rows = self._layer_rows(start, end)
            source = payload.reshape(-1, width)
            if source.device != self._device:
                source = source.to(device=self._device, non_blocking=True)
            skipped = self._negatives_in(start, end)
            if skipped:
                keep_list = sorted(set(range(end - start)) - {p - start for p in skipped})
                if not keep_list:
                    continue
                keep = torch.tensor(keep_list, dtype=torch.int64, device=self._device)
                per_token = torch.arange(step, device=self._device)
                keep_rows = (keep.unsqueeze(1) * step + per_token).view(-1)
                source = source.index_select(0, keep_rows)
                rows = rows.index_select(0, keep_rows)
            dst.index_copy_(0, rows, source)
