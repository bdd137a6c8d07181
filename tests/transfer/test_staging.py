"""The staging buffer of staged transfers: reused between batches, grown as needed, freed on
close, and on CUDA ordered between the streams that take turns with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.transfer.staging import DEFAULT_STAGING_BYTES, StagingBuffer
from tests.fake_cuda import install

MIB = 1024**2


def test_the_buffer_is_reused_and_grows_only_when_a_batch_needs_more() -> None:
    staging = StagingBuffer("cpu", max_bytes=8 * MIB)
    assert staging.statistics() == (0, 0, 0)
    with staging.use(10) as first:
        assert first.dtype is torch.uint8
        assert first.numel() == MIB  # whole MiB
    with staging.use(MIB) as again:
        assert again.data_ptr() == first.data_ptr()
    assert staging.statistics() == (MIB, 2, 1)
    with staging.use(MIB + 1) as grown:
        assert grown.numel() == 2 * MIB
    with staging.use(3 * MIB):  # doubles, up to the bound
        pass
    assert staging.statistics().nbytes == 4 * MIB
    with staging.use(7 * MIB + 5):
        pass
    assert staging.statistics() == (8 * MIB, 5, 4)
    with staging.use(20 * MIB):  # a payload larger than the bound still goes through
        pass
    assert staging.statistics().nbytes == 20 * MIB
    staging.close()


def test_closing_frees_the_buffer_and_refuses_further_uses() -> None:
    with StagingBuffer("cpu") as staging:
        with staging.use(100) as buffer:
            assert buffer.numel() == MIB
        assert staging.max_bytes == DEFAULT_STAGING_BYTES
        assert staging.host_granule is None
    assert staging.closed
    assert staging.statistics().nbytes == 0
    staging.close()  # idempotent
    with pytest.raises(EngineClosedError, match="staging buffer is closed"), staging.use(1):
        pass


def test_a_failure_in_a_use_releases_the_buffer_for_the_next() -> None:
    staging = StagingBuffer("cpu")
    with pytest.raises(RuntimeError, match="boom"), staging.use(1):
        raise RuntimeError("boom")
    with staging.use(1):
        assert staging.statistics().uses == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_bytes": 0}, "max_bytes: expected a positive int"),
        ({"max_bytes": True}, "max_bytes"),
        ({"max_bytes": 1.5}, "max_bytes"),
        ({"host_granule": 100}, "host_granule: expected None or a positive multiple of 256"),
        ({"host_granule": 0}, "host_granule"),
        ({"host_granule": False}, "host_granule"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        StagingBuffer("cpu", **kwargs)


def test_on_cuda_a_use_on_another_stream_waits_for_the_last_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A buffer taken by the load stream after the store stream queued copies on it waits
    for those copies, and is made known to the allocator for that stream (once)."""
    cuda = install(monkeypatch)
    recorded: list[str] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s.name))
    staging = StagingBuffer("cpu")
    staging._cuda = True  # as on a CUDA device, its tensors on the CPU
    store, load = cuda.Stream(name="store"), cuda.Stream(name="load")

    with cuda.stream(store), staging.use(1):
        cuda.log.append(("work", "store"))
    with cuda.stream(store), staging.use(1):
        cuda.log.append(("work", "store"))
    with cuda.stream(load), staging.use(1):
        cuda.log.append(("work", "load"))
    with cuda.stream(load), staging.use(1):
        cuda.log.append(("work", "load"))
    with cuda.stream(store), staging.use(1):
        cuda.log.append(("work", "store"))

    event = cuda.log[1][1]  # one event, recorded again behind each use
    assert cuda.log == [
        ("work", "store"),
        ("record", event, "store"),
        ("work", "store"),
        ("record", event, "store"),
        ("wait", "load", event),
        ("work", "load"),
        ("record", event, "load"),
        ("work", "load"),
        ("record", event, "load"),
        ("wait", "store", event),
        ("work", "store"),
        ("record", event, "store"),
    ]
    assert recorded == ["load"]  # allocated on the store stream, used on load once


def test_on_cuda_a_grown_buffer_belongs_to_the_stream_it_was_allocated_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = install(monkeypatch)
    recorded: list[str] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s.name))
    staging = StagingBuffer("cpu")
    staging._cuda = True
    store, load = cuda.Stream(name="store"), cuda.Stream(name="load")
    with cuda.stream(store), staging.use(1):
        pass
    with cuda.stream(load), staging.use(2 * 1024**2):  # grows: a new tensor, on load
        pass
    with cuda.stream(load), staging.use(1):
        pass
    with cuda.stream(store), staging.use(1):
        pass
    assert recorded == ["store"]
    assert staging.statistics().allocations == 2
