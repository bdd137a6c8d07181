"""GPU benchmark: the engine's device copies next to plain pinned copies, layerwise overlap,
and staged transfers next to the per-chunk path.

Every figure is measured in the same run, on the same tensors, as its baseline:

- **D2H** GB/s: ``engine.store`` of ``T`` tokens out of KV caches on the device into an
  emptied cache (pinned host arena), against the plain way of moving the same bytes: per
  layer and K/V one ``index_select`` into a preallocated device buffer ``[2, L, T, H*D]``,
  then one ``copy_(non_blocking=True)`` into a pinned host tensor;
- **H2D** GB/s: ``engine.retrieve`` of those tokens into other blocks, against one pinned
  ``copy_(non_blocking=True)`` into the device buffer followed by one ``index_copy_`` per
  layer and K/V;
- **layerwise overlap**: ``engine.retrieve_layer`` driven the way a serving engine drives it
  (await layer *i*, then queue layer *i*'s compute on the compute stream, which is the
  current stream as in vLLM), with a simulated compute per layer (square matmuls, as many as
  take about as long as one layer's transfer) against the transfer and the compute run back
  to back. The fraction of transfer time hidden is ``(serial - overlap) / transfer``;
- **staged** gather/scatter GB/s: one request's chunks moved as one batch through a device
  staging buffer (:mod:`lmcache_async.transfer.staged`: a few launches per layer and K/V,
  one host copy per run of payloads back to back) against
  :meth:`~lmcache_async.transfer.plan.TransferPlan.gather_chunks` / ``scatter_chunks`` (one
  launch per chunk, layer and K/V), with the payloads back to back and apart (informative:
  no target).

Times are wall clock around each call with the device synchronized before and after, so the
engine (which returns once its copies have completed) and the baselines are timed alike;
each figure is the median of ``repeat`` runs after one warm-up run.

On the CPU (``device="cpu"``, or ``"auto"`` without CUDA) the same code runs on host tensors
at whatever sizes are given: it checks that the benchmark works, but its figures say nothing
about a GPU and the targets do not apply to them.

The package: :mod:`~.options` (sizes, device and targets), :mod:`~.scene` (the shared
tensors), :mod:`~.copies` (D2H and H2D), :mod:`~.layerwise` (the overlap), :mod:`~.staged`
(staged against per-chunk), :mod:`~.run` (a whole run) and :mod:`~.report` (the text
table); this module re-exports the public names.
The plain copies are :mod:`lmcache_async.bench.baselines`.
"""

from __future__ import annotations

from lmcache_async.bench.gpu.options import CPU_NOTE, DEVICES, TARGETS, GpuOptions
from lmcache_async.bench.gpu.report import format_gpu
from lmcache_async.bench.gpu.run import run_gpu_bench, run_gpu_bench_async

__all__ = [
    "CPU_NOTE",
    "DEVICES",
    "TARGETS",
    "GpuOptions",
    "format_gpu",
    "run_gpu_bench",
    "run_gpu_bench_async",
]
