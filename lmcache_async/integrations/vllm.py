"""A vLLM v1 KV connector: ``LMCacheAsyncConnector``.

Load it with::

    KVTransferConfig(
        kv_connector="LMCacheAsyncConnector",
        kv_connector_module_path="lmcache_async.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"chunk_size": 256, "local_disk": "/var/cache/kv"},
    )

vLLM builds the connector twice: once in its scheduler (role ``SCHEDULER``) and once in
every worker (role ``WORKER``), usually in different processes. Each worker opens a
:class:`~lmcache_async.sync_engine.SyncCacheEngine` over the paged KV memory vLLM hands it
and answers the scheduler's lookups over ZeroMQ (:mod:`lmcache_async.rpc.lookup`). Each step
the scheduler side tells the workers, through the connector metadata, what to load before
the forward pass and what to store after it:

1. ``get_num_new_matched_tokens`` looks the prompt up on every worker, pinning the hit under
   the request id, and offers vLLM the cached tokens beyond its own prefix cache (at most
   the prompt length minus 1, so vLLM computes at least one token itself).
2. ``update_state_after_alloc`` keeps the load vLLM accepted; ``build_connector_meta`` sends
   it to the workers with the request's block ids.
3. ``start_load_kv`` (worker) retrieves into the paged memory before the forward pass. A
   load that comes back shorter than promised (a chunk failed its checksum or could not be
   read) reports the blocks it did not fill (``get_block_ids_with_load_errors``), so vLLM
   recomputes them; the request's stores of that step are dropped, since they were computed
   over the missing prefix.
4. ``wait_for_save`` (worker) stores the whole chunks of the prompt whose KV this step
   computed (and the short last chunk once the prompt is done, when ``save_unfull_chunk``).
   A store returns once the chunks are in host memory; disk and Redis are written behind it.

With ``use_layerwise: true`` the worker moves KV layer by layer, as vLLM's forward pass
reaches each attention layer: ``start_load_kv`` starts each load (looks its chunks up),
``wait_for_layer_load`` loads the layer about to run, ``save_kv_layer`` copies out the layer
just computed and ``wait_for_save`` puts the stored chunks (embedded engine only).

With ``sidecar_url`` each worker keeps no cache of its own: it opens a client of the sidecar
(``lmcache-async serve``), so several vLLM instances on the host share one cache that
outlives them. The scheduler still asks the workers, which ask the sidecar. Every request
to the sidecar is bounded by ``sidecar_timeout``; a sidecar that is down or slow makes
loads and lookups misses and stores no-ops (vLLM recomputes), never a hang.

Configuration: ``kv_connector_extra_config`` holds :class:`~lmcache_async.config.EngineConfig`
fields plus the connector's own keys (:data:`CONNECTOR_KEYS`); ``LMCACHE_ASYNC_*``
environment variables and a YAML file (``config_file``) are merged as by
:meth:`EngineConfig.load`, the extra config winning.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog
import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_async.config import EngineConfig
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.layouts import CpuKVPacking, KVLayout
from lmcache_async.rpc.lookup import DEFAULT_LOOKUP_TIMEOUT, SyncLookupClient, lookup_endpoint
from lmcache_async.sync_engine import DEFAULT_SIDECAR_TIMEOUT, LayerSteps, SyncCacheEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_KEYS",
    "REQUEST_STATS_KEY",
    "SIDECAR_ENGINE_KEYS",
    "ConnectorSettings",
    "LMCacheAsyncConnector",
    "LMCacheAsyncConnectorMetadata",
    "LoadSpec",
    "SaveSpec",
    "SchedulerPlanner",
    "block_slots",
    "detect_layout",
    "layer_order",
]

log = structlog.get_logger(__name__)

CONNECTOR_KEYS: Final = (
    "config_file",
    "instance_id",
    "lookup_timeout",
    "request_stats",
    "sidecar_timeout",
    "sidecar_url",
    "socket_dir",
    "tenant",
)
"""``kv_connector_extra_config`` keys read by the connector itself, not by the engine:

