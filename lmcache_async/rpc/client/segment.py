"""The server's arena segment mapped into a client on the same host.

KV payloads are copied straight into and out of the server's memory through it; a client
on another host gets no segment and sends payloads inline.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

import torch

from lmcache_async.errors import ProtocolError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.wire import Unavailable

__all__ = ["Segment"]

log = get_logger(__name__)


class Segment:
    """The server's arena segment mapped into this process.

    Requests borrow it (:meth:`use`); once retired (the server restarted or the client
    closed) it is unmapped when the last borrower is done, so no copy ever writes into
    memory that is gone.

    Raises:
        OSError: the segment cannot be opened (another host, or it is already gone).
    """

    def __init__(self, name: str, nbytes: int, *, owner_pid: int | None) -> None:
        if sys.version_info >= (3, 13):
            self._segment = shared_memory.SharedMemory(name=name, track=False)
        else:
            self._segment = shared_memory.SharedMemory(name=name)
            # Before 3.13 an attached segment is registered with this process's resource
            # tracker, which would unlink the server's segment when this process exits.
            # A server in this very process shares the tracker and keeps its registration.
            if owner_pid != os.getpid():
                resource_tracker.unregister(self._segment._name, "shared_memory")  # type: ignore[attr-defined]
        if self._segment.size < nbytes:
            self._segment.close()
            raise OSError(f"segment {name} holds {self._segment.size} bytes, expected {nbytes}")
        self.name = name
        self._arena: torch.Tensor | None = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        self._users = 0
        self._retired = False

    def view(
        self, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The payload at ``offset`` as a ``shape``/``dtype`` tensor in the segment.

        Raises:
            Unavailable: the segment is unmapped (retired).
            ProtocolError: the payload lies outside the segment.
        """
        if self._arena is None:
            raise Unavailable("the shared-memory segment is unmapped")
        if offset < 0 or offset + nbytes > self._arena.numel():
            raise ProtocolError(f"payload [{offset}, +{nbytes}) lies outside the segment")
        return self._arena[offset : offset + nbytes].view(dtype).view(shape)

    @contextlib.contextmanager
    def use(self) -> Iterator[Segment]:
        """Borrow the segment: it stays mapped until the ``with`` block ends."""
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            self._close_if_done()

    def retire(self) -> None:
        """Unmap the segment once the last borrower is done."""
        self._retired = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if not self._retired or self._users or self._arena is None:
            return
        self._arena = None
        try:
            self._segment.close()
        except BufferError:
            log.debug("sidecar_segment_still_mapped", name=self.name)
