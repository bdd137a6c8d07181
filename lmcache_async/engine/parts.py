"""The parts of one engine, built from its config with their dependencies passed in.

:func:`build_parts` creates the memory pool, the tiers' manager, the request core, the
pipelines and the lookups, each given what it needs; :class:`EngineParts` holds them with
the engine's lifecycle state, and :class:`EngineBase` is what every group of the engine's
public methods shares: the parts, the open check and the health test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from anyio import CancelScope

from lmcache_async.keys.chunks import ChunkHasher, DigestFrames, HashAlgorithm, Namespace
from lmcache_async.memory.pool import MemoryPool, page_size_for
from lmcache_async.transfer.cuda import Transfers

from ..backends.admission import Admission, admission_capacity
from ..backends.cipher import RecordCipher
from ..backends.cpu import CPUBackend
from ..backends.manager import StorageManager
from ..config import EngineConfig
from ..core import LoadCore, RequestCore, StoreCore
from ..core.load import read_batch_chunks
from ..errors import ConfigError, EngineClosedError
from ..events import EventBuffer
from ..health import HealthMonitor
from ..layouts import KVCacheViews, KVLayout
from ..pipelines.layerwise import LayerwisePipeline
from ..pipelines.retrieve import build_retrieve_stages
from ..pipelines.stage import Pipeline
from ..pipelines.store import build_store_stages
from ..stats import Counters
from .costs import LoadCosts
from .execute import Runner
from .hashers import TenantHashers
from .lookups import Lookups
from .probe import TierProbe
from .promises import Promises
from .requests import RequestKeys
from .tiers import check_tier_settings, record_cipher, tier_limits

__all__ = ["EngineBase", "EngineParts", "build_parts"]

# Long prompts whose chunk digests are remembered: a prompt is typically looked up,
# retrieved and stored in turn.
_DIGEST_MEMO_PROMPTS = 32


@dataclass(eq=False)
class EngineParts:
    """Everything one engine is made of, and whether it is started or closed."""

    config: EngineConfig
    layout: KVLayout
    namespace: Namespace
    hasher: ChunkHasher
    hashers: TenantHashers
    kv_views: KVCacheViews
    keys: RequestKeys
    events: EventBuffer
    pool: MemoryPool
    manager: StorageManager
    counters: Counters
    transfers: Transfers
    layerwise: LayerwisePipeline
    lookups: Lookups
    core: RequestCore
    runner: Runner
    store_pipe: Pipeline
    retrieve_pipe: Pipeline
    promises: Promises
    costs: LoadCosts
    """The slow tiers' read speeds and the load-or-recompute decision."""
    probe: TierProbe
    """Seeds ``costs`` at start: a chunk written, read back and removed per slow tier."""
    cipher: RecordCipher | None = None
    """Seals disk and Redis records (config ``encryption_key_file``); None: in the clear."""
    health: HealthMonitor | None = None
    health_scope: CancelScope = field(default_factory=CancelScope)
    started: bool = False
    closed: bool = False

    def healthy(self) -> bool:
        """True while the engine is open, its pipelines run and its tiers can serve."""
        return (
            not self.closed
            and self.store_pipe.running
            and self.retrieve_pipe.running
            and self.manager.healthy()
        )


class _Liveness:
    """The parts' health test, for the parts built before the parts exist."""

    parts: EngineParts | None = None

    def __call__(self) -> bool:
        return self.parts is not None and self.parts.healthy()


