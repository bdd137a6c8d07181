"""Micro-benchmarks: the engine's copies, lookups and hashing next to plain baselines.

Each figure is measured in the same run, on the same tensors, as its baselines:

- **store** GB/s: ``engine.store`` of ``T`` tokens into an emptied cache, the KV caches
  the same from request to request, against the raw gather of the same rows (per layer
  and K/V one ``index_select(out=)`` into one preallocated ``[2, L, T, H*D]`` buffer) and
  against a plain contiguous ``copy_`` of as many bytes (the memory's limit);
- **retrieve** GB/s: ``engine.retrieve`` of those tokens into other blocks, against the
  raw ``index_copy_`` scatter of the same rows and the same plain ``copy_``;
  both on the default shape and on :data:`~.options.WIDE_SHAPE` (8 x 8 x 128 bf16);
- **small request**: p50 and p99 of a 1k-token store (of a prompt not seen before) and
  retrieve (checked to load every token) on :data:`~.options.SMALL_SHAPE`, whose copies
  are a few KiB, beside one raw copy of the same rows (per layer and K/V one
  ``index_select`` / ``index_copy_`` of all of them) and the same copy chunk by chunk;
- **lookup** latency of a fully cached long prompt, tokens as a tensor and as a list;
- **hashing** tokens/s of :class:`~lmcache_async.keys.chunks.ChunkHasher` (blake3, xxh3_128),
  against the plain way to get the same digests from a tensor: convert it to int32 bytes,
  then one ``H(chunk bytes + previous digest)`` call per chunk, with the hash's Python package.

Copy figures are the median over ``repeat`` measured runs after a warm-up run (the best
run beside it in the JSON, every run's times too); the small request, lookups and hashing
are over many more iterations.

The package: :mod:`~.options` (sizes, shapes and targets), :mod:`~.copies` (store and
retrieve GB/s), :mod:`~.small` (the small request), :mod:`~.lookup`, :mod:`~.hashing`,
:mod:`~.run` (a whole run) and :mod:`~.report` (the text table); this module re-exports
the public names. The plain copies are :mod:`lmcache_async.bench.baselines`.
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
