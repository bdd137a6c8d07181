"""Prometheus metrics for the sidecar: a collector over ``engine.stats()`` and an endpoint.

:class:`EngineCollector` reads a fresh :class:`~lmcache_async.EngineStats` at every scrape
(nothing is copied into ``prometheus_client`` metric objects between scrapes) and adds the
request latencies of a :class:`LatencyTracker`. It lives in a registry of its own (never
the process-wide default one). :class:`MetricsServer` serves that registry over HTTP on
the event loop, so a scrape reads the engine on the thread that changes it.

Metric names start with ``lmcache_async_``: token, request and chunk counters
(``*_total``), pool and tier gauges (bytes, chunks, usage, ``tier_healthy{tier}`` as 0/1),
the ``request_latency_seconds{op}`` histogram, the series by tenant
(:mod:`.metrics_tenants`, ``tenant_*{tenant}``, at most ``tenant_labels`` tenants labelled)
and those of tier read speeds, load decisions and store admission (:mod:`.metrics_costs`).
"""

from __future__ import annotations

import bisect
import collections
import ipaddress
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.abc
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.metrics_costs import cost_metrics
from lmcache_async.rpc.metrics_tenants import DEFAULT_TENANT_LABELS, TenantSeries
from lmcache_async.stats import EngineStats

__all__ = [
    "DEFAULT_LATENCY_BUCKETS",
    "DEFAULT_LATENCY_WINDOW",
    "DEFAULT_METRICS_HOST",
    "EngineCollector",
    "LatencySummary",
    "LatencyTracker",
    "MetricsServer",
    "make_registry",
]

log = get_logger(__name__)

DEFAULT_LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Histogram bucket bounds in seconds: 100 us (an ipc lookup) to 10 s (a stalled store)."""
DEFAULT_LATENCY_WINDOW: Final = 1024
"""Latest samples per operation kept for percentiles."""
DEFAULT_METRICS_HOST: Final = "127.0.0.1"
"""The metrics endpoint binds to loopback unless told otherwise."""

_PREFIX: Final = "lmcache_async"
_MAX_REQUEST_BYTES: Final = 8192
_REQUEST_TIMEOUT: Final = 5.0
_METRICS_PATHS: Final = frozenset({"/", "/metrics"})


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """One operation's latencies: totals since start and percentiles (seconds) over the
    latest :attr:`window` samples (zeros before any)."""

    count: int
    sum: float
    window: int
    p50: float
    p90: float
    p99: float
    max: float


class _OpLatency:
    __slots__ = ("buckets", "count", "recent", "total")

    def __init__(self, window: int, num_buckets: int) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.buckets = [0] * (num_buckets + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0


def _percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of sorted samples."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


class LatencyTracker:
    """Request latencies per operation, in bounded memory.

    Each operation keeps a count, a sum and histogram bucket counts since start (for
    Prometheus) and its latest ``window`` samples (for percentiles). Operations are fixed
    at construction, so a caller cannot grow the tracker without bound.

    Raises (constructor):
        InvalidInputError: no operations, a window below 1, or buckets that are not
            positive, finite and increasing.
    """

    def __init__(
        self,
        ops: Sequence[str],
        *,
        window: int = DEFAULT_LATENCY_WINDOW,
        buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
    ) -> None:
        if not ops or not all(isinstance(op, str) and op for op in ops):
            raise InvalidInputError("ops must be a non-empty sequence of names")
        if not is_strict_int(window) or window < 1:
            raise InvalidInputError(f"window must be a positive int, got {window!r}")
        bounds = [float(b) for b in buckets]
        if not bounds or any(not math.isfinite(b) or b <= 0 for b in bounds):
            raise InvalidInputError("buckets must be positive finite numbers")
        if any(b >= c for b, c in itertools.pairwise(bounds)):
            raise InvalidInputError("buckets must be increasing")
        self.buckets: tuple[float, ...] = tuple(bounds)
        self.window = window
        self._ops = {op: _OpLatency(window, len(bounds)) for op in ops}

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self._ops)

    def record(self, op: str, seconds: float) -> None:
        """Count one request of ``op`` that took ``seconds``.

        Raises:
            InvalidInputError: ``op`` is not one of the tracker's operations, or
                ``seconds`` is negative or not finite.
        """
        state = self._ops.get(op)
        if state is None:
            raise InvalidInputError(f"unknown operation {op!r}; tracked: {sorted(self._ops)}")
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidInputError(f"seconds must be finite and >= 0, got {seconds!r}")
        state.recent.append(seconds)
        state.buckets[bisect.bisect_left(self.buckets, seconds)] += 1
        state.count += 1
        state.total += seconds

    @contextmanager
    def time(self, op: str) -> Iterator[None]:
        """Record how long the ``with`` body takes (also when it raises)."""
        if op not in self._ops:
            raise InvalidInputError(f"unknown operation {op!r}; tracked: {sorted(self._ops)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(op, time.perf_counter() - start)

    def summary(self, op: str) -> LatencySummary:
        """``op``'s totals and percentiles. Raises InvalidInputError for an unknown op."""
        state = self._ops.get(op)
        if state is None:
            raise InvalidInputError(f"unknown operation {op!r}; tracked: {sorted(self._ops)}")
        ordered = sorted(state.recent)
        return LatencySummary(
            count=state.count,
            sum=state.total,
            window=len(ordered),
            p50=_percentile(ordered, 0.50),
            p90=_percentile(ordered, 0.90),
            p99=_percentile(ordered, 0.99),
            max=ordered[-1] if ordered else 0.0,
        )

    def summaries(self) -> dict[str, LatencySummary]:
        return {op: self.summary(op) for op in self._ops}

    def histogram(self, op: str) -> tuple[list[tuple[str, float]], float]:
        """``op``'s cumulative buckets as Prometheus wants them (``le`` labels, ``+Inf``
        last) and the sum of its samples."""
        state = self._ops[op]
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.buckets, math.inf), state.buckets, strict=True):
            running += count
            cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), float(running)))
        return cumulative, state.total


