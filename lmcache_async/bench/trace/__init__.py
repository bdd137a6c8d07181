"""Trace replay behind ``lmcache-async bench --trace FILE``: a production trace (Mooncake's
JSONL: a timestamp, input and output lengths and one hash id per block of each request) in
arrival order against an embedded engine, a sidecar or vLLM, beside what the trace itself
allows.

Each hash id becomes a block of tokens of its own (:mod:`.tokens`), and one block is one of
the engine's chunks. Against a cache each request is a ``lookup`` of its prompt, a
``retrieve`` of the hit into paged KV memory (checked bit for bit every ``verify_every``)
and a ``store`` of the whole prompt with real KV (the load generator's runner); against
vLLM a generation of ``output_length`` tokens, capped. Printed in the same run:

- the trace's hit rate with an unbounded cache and with a block LRU of the engine's
  capacity, from the hash ids alone (:mod:`.bounds` defines both, and the hit rate);
- the hit rate the engine served (tokens its retrieves loaded), per-step p50/p90/p99, each
  tier's occupancy and evictions;
- with ``capacities``, the LRU's hit rate (and, asked to, the engine's) at each capacity,
  with the bytes each takes for the model shape: the tier sizing table (``plot``: a PNG).

The trace is read as a stream: once to check every line, once as the replay goes, once for
the bounds. Tokens exist only for the requests in flight and the next few (a bounded
stream); the bounds keep a small int per distinct block and per block each LRU holds.
:func:`generate_trace` writes a synthetic trace of shared system prompts, multi-turn
sessions and one-off prompts.

The package, one concept per module: :mod:`.parse` (reading and checking), :mod:`.tokens`
(hash ids to tokens), :mod:`.bounds` (unbounded and LRU hit rates), :mod:`.sizing` (tier
sizes in chunks), :mod:`.replay` (the pace), :mod:`.targets` (one replay against a target),
:mod:`.sweep` (capacities), :mod:`.options`, :mod:`.run` (the whole run), :mod:`.results`,
:mod:`.report`, :mod:`.plot` and :mod:`.generate`.

May import: everything (the top floor, with ``cli``).
"""

from __future__ import annotations

from lmcache_async.bench.trace.bounds import BlockLRU, compute_bounds
from lmcache_async.bench.trace.generate import TraceShape, generate_trace
from lmcache_async.bench.trace.options import DEFAULT_BLOCK_SIZE, TraceOptions, parse_capacities
from lmcache_async.bench.trace.parse import TraceRequest, read_trace
from lmcache_async.bench.trace.plot import write_sweep_plot
from lmcache_async.bench.trace.report import format_trace
from lmcache_async.bench.trace.run import run_trace, run_trace_async

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockLRU",
    "TraceOptions",
    "TraceRequest",
    "TraceShape",
    "compute_bounds",
    "format_trace",
    "generate_trace",
    "parse_capacities",
    "read_trace",
    "run_trace",
    "run_trace_async",
    "write_sweep_plot",
]