* ``config_file``: YAML file of engine settings (below the extra config in precedence);
* ``instance_id``: names the lookup sockets (default: vLLM's ``engine_id``);
* ``lookup_timeout``: seconds the scheduler waits for the workers' answer (then 0 hits);
* ``request_stats``: when true, each finished request's ``kv_transfer_params`` carry
  ``{"lmcache_async": {...}}`` with its external, loaded, failed and stored token counts;
* ``sidecar_url``: ``ipc://PATH`` or ``tcp://HOST:PORT`` of a sidecar (``lmcache-async
  serve``): the workers keep their cache there instead of in an embedded engine. The
  sidecar owns the tiers, so the only engine keys allowed beside it are
  :data:`SIDECAR_ENGINE_KEYS` (``chunk_size`` must be the sidecar's);
* ``sidecar_timeout``: seconds each request to the sidecar may take (default 5); a sidecar
  that does not answer in time is a miss;
* ``socket_dir``: directory of the lookup sockets (default: the temporary directory);
* ``tenant``: a salt in every chunk key, so tenants never share cache entries.
"""

SIDECAR_ENGINE_KEYS: Final = ("chunk_size", "save_unfull_chunk", "log_level", "log_format")
"""Engine keys the connector accepts with ``sidecar_url``: the scheduler side plans chunks
with them. Storage keys (tiers, sizes, timeouts) are the sidecar's own."""

_R = TypeVar("_R")

REQUEST_STATS_KEY: Final = "lmcache_async"
"""Key of the per-request counts in ``kv_transfer_params`` (with ``request_stats``)."""


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's configuration: the engine's settings and the connector's own keys."""

    engine: EngineConfig
    instance_id: str | None = None
    socket_dir: str | None = None
    lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT
    tenant: str | None = None
    request_stats: bool = False
    sidecar_url: str | None = None
    sidecar_timeout: float = DEFAULT_SIDECAR_TIMEOUT

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Split ``kv_connector_extra_config`` into engine and connector settings.

        Raises:
            ConfigError: an unknown key (the message suggests the closest known one), a
                connector key of the wrong type or range, an invalid engine setting, or
                with ``sidecar_url`` a storage key or ``use_layerwise`` (the sidecar owns
                the tiers and moves whole chunks); ``.field`` names the key.
        """
        known = set(EngineConfig.field_names()) | set(CONNECTOR_KEYS)
        for key in extra:
            if not isinstance(key, str):
                raise ConfigError(repr(key), "kv_connector_extra_config keys must be strings")
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(key, "unknown kv_connector_extra_config key" + hint)
        own = {key: extra[key] for key in CONNECTOR_KEYS if key in extra}
        engine_keys = {key: value for key, value in extra.items() if key not in own}
        config_file = own.get("config_file")
        if config_file is not None and not isinstance(config_file, str):
            raise ConfigError("config_file", f"expected a path string, got {config_file!r}")
        engine = EngineConfig.load(config_file, environ=environ, **engine_keys)
        instance_id = _optional_str(own, "instance_id")
        socket_dir = _optional_str(own, "socket_dir")
        if instance_id is not None:
            try:
                lookup_endpoint(instance_id, 0, socket_dir)
            except InvalidInputError as exc:
                raise ConfigError("instance_id", str(exc)) from None
        timeout = _seconds(own, "lookup_timeout", DEFAULT_LOOKUP_TIMEOUT)
        request_stats = own.get("request_stats", False)
        if not isinstance(request_stats, bool):
            raise ConfigError("request_stats", f"expected a bool, got {request_stats!r}")
        sidecar_url = _optional_str(own, "sidecar_url")
        if sidecar_url is not None:
            _check_sidecar(sidecar_url, engine, engine_keys)
        elif "sidecar_timeout" in own:
            raise ConfigError("sidecar_timeout", "only meaningful with sidecar_url")
        return cls(
            engine=engine,
            instance_id=instance_id,
            socket_dir=socket_dir,
            lookup_timeout=timeout,
            tenant=_optional_str(own, "tenant"),
            request_stats=request_stats,
            sidecar_url=sidecar_url,
            sidecar_timeout=_seconds(own, "sidecar_timeout", DEFAULT_SIDECAR_TIMEOUT),
        )


def _seconds(values: Mapping[str, Any], key: str, default: float) -> float:
    value = values.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(key, f"expected a number of seconds > 0, got {value!r}")
    return float(value)


def _check_sidecar(url: str, engine: EngineConfig, engine_keys: Mapping[str, Any]) -> None:
    """Refuse what a sidecar cannot honour: a bad URL, layerwise, storage keys here."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("ipc", "tcp") or not rest:
        raise ConfigError("sidecar_url", f"expected ipc://PATH or tcp://HOST:PORT, got {url!r}")
    if engine.use_layerwise:
        raise ConfigError(
            "use_layerwise",
            "layerwise transfers are not offered over the sidecar; drop use_layerwise or "
            "sidecar_url",
        )
    for key in engine_keys:
        if key not in SIDECAR_ENGINE_KEYS:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                key,
                f"the sidecar at {url} owns the storage settings: give {flag} to "
                "`lmcache-async serve`, not to the connector",
            )


def _optional_str(values: Mapping[str, Any], key: str) -> str | None:
    value = values.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(key, f"expected a non-empty string, got {value!r}")
    return value


# -- KV memory -------------------------------------------------------------------------------


