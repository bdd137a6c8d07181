"""The tensors every part of the GPU benchmark shares, and its device-synchronized timer."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import torch

from lmcache_async import KVLayout
from lmcache_async.bench.baselines import gather_rows, row_views, slots_over, synchronize
from lmcache_async.bench.gpu.options import GpuOptions

__all__ = ["Scene", "atimed", "make_scene"]

_VOCAB: Final = 32000


async def atimed(device: torch.device, fn: Callable[[], Awaitable[object]]) -> float:
    """Seconds of ``await fn()`` with the device synchronized before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    await fn()
    synchronize(device)
    return time.perf_counter() - t0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as raw bytes, to compare KV bit for bit."""
    return t.contiguous().view(torch.uint8)


@dataclass(slots=True)
class Scene:
    """The tensors every part of the benchmark shares."""

    device: torch.device
    layout: KVLayout
    kv: list[torch.Tensor]
    tokens: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    dst_blocks: torch.Tensor
    nbytes: int

    def blank_destination(self) -> None:
        for layer in self.kv:
            layer.index_fill_(1, self.dst_blocks, 0)

    def destination_matches_source(self) -> bool:
        """Whether the destination slots hold exactly the source slots' KV (on the device)."""
        views = row_views(self.layout, self.kv)
        shape = self.layout.payload_shape(int(self.tokens.shape[0]))
        expected = torch.empty(shape, dtype=self.layout.dtype, device=self.device)
        got = torch.empty_like(expected)
        gather_rows(views, self.src_slots, expected)
        gather_rows(views, self.dst_slots, got)
        return torch.equal(_bits(expected), _bits(got))


def make_scene(options: GpuOptions, device: torch.device) -> Scene:
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    num_tokens = options.tokens
    bs = options.block_size
    blocks_needed = math.ceil(num_tokens / bs)
    num_blocks = 2 * blocks_needed
    device_gen = torch.Generator(device=device).manual_seed(options.seed)
    kv = layout.allocate_kv_caches(num_blocks, device=device, generator=device_gen, random=True)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    src_blocks, dst_blocks = perm[:blocks_needed], perm[blocks_needed:]
    return Scene(
        device=device,
        layout=layout,
        kv=kv,
        tokens=torch.randint(0, _VOCAB, (num_tokens,), generator=gen, dtype=torch.int64),
        # On the device, as a serving engine hands them over.
        src_slots=slots_over(src_blocks, bs, num_tokens).to(device),
        dst_slots=slots_over(dst_blocks, bs, num_tokens).to(device),
        dst_blocks=dst_blocks.to(device),
        nbytes=num_tokens * layout.token_bytes,
    )
