"""Tier sizes in chunks: what a tier of N tokens costs, how to configure one that holds
exactly N tokens' chunks, and how many chunks an engine's tiers turned out to hold.

A chunk is one trace block (the engine's ``chunk_size`` is the trace's block size). In the
CPU tier it takes whole pool pages (:func:`~lmcache_async.memory.page_size_for` fits the
page to the chunk), so a pool of P bytes holds ``P // room`` chunks, ``room`` being the
chunk's payload rounded up to pages. On disk it is one record file: the payload and a
header of a few hundred bytes (measured by storing one chunk: :func:`record_bytes`), so a
disk tier of D bytes holds ``D // record`` chunks.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError
from lmcache_async.memory import page_size_for

__all__ = [
    "ChunkSize",
    "check_block_size",
    "chunk_size_of",
    "cpu_chunks_held",
    "disk_chunks_held",
    "model_layout",
    "record_bytes",
    "room_of",
    "sized_config",
]

_PROBE_MODEL: Final = "lmcache-async-bench-trace-probe"
_PROBE_TIMEOUT: Final = 60.0


@dataclass(frozen=True, slots=True)
class ChunkSize:
    """The bytes of one chunk: its KV payload, its room in the CPU tier's pool, the page."""

    tokens: int
    payload: int
    page: int
    room: int

    def cpu_bytes(self, chunks: int) -> int:
        """Pool bytes that hold ``chunks`` chunks."""
        return chunks * self.room