def detect_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
    use_mla: bool = False,
    tp_world_size: int = 1,
    tp_rank: int = 0,
    cpu_isa: str | None = None,
) -> tuple[KVLayout, list[torch.Tensor]]:
    """Recognise the per-layer KV tensors vLLM registers and return their layout.

    Known layouts (``H`` = ``num_kv_heads`` of this rank, ``D`` = ``head_size``):

    * vLLM CPU attention: ``[num_blocks, H, block_size, 2 * D]``, contiguous, on the CPU,
      each block and head packed as the attention kernel ("ISA") vLLM picks for the dtype,
      block size and CPU wants (``cpu_isa``, asked from vLLM when not given). The packing
      is checked by writing one block with vLLM's own ``cpu_attn_reshape_and_cache`` and
      reading it back;
    * vLLM's GPU flash-attention (0.32): ``[num_blocks, H, block_size, 2 * D]`` on the
      device, each token's row its keys then its values (``CpuKVPacking.TOKEN_ROWS``);
    * flash-attention: ``[2, num_blocks, block_size, H, D]`` (NHD, or HND strides);
    * FlashInfer-style: ``[num_blocks, 2, block_size, H, D]``;
    * MLA (``use_mla``): ``[num_blocks, block_size, latent]`` or
      ``[num_blocks, 1, block_size, latent]`` (returned as 3-D views).

    Returns the layout and the tensors to hand to the engine (views of the same memory).

    Raises:
        InvalidInputError: no tensors, or a shape, stride, dtype or device that matches no
            known layout (the message names what was seen); or a vLLM CPU attention
            kernel whose packing lmcache_async does not describe, or that packs a block
            otherwise than the layout says.
    """
    tensors = list(kv_caches)
    if not tensors:
        raise InvalidInputError("no KV cache tensors were registered")
    first = tensors[0]
    shape = tuple(first.shape)
    seen = (
        f"per-layer tensor of shape {shape}, strides {first.stride()}, dtype "
        f"{str(first.dtype).removeprefix('torch.')} on {first.device} "
        f"(expected num_kv_heads={num_kv_heads}, head_size={head_size}, use_mla={use_mla})"
    )
    common: dict[str, Any] = {"dtype": first.dtype, "tp_world_size": tp_world_size}
    common["tp_rank"] = tp_rank
    layout: KVLayout | None = None
    if use_mla:
        if first.ndim == 4 and shape[1] == 1 and first.is_contiguous():
            tensors = [t.view(t.shape[0], t.shape[2], t.shape[3]) for t in tensors]
            shape = (shape[0], shape[2], shape[3])
        if len(shape) == 3:
            layout = KVLayout.mla(
                num_layers=len(tensors), block_size=shape[1], latent_dim=shape[2], **common
            )
    elif first.ndim == 5 and shape[3:] == (num_kv_heads, head_size):
        if shape[0] == 2:
            hnd = not first.is_contiguous() and first.transpose(2, 3).is_contiguous()
            layout = KVLayout.vllm_flash_attn(
                num_layers=len(tensors),
                block_size=shape[2],
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                hnd=hnd,
                **common,
            )
        elif shape[1] == 2:
            layout = KVLayout.flashinfer(
                num_layers=len(tensors),
                block_size=shape[2],
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                **common,
            )
    elif first.ndim == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        if first.device.type != "cpu":
            # vLLM's GPU flash-attention backend: each token's row holds K then V.
            layout = KVLayout.vllm_cpu(
                num_layers=len(tensors),
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                block_size=shape[2],
                packing=CpuKVPacking.TOKEN_ROWS,
                **common,
            )
            layout.check_kv_caches(tensors)
            return layout, tensors
        isa = cpu_isa or _vllm_cpu_isa(first.dtype, shape[2], head_size)
        layout = KVLayout.vllm_cpu(
            num_layers=len(tensors),
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=shape[2],
            packing=CpuKVPacking.for_vllm_isa(isa, first.dtype),
            **common,
        )
        _check_cpu_packing(layout, isa)
    if layout is None:
        raise InvalidInputError(f"unknown KV cache layout: {seen}")
    layout.check_kv_caches(tensors)
    return layout, tensors