def _name(suffix: str) -> str:
    return f"{_PREFIX}_{suffix}"


class EngineCollector(Collector):
    """Reads the engine's stats at each scrape and turns them into metric families.

    ``stats`` returns the current snapshot, or None while there is no engine (a sidecar
    before its first client): then only ``lmcache_async_engine_open 0``, the latencies
    and ``extra`` are reported. ``extra`` returns more gauges by name (the sidecar's
    sessions, event subscribers, ...), each reported as ``lmcache_async_{name}``.
    ``tenant_labels``: the tenants reported under a label of their own (the rest: ``other``;
    InvalidInputError unless an int >= 0).
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        *,
        latency: LatencyTracker | None = None,
        extra: Callable[[], Mapping[str, float]] | None = None,
        tenant_labels: int = DEFAULT_TENANT_LABELS,
    ) -> None:
        self._stats = stats
        self._latency = latency
        self._extra = extra
        self._tenants = TenantSeries(tenant_labels)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily(
            _name("engine_open"), "1 while the engine is open", value=float(stats is not None)
        )
        if stats is not None:
            yield from _engine_metrics(stats)
            yield from self._tenants.collect(stats)
        if self._latency is not None:
            yield _latency_metric(self._latency)
        if self._extra is not None:
            for key, value in sorted(self._extra().items()):
                yield GaugeMetricFamily(_name(key), f"sidecar state: {key}", value=float(value))


def _counter(suffix: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_name(suffix), doc, value=float(value))


def _gauge(suffix: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_name(suffix), doc, value=float(value))


def _engine_metrics(s: EngineStats) -> Iterator[Metric]:
    requests = CounterMetricFamily(_name("requests"), "Requests finished", labels=["op"])
    requests.add_metric(["store"], s.store_requests)
    requests.add_metric(["retrieve"], s.retrieve_requests)
    requests.add_metric(["lookup"], s.lookup_requests)
    yield requests
    yield _counter("lookup_tokens", "Tokens asked about by lookups", s.lookup_tokens)
    yield _counter("lookup_hit_tokens", "Prefix tokens lookups found cached", s.lookup_hit_tokens)
    yield _counter(
        "lookup_miss_tokens",
        "Tokens lookups asked about and did not find",
        s.lookup_tokens - s.lookup_hit_tokens,
    )
    yield _counter("stored_tokens", "Tokens whose chunks stores left cached", s.stored_tokens)
    yield _counter("retrieved_tokens", "Tokens loaded into serving engines", s.retrieved_tokens)
    yield _counter("partial_stores", "Stores cut short for lack of memory", s.partial_stores)
    yield _counter("failed_requests", "Requests that failed", s.failed_requests)
    yield _counter("timed_out_requests", "Requests that ran out of time", s.timed_out_requests)
    yield _counter("promises", "Promises given to schedulers", s.promises)
    yield _counter("promised_tokens", "Tokens promised, verified in host memory", s.promised_tokens)
    yield _counter(
        "promises_cut_short", "Promises whose prefetch the scheduler stopped", s.promises_cut_short
    )
    yield _counter(
        "promise_shortfall_tokens",
        "Tokens chosen for loading that did not arrive verified",
        s.promise_shortfall_tokens,
    )
    yield _counter("evicted_chunks", "Chunks the CPU tier evicted", s.evicted_chunks)
    yield _counter("expired_pins", "Lookup pins released by timeout", s.expired_pins)
    yield _counter("promoted_chunks", "Chunks read from a slow tier into CPU", s.promoted_chunks)
    yield _counter(
        "tier_writes_dropped", "Chunks not written to a slow tier", s.tier_writes_dropped
    )
    yield _counter("tier_writes_failed", "Chunks a slow tier failed to write", s.tier_writes_failed)
    yield _counter("tier_read_errors", "Slow-tier reads that failed", s.tier_read_errors)
    yield _counter("events_dropped", "KV events dropped from a full buffer", s.events_dropped)

    yield _gauge("cached_chunks", "Chunks in the CPU tier", s.cached_chunks)
    yield _gauge("pinned_chunks", "Chunks pinned by lookups", s.pinned_chunks)
    yield _gauge("active_lookup_ids", "Lookup ids holding pins", s.active_lookup_ids)
    yield _gauge("tier_writes_pending", "Batches queued for slow tiers", s.tier_writes_pending)
    yield _gauge("healthy", "1 while the engine can serve", float(s.healthy))
    yield _gauge("frozen", "1 in freeze mode (stores write nothing)", float(s.frozen))
    yield _gauge("hot_cache", "1 while the CPU hot cache keeps new chunks", float(s.hot_cache))

    pool = s.pool
    yield _gauge("pool_capacity_bytes", "Host arena size", pool.capacity_bytes)
    yield _gauge("pool_used_bytes", "Host arena bytes held by live objects", pool.used_bytes)
    yield _gauge("pool_free_bytes", "Host arena bytes free", pool.free_bytes)
    yield _gauge("pool_largest_free_bytes", "Largest contiguous free run", pool.largest_free_bytes)
    yield _gauge("pool_objects", "Live payload objects", pool.num_objects)
    yield _gauge("pool_pinned_objects", "Live objects pinned", pool.pinned_objects)
    yield _gauge("pool_pinned_bytes", "Host arena bytes page-locked for CUDA", pool.pinned_bytes)
    yield _gauge("pool_waiters", "Allocations waiting for memory", pool.waiters)
    usage = pool.used_bytes / pool.capacity_bytes if pool.capacity_bytes else 0.0
    yield _gauge("pool_usage_ratio", "Used over capacity of the host arena", usage)

    yield from _tier_metrics(s)
    yield from cost_metrics(s)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    labels = ["tier"]
    health = GaugeMetricFamily(_name("tier_healthy"), "1 while a tier serves", labels=labels)
    for tier, up in sorted(s.tier_health.items()):
        health.add_metric([tier], float(up))
    yield health
    gauges = {
        "chunks": GaugeMetricFamily(_name("tier_chunks"), "Chunks in a tier", labels=labels),
        "bytes": GaugeMetricFamily(_name("tier_bytes"), "Payload bytes in a tier", labels=labels),
    }
    counters = {
        name: CounterMetricFamily(_name(f"tier_{name}"), doc, labels=labels)
        for name, doc in (
            ("hits", "Chunks found in a tier"),
            ("misses", "Chunks asked of a tier and not found"),
            ("puts", "Chunks written to a tier"),
            ("evictions", "Chunks a tier evicted"),
            ("corrupt", "Entries found corrupt and deleted"),
            ("errors", "Operations that failed against a tier"),
        )
    }
    for tier, stats in sorted(s.tiers.items()):
        for name, family in gauges.items():
            family.add_metric([tier], float(getattr(stats, name)))
        for name, counter in counters.items():
            counter.add_metric([tier], float(getattr(stats, name)))
    yield from gauges.values()
    yield from counters.values()


def _latency_metric(tracker: LatencyTracker) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        _name("request_latency_seconds"),
        "Time the server spent on a request, by operation",
        labels=["op"],
    )
    for op in tracker.ops:
        buckets, total = tracker.histogram(op)
        family.add_metric([op], buckets, sum_value=total)
    return family


def make_registry(collector: Collector) -> CollectorRegistry:
    """A registry of its own holding ``collector`` (never the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def _check_host(host: str, allow_remote: bool) -> None:
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            "metrics_host", f"{host!r} is beyond loopback; allow remote binds to serve it"
        )


