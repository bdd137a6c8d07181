"""MOVE: the sidecar's engine sends a tenant's prefix to another sidecar.

A move makes this sidecar connect out and write to another cache, so it is an admin's
request (the route says so) and goes only to a target on the operator's allow-list
(``--move-targets URL=KEYFILE``): over CURVE with the target's public key, proving itself
with this sidecar's own key pair (its public certificate goes in the target's
``--curve-clients``), or in the clear to a target on this host listed without a key. The
chunks are the tenant's the request names (none: the engine's own), and the target is
asked for that same tenant.
"""

from __future__ import annotations

from typing import Any

import zmq

from lmcache_async.errors import PermissionDeniedError, ProtocolError
from lmcache_async.rpc.client import check_move_target
from lmcache_async.rpc.move import move
from lmcache_async.rpc.protocol import Message, tenant_of, tokens_from_payload
from lmcache_async.rpc.sidecar.fields import flag_field, seconds_field
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session
from lmcache_async.rpc.sidecar.settings import SidecarSettings

__all__ = ["MoveHandler"]


class MoveHandler:
    """MOVE requests on the engine ``host`` holds, to the targets ``settings`` allow."""

    def __init__(self, settings: SidecarSettings, host: EngineHost) -> None:
        self._host = host
        self._targets = settings.move_targets
        self._max_timeout = settings.max_request_timeout
        secret = settings.curve_secret_key
        self._own_keys = None if secret is None else (zmq.curve_public(secret), secret)

    async def on_move(self, session: Session | None, message: Message) -> Reply:
        """Move a prefix; answers ``{"moved": tokens}``.

        Raises:
            PermissionDeniedError: the target is not on the allow-list.
            ProtocolError: not exactly one token frame.
            InvalidInputError: bad tokens, positions (checked before the allow-list, so
                the message says what is malformed), tenant or timeout.
        """
        engine = self._host.need_engine()
        header = message.header
        if len(message.payloads) != 1:
            raise ProtocolError("a move carries exactly one token frame")
        tokens = tokens_from_payload(message.payloads[0])
        # Both positions are checked by the engine, which names what is wrong.
        old_position: Any = header.get("old_position")
        new_position: Any = header.get("new_position")
        copy = flag_field(header, "copy", required=True)
        tenant = tenant_of(header)
        url, _ = check_move_target(new_position)
        if url not in self._targets:
            raise PermissionDeniedError(
                f"{url[:120]!r} is not a move target of this sidecar (--move-targets)"
            )
        server_key = self._targets[url]
        moved = await move(
            engine,
            tokens,
            old_position,
            new_position,
            copy,
            timeout=seconds_field(header, "timeout", self._max_timeout),
            tenant=tenant,
            server_public_key=server_key,
            client_certificate=None if server_key is None else self._own_keys,
        )
        return {"moved": moved}, ()