def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The attention kernel vLLM's CPU backend picks for a cache of this dtype and shape.

    Raises:
        InvalidInputError: this vLLM does not say (its CPU attention backend is missing or
            picks kernels another way).
    """
    try:
        # Only CPU caches need vLLM's CPU backend; other builds may lack or break it.
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

        return str(_get_attn_isa(dtype, block_size, head_size))
    except (ImportError, TypeError, NotImplementedError) as exc:
        raise InvalidInputError(
            f"cannot tell which attention kernel vLLM's CPU backend uses, so not how it packs "
            f"the KV cache ({type(exc).__name__}: {exc}); pass cpu_isa to detect_layout"
        ) from exc


def _check_cpu_packing(layout: KVLayout, isa: str) -> None:
    """Write one block through vLLM's ``cpu_attn_reshape_and_cache`` for ``isa`` and read it
    back through ``layout``, so a kernel that packs otherwise is refused, not misread.

    Skipped (with a warning) when vLLM's CPU ops cannot run here.

    Raises:
        InvalidInputError: the block read back differs from what vLLM was given.
    """
    probe = KVLayout.vllm_cpu(
        num_layers=1,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        block_size=layout.block_size,
        packing=layout.cpu_packing or CpuKVPacking.KEYS_TRANSPOSED,
    )
    bs, heads, size = probe.block_size, probe.num_kv_heads, probe.head_size
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(bs, heads, size, generator=gen).to(probe.dtype)
    values = torch.randn(bs, heads, size, generator=gen).to(probe.dtype)
    cache = torch.zeros(probe.kv_cache_shape(1), dtype=probe.dtype)
    key_cache, value_cache = cache.view(1, heads, 2 * bs, size).chunk(2, dim=2)
    slots = torch.arange(bs - 1, -1, -1, dtype=torch.int64)
    try:
        from vllm import _custom_ops  # noqa: PLC0415  # loads vLLM's compiled ops: CPU only

        _custom_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.warning("vllm_cpu_packing_unchecked", isa=isa, error=str(exc))
        return
    out = torch.empty(probe.payload_shape(bs), dtype=probe.dtype)
    probe.gather([cache], slots, out)
    if not (
        torch.equal(out[0, 0], keys.view(bs, -1)) and torch.equal(out[1, 0], values.view(bs, -1))
    ):
        raise InvalidInputError(
            f"vLLM's CPU attention kernel {isa!r} packs the KV cache otherwise than the "
            f"{probe.cpu_packing} layout describes; lmcache_async cannot read this cache"
        )


def block_slots(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The slots (``block_id * block_size + offset``) of a request's first ``num_tokens``
    tokens, as a fresh 1-D int64 tensor.

    Raises:
        InvalidInputError: the blocks hold fewer than ``num_tokens`` tokens.
    """
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise InvalidInputError(
            f"{num_tokens} tokens need {needed} blocks of {block_size}, the request has "
            f"{len(block_ids)}"
        )
    blocks = torch.tensor(list(block_ids[:needed]), dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks.unsqueeze(1) * block_size + offsets).view(-1)[:num_tokens].clone()


def layer_order(names: Sequence[str]) -> list[int]:
    """The indices of ``names`` (vLLM's attention layer names) in the model's layer order.

    Each name is expected to hold one integer part, the layer number
    (``model.layers.3.self_attn.attn``); when every name does and no two share one, the
    names are ordered by it, so every process lays the layers out alike and layerwise
    transfers follow the forward pass. Otherwise the given order is kept.
    """
    numbers: list[int] = []
    for name in names:
        found = [int(part) for part in name.split(".") if part.isdigit()]
        if len(found) != 1:
            return list(range(len(names)))
        numbers.append(found[0])
    if len(set(numbers)) != len(numbers):
        return list(range(len(names)))
    return sorted(range(len(names)), key=numbers.__getitem__)