class MetricsServer:
    """A small HTTP endpoint serving a registry (``GET /metrics``) on the event loop.

    Each connection gets one response and is closed. Made by :meth:`bind`; :meth:`serve`
    answers scrapes until cancelled; :meth:`aclose` stops listening.
    """

    def __init__(
        self, registry: CollectorRegistry, listener: anyio.abc.Listener[anyio.abc.SocketStream]
    ) -> None:
        self._registry = registry
        self._listener = listener
        address = listener.extra(anyio.abc.SocketAttribute.local_address)
        if not isinstance(address, tuple):
            raise ConfigError("metrics_port", f"not a TCP listener: {address!r}")
        self.host: str = str(address[0])
        self.port: int = int(address[1])
        self.scrapes = 0

    @classmethod
    async def bind(
        cls,
        registry: CollectorRegistry,
        *,
        port: int = 0,
        host: str = DEFAULT_METRICS_HOST,
        allow_remote: bool = False,
    ) -> MetricsServer:
        """Listen on ``host:port`` (port 0: any free port, see :attr:`port`).

        Raises:
            ConfigError: ``field="metrics_port"``: not a port number or cannot be bound;
                ``field="metrics_host"``: beyond loopback without ``allow_remote``.
        """
        if not is_strict_int(port) or not 0 <= port <= 65535:
            raise ConfigError("metrics_port", f"expected a port number, got {port!r}")
        _check_host(host, allow_remote)
        try:
            listener = await anyio.create_tcp_listener(
                local_host=host, local_port=port, reuse_port=False
            )
        except OSError as exc:
            raise ConfigError("metrics_port", f"cannot listen on {host}:{port}: {exc}") from None
        server = cls(registry, listener)
        log.info("metrics_listening", host=server.host, port=server.port)
        return server

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def serve(self) -> None:
        """Answer scrapes until cancelled."""
        await self._listener.serve(self._handle)

    async def aclose(self) -> None:
        await self._listener.aclose()

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(_REQUEST_TIMEOUT):
                    head = await _read_head(stream)
                    await stream.send(self._respond(head))
            except (TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                return

    def _respond(self, head: bytes | None) -> bytes:
        if head is None:
            return _response(400, b"bad request\n")
        request_line, _, rest = head.partition(b"\r\n")
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1].split(b"?", 1)[0].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"method not allowed\n")
        if target not in _METRICS_PATHS:
            return _response(404, b"not found: try /metrics\n")
        accept = _header(rest, b"accept")
        encoder, content_type = choose_encoder(accept)
        body = encoder(self._registry)
        self.scrapes += 1
        return _response(200, body, content_type, include_body=method == b"GET")


async def _read_head(stream: anyio.abc.SocketStream) -> bytes | None:
    """The request line and headers, or None when they exceed the size limit."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > _MAX_REQUEST_BYTES:
            return None
        data += await stream.receive(4096)
    return data.split(b"\r\n\r\n", 1)[0]


def _header(headers: bytes, name: bytes) -> str:
    for line in headers.split(b"\r\n"):
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
}


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    include_body: bool = True,
) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    return head + body if include_body else head
