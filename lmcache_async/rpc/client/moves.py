"""Moves between instances, client side: PUSH (the receiving half of
:meth:`CacheEngine.move <lmcache_async.CacheEngine.move>`: payloads with their checksums,
verified by the sidecar) and MOVE (the sidecar's engine moves a prefix to another one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from lmcache_async.backends.record import tensor_bytes
from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.tokens import Tokens, is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import Unavailable, count, key_fields
from lmcache_async.rpc.protocol import MessageType
from lmcache_async.tenancy.tenants import check_tenant

__all__ = ["Moves", "check_move_target"]

log = get_logger(__name__)

_MOVE_WAIT_FACTOR: Final = 10  # a move's default wait, in request timeouts
_CHECKSUM_LIMIT: Final = 1 << 64


class Moves:
    """PUSH and MOVE requests over ``conn``."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def push_chunks(
        self,
        tokens: Tokens,
        payloads: Sequence[torch.Tensor | bytes | bytearray | memoryview],
        *,
        checksums: Sequence[int],
        start: int,
        location: str | None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`RemoteCacheEngine.push_chunks`.

        Raises:
            InvalidInputError: bad input, or a tier the sidecar does not have.
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        header, frames, _ = key_fields(tokens, None, None)
        if not is_strict_int(start) or start < 0:
            raise InvalidInputError(f"start must be an int >= 0, got {start!r:.40}")
        sums = _check_checksums(checksums)
        given: object = payloads
        if isinstance(given, (torch.Tensor, bytes, bytearray, memoryview)) or not isinstance(
            given, Sequence
        ):
            raise InvalidInputError("payloads must be a sequence of tensors or bytes")
        if len(sums) != len(payloads):
            raise InvalidInputError(
                f"got {len(payloads)} payloads but {len(sums)} checksums; they must match"
            )
        frames.extend(_payload_bytes(payload, index) for index, payload in enumerate(payloads))
        header["start"] = start
        header["checksums"] = sums
        if tenant is not None:
            header["tenant"] = check_tenant(tenant)
        header["timeout"] = conn.timeout
        if location is not None:
            header["store_location"] = check_tiers(conn.welcome, [location], "location")
        if not payloads:
            return 0
        link = await conn.usable()
        if link is None:
            log.warning("sidecar_push_unreachable", url=conn.url)
            return 0
        try:
            return count(await conn.ask(link, MessageType.PUSH, header, frames), "stored")
        except (Unavailable, ProtocolError) as exc:
            log.warning("sidecar_push_failed", url=conn.url, error=str(exc))
            return 0

    async def move(
        self,
        tokens: Tokens,
        old_position: str,
        new_position: tuple[str, str] | Sequence[str],
        copy: bool,
        *,
        timeout: float | None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`RemoteCacheEngine.move`.

        Raises:
            InvalidInputError: bad tokens, ``old_position`` is not a tier of this sidecar,
                ``new_position`` is not a (URL, tier) pair, or the target refused it.
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        header, payloads, num_tokens = key_fields(tokens, None, None)
        if not isinstance(old_position, str):
            raise InvalidInputError(
                f"old_position must be a tier name, got {type(old_position).__name__}"
            )
        check_tiers(conn.welcome, [old_position], "old_position")
        url, location = check_move_target(new_position)
        if not isinstance(copy, bool):
            raise InvalidInputError(f"copy must be a bool, got {type(copy).__name__}")
        wait = _MOVE_WAIT_FACTOR * conn.timeout if timeout is None else timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")
        header["old_position"] = old_position
        header["new_position"] = [url, location]
        header["copy"] = copy
        header["timeout"] = conn.timeout
        header["tenant"] = check_tenant(tenant) if tenant is not None else conn.tenant
        link = await conn.usable()
        if link is None:
            log.warning("sidecar_move_unreachable", url=conn.url)
            return 0
        if num_tokens == 0:
            return 0
        conn.counters.requests += 1
        try:
            reply = await link.request(MessageType.MOVE, header, payloads, timeout=float(wait))
            return count(reply, "moved")
        except (Unavailable, ProtocolError) as exc:
            log.warning("sidecar_move_failed", url=conn.url, target=url, error=str(exc))
            return 0


def check_move_target(new_position: object) -> tuple[str, str]:
    """The ``(url, location)`` a move goes to, checked: the target sidecar's ``ipc://`` or
    ``tcp://`` URL and the name of its tier to write (whether it has that tier is known
    only once it answers).

    Raises:
        InvalidInputError: not a pair of a sidecar URL and a tier name.
    """
    if (
        isinstance(new_position, (str, bytes, bytearray))
        or not isinstance(new_position, Sequence)
        or len(new_position) != 2
    ):
        raise InvalidInputError(
            "new_position must be a (url, location) pair such as ('ipc:///tmp/b.sock', 'cpu'),"
            f" got {new_position!r:.80}"
        )
    url, location = new_position
    if (
        not isinstance(url, str)
        or not url.startswith(("ipc://", "tcp://"))
        or len(url) <= len("tcp://")
    ):
        raise InvalidInputError(
            f"new_position's url must be ipc://PATH or tcp://HOST:PORT, got {url!r:.80}"
        )
    if not isinstance(location, str) or not location:
        raise InvalidInputError(
            f"new_position's location must be a tier name, got {location!r:.40}"
        )
    return url, location


def _check_checksums(checksums: object) -> list[int]:
    """Payload checksums as a list of unsigned 64-bit ints. Raises InvalidInputError."""
    if isinstance(checksums, (str, bytes, bytearray)) or not isinstance(checksums, Sequence):
        raise InvalidInputError(f"checksums must be a sequence, got {type(checksums).__name__}")
    sums = list(checksums)
    for index, value in enumerate(sums):
        if not is_strict_int(value) or not 0 <= value < _CHECKSUM_LIMIT:
            raise InvalidInputError(
                f"checksums[{index}] must be an unsigned 64-bit int, got {value!r:.40}"
            )
    return sums


def _payload_bytes(payload: object, index: int) -> memoryview:
    """The raw bytes of one pushed payload (a view, no copy). Raises InvalidInputError."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu" or not payload.is_contiguous():
            raise InvalidInputError(f"payloads[{index}] must be a contiguous CPU tensor")
        return tensor_bytes(payload)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        view = memoryview(payload)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    raise InvalidInputError(
        f"payloads[{index}] must be a tensor or bytes, got {type(payload).__name__}"
    )
