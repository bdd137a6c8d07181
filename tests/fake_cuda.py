"""Stand-ins for torch.cuda's streams and events, for testing the CUDA copy path's order
of calls on a machine without a GPU.

:func:`install` puts them in place of ``torch.cuda.Stream``, ``Event``, ``stream`` and
``current_stream``; every call the copy path makes on them is appended to
:attr:`FakeCuda.log` as a tuple, so a test reads the order in which a copy waited,
ran and recorded.

Two more pieces, asked for by the tests that need them:

- :meth:`FakeCuda.count_ops` wraps the torch operations the transfer code issues (the
  indexing kernels and ``copy_``) and lists each in :attr:`FakeCuda.ops` with the stream
  it was issued on: on a device each is one kernel launch or one copy.
- ``install(..., host_device=True)`` runs the engine's CUDA path over CPU tensors: every
  :class:`~lmcache_async.transfer.plan.TransferPlan` reports the fake device, and the
  staging buffers :class:`~lmcache_async.transfer.cuda.Transfers` makes live on the host.
  :meth:`FakeCuda.hold` keeps every event from completing (``synchronize()`` blocks)
  until :meth:`FakeCuda.release`: what returns meanwhile did not wait for the GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmcache_async.transfer import cuda as transfer_cuda
from lmcache_async.transfer import staged
from lmcache_async.transfer.plan import TransferPlan
from lmcache_async.transfer.staging import StagingBuffer

__all__ = ["FakeCuda", "install"]

CUDA = torch.device("cuda", 0)


class FakeCuda:
    """The fakes of one test and what was asked of them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.synced: list[str] = []  # events synchronize()d (the bridge's thread)
        self.fail_record = 0  # the next this many Event.record() calls raise
        self.ops: list[tuple[str, str]] = []  # (operation, stream) once count_ops() is on
        self._gate = threading.Event()  # cleared by hold(): events do not complete
        self._gate.set()
        self._local = threading.local()
        names = itertools.count(1)
        cuda = self

        class Stream:
            def __init__(self, device: Any = None, *, name: str | None = None) -> None:
                self.device = CUDA
                self.name = name or f"stream{next(names)}"

            def wait_event(self, event: Any) -> None:
                cuda.log.append(("wait", self.name, event.name))

            def synchronize(self) -> None:
                cuda.log.append(("sync", self.name))

            def __repr__(self) -> str:
                return self.name

        class Event:
            def __init__(self) -> None:
                self.name = f"event{next(names)}"

            def record(self, stream: Any) -> None:
                if cuda.fail_record:
                    cuda.fail_record -= 1
                    raise RuntimeError("record failed")
                cuda.log.append(("record", self.name, stream.name))

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                if not cuda._gate.wait(timeout=30):
                    raise RuntimeError("a held event was never released")
                cuda.synced.append(self.name)

        self.Stream = Stream
        self.Event = Event
        self.default = Stream(name="default")

    def current_stream(self, device: Any = None) -> Any:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def hold(self) -> None:
        """Keep every event from completing until :meth:`release`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """:meth:`hold` for the block, released however it ends (an engine closing waits
        for the events it queued)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def count_ops(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """From now on list in :attr:`ops` every indexing kernel and ``copy_`` issued from
        Python, with the current stream: ``("copy_", stream)``, ``("index_copy_", ...)``,
        ``("index_select", ...)``, ``("index_put_", ...)``, ``("index", ...)`` (the staged
        path's batched gather, ``aten.index``), ``("cat", ...)``."""
        cuda = self

        def counted(name: str, fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                cuda.ops.append((name, cuda.current_stream().name))
                return fn(*args, **kwargs)

            return run

        for name in ("copy_", "index_copy_", "index_put_", "index_select"):
            monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "index_select", counted("index_select", torch.index_select))
        monkeypatch.setattr(torch, "cat", counted("cat", torch.cat))
        monkeypatch.setattr(staged, "_index_out", counted("index", staged._index_out))
        monkeypatch.setattr(staged, "_index", counted("index", staged._index))

    def launches(self) -> Counter[str]:
        """The operations listed by :meth:`count_ops`, by name."""
        return Counter(name for name, _ in self.ops)

    def work(self, jobs: list[Any]) -> None:
        """A copy: logs the stream it runs on and the thread that runs it."""
        self.log.append(("work", self.current_stream().name, threading.current_thread().name))


def install(monkeypatch: pytest.MonkeyPatch, *, host_device: bool = False) -> FakeCuda:
    """Put a fresh set of fakes in place of torch.cuda's (undone with ``monkeypatch``).

    With ``host_device`` the engine takes CPU caches for caches on the fake device: plans
    report :data:`CUDA` and the transfers' staging buffers are made on the host.
    """
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", cuda.Stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    if host_device:
        monkeypatch.setattr(TransferPlan, "device", property(lambda self: CUDA))

        def host_staging(device: Any, **kwargs: Any) -> StagingBuffer:
            return StagingBuffer("cpu", **kwargs)

        monkeypatch.setattr(transfer_cuda, "StagingBuffer", host_staging)
    return cuda
