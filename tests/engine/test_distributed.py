"""MLA with tensor parallelism over a real gloo process group of two processes.

The test starts this file twice as a script (group ranks 0 and 1). Rank 0 has the engine;
rank 1 has none, and any attempt of it to build an engine, a tier or a memory pool fails
loudly. Each rank writes what it saw to a JSON file the test then checks: bit-exact KV on
both ranks, the skipped slot on rank 1, misses, a mismatched call, and a peer that never
answers.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

NUM_LAYERS = 3
BLOCK_SIZE = 16
NUM_BLOCKS = 12
LATENT = 16
CHUNK = 16
N = 3 * CHUNK + 5
SKIPPED_ON_RANK_1 = 7
RUN_TIMEOUT = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.subprocess
def test_two_ranks_share_the_first_ranks_cache(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(Path(__file__).parents[1]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank][-4000:]}"
    first = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())

    assert (first["stored"], other["stored"]) == (N, 0)
    assert (first["hits"], other["hits"]) == (N, N)
    assert first["mask"] == [True] * N
    want = [True] * N
    want[SKIPPED_ON_RANK_1] = False
    assert other["mask"] == want
    assert first["exact"] and other["exact"]
    assert first["miss"] == [False] * N and other["miss"] == [False] * N
    assert first["miss_exact"] and other["miss_exact"]
    # Rank 1 asked for fewer tokens than rank 0 retrieved: it is told, rank 0 is served.
    assert other["mismatch"] == "InvalidInputError"
    assert first["mismatch"] == [True] * N
    assert first["refused"] == ["InvalidInputError", "InvalidInputError"]
    assert other["refused"] == ["InvalidInputError"]
    assert other["no_answer"] == "TierUnavailableError"
    assert other["opened_tier"] is False


# ---------------------------------------------------------------------------- the ranks


def _expected(before: Any, source: Any, src: Any, dst: Any, loaded: Any) -> list[Any]:
    """``before`` with each loaded token's latent copied from its source slot."""
    out = [t.clone() for t in before]
    for i in range(len(loaded)):
        if loaded[i] and int(dst[i]) >= 0:
            sb, so = divmod(int(src[i]), BLOCK_SIZE)
            db, do = divmod(int(dst[i]), BLOCK_SIZE)
            for o, s in zip(out, source, strict=True):
                o[db, do] = s[sb, so]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return all(
        torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True)
    )


async def _rank_main(rank: int, store: Any, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from lmcache_async import CacheEngine, EngineConfig, KVLayout
    from lmcache_async.engine.distributed import (
        lookup_first_rank,
        retrieve_broadcast,
        store_first_rank,
    )
    from lmcache_async.errors import InvalidInputError

    group = dist.new_group([0, 1], backend="gloo")
    layout = KVLayout.mla(
        num_layers=NUM_LAYERS,
        block_size=BLOCK_SIZE,
        latent_dim=LATENT,
        dtype=torch.bfloat16,
        tp_world_size=2,
        tp_rank=rank,
    )
    gen = torch.Generator().manual_seed(7)  # the same source KV on both ranks
    source = layout.allocate_kv_caches(NUM_BLOCKS, generator=gen)
    tokens = [int(t) for t in torch.randint(0, 50_000, (N,), generator=gen)]
    src_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:N]
    mine = torch.Generator().manual_seed(100 + rank)  # each rank's own target and slots
    target = layout.allocate_kv_caches(NUM_BLOCKS, generator=mine)
    dst_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=mine)[:N]
    if rank == 1:
        dst_slots[SKIPPED_ON_RANK_1] = -1
    result: dict[str, Any] = {}

    async def run(engine: CacheEngine | None) -> None:
        result["stored"] = await store_first_rank(
            engine, group, tokens, kv_caches=source, slot_mapping=src_slots
        )
        result["hits"] = await lookup_first_rank(engine, group, tokens)
        before = [t.clone() for t in target]
        mask = await retrieve_broadcast(
            engine,
            group,
            tokens,
            layout=layout,
            kv_caches=target,
            slot_mapping=dst_slots,
            piece_tokens=CHUNK,  # four pieces
        )
        result["mask"] = mask.tolist()
        result["exact"] = _same(target, _expected(before, source, src_slots, dst_slots, mask))

        other_tokens = [t + 1 for t in tokens]
        before = [t.clone() for t in target]
        miss = await retrieve_broadcast(
            engine, group, other_tokens, layout=layout, kv_caches=target, slot_mapping=dst_slots
        )
        result["miss"] = miss.tolist()
        result["miss_exact"] = _same(target, before)

        asked = tokens if rank == 0 else tokens[:-1]
        try:
            got = await retrieve_broadcast(
                engine,
                group,
                asked,
                layout=layout,
                kv_caches=target,
                slot_mapping=dst_slots[: len(asked)],
            )
            result["mismatch"] = got.tolist()
        except InvalidInputError as exc:
            result["mismatch"] = type(exc).__name__

        # Refused before any collective: no rank waits on them.
        refused = []
        flash = KVLayout.vllm_flash_attn(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.bfloat16,
        )
        try:
            await retrieve_broadcast(
                engine, group, tokens, layout=flash, kv_caches=target, slot_mapping=dst_slots
            )
        except InvalidInputError as exc:
            refused.append(type(exc).__name__)
        if rank == 0:
            try:  # rank 0 without its engine
                await lookup_first_rank(None, group, tokens)
            except InvalidInputError as exc:
                refused.append(type(exc).__name__)
        result["refused"] = refused

    if rank == 0:
        config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
        async with CacheEngine.open(config, layout, model_name="mla-tp") as engine:
            await run(engine)
        # Rank 1 now calls alone; keep the group up until it has seen the timeout.
        store.wait(["no_answer_seen"], datetime.timedelta(seconds=60))
    else:
        await run(None)
        from lmcache_async.errors import TierUnavailableError

        try:
            await retrieve_broadcast(
                None,
                group,
                tokens,
                layout=layout,
                kv_caches=target,
                slot_mapping=dst_slots,
                timeout=1.0,
            )
            result["no_answer"] = "answered"
        except TierUnavailableError as exc:
            result["no_answer"] = type(exc).__name__
        store.set("no_answer_seen", "1")
        result["opened_tier"] = False
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def _forbid_cache_on_this_rank() -> None:
    """Make every way of holding cache memory or a tier fail in this process."""
    from lmcache_async import engine as engine_module
    from lmcache_async.backends import cpu
    from lmcache_async.memory import pool as memory

    def forbidden(*args: object, **kwargs: object) -> None:
        raise RuntimeError("rank 1 opened a cache tier")

    memory.MemoryPool.__init__ = forbidden  # type: ignore[method-assign]
    cpu.CPUBackend.__init__ = forbidden  # type: ignore[method-assign]
    engine_module.CacheEngine.__init__ = forbidden  # type: ignore[method-assign]


def _main() -> None:
    import anyio
    import torch.distributed as dist

    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1:
        _forbid_cache_on_this_rank()
    try:
        anyio.run(_rank_main, rank, store, out_dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