def build_parts(
    config: EngineConfig,
    layout: KVLayout,
    namespace: Namespace,
    pool_buffer: memoryview | None,
) -> EngineParts:
    """Build an engine's parts (nothing started).

    Raises:
        ConfigError: the CPU tier holds less than one chunk, or a location names a tier
            the config does not enable.
    """
    liveness = _Liveness()
    hasher = ChunkHasher(
        namespace,
        chunk_size=config.chunk_size,
        algorithm=HashAlgorithm(config.hash_algorithm),
        memo_size=_DIGEST_MEMO_PROMPTS,
    )
    kv_views = KVCacheViews(layout)  # the serving engine's caches, checked once
    # A sidecar's lookups come as digest frames.
    hashers = TenantHashers(hasher)
    keys = RequestKeys(config, hashers, DigestFrames(_DIGEST_MEMO_PROMPTS), kv_views)
    events = EventBuffer(
        config.max_kv_events, max_bytes=config.max_kv_event_bytes, enabled=config.enable_kv_events
    )
    pool, chunk_bytes = _host_pool(config, layout, pool_buffer)
    check_tier_settings(config)
    cipher = record_cipher(config)  # the key file read once, before anything starts
    cpu = CPUBackend(pool, limits=tier_limits(config, "cpu"))
    slow_names = [
        name
        for name, enabled in (("disk", config.local_disk), ("redis", config.remote_url))
        if enabled is not None
    ]
    admission = None
    if config.store_threshold > 1 and slow_names:
        admission = Admission(
            config.store_threshold, capacity=admission_capacity(pool.capacity_bytes, chunk_bytes)
        )
    manager = StorageManager(
        cpu,
        events=events,
        chunk_size=config.chunk_size,
        pin_timeout=config.pin_timeout,
        hot_cache=config.local_cpu,
        store_location=config.store_location,
        retrieve_locations=config.retrieve_locations,
        write_queue_size=config.slow_tier_queue_size,
        wait_for_slow_tiers=config.wait_for_slow_tiers,
        admission=admission,
    )
    cpu.set_eviction_listener(manager.on_evicted)
    costs = LoadCosts(
        ["cpu", *slow_names],
        chunk_size=config.chunk_size,
        batch_chunks=config.pipeline_batch_chunks,
    )
    manager.set_read_observer(costs.observe)
    probe = TierProbe(costs, pool, layout, lambda: manager.slow_tiers, chunk_size=config.chunk_size)
    counters = Counters()
    # CUDA copies to or from an unpinned arena (a shared-memory buffer, or pinning refused)
    # block the thread that queues them: they are queued off the event loop.
    transfers = Transfers(inline_bytes=config.inline_copy_bytes, host_pinned=pool.pinned)
    load = LoadCore(
        manager,
        counters,
        batch_chunks=config.pipeline_batch_chunks,
        read_batch=read_batch_chunks(config.pipeline_batch_chunks, chunk_bytes),
        timeout=config.retrieve_timeout,
        healthy=liveness,
        # Late bound: the lookups are built next, with this core.
        pins_changed=lambda: lookups.pins_changed(),  # noqa: PLW0108
    )
    store = StoreCore(
        manager,
        pool,
        layout,
        counters,
        allocation_timeout=config.allocation_timeout,
        healthy=liveness,
    )
    layerwise = LayerwisePipeline(
        manager,
        store,
        load,
        layout,
        transfers,
        counters=counters,
        healthy=liveness,
        store_timeout=config.store_timeout,
        retrieve_timeout=config.retrieve_timeout,
        remove_after_retrieve=config.remove_after_retrieve,
    )
    lookups = Lookups(
        config,
        manager,
        load,
        layerwise,
        counters,
        healthy=liveness,
        sighted=None if admission is None else manager.sighted,
    )
    promises = Promises(
        manager,
        load,
        lookups,
        counters,
        costs=costs,
        chunk_size=config.chunk_size,
        token_bytes=layout.token_bytes,
        pin_timeout=config.pin_timeout,
        layerwise=config.use_layerwise,
        declined=probe.want,
    )
    core = RequestCore(store, load, pool)
    runner = Runner(
        manager,
        counters,
        token_bytes=layout.token_bytes,
        inline_copy_bytes=config.inline_copy_bytes,
    )
    store_pipe = Pipeline(
        "store",
        build_store_stages(
            store,
            transfers,
            batch_chunks=config.pipeline_batch_chunks,
            copy_timeout=config.store_timeout,
        ),
        buffer_size=config.pipeline_queue_size,
    )
    retrieve_pipe = Pipeline(
        "retrieve",
        build_retrieve_stages(load, transfers, copy_timeout=config.retrieve_timeout),
        buffer_size=config.pipeline_queue_size,
    )
    parts = EngineParts(
        config,
        layout,
        namespace,
        hasher,
        hashers,
        kv_views,
        keys,
        events,
        pool,
        manager,
        counters,
        transfers,
        layerwise,
        lookups,
        core,
        runner,
        store_pipe,
        retrieve_pipe,
        promises,
        costs,
        probe,
        cipher=cipher,
    )
    liveness.parts = parts
    return parts


class EngineBase:
    """What every group of the engine's public methods shares."""

    def __init__(self, parts: EngineParts) -> None:
        self._parts = parts

    def _check_open(self) -> None:
        if self._parts.closed:
            raise EngineClosedError("the cache engine is closed")
        if not self._parts.started:
            raise EngineClosedError(
                "the cache engine is not started: use `async with CacheEngine.open(...)`"
            )

    def is_healthy(self) -> bool:
        """True while the engine is open, its pipelines run and its tiers can serve."""
        return self._parts.healthy()

    def check_locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...] | None:
        """Validated per-call tier names, or None for the configured ones.

        Raises:
            InvalidInputError: a name that is not an enabled tier (``name`` is the field).
        """
        if locations is None:
            return None
        return self._parts.manager.check_locations(locations, name)


def _host_pool(
    config: EngineConfig, layout: KVLayout, pool_buffer: memoryview | None
) -> tuple[MemoryPool, int]:
    """The CPU tier's pool (over ``pool_buffer`` when given: a sidecar's shared segment),
    its page fitted to the payloads it holds (a layer's with ``use_layerwise``), and a
    whole chunk's payload bytes.

    Raises:
        ConfigError: the pool holds less than one chunk.
    """
    tokens, itemsize = config.chunk_size, layout.dtype.itemsize
    chunk_bytes = math.prod(layout.payload_shape(tokens)) * itemsize
    payloads, payload_bytes = 1, chunk_bytes
    if config.use_layerwise:
        payloads = layout.num_layers
        payload_bytes = math.prod(layout.layer_payload_shape(tokens)) * itemsize
    page = page_size_for(payload_bytes)
    room = payloads * -(-payload_bytes // page) * page
    capacity = config.cpu_capacity_bytes if pool_buffer is None else pool_buffer.nbytes
    if room <= capacity:
        pool = (
            MemoryPool(capacity, page_size=page)
            if pool_buffer is None
            else MemoryPool.from_buffer(pool_buffer, page_size=page)
        )
        if room <= pool.capacity_bytes:
            return pool, chunk_bytes
        pool.close()
    raise ConfigError(
        "max_local_cpu_size",
        f"{config.max_local_cpu_size} GB holds less than one chunk of this layout "
        f"({room} bytes for {tokens} tokens)",
    )
