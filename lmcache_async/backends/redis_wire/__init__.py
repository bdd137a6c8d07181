"""The Redis tier's bulk value path: ``GET`` and ``SET`` of chunk records on connections
of its own, the bytes of each value received into, and sent from, the memory where the
chunk lies (a pool page), with nothing assembled in between.

It also asks which keys exist (``EXISTS``, before a put's payloads and for a lookup).
redis-py keeps every other call (``UNLINK``, scripts, ``SCAN``, ``PING``) and the settings
this path reuses: the server's address, TLS context and credentials, a cluster's slot map.
:mod:`.stream` is one connection (an :class:`asyncio.BufferedProtocol` that hands the
transport the destination of the value being read), :mod:`.resp` the little of RESP2
spoken, :mod:`.endpoints` where to connect and how to log in, :mod:`.gets`, :mod:`.sets`
and :mod:`.exists` the pipelined loops, :mod:`.client` the connections kept and a cluster
call split by node, :mod:`.overlap` tasks run side by side.
What a record is (header, checksum, codec) stays with the callers
(:mod:`lmcache_async.backends.redis_records`): this package moves bytes.

May import: the ground floor (``errors``, ``logging``) and redis-py. Never the rest of
``backends`` or the data model.
"""

from __future__ import annotations

from .client import MAX_IDLE, WireClient
from .gets import BulkValue, ValueSink
from .overlap import concurrently
from .sets import Encode, Outgoing, Replied
from .stream import SCRATCH_BYTES, WRITE_PIECE, WireStream

__all__ = [
    "MAX_IDLE",
    "SCRATCH_BYTES",
    "WRITE_PIECE",
    "BulkValue",
    "Encode",
    "Outgoing",
    "Replied",
    "ValueSink",
    "WireClient",
    "WireStream",
    "concurrently",
]
