"""Stand-ins for torch.cuda's streams and events, for testing the CUDA copy path's order
of calls on a machine without a GPU.

:func:`install` puts them in place of ``torch.cuda.Stream``, ``Event``, ``stream`` and
``current_stream``; every call the copy path makes on them is appended to
:attr:`FakeCuda.log` as a tuple, so a test reads the order in which a copy waited,
ran and recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

__all__ = ["FakeCuda", "install"]

CUDA = torch.device("cuda", 0)


class FakeCuda:
    """The fakes of one test and what was asked of them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.synced: list[str] = []  # events synchronize()d (the bridge's thread)
        self.fail_record = 0  # the next this many Event.record() calls raise
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

    def work(self, jobs: list[Any]) -> None:
        """A copy: logs the stream it runs on and the thread that runs it."""
        self.log.append(("work", self.current_stream().name, threading.current_thread().name))


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Put a fresh set of fakes in place of torch.cuda's (undone with ``monkeypatch``)."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", cuda.Stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    return cuda
