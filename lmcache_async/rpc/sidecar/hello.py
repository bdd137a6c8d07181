"""HELLO, HEARTBEAT and PING: how a client opens its session and keeps it alive.

The HELLO reply (the *welcome*) tells the client everything it needs to work with this
sidecar: the shared-memory segment (when the client is on this host), the chunk size, the
heartbeat interval and session timeout, the tiers, the namespace served and how chunk keys
are hashed (so the client can look up by digests).
"""

from __future__ import annotations

import os
import socket as socketlib
import time
from typing import Any

from lmcache_async.logging import get_logger
from lmcache_async.rpc.protocol import Message
from lmcache_async.rpc.sidecar.fields import label_field
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session, Sessions
from lmcache_async.rpc.sidecar.settings import SidecarNamespace, SidecarSettings
from lmcache_async.rpc.transport import boot_id

__all__ = ["SessionHandlers"]

log = get_logger(__name__)


class SessionHandlers:
    """The session requests of one sidecar (``instance``), whose arena is the segment
    ``segment_name`` of ``segment_bytes``."""

    def __init__(
        self,
        settings: SidecarSettings,
        host: EngineHost,
        sessions: Sessions,
        *,
        instance: str,
        segment_name: str,
        segment_bytes: int,
    ) -> None:
        self._settings = settings
        self._host = host
        self._sessions = sessions
        self._instance = instance
        self._segment_name = segment_name
        self._segment_bytes = segment_bytes
        self._host_name = socketlib.gethostname()
        self._boot_id = boot_id()

    async def on_hello(self, session: Session | None, message: Message) -> Reply:
        """Open the engine for the namespace asked for (the first client fixes it), keep
        the session and welcome the client.

        Raises:
            ProtocolError: the client's name (``"client"``) is neither a str nor an int.
            InvalidInputError: a malformed namespace, or not the one served; a client name
                longer than :data:`~.fields.MAX_ID_CHARS`.
        """
        assert session is not None
        header = message.header
        label = label_field(header, "client", session.identity.hex())
        namespace = SidecarNamespace.from_wire(header)
        engine = await self._host.open(namespace)
        session.label = label
        session.last_seen = time.monotonic()
        self._sessions.add(session)
        settings = self._settings
        host, boot = header.get("host"), header.get("boot_id")
        same_host = settings.listen.startswith("ipc://") or (
            host == self._host_name and boot is not None and boot == self._boot_id
        )
        log.info("sidecar_client_hello", client=session.label, shared_memory=same_host)
        config = engine.config
        reply = {
            "server": self._instance,
            "pid": os.getpid(),
            "shm": self._segment_name if same_host else None,
            "shm_bytes": self._segment_bytes,
            "chunk_size": config.chunk_size,
            "save_unfull_chunk": config.save_unfull_chunk,
            "heartbeat_interval": settings.heartbeat_interval,
            "client_timeout": settings.session_timeout,
            "max_payload_bytes": settings.limits.max_payload_bytes,
            "tiers": list(engine.stats().tiers),
            "namespace": (self._host.namespace or namespace).to_wire(),
            # Enough for a client to compute chunk keys itself and look up by digests.
            "hash_algorithm": engine.key_hasher.algorithm.value,
            "key_seed": engine.key_hasher.seed,
        }
        return reply, ()

    async def on_heartbeat(self, session: Session | None, message: Message) -> Reply:
        return self.heartbeat_now(session, message), ()

    def heartbeat_now(self, session: Session | None, message: Message) -> dict[str, Any]:
        engine = self._host.engine
        return {"server": self._instance, "healthy": engine is not None and engine.is_healthy()}

    async def on_ping(self, session: Session | None, message: Message) -> Reply:
        return self.ping_now(session, message), ()

    def ping_now(self, session: Session | None, message: Message) -> dict[str, Any]:
        return {"server": self._instance}
