"""Micro-benchmarks: the engine's copies, lookups and hashing next to plain baselines.

Each figure is measured in the same run, on the same tensors, as its baseline:

- **store** GB/s: ``engine.store`` of ``T`` tokens into an emptied cache, against the best
  plain-torch gather of the same bytes (per layer and K/V one ``index_select`` into one
  preallocated ``[2, L, T, H*D]`` buffer);
- **retrieve** GB/s: ``engine.retrieve`` of those tokens into other blocks, against the
  plain ``index_copy_`` scatter of the same bytes;
- **lookup** latency of a fully cached long prompt, tokens as a tensor and as a list;
- **hashing** tokens/s of :class:`~lmcache_async.keys.ChunkHasher` (blake3, xxh3_128),
  against the plain way to get the same digests from a tensor: convert it to int32 bytes,
  then one ``H(chunk bytes + previous digest)`` call per chunk, with the hash's Python package;
- **per-request overhead** of a short store and retrieve: engine time minus the plain copy
  of the same chunk payloads (per chunk, layer and K/V one ``index_select`` into a
  preallocated chunk buffer; ``index_copy_`` back). Beside it, the cost of chunking: that
  per-chunk copy against one copy of the whole request into a single buffer.

Every figure is the median over ``repeat`` measured runs (lookups and hashing: over many
more iterations) after warm-up runs; the best run is reported beside it in the JSON.

The package: :mod:`~.options` (sizes and targets), :mod:`~.copies` (store, retrieve and
overhead), :mod:`~.lookup`, :mod:`~.hashing`, :mod:`~.run` (a whole run) and
:mod:`~.report` (the text table); this module re-exports the public names. The plain
copies are :mod:`lmcache_async.bench.baselines`.
"""

from __future__ import annotations

from lmcache_async.bench.micro.options import TARGETS, MicroOptions
from lmcache_async.bench.micro.report import format_micro
from lmcache_async.bench.micro.run import run_micro, run_micro_async

__all__ = [
    "TARGETS",
    "MicroOptions",
    "format_micro",
    "run_micro",
    "run_micro_async",
]