def chunk_size_of(layout: KVLayout, chunk_tokens: int, *, layerwise: bool = False) -> ChunkSize:
    """The sizes of a ``chunk_tokens``-token chunk of ``layout`` (with ``layerwise``: stored
    as one payload per layer, as the engine's pool does then)."""
    itemsize = layout.dtype.itemsize
    payload = math.prod(layout.payload_shape(chunk_tokens)) * itemsize
    if not layerwise:
        page = page_size_for(payload)
        return ChunkSize(chunk_tokens, payload, page, -(-payload // page) * page)
    layer = math.prod(layout.layer_payload_shape(chunk_tokens)) * itemsize
    page = page_size_for(layer)
    return ChunkSize(chunk_tokens, payload, page, layout.num_layers * -(-layer // page) * page)


def sized_config(
    base: EngineConfig,
    chunk: ChunkSize,
    *,
    cpu_chunks: int | None,
    disk_chunks: int | None = None,
    disk_record: int | None = None,
    disk_directory: str | None = None,
) -> EngineConfig:
    """``base`` with the trace's chunking (``chunk_size``, no short last chunk stored) and,
    where given, a CPU tier of exactly ``cpu_chunks`` chunks and a disk tier in
    ``disk_directory`` of exactly ``disk_chunks`` records of ``disk_record`` bytes, written
    through (``wait_for_slow_tiers``), so that every store is on disk before the next.

    Raises:
        ConfigError: the configuration is refused.
    """
    changes: dict[str, Any] = {"chunk_size": chunk.tokens, "save_unfull_chunk": False}
    if cpu_chunks is not None:
        # Exact: a power of two divides and multiplies back without rounding.
        changes["max_local_cpu_size"] = chunk.cpu_bytes(cpu_chunks) / GB
        changes["local_cpu"] = True
    if disk_chunks is not None and disk_record is not None:
        changes["local_disk"] = disk_directory
        changes["max_local_disk_size"] = (disk_chunks * disk_record + disk_record // 2) / GB
        changes["wait_for_slow_tiers"] = True
    return base.replace(**changes)


async def record_bytes(base: EngineConfig, layout: KVLayout, chunk: ChunkSize) -> int:
    """The size of one chunk's record on disk: one chunk stored by an engine of this layout
    with a disk tier in a temporary directory.

    Raises:
        ConfigError: the configuration is refused.
        InvalidInputError: the chunk did not reach the disk.
        TimeoutError: the probe took over a minute.
    """
    with tempfile.TemporaryDirectory(prefix="lmc-trace-probe-") as directory:
        config = sized_config(
            base.replace(remote_url=None, enable_kv_events=False, store_threshold=1),
            chunk,
            cpu_chunks=2,
            disk_chunks=4,
            disk_record=chunk.payload + 64 * 1024,
            disk_directory=directory,
        )
        tokens = torch.arange(chunk.tokens, dtype=torch.int64)
        slots = torch.arange(chunk.tokens, dtype=torch.int64)
        blocks = -(-chunk.tokens // layout.block_size)
        kv = layout.allocate_kv_caches(blocks, random=False)
        with anyio.fail_after(_PROBE_TIMEOUT):
            async with CacheEngine.open(config, layout, model_name=_PROBE_MODEL) as engine:
                await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
                disk = engine.stats().tiers.get("disk")
        if disk is None or disk.chunks != 1:
            raise InvalidInputError("the disk tier did not take the probe chunk")
        return int(disk.bytes)


def cpu_chunks_held(stats: Mapping[str, Any], room: int | None) -> int | None:
    """How many chunks taking ``room`` pool bytes each the CPU tier's pool holds, from an
    engine's statistics as plain data (None when they do not say)."""
    pool = stats.get("pool") or {}
    capacity = pool.get("capacity_bytes")
    if not capacity or not room:
        return None
    return int(capacity) // room


def room_of(nbytes: Any, chunks: Any) -> int | None:
    """The pool room of chunks that hold ``nbytes`` in all (None without chunks)."""
    if not chunks or not nbytes:
        return None
    payload = int(nbytes) // int(chunks)
    page = page_size_for(payload)
    return -(-payload // page) * page


def disk_chunks_held(stats: Mapping[str, Any], capacity_bytes: int | None) -> int | None:
    """How many records a disk tier of ``capacity_bytes`` holds, from the record size it
    shows in an engine's statistics (None without a disk tier, a capacity or a record)."""
    disk = (stats.get("tiers") or {}).get("disk") or {}
    chunks, nbytes = disk.get("chunks"), disk.get("bytes")
    if not capacity_bytes or not chunks or not nbytes:
        return None
    return int(capacity_bytes) // math.ceil(int(nbytes) / int(chunks))


def model_layout(path: str, dtype: str = "auto") -> KVLayout:
    """The KV layout of the Hugging Face model in ``path`` as the connector stores it:
    layers, KV heads and head size from its ``config.json``; ``dtype`` (``auto``: the
    config's, a float32 one as bfloat16, as vLLM runs it).

    Raises:
        InvalidInputError: the config does not give the shape, or names an unknown dtype.
    """
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--model {path}: cannot read config.json: {exc}") from None
    text = data.get("text_config")
    source: Mapping[str, Any] = text if isinstance(text, dict) else data
    heads = source.get("num_attention_heads")
    shape = {
        "num_layers": source.get("num_hidden_layers"),
        "num_kv_heads": source.get("num_key_value_heads", heads),
        "head_size": source.get("head_dim")
        or (source.get("hidden_size", 0) // heads if isinstance(heads, int) and heads else None),
    }
    for name, value in shape.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidInputError(f"--model {path}: config.json does not give {name}")
    name = str(source.get("torch_dtype") or source.get("dtype") or "float32")
    if dtype != "auto":
        name = dtype
    elif name == "float32":  # vLLM's "auto" runs a float32 checkpoint in bfloat16
        name = "bfloat16"
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise InvalidInputError(f"--model {path}: unknown dtype {name!r}")
    return KVLayout.vllm_flash_attn(block_size=16, dtype=torch_dtype, **shape)


def check_block_size(chunk_size: int | None, block_size: int, where: str) -> None:
    """Raises InvalidInputError when ``where``'s chunk size is not the trace's block size."""
    if chunk_size != block_size:
        raise InvalidInputError(
            f"{where} cuts chunks of {chunk_size} tokens, the trace blocks of {block_size}: "
            "one hash id must be one chunk (--trace-block-size, or the sidecar's chunk_size)"
        )
