"""What the scheduler's two lookup clients share (:class:`ClientCore`): argument checks,
request building, matching replies to requests, and turning the ranks' replies into a
result (:class:`Call`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import zmq

from lmcache_async.engine.client import Promise, check_promise_wait
from lmcache_async.errors import EngineClosedError, InvalidInputError, ProtocolError
from lmcache_async.keys.key_input import check_key_input
from lmcache_async.keys.tokens import Tokens, is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup.endpoint import LookupId, check_lookup_id, lookup_endpoint
from lmcache_async.rpc.protocol import (
    ErrorCode,
    FrameLike,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
    hashes_to_wire,
    put_tenant,
    tokens_payload,
)

__all__ = ["DEFAULT_LOOKUP_TIMEOUT", "Call", "ClientCore"]

log = get_logger(__name__)

T = TypeVar("T")

DEFAULT_LOOKUP_TIMEOUT: Final = 1.0
"""Seconds a client waits for all ranks before counting the silent ones as 0 hits."""

_RECONNECT_IVL_MS: Final = 100


@dataclass(slots=True)
class Call(Generic[T]):
    """One request fanned out to every rank: its frames, and how the replies become a result.

    ``finisher`` gets the call and one entry per rank: the reply, or None for a rank that
    did not answer.
    """

    op: str
    request_id: int
    frames: list[bytes | memoryview] | None  # None: answered without asking the ranks
    expected: MessageType
    finisher: Callable[[Call[T], list[Message | None]], T]

    def finish(self, replies: list[Message | None]) -> T:
        return self.finisher(self, replies)


class ClientCore:
    """What both clients share: validation, message building, reply matching, results."""

    def __init__(
        self,
        instance_id: str,
        world_size: int,
        socket_dir: str | None,
        timeout: float,
        limits: MessageLimits,
    ) -> None:
        if not is_strict_int(world_size) or world_size <= 0:
            raise InvalidInputError(f"world_size must be a positive int, got {world_size!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise InvalidInputError(f"timeout must be a positive number of seconds: {timeout!r}")
        if not isinstance(limits, MessageLimits):
            raise InvalidInputError("limits must be a MessageLimits")
        self.endpoints = [lookup_endpoint(instance_id, r, socket_dir) for r in range(world_size)]
        self.timeout = float(timeout)
        self.limits = limits
        self._ids = itertools.count(1)
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the lookup client is closed")

    def configure(self, socket: zmq.Socket[Any], rank: int) -> None:
        """DEALER options, then connect. ``IMMEDIATE`` queues nothing for a rank that is not
        connected, so no stale request reaches a worker that restarts later."""
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        socket.connect(self.endpoints[rank])

    def match(self, frames: Sequence[FrameLike], call: Call[Any], rank: int) -> Message | None:
        """The reply to ``call`` among received frames; None for anything else (a stale
        reply to an earlier, abandoned request, or garbage), which the caller drops."""
        try:
            message = decode(
                frames,
                max_header_bytes=self.limits.max_header_bytes,
                max_payload_bytes=self.limits.max_payload_bytes,
            )
        except ProtocolError as exc:
            log.warning("lookup_bad_reply", rank=rank, reason=str(exc))
            return None
        if message.request_id != call.request_id:
            log.debug("lookup_stale_reply", rank=rank, request_id=message.request_id)
            return None
        return message

    def timed_out(self, call: Call[Any], rank: int) -> None:
        log.warning(
            "lookup_rank_timeout",
            op=call.op,
            rank=rank,
            endpoint=self.endpoints[rank],
            timeout_s=self.timeout,
        )

    def _result(self, call: Call[Any], rank: int, reply: Message | None) -> Message | None:
        """A rank's reply of the expected type, or None (logged) when it failed.

        Raises:
            InvalidInputError: the rank refused the request's arguments.
        """
        if reply is None:
            return None
        if reply.type is MessageType.ERROR:
            code = reply.header.get("code")
            text = str(reply.header.get("message", ""))
            if code == ErrorCode.INVALID_INPUT:
                raise InvalidInputError(f"rank {rank}: {text}")
            log.warning("lookup_rank_error", op=call.op, rank=rank, code=code, message=text)
            return None
        if reply.type is not call.expected:
            log.warning("lookup_unexpected_reply", op=call.op, rank=rank, type=reply.type.name)
            return None
        return reply

    def _call(
        self,
        op: str,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object],
        finish: Callable[[Call[T], list[Message | None]], T],
    ) -> Call[T]:
        request_id = next(self._ids)
        frames = encode(msg_type, header, payloads, request_id=request_id)
        return Call(op, request_id, frames, msg_type, finish)

    def lookup(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        lookup_id: LookupId | None,
        pin: bool,
        *,
        tenant: str | None = None,
    ) -> Call[int]:
        self.check_open()
        if not isinstance(pin, bool):
            raise InvalidInputError(f"pin must be a bool, got {type(pin).__name__}")
        header: dict[str, Any] = {"pin": pin}
        if lookup_id is not None:
            header["lookup_id"] = check_lookup_id(lookup_id)
        elif pin:
            raise InvalidInputError("pin=True needs a lookup_id")
        put_tenant(header, tenant)
        payloads: list[memoryview] = []
        ends = check_key_input(tokens, hashes, offsets)
        if ends is not None:
            assert hashes is not None  # check_key_input: offsets come with hashes
            header["hashes"] = hashes_to_wire(hashes)
            header["offsets"] = ends
        else:
            assert tokens is not None
            payloads.append(tokens_payload(tokens))
        call = self._call("lookup", MessageType.LOOKUP, header, payloads, self._finish_lookup)
        if (hashes is not None and not header["hashes"]) or (payloads and not payloads[0].nbytes):
            call.frames = None  # nothing to look up: 0 hits without a round trip
        return call

    def promise(
        self,
        tokens: Tokens,
        lookup_id: LookupId,
        *,
        tenant: str | None,
        computed_tokens: int,
        finish: bool,
        wait: float = 0.0,
    ) -> Call[Promise]:
        """A promise (:meth:`CacheEngine.promise <lmcache_async.CacheEngine.promise>`) of
        every rank: a LOOKUP with ``"promise": true``."""
        self.check_open()
        if not is_strict_int(computed_tokens) or computed_tokens < 0:
            raise InvalidInputError(f"computed_tokens must be an int >= 0, got {computed_tokens!r}")
        if not isinstance(finish, bool):
            raise InvalidInputError(f"finish must be a bool, got {type(finish).__name__}")
        header: dict[str, Any] = {
            "promise": True,
            "lookup_id": check_lookup_id(lookup_id),
            "computed": computed_tokens,
            "finish": finish,
        }
        if check_promise_wait(wait):
            header["wait"] = wait
        put_tenant(header, tenant)
        check_key_input(tokens, None, None)
        payload = tokens_payload(tokens)
        call = self._call("promise", MessageType.LOOKUP, header, [payload], self._finish_promise)
        if not payload.nbytes:
            call.frames = None  # nothing to promise: no round trip
        return call

    def _finish_promise(self, call: Call[Promise], replies: list[Message | None]) -> Promise:
        """The ranks' promises together: the fewest tokens, pending while any rank is (a
        rank that did not answer promises nothing and is not waited for)."""
        if call.frames is None:
            return Promise(0, False)
        hits = self._finish_lookup(call, replies)
        pending = False
        for reply in replies:
            if reply is not None and reply.type is MessageType.LOOKUP:
                pending = pending or reply.header.get("pending") is True
        return Promise(hits, pending)

    def _finish_lookup(self, call: Call[Any], replies: list[Message | None]) -> int:
        if call.frames is None:
            return 0
        hits: list[int] = []
        for rank, reply in enumerate(replies):
            message = self._result(call, rank, reply)
            value = message.header.get("hits") if message is not None else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                log.warning("lookup_bad_reply", rank=rank, reason="'hits' is not an int >= 0")
                value = 0
            hits.append(value)
        return min(hits)

    def unpin(self, lookup_id: LookupId) -> Call[None]:
        self.check_open()
        header = {"lookup_id": check_lookup_id(lookup_id)}
        return self._call("unpin", MessageType.UNPIN, header, (), self._finish_all)

    def _finish_all(self, call: Call[None], replies: list[Message | None]) -> None:
        for rank, reply in enumerate(replies):
            self._result(call, rank, reply)

    def ping(self) -> Call[list[bool]]:
        self.check_open()
        return self._call("ping", MessageType.PING, None, (), self._finish_ping)

    def _finish_ping(self, call: Call[list[bool]], replies: list[Message | None]) -> list[bool]:
        return [self._result(call, rank, reply) is not None for rank, reply in enumerate(replies)]

    def stats(self) -> Call[list[dict[str, Any] | None]]:
        self.check_open()
        return self._call("stats", MessageType.STATS, None, (), self._finish_stats)

    def _finish_stats(
        self, call: Call[list[dict[str, Any] | None]], replies: list[Message | None]
    ) -> list[dict[str, Any] | None]:
        result: list[dict[str, Any] | None] = []
        for rank, reply in enumerate(replies):
            message = self._result(call, rank, reply)
            stats = message.header.get("stats") if message is not None else None
            result.append(stats if isinstance(stats, dict) else None)
        return result