# -- metadata --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of a request into its blocks before this step's forward.

    ``tokens`` are the prompt's tokens up to the end of the last chunk to read (they key the
    chunks; ``end`` may stop short of it, as it does for a fully cached prompt).
    ``epoch`` counts the request's restarts (a failed load, a preemption).
    """

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    epoch: int


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks of ``tokens`` (a prompt prefix) from token ``start`` (a chunk
    boundary) on, after this step's forward."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    epoch: int


@dataclass(slots=True)
class LMCacheAsyncConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side asks the workers to do in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# -- scheduler side --------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """A hit offered to vLLM and not yet sent to the workers."""

    key_end: int  # tokens keying the chunks to read
    start: int  # vLLM's own computed tokens
    end: int  # one past the last token to load
    hit: int  # cached prefix tokens found by the lookup


@dataclass(slots=True)
class _Tracker:
    """A running request as the scheduler side sees it."""

    prompt: list[int]
    block_ids: list[int]
    saved: int  # prompt tokens [0, saved) are cached or handed to a store
    computed: int  # tokens whose KV exists once the last scheduled step ran
    epoch: int = 0
    load_end: int = 0
    external: int = 0
    failed: int = 0
    stored: int = 0


class SchedulerPlanner:
    """The scheduler side's bookkeeping: which tokens to load and store, step by step.

    It reads only plain attributes of vLLM's scheduler output, so it can be driven by
    tests without a running vLLM. ``lookup(tokens, req_id)`` returns the cached prefix
    tokens (pinning them under ``req_id``); ``unpin(req_id)`` releases such pins.

    ``load_granule``: a load ends on a multiple of it (1: any token). Every KV layout the
    connector accepts moves single tokens exactly (vLLM's CPU packings included), so the
    connector loads up to the token vLLM must compute itself.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        save_unfull_chunk: bool,
        lookup: Callable[[list[int], str], int],
        unpin: Callable[[str], None],
        can_load: bool = True,
        can_save: bool = True,
        load_granule: int = 1,
    ) -> None:
        self._chunk = chunk_size
        self._granule = load_granule
        self._save_unfull = save_unfull_chunk
        self._lookup = lookup
        self._unpin = unpin
        self._can_load = can_load
        self._can_save = can_save
        self._pending: dict[str, _Pending] = {}
        self._loads: dict[str, _Pending] = {}
        self._trackers: dict[str, _Tracker] = {}

    def _align(self, tokens: int) -> int:
        return tokens - tokens % self._chunk

    def num_new_matched_tokens(
        self, req_id: str, prompt: Sequence[int] | None, num_computed: int
    ) -> int:
        """Tokens beyond ``num_computed`` the workers can load for this prompt (may be 0)."""
        if not self._can_load or prompt is None or len(prompt) < 2:
            return 0
        hit = self._lookup(list(prompt), req_id)
        length = len(prompt)
        if hit >= length:
            # The whole prompt is cached: load all but its last token, which vLLM computes.
            key_end, end = length, length - 1
        else:
            key_end = end = self._align(hit)
        end -= end % self._granule
        # Read no chunk that holds nothing to load.
        key_end = min(key_end, end + (-end) % self._chunk)
        if end <= num_computed:
            self._pending.pop(req_id, None)
            if hit:
                self._unpin(req_id)
            return 0
        self._pending[req_id] = _Pending(key_end=key_end, start=num_computed, end=end, hit=hit)
        return end - num_computed

    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks and accepted ``num_external_tokens`` of the offer."""
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        if num_external_tokens <= 0:
            if pending.hit:
                self._unpin(req_id)
            return
        pending.end = min(pending.end, pending.start + num_external_tokens)
        self._loads[req_id] = pending

    def build(self, output: SchedulerOutput) -> LMCacheAsyncConnectorMetadata:
        """The workers' orders for the step vLLM just scheduled."""
        meta = LMCacheAsyncConnectorMetadata()
        scheduled = output.num_scheduled_tokens
        for req_id in output.finished_req_ids:
            self._trackers.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                continue
            tracker = _Tracker(
                prompt=list(new.prompt_token_ids),
                block_ids=list(new.block_ids[0]) if new.block_ids else [],
                saved=0,
                computed=new.num_computed_tokens + scheduled.get(new.req_id, 0),
            )
            self._trackers[new.req_id] = tracker
            self._plan_load(new.req_id, tracker, meta)
            self._plan_save(new.req_id, tracker, meta)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            new_blocks = cached.new_block_ids[i]
            num_computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and scheduled again: a fresh block table, a new epoch.
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
                tracker.epoch += 1
                tracker.load_end = 0
            else:
                if new_blocks:
                    tracker.block_ids.extend(new_blocks[0])
                if num_computed < tracker.computed:
                    # vLLM rolled the request back: a load failed and is being recomputed.
                    tracker.epoch += 1
                    if tracker.load_end > num_computed:
                        tracker.failed += tracker.load_end - num_computed
                        tracker.load_end = num_computed
                    tracker.saved = min(tracker.saved, self._align(num_computed))
            tracker.computed = num_computed + scheduled.get(req_id, 0)
            self._plan_load(req_id, tracker, meta)
            self._plan_save(req_id, tracker, meta)
        return meta

    def _plan_load(
        self, req_id: str, tracker: _Tracker, meta: LMCacheAsyncConnectorMetadata
    ) -> None:
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        meta.loads.append(
            LoadSpec(
                req_id=req_id,
                tokens=tracker.prompt[: load.key_end],
                block_ids=list(tracker.block_ids),
                start=load.start,
                end=load.end,
                epoch=tracker.epoch,
            )
        )
        tracker.load_end = load.end
        tracker.external += load.end - load.start
        # What the cache holds needs no store (a failed load rolls this back).
        cached = load.hit if load.hit >= len(tracker.prompt) else self._align(load.hit)
        tracker.saved = max(tracker.saved, cached)

    def _plan_save(
        self, req_id: str, tracker: _Tracker, meta: LMCacheAsyncConnectorMetadata
    ) -> None:
        if not self._can_save:
            return
        length = len(tracker.prompt)
        if tracker.saved >= length:
            return
        done = min(tracker.computed, length)
        end = done if done == length and self._save_unfull else self._align(done)
        if end <= tracker.saved:
            return
        meta.saves.append(
            SaveSpec(
                req_id=req_id,
                tokens=tracker.prompt[:end],
                block_ids=list(tracker.block_ids),
                start=tracker.saved,
                epoch=tracker.epoch,
            )
        )
        tracker.stored += end - tracker.saved
        tracker.saved = end

    def finished(self, req_id: str) -> dict[str, int] | None:
        """Forget a finished request; returns its token counts if it was tracked."""
        pending = self._pending.pop(req_id, None) or self._loads.pop(req_id, None)
        self._loads.pop(req_id, None)
        if pending is not None and pending.hit:
            self._unpin(req_id)
        tracker = self._trackers.pop(req_id, None)
        if tracker is None:
            return None
        return {
            "external_tokens": tracker.external,
            "loaded_tokens": tracker.external - tracker.failed,
            "failed_tokens": tracker.failed,
            "stored_tokens": tracker.stored,
        }


