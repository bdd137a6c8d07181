"""The request core's copies go through the transfers' staging buffer when there is one
(CUDA caches): a kernel per layer and part for the whole batch, the same bytes as the
per-chunk path. On a machine without a GPU the staging is offered for CPU caches here, so
the wiring runs as it does on CUDA."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
import torch

from lmcache_async.core.copy import gather, scatter
from lmcache_async.errors import EngineClosedError
from lmcache_async.transfer.cuda import Direction, Transfers
from lmcache_async.transfer.staging import StagingBuffer
from tests.transfer.test_staged import Batch, ops, same_kv


class StagedTransfers(Transfers):
    """Transfers that stage CPU copies too, as they do CUDA ones."""

    def __init__(self) -> None:
        super().__init__(inline_bytes=1 << 30)
        self.buffers: dict[Direction, StagingBuffer] = {}

    def staging(self, device: torch.device, direction: Direction) -> StagingBuffer | None:
        return self.buffers.setdefault(direction, StagingBuffer(device))


def run(coro_fn: object) -> Counter[str]:
    return ops(lambda: anyio.run(coro_fn))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["flash_nhd", "flash_hnd", "mla"])
def test_the_core_copies_a_batch_through_the_staging_buffer(kind: str) -> None:
    batch = Batch(kind, full=6)
    plain = Batch(kind, full=6)  # the same request, copied chunk by chunk
    transfers, direct = StagedTransfers(), Transfers(inline_bytes=1 << 30)
    try:
        counts = run(lambda: gather(transfers, batch.plan, batch.jobs(), timeout=5))
        anyio.run(lambda: gather(direct, plain.plan, plain.jobs(), timeout=5))
        assert all(torch.equal(a, b) for a, b in zip(batch.payloads, plain.payloads, strict=True))
        per_length = batch.parts * 3  # parts x layers, for the full chunks and the partial one
        assert counts["aten::index"] + counts["aten::index_select"] == 2 * per_length
        for payload in batch.payloads:
            payload.add_(1)
        for payload in plain.payloads:
            payload.add_(1)
        anyio.run(lambda: scatter(transfers, batch.plan, batch.jobs(), timeout=5))
        anyio.run(lambda: scatter(direct, plain.plan, plain.jobs(), timeout=5))
        assert same_kv(batch.kv, plain.kv)
        assert set(transfers.buffers) == {Direction.STORE, Direction.LOAD}
    finally:
        transfers.close()
        direct.close()


def test_cpu_transfers_have_no_staging_and_closed_ones_none_at_all() -> None:
    transfers = Transfers(inline_bytes=0)
    assert transfers.staging(torch.device("cpu"), Direction.STORE) is None
    transfers.close()
    with pytest.raises(EngineClosedError):
        transfers.staging(torch.device("cuda", 0), Direction.LOAD)
