"""Transfers: moving KV between a serving engine's paged memory and chunk payloads.

:mod:`.plan` (:class:`TransferPlan`: the rows of every layer and part, built once per
request), :mod:`.native` (the plan described to the C row copies in ``_rows.c``), the CUDA
path: :mod:`.staging` and :mod:`.staged` (per-device staging buffers and one launch per
layer), :mod:`.pipelined` (a staged batch double-buffered on two streams),
:mod:`.layer_staged` (one layer of a request's chunks per launch), :mod:`.layer_copies`
(a layerwise request's copies, queued ahead on CUDA), :mod:`.cuda` (copies on
dedicated streams), :mod:`.cuda_streams` (the caller's stream) and :mod:`.cuda_bridge`
(CUDA events awaited on the event loop).

May import: the ground floor. Never the other data-model packages (``layouts`` builds its
plans from this one) or anything above them.
"""

from __future__ import annotations

from lmcache_async.transfer.plan import (
    PlanLayout,
    PlanPart,
    TransferPlan,
    negatives_in,
    refuse_negatives,
    settle,
)

__all__ = [
    "PlanLayout",
    "PlanPart",
    "TransferPlan",
    "negatives_in",
    "refuse_negatives",
    "settle",
]
