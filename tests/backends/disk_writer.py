"""Writes deterministic chunks through a DiskBackend until killed (for the crash test).

Usage: ``python disk_writer.py DIRECTORY COUNT [FIRST]``: chunks ``FIRST`` (0 by default)
to ``FIRST + COUNT - 1``, then a clean close. Chunk ``i`` has key :func:`key_for` and
payload :func:`payload_for`; chunks are put ``BATCH`` at a time, and after each put the
writer prints the ids it stored, one per line, so the test knows the writer is under way
and can SIGKILL it in the middle of later writes. The test imports the helpers from this
file, so both sides agree on every byte.
"""

from __future__ import annotations

import functools
import math
import sys

import anyio
import torch

from lmcache_async.backends.codec import Codec
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.record import RecordSpec
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryPool

CHUNK_TOKENS = 64
BATCH = 8
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=8, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
)
"""Chunks of 2 MiB: large enough that a kill often lands in the middle of a write."""


def make_spec(codec: Codec = Codec.NONE) -> RecordSpec:
    return RecordSpec(
        fingerprint=LAYOUT.fingerprint,
        fmt=str(LAYOUT.fmt),
        dtype=LAYOUT.dtype,
        max_tokens=CHUNK_TOKENS,
        shape_of=LAYOUT.payload_shape,
        codec=codec,
    )


def key_for(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(DIGEST_SIZE, "little"))


def payload_for(i: int) -> torch.Tensor:
    """The bytes of chunk ``i`` (uint8, a full chunk): random bytes rotated by a per-key
    offset, cheap to make so that the writer spends its time writing."""
    return _base().roll(i * 4099 + 1)


@functools.cache
def _base() -> torch.Tensor:
    nbytes = math.prod(LAYOUT.payload_shape(CHUNK_TOKENS)) * LAYOUT.dtype.itemsize
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


async def write(directory: str, count: int, first: int = 0) -> None:
    spec = make_spec()
    shape = LAYOUT.payload_shape(CHUNK_TOKENS)
    pool = MemoryPool((BATCH + 1) * (4 << 20), pin_memory=False)
    disk = await DiskBackend.open(
        directory,
        pool=pool,
        spec=spec,
        allocation_timeout=5.0,
        max_local_disk_size=1 << 40,
    )
    for start in range(first, first + count, BATCH):
        ids = range(start, min(start + BATCH, first + count))
        objs = []
        for i in ids:
            obj = await pool.allocate(shape, spec.dtype, timeout=5.0)
            obj.tensor.view(torch.uint8).view(-1).copy_(payload_for(i))
            objs.append(obj)
        await disk.put([key_for(i) for i in ids], objs)
        for obj in objs:
            obj.unref()
        sys.stdout.write("".join(f"{i}\n" for i in ids))
        sys.stdout.flush()
    await disk.aclose()


if __name__ == "__main__":
    anyio.run(write, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