# -- the connector ---------------------------------------------------------------------------


@dataclass(slots=True)
class _LayerLoad:
    """A layerwise load of this step, stepped once per attention layer."""

    load: LoadSpec
    steps: LayerSteps[torch.Tensor | None]


@dataclass(slots=True)
class _LayerSave:
    """A layerwise store of this step, stepped once per attention layer."""

    save: SaveSpec
    steps: LayerSteps[int | None]


class LMCacheAsyncConnector(KVConnectorBase_V1):
    """vLLM's KV connector for lmcache_async; see the module docstring for the protocol.

    Raises (at construction):
        ConfigError: an invalid ``kv_connector_extra_config``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._settings = ConnectorSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {})
        )
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._instance_id = self._settings.instance_id or _instance_id(vllm_config)
        self._layerwise = self._settings.engine.use_layerwise
        self._engine: SyncCacheEngine | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._layer_positions: dict[str, int] = {}
        self._layer_loads: list[_LayerLoad] = []
        self._layer_saves: list[_LayerSave] | None = None
        self._load_errors: set[int] = set()
        self._failed_epochs: dict[str, int] = {}
        self._client: SyncLookupClient | None = None
        self._planner: SchedulerPlanner | None = None
        if role == KVConnectorRole.SCHEDULER:
            client = SyncLookupClient(
                self._instance_id,
                self._tp_size * self._pp_size,
                socket_dir=self._settings.socket_dir,
                timeout=self._settings.lookup_timeout,
            )
            self._client = client
            self._planner = SchedulerPlanner(
                chunk_size=self._settings.engine.chunk_size,
                save_unfull_chunk=self._settings.engine.save_unfull_chunk,
                lookup=lambda tokens, req_id: client.lookup(tokens, lookup_id=req_id, pin=True),
                unpin=client.unpin,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
                load_granule=1,
            )
        log.info(
            "vllm_connector_created",
            role=role.name,
            instance_id=self._instance_id,
            chunk_size=self._settings.engine.chunk_size,
            sidecar=self._settings.sidecar_url,
            layerwise=self._layerwise,
        )

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognise vLLM's KV memory, open the cache engine on it (embedded, or a client
        of the sidecar) and serve lookups.

        Raises:
            InvalidInputError: a KV layout this connector does not know (naming it).
            ConfigError: the sidecar cuts chunks of another size than ``chunk_size``.
        """
        vllm_config = self._vllm_config
        model = vllm_config.model_config
        num_kv_heads, head_size = _heads(vllm_config, self._kv_cache_config)
        tp_rank, pp_rank = _ranks()
        names = list(kv_caches)
        order = layer_order(names)
        layout, tensors = detect_layout(
            [kv_caches[names[i]] for i in order],
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            use_mla=bool(getattr(model, "use_mla", False)),
            tp_world_size=self._tp_size,
            tp_rank=tp_rank,
        )
        tenant = self._settings.tenant
        if self._pp_size > 1:
            # Pipeline stages hold different layers under one layout fingerprint.
            tenant = f"{tenant or ''}/pp{pp_rank}"
        if self._engine is not None:
            self._engine.close()  # registered again: the old memory is gone
            self._engine = None
        self._kv_caches = tensors
        self._layer_positions = {names[i]: position for position, i in enumerate(order)}
        engine = self._open_engine(layout, str(model.model), model.revision, tenant)
        self._engine = engine
        rank = pp_rank * self._tp_size + tp_rank
        endpoint = engine.serve_lookups(self._instance_id, rank, self._settings.socket_dir)
        log.info(
            "vllm_kv_caches_registered",
            layout=layout.kind.value,
            fingerprint=layout.fingerprint,
            block_size=layout.block_size,
            layers=layout.num_layers,
            endpoint=endpoint,
            sidecar=self._settings.sidecar_url,
        )

    def _open_engine(
        self, layout: KVLayout, model_name: str, revision: str | None, tenant: str | None
    ) -> SyncCacheEngine:
        settings = self._settings
        url = settings.sidecar_url
        if url is None:
            return SyncCacheEngine.open(
                settings.engine, layout, model_name=model_name, revision=revision, tenant=tenant
            )
        # A sidecar that is down is not fatal: calls are misses until it answers.
        engine = SyncCacheEngine.connect(
            url,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            timeout=settings.sidecar_timeout,
        )
        chunk = engine.chunk_size
        if chunk is None:
            log.warning("vllm_sidecar_unreachable", url=url, timeout=settings.sidecar_timeout)
        elif chunk != settings.engine.chunk_size:
            engine.close()
            raise ConfigError(
                "chunk_size",
                f"the sidecar at {url} cuts chunks of {chunk} tokens, the connector is "
                f"configured for {settings.engine.chunk_size}: set chunk_size to {chunk}",
            )
        return engine

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Retrieve this step's loads into the paged memory: whole, before returning; or,
        with ``use_layerwise``, start them (the lookup) and load each layer in
        :meth:`wait_for_layer_load`."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCacheAsyncConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            if self._layerwise:
                self._start_layer_load(load)
            else:
                self._load(load)

    def _load_args(self, load: LoadSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot mapping and mask of a load: the chunks from the one holding
        ``load.start`` on are read; only tokens ``[start, end)`` are written."""
        chunk = self._settings.engine.chunk_size
        num = len(load.tokens)
        slots = block_slots(load.block_ids, self._block_size, num)
        mask_start = load.start - load.start % chunk
        slots[mask_start : load.start] = -1  # vLLM's own prefix: never overwritten
        slots[load.end :] = -1
        mask = torch.zeros(num, dtype=torch.bool)
        mask[mask_start:] = True
        return slots, mask

    def _load(self, load: LoadSpec) -> None:
        engine = self._engine
        loaded: torch.Tensor | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            slots, mask = self._load_args(load)
            loaded = engine.retrieve(
                load.tokens,
                kv_caches=self._kv_caches,
                slot_mapping=slots,
                mask=mask,
                req_id=load.req_id,
                lookup_id=load.req_id,
            )
        except Exception:
            self._load_failed(load)
        self._loaded(load, loaded)

    def _load_failed(self, load: LoadSpec) -> None:
        log.exception("vllm_load_failed", req_id=load.req_id)
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.lookup_unpin(load.req_id)

    def _loaded(self, load: LoadSpec, loaded: torch.Tensor | None) -> None:
        """Check a finished load (``loaded``: its mask, None if it failed); report the
        blocks it did not fill, so vLLM recomputes them."""
        filled = load.start
        if loaded is not None:
            missing = (~loaded[load.start : load.end]).nonzero()
            filled = load.end if missing.numel() == 0 else load.start + int(missing[0])
        if filled >= load.end:
            log.debug("vllm_kv_loaded", req_id=load.req_id, tokens=load.end - load.start)
            return
        bs = self._block_size
        bad = set(load.block_ids[filled // bs : (load.end - 1) // bs + 1])
        self._load_errors |= bad
        self._failed_epochs[load.req_id] = load.epoch
        log.warning(
            "vllm_kv_load_incomplete",
            req_id=load.req_id,
            promised=load.end - load.start,
            loaded=filled - load.start,
            blocks=len(bad),
        )

    # -- layerwise --------------------------------------------------------------------------

    def _start_layer_load(self, load: LoadSpec) -> None:
        engine = self._engine
        steps: LayerSteps[torch.Tensor | None] | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            slots, mask = self._load_args(load)
            steps = engine.retrieve_layer(
                load.tokens,
                kv_caches=self._kv_caches,
                slot_mapping=slots,
                mask=mask,
                req_id=load.req_id,
                lookup_id=load.req_id,
            )
            steps.step()  # the lookup: references on every layer of the cached chunks
        except Exception:
            self._load_failed(load)
            if steps is not None:
                with contextlib.suppress(Exception):
                    steps.close()
            self._loaded(load, None)
            return
        self._layer_loads.append(_LayerLoad(load, steps))

    def _step_to(self, steps: LayerSteps[Any], taken: int, req_id: str) -> bool:
        """Step ``steps`` until ``taken`` steps are taken (or none is left); False when a
        step failed (logged; the transfer is then over)."""
        try:
            while not steps.done and steps.taken < taken:
                steps.step()
        except Exception:
            log.exception("vllm_layerwise_step_failed", req_id=req_id)
            return False
        return True

    def _finish_layer_loads(self) -> None:
        """Load every layer left of this step's layerwise loads and check them."""
        pending, self._layer_loads = self._layer_loads, []
        for layer_load in pending:
            steps = layer_load.steps
            ok = self._step_to(steps, steps.total, layer_load.load.req_id)
            last = steps.finish() if ok else None
            self._loaded(layer_load.load, last if isinstance(last, torch.Tensor) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``use_layerwise``: return once ``layer_name``'s KV of this step's loads is
        in the paged memory (the layers before it too). Otherwise loads finished in
        :meth:`start_load_kv`."""
        if not self._layer_loads:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return  # not a layer of ours: everything left is loaded by wait_for_save
        for layer_load in self._layer_loads:
            # Step 0 was the lookup; step i + 1 loads layer i.
            self._step_to(layer_load.steps, position + 2, layer_load.load.req_id)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """With ``use_layerwise``: copy ``layer_name``'s KV of this step's stores out (the
        chunks are put in :meth:`wait_for_save`). Otherwise nothing: whole chunks are
        stored in :meth:`wait_for_save`."""
        if not self._layerwise:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return
        if self._layer_saves is None:
            self._layer_saves = self._start_layer_saves()
        for layer_save in self._layer_saves:
            # Step i copies layer i out (step 0 also allocates the chunks' memory).
            self._step_to(layer_save.steps, position + 1, layer_save.save.req_id)

    def _start_layer_saves(self) -> list[_LayerSave]:
        engine = self._engine
        if engine is None:
            return []
        return [_LayerSave(save, steps) for save, steps in self._each_save(engine.store_layer)]

    def _each_save(self, store: Callable[..., _R]) -> list[tuple[SaveSpec, _R]]:
        """Call ``store`` (the engine's ``store`` or ``store_layer``) for each of this
        step's saves, skipping requests whose load failed; a failure is logged and that
        save left out."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCacheAsyncConnectorMetadata):
            return []
        done = []
        for save in meta.saves:
            if self._failed_epochs.get(save.req_id) == save.epoch:
                continue  # computed over a prefix that failed to load
            try:
                slots, mask = self._save_args(save)
                result = store(
                    save.tokens,
                    kv_caches=self._kv_caches,
                    slot_mapping=slots,
                    mask=mask,
                    req_id=save.req_id,
                )
            except Exception:
                log.exception("vllm_store_failed", req_id=save.req_id)
                continue
            done.append((save, result))
        return done

    def _save_args(self, save: SaveSpec) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self._settings.engine.chunk_size
        num = len(save.tokens)
        slots = block_slots(save.block_ids, self._block_size, num)
        mask = torch.zeros(num, dtype=torch.bool)
        mask[save.start - save.start % chunk :] = True
        return slots, mask

    def wait_for_save(self) -> None:
        """Store this step's whole prompt chunks; returns once they are in host memory.
        With ``use_layerwise`` the layers were copied out in :meth:`save_kv_layer`: the
        chunks are put here (dropped when the request's load failed this step)."""
        if self._layerwise:
            self._finish_layer_saves()
            return
        engine = self._engine
        if engine is None:
            return
        for save, stored in self._each_save(engine.store):
            log.debug("vllm_kv_stored", req_id=save.req_id, start=save.start, tokens=stored)

    def _finish_layer_saves(self) -> None:
        self._finish_layer_loads()  # a load failing now voids the request's stores
        saves = self._layer_saves
        if saves is None:  # no attention layer ran with metadata: copy every layer now
            saves = self._start_layer_saves()
        self._layer_saves = None
        for layer_save in saves:
            save, steps = layer_save.save, layer_save.steps
            if self._failed_epochs.get(save.req_id) == save.epoch:
                with contextlib.suppress(Exception):
                    steps.close()
                continue
            if self._step_to(steps, steps.total, save.req_id):
                stored = steps.finish()
                log.debug("vllm_kv_stored", req_id=save.req_id, start=save.start, tokens=stored)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads and stores are synchronous: nothing finishes later. Forgets finished ids."""
        for req_id in finished_req_ids:
            self._failed_epochs.pop(req_id, None)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed this step; vLLM recomputes them."""
        self._finish_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the engine (queued disk/Redis writes are finished, bounded) or the client."""
        if self._engine is not None:
            self._engine.close()
        if self._client is not None:
            self._client.close()

    # -- scheduler side -------------------------------------------------------------------

    def _scheduler(self) -> SchedulerPlanner:
        if self._planner is None:
            raise InvalidInputError("a scheduler-side method was called on a worker connector")
        return self._planner

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Cached tokens beyond vLLM's ``num_computed_tokens``; always a synchronous load."""
        hits = self._scheduler().num_new_matched_tokens(
            request.request_id, request.prompt_token_ids, num_computed_tokens
        )
        return hits, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Nothing to do: a failed load shows as vLLM rolling the request back."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request still holds; its blocks may be freed at once."""
        counts = self._scheduler().finished(request.request_id)
        if self._settings.request_stats and counts is not None:
            return False, {REQUEST_STATS_KEY: counts}
        return False, None


def _instance_id(vllm_config: VllmConfig) -> str:
    """Sockets are named after vLLM's engine id, plus the data-parallel rank."""
    engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
    base = engine_id or "vllm"
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        return f"{base}-dp{parallel.data_parallel_rank}"
    return base


def _heads(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> tuple[int, int]:
    """KV heads of this rank and head size, from the KV cache spec or the model config."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        heads = getattr(spec, "num_kv_heads", None)
        size = getattr(spec, "head_size", None)
        if isinstance(heads, int) and isinstance(size, int):
            return heads, size
    model = vllm_config.model_config
    return model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size()


def _ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks (0, 0 outside a vLLM group)."""
    try:
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pp_group().rank_in_group,
        )
    except (AssertionError, AttributeError):
        return 0, 0
