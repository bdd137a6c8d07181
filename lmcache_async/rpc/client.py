"""The sidecar's client: :class:`RemoteCacheEngine`, the engine interface over ZeroMQ.

A serving-engine worker opens it like an embedded engine::

    async with RemoteCacheEngine.connect(url, layout, model_name="m") as engine:
        stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
        mask = await engine.retrieve(tokens, kv_caches=kv, slot_mapping=slots)

The KV copies run here, in the caller's process, through the same transfer plans as an
embedded engine; only chunk keys and offsets cross the socket. On the server's host the
payloads are the server's own memory (a shared-memory segment mapped here); from another
host they travel as inline frames.

Every request has a timeout. When the sidecar is down, slow or restarting, ``store``
returns 0, ``retrieve`` an all-False mask and ``lookup`` 0 (the serving engine recomputes),
and a background task says hello again until it is back (a restarted sidecar has a new
segment, which is mapped afresh). Bad input still raises InvalidInputError. Concurrent
calls from many tasks share one DEALER socket: requests carry ids and one receive loop
hands each reply to its caller. The client needs the asyncio event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import os
import secrets
import socket as socketlib
import sys
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import structlog
import torch
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup

from lmcache_async.backends.record import tensor_bytes
from lmcache_async.config import DEFAULT_INLINE_COPY_BYTES, DEFAULT_INLINE_HASH_TOKENS
from lmcache_async.cuda import Direction, Transfers
from lmcache_async.errors import (
    EngineClosedError,
    InvalidInputError,
    ProtocolError,
    TierUnavailableError,
)
from lmcache_async.keys import ChunkHasher, DigestGuess, HashAlgorithm, Namespace
from lmcache_async.layouts import KVCacheViews, KVLayout
from lmcache_async.rpc.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
    hashes_to_wire,
    tokens_payload,
)
from lmcache_async.rpc.transport import LoopSocket
from lmcache_async.tokens import Tokens, check_mask, is_strict_int
from lmcache_async.transfer import TransferPlan

__all__ = [
    "DEFAULT_CLIENT_LIMITS",
    "DEFAULT_RECONNECT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "RemoteCacheEngine",
    "check_move_target",
]

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT: Final = 5.0
"""Seconds any one request may take before it counts as a miss."""
DEFAULT_RECONNECT_INTERVAL: Final = 0.5
"""Seconds between hellos while the sidecar is unreachable."""
DEFAULT_CLIENT_LIMITS: Final = MessageLimits(max_header_bytes=4 << 20, max_payload_bytes=1 << 30)
"""Replies a client accepts: a 4 MiB header and 1 GiB of inline payload."""

_RECONNECT_IVL_MS: Final = 100
_PROBE_TIMEOUT_FLOOR: Final = 0.05
_ZERO_COPY_BYTES: Final = 4 << 20
_LATE_SEND: Final = 1.0  # seconds to hand back a transaction whose request timed out
_MOVE_WAIT_FACTOR: Final = 10  # a move's default wait, in request timeouts
_CHECKSUM_LIMIT: Final = 1 << 64
_DIGEST_MEMO_PROMPTS: Final = 8  # recent long prompts whose digests a client remembers

_T = TypeVar("_T")


class _Unavailable(Exception):
    """The request could not be served (no server, timeout, lost session): a miss."""


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


class _Segment:
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
        """The payload at ``offset`` as a ``shape``/``dtype`` tensor in the segment."""
        if self._arena is None:
            raise _Unavailable("the shared-memory segment is unmapped")
        if offset < 0 or offset + nbytes > self._arena.numel():
            raise ProtocolError(f"payload [{offset}, +{nbytes}) lies outside the segment")
        return self._arena[offset : offset + nbytes].view(dtype).view(shape)

    @contextlib.contextmanager
    def use(self) -> Iterator[_Segment]:
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            self._close_if_done()

    def retire(self) -> None:
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


def _optional(header: dict[str, Any], name: str, kind: type[_T]) -> _T | None:
    value = header.get(name)
    return value if isinstance(value, kind) else None


@dataclass(frozen=True, slots=True)
class _Welcome:
    """What the server said in its HELLO reply."""

    server: str
    pid: int | None
    shm: str | None
    shm_bytes: int
    chunk_size: int
    save_unfull_chunk: bool
    heartbeat_interval: float
    client_timeout: float
    tiers: tuple[str, ...]
    hash_algorithm: str | None = None
    key_seed: bytes | None = None

    @classmethod
    def parse(cls, header: dict[str, Any]) -> _Welcome:
        try:
            welcome = cls(
                server=str(header["server"]),
                pid=header.get("pid") if is_strict_int(header.get("pid")) else None,
                shm=header.get("shm"),
                shm_bytes=int(header["shm_bytes"]),
                chunk_size=int(header["chunk_size"]),
                save_unfull_chunk=bool(header["save_unfull_chunk"]),
                heartbeat_interval=float(header["heartbeat_interval"]),
                client_timeout=float(header["client_timeout"]),
                tiers=tuple(str(t) for t in header.get("tiers", ())),
                hash_algorithm=_optional(header, "hash_algorithm", str),
                key_seed=_optional(header, "key_seed", bytes),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed HELLO reply: {exc!r}") from None
        if welcome.shm is not None and not isinstance(welcome.shm, str):
            raise ProtocolError("malformed HELLO reply: 'shm' is not a name")
        if welcome.chunk_size <= 0 or welcome.heartbeat_interval <= 0:
            raise ProtocolError("malformed HELLO reply: non-positive chunk size or interval")
        return welcome


class _Link:
    """One DEALER socket and the session it holds with the server.

    Replies are read in the event loop's reader callback (:class:`LoopSocket`): each goes
    straight to the future of the request with its id; a reply nobody waits for (it came
    after its request timed out) is dropped, its transaction given back.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        url: str,
        identity: bytes,
        server_public_key: bytes | None,
        limits: MessageLimits,
    ) -> None:
        self.identity = identity
        self.url = url
        self._limits = limits
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        socket.setsockopt(zmq.IDENTITY, identity)
        if server_public_key is not None:
            public, secret = zmq.curve_keypair()
            socket.curve_serverkey = server_public_key
            socket.curve_publickey = public
            socket.curve_secretkey = secret
        socket.connect(url)
        self._socket = LoopSocket(socket, self._on_message)
        self._ids = itertools.count(1)
        # A future resolves to the reply, or to None when the link is closed.
        self._pending: dict[int, asyncio.Future[Message | None]] = {}
        # Each waiting request's deadline, and one timer for the earliest of them: with
        # requests of one timeout it is armed once per timeout, not once per request.
        self._deadlines: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.dead = False
        self.welcome: _Welcome | None = None
        self.segment: _Segment | None = None

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            message = decode(
                frames,
                max_header_bytes=self._limits.max_header_bytes,
                max_payload_bytes=self._limits.max_payload_bytes,
            )
        except ProtocolError as exc:
            log.warning("sidecar_bad_reply", reason=str(exc))
            return
        request_id = message.request_id
        if not isinstance(request_id, int):
            return
        future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(message)
        elif "txn" in message.header:
            self._give_back(message)

    def _give_back(self, reply: Message) -> None:
        """End the transaction of a reply that came after its request timed out, so the
        server does not hold its memory until the transaction's deadline (best effort: a
        message the socket cannot take now is left to that deadline)."""
        txn = reply.header["txn"]
        if reply.type is MessageType.STORE:
            frames = encode(MessageType.COMMIT, {"txn": txn, "abort": True})
        elif reply.type is MessageType.RETRIEVE:
            frames = encode(MessageType.RELEASE, {"txn": txn, "loaded": 0})
        else:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send_nowait(frames)

    async def request(
        self,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object] = (),
        *,
        timeout: float,
        meanwhile: Callable[[], object] | None = None,
    ) -> Message:
        """Send a request and wait for its reply; ``meanwhile`` is called once the
        request is on its way, before the wait.

        Raises:
            _Unavailable: the link is dead, the reply did not come in time, the server has
                no session for us or its engine is closed, or it failed internally.
            InvalidInputError: the server refused the request's input.
            ProtocolError: the server could not read the request.
        """
        if self.dead:
            raise _Unavailable("the link is down")
        request_id = next(self._ids)
        frames = encode(msg_type, header, payloads, request_id=request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        future: asyncio.Future[Message | None] = loop.create_future()
        self._pending[request_id] = future
        try:
            copy = _copy_frames(frames)
            if not self._socket.send_nowait(frames, copy=copy):
                async with asyncio.timeout_at(deadline):
                    await self._socket.send(frames, copy=copy)
            # The link's timer fails the future at the deadline: asyncio.timeout around
            # the await, or a timer per request, would cost every request far more.
            self._deadlines[request_id] = deadline
            if deadline < self._timer_at:
                self._arm(loop, deadline)
            if meanwhile is not None:
                meanwhile()
            reply = await future
        except TimeoutError:
            raise _Unavailable(f"no reply to {msg_type.name} within {timeout} s") from None
        except zmq.ZMQError as exc:
            raise _Unavailable(f"{msg_type.name} failed: {exc}") from None
        finally:
            self._pending.pop(request_id, None)
            self._deadlines.pop(request_id, None)
        if reply is None:
            raise _Unavailable(f"{msg_type.name}: the link was closed")
        if reply.type is MessageType.ERROR:
            _raise_error(msg_type, reply)
        if reply.type is not msg_type:
            raise ProtocolError(f"a {reply.type.name} reply to a {msg_type.name} request")
        return reply

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._expire_due, loop)

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the requests whose deadline has come; arm the timer for the next one."""
        self._timer, self._timer_at = None, math.inf
        now = loop.time()
        for request_id, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[request_id]
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_exception(TimeoutError())
        if self._deadlines:
            self._arm(loop, min(self._deadlines.values()))

    async def notify(self, msg_type: MessageType, header: dict[str, Any], timeout: float) -> None:
        """Send a message that gets no reply (RELEASE, an aborted COMMIT); best effort,
        bounded by ``timeout`` and shielded, so it is sent even by a cancelled caller."""
        if self.dead:
            return
        frames = encode(msg_type, header)
        try:
            if self._socket.send_nowait(frames):
                return
            with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
                await self._socket.send(frames)
        except zmq.ZMQError:
            return

    def close(self) -> None:
        """Close the socket; waiting requests fail at once."""
        self.dead = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        for future in self._pending.values():
            if not future.done():
                future.set_result(None)
        self._pending.clear()
        self._socket.close()
        if self.segment is not None:
            self.segment.retire()


def _copy_frames(frames: Sequence[bytes | memoryview]) -> bool:
    """Whether to let ZeroMQ copy a message: below a few MiB a copy is cheaper than the
    zero-copy hand-off (which hands each frame's release to pyzmq's garbage thread)."""
    return sum(len(frame) for frame in frames) < _ZERO_COPY_BYTES


def _raise_error(msg_type: MessageType, reply: Message) -> None:
    code = reply.header.get("code")
    text = str(reply.header.get("message", ""))
    if code == ErrorCode.INVALID_INPUT:
        raise InvalidInputError(text)
    if code in (ErrorCode.PROTOCOL, ErrorCode.UNSUPPORTED):
        raise ProtocolError(f"the sidecar refused a {msg_type.name} request: {text}")
    if code == ErrorCode.NO_SESSION:
        raise _SessionLost(text)
    log.warning("sidecar_request_failed", type=msg_type.name, code=code, message=text)
    raise _Unavailable(text)


class _SessionLost(_Unavailable):
    """The server does not know this client (it restarted, or our session expired)."""


@dataclass(slots=True)
class _Prepared:
    """A store or retrieve checked here: its key fields and its transfer plan."""

    header: dict[str, Any]
    payloads: list[memoryview]
    num_tokens: int
    start: int
    plan: TransferPlan
    slots_cpu: torch.Tensor


@dataclass(slots=True)
class _ClientCounters:
    requests: int = 0
    unavailable: int = 0
    timeouts: int = 0
    reconnects: int = 0
    refused: int = 0


class RemoteCacheEngine:
    """A sidecar's cache, behind the async interface of
    :class:`~lmcache_async.CacheEngine` (store, retrieve, lookup, lookup_unpin, prefetch,
    clear, freeze, set_hot_cache, stats, move, is_healthy, aclose).

    Create it with :meth:`connect`. :meth:`push_chunks` is the receiving half of a move
    (payloads with their checksums, verified by the sidecar). ``freeze``,
    ``set_hot_cache`` and ``stats`` are coroutines here (they ask the server).
    ``store_layer``/``retrieve_layer``, ``flush`` and KV events are not offered over the
    sidecar. Lookups by tokens send the prompt's chunk digests (the server says how it
    hashes in its welcome), not the tokens.
    """

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server_public_key: bytes | str | None = None,
        shared_memory: bool | None = None,
        reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL,
        name: str | None = None,
        limits: MessageLimits = DEFAULT_CLIENT_LIMITS,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("ipc://", "tcp://")):
            raise InvalidInputError(f"url must be ipc://PATH or tcp://HOST:PORT, got {url!r:.80}")
        if not isinstance(layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        for label, value in (("revision", revision), ("tenant", tenant), ("name", name)):
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{label} must be a str or None, got {value!r:.40}")
        for label, number in (("timeout", timeout), ("reconnect_interval", reconnect_interval)):
            if (
                isinstance(number, bool)
                or not isinstance(number, (int, float))
                or not math.isfinite(number)
                or number <= 0
            ):
                raise InvalidInputError(f"{label} must be a positive number, got {number!r}")
        if shared_memory is not None and not isinstance(shared_memory, bool):
            raise InvalidInputError("shared_memory must be True, False or None (auto)")
        if isinstance(server_public_key, str):
            server_public_key = server_public_key.encode("ascii")
        if server_public_key is not None and (
            not isinstance(server_public_key, bytes) or len(server_public_key) != 40
        ):
            raise InvalidInputError("server_public_key must be a 40-character z85 CURVE key")
        if not isinstance(limits, MessageLimits):
            raise InvalidInputError("limits must be a MessageLimits")
        self.url = url
        self.layout = layout
        self._kv_views = KVCacheViews(layout)  # the serving engine's caches, checked once
        self._hello = {
            "model_name": model_name,
            "revision": revision,
            "tenant": tenant,
            "layout": layout.to_dict(),
            "client": name or f"{socketlib.gethostname()}:{os.getpid()}",
            "host": socketlib.gethostname(),
            "boot_id": _boot_id(),
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
        }
        self._label = str(self._hello["client"])
        self._timeout = float(timeout)
        self._server_key = server_public_key
        self._shared_memory = shared_memory
        self._reconnect_interval = float(reconnect_interval)
        self._limits = limits
        self._context: zmq.asyncio.Context | None = None
        self._link: _Link | None = None
        self._links: set[_Link] = set()  # every open link, the current one and hellos
        self._welcome: _Welcome | None = None
        # Set from the server's welcome: lookups then send chunk digests, not tokens.
        self._hasher: ChunkHasher | None = None
        self._namespace = Namespace(
            model_name=model_name,
            layout_fingerprint=layout.fingerprint,
            revision=revision,
            tenant_salt=tenant,
        )
        self._task_group: TaskGroup | None = None
        self._keeper = anyio.CancelScope()
        self._probe = anyio.Event()
        self._serial = itertools.count()
        self._transfers = Transfers(inline_bytes=DEFAULT_INLINE_COPY_BYTES)
        self._counters = _ClientCounters()
        self._healthy = False
        self._connected = anyio.Event()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        url: str,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server_public_key: bytes | str | None = None,
        shared_memory: bool | None = None,
        require_server: bool = True,
        reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL,
        name: str | None = None,
    ) -> _RemoteContext:
        """An async context manager: say hello to the sidecar at ``url``, yield the client,
        close it on exit.

        ``model_name``, ``revision``, ``tenant`` and ``layout`` name the namespace; the
        first client fixes it for the sidecar. ``server_public_key`` (z85) is needed for a
        sidecar started with a CURVE secret key. ``shared_memory``: None uses the server's
        segment when it is on this host, False always sends payloads inline, True requires
        the segment. With ``require_server=False`` an unreachable sidecar is not an error:
        calls are misses until it answers.

        Raises:
            InvalidInputError: a bad argument, or the sidecar serves another namespace
                (the message names the difference).
            ProtocolError: the sidecar speaks another protocol version.
            TierUnavailableError: with ``require_server``, no answer within ``timeout``
                (a sidecar with CURVE keys does not answer a client without its key).
        """
        engine = cls(
            url,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            timeout=timeout,
            server_public_key=server_public_key,
            shared_memory=shared_memory,
            reconnect_interval=reconnect_interval,
            name=name,
        )
        return _RemoteContext(engine, require_server)

    async def _start(self, task_group: TaskGroup, require_server: bool) -> None:
        self._context = zmq.asyncio.Context()
        self._task_group = task_group
        try:
            await self._say_hello()
        except _Unavailable as exc:
            if require_server:
                raise TierUnavailableError(
                    f"no answer from the sidecar at {self.url} within {self._timeout} s ({exc}):"
                    " is it running, and if it uses CURVE keys, was server_public_key given?"
                ) from None
            log.warning("sidecar_unreachable", url=self.url)
        task_group.start_soon(self._keep, name="sidecar-keeper")

    async def aclose(self) -> None:
        """Close the socket, unmap the segment and stop the copy threads; idempotent.
        Later calls raise EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._drop_link()
        self._keeper.cancel()
        for link in list(self._links):  # a hello in flight
            link.close()
        self._links.clear()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._transfers.close)
        self._kv_views.forget()
        if self._context is not None:
            self._context.term()  # every socket is closed: this returns at once
            self._context = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the remote cache engine is closed")

    # -- the connection -------------------------------------------------------------------

    async def _say_hello(self) -> None:
        """Open a new link and say hello; on success it replaces the current one.

        Raises:
            _Unavailable: no answer in time.
            InvalidInputError, ProtocolError: the server refused us.
        """
        assert self._context is not None and self._task_group is not None
        identity = f"{self._label}/{next(self._serial)}/{secrets.token_hex(4)}".encode()
        link = _Link(self._context, self.url, identity, self._server_key, self._limits)
        self._links.add(link)
        try:
            reply = await link.request(MessageType.HELLO, self._hello, timeout=self._timeout)
            welcome = _Welcome.parse(reply.header)
            link.welcome = welcome
            link.segment = self._attach(welcome)
        except InvalidInputError as exc:
            self._close_link(link)
            refusal = f"the sidecar at {self.url} refused this client: {exc}"
            raise InvalidInputError(refusal) from None
        except BaseException:
            self._close_link(link)
            raise
        self._drop_link()
        self._link, self._welcome = link, welcome
        self._hasher = self._key_hasher(welcome)
        self._healthy = True
        self._connected.set()
        log.info(
            "sidecar_connected",
            url=self.url,
            server=welcome.server,
            shared_memory=link.segment is not None,
        )

    def _key_hasher(self, welcome: _Welcome) -> ChunkHasher | None:
        """A hasher giving the server's chunk keys, or None (lookups then send tokens):
        the server did not say how it hashes, or its seed is not ours."""
        if welcome.hash_algorithm is None or welcome.key_seed is None:
            return None
        try:
            hasher = ChunkHasher(
                self._namespace,
                chunk_size=welcome.chunk_size,
                algorithm=HashAlgorithm(welcome.hash_algorithm),
                memo_size=_DIGEST_MEMO_PROMPTS,
            )
        except (ValueError, InvalidInputError) as exc:
            log.warning("sidecar_key_hasher_unavailable", error=str(exc))
            return None
        if hasher.seed != welcome.key_seed:
            log.warning("sidecar_key_seed_differs", url=self.url)
            return None
        return hasher

    async def _digests(self, hasher: ChunkHasher, tokens: Tokens) -> list[bytes]:
        """The chunk digests of ``tokens``: remembered, hashed here when short, else in a
        worker thread. Raises InvalidInputError for bad tokens."""
        probe = hasher.probe(tokens)
        if probe.digests is not None:
            return probe.digests
        if len(tokens) < DEFAULT_INLINE_HASH_TOKENS:
            return hasher.digests(tokens, probe=probe)
        return await anyio.to_thread.run_sync(
            functools.partial(hasher.digests, tokens, probe=probe)
        )

    def _attach(self, welcome: _Welcome) -> _Segment | None:
        if welcome.shm is None or self._shared_memory is False:
            if self._shared_memory:
                raise InvalidInputError(
                    f"the sidecar at {self.url} offers no shared memory to this client"
                )
            return None
        try:
            return _Segment(welcome.shm, welcome.shm_bytes, owner_pid=welcome.pid)
        except OSError as exc:
            if self._shared_memory:
                raise InvalidInputError(
                    f"cannot map the sidecar's shared memory {welcome.shm}: {exc}"
                ) from None
            log.warning("sidecar_shm_unavailable", name=welcome.shm, error=str(exc))
            return None

    def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            self._close_link(link)

    def _close_link(self, link: _Link) -> None:
        self._links.discard(link)
        link.close()

    def _lost(self, link: _Link, reason: str) -> None:
        """Give up on ``link`` (calls are misses) and let the keeper reconnect."""
        if self._link is link:
            self._drop_link()
            self._healthy = False
            self._connected = anyio.Event()
            log.warning("sidecar_lost", url=self.url, reason=reason)
            self._probe.set()

    async def _keep(self) -> None:
        """Heartbeats while connected; hellos every ``reconnect_interval`` while not."""
        with self._keeper:
            await self._keep_up()

    async def _keep_up(self) -> None:
        while not self._closed:
            link = self._link
            if link is None:
                try:
                    await self._say_hello()
                    self._counters.reconnects += 1
                except _Unavailable:
                    await anyio.sleep(self._reconnect_interval)
                except (InvalidInputError, ProtocolError) as exc:
                    # A sidecar restarted for another namespace: said once, retried quietly.
                    if not self._counters.refused:
                        log.error("sidecar_refused", url=self.url, error=str(exc))
                    self._counters.refused += 1
                    await anyio.sleep(self._reconnect_interval)
                except Exception:  # the keeper must outlive any one failed hello
                    log.exception("sidecar_hello_failed", url=self.url)
                    await anyio.sleep(self._reconnect_interval)
                continue
            assert link.welcome is not None
            with anyio.move_on_after(link.welcome.heartbeat_interval):
                await self._probe.wait()
            self._probe = anyio.Event()
            if self._link is not link:
                continue
            try:
                reply = await link.request(
                    MessageType.HEARTBEAT, None, timeout=self._heartbeat_timeout(link)
                )
            except (_Unavailable, ProtocolError, InvalidInputError) as exc:
                self._lost(link, str(exc) or type(exc).__name__)
                continue
            if reply.header.get("server") != link.welcome.server:
                self._lost(link, "the sidecar restarted")
                continue
            self._healthy = bool(reply.header.get("healthy", False))

    def _heartbeat_timeout(self, link: _Link) -> float:
        assert link.welcome is not None
        return max(_PROBE_TIMEOUT_FLOOR, min(self._timeout, link.welcome.client_timeout))

    async def _usable(self) -> _Link | None:
        """The live link, or None (counted: the call is a miss). A miss still yields to
        the event loop, so a caller looping over misses lets the keeper reconnect."""
        self._check_open()
        link = self._link
        if link is None or link.dead:
            self._counters.unavailable += 1
            await anyio.lowlevel.checkpoint()
            return None
        return link

    async def _ask(
        self,
        link: _Link,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object] = (),
        *,
        meanwhile: Callable[[], object] | None = None,
    ) -> Message:
        """A request on ``link``; a timeout or lost session gives up the link.

        Raises:
            _Unavailable, InvalidInputError, ProtocolError: as :meth:`_Link.request`.
        """
        self._counters.requests += 1
        try:
            return await link.request(
                msg_type, header, payloads, timeout=self._timeout, meanwhile=meanwhile
            )
        except _SessionLost:
            self._lost(link, "the sidecar has no session for this client")
            raise
        except _Unavailable as exc:
            if not link.dead:
                self._counters.timeouts += 1
                log.warning("sidecar_request_timed_out", type=msg_type.name, error=str(exc))
                self._probe.set()  # let the keeper check the server now
            raise

    # -- input ----------------------------------------------------------------------------

    def _key_fields(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
    ) -> tuple[dict[str, Any], list[memoryview], int]:
        """The wire form of a request's keys, and its number of tokens.

        Raises:
            InvalidInputError: tokens and hashes both or neither given, bad tokens, hashes
                or offsets.
        """
        if hashes is not None:
            if tokens is not None:
                raise InvalidInputError("pass either tokens or hashes, not both")
            if offsets is None:
                raise InvalidInputError("hashes need offsets (the end token offset of each hash)")
            if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
                raise InvalidInputError(f"offsets must be a sequence, got {type(offsets).__name__}")
            ends = list(offsets)
            for index, end in enumerate(ends):
                if not is_strict_int(end):
                    raise InvalidInputError(f"offsets[{index}] must be an int, got {end!r:.40}")
            wire = hashes_to_wire(hashes)
            if len(wire) != len(ends):
                raise InvalidInputError(
                    f"got {len(wire)} hashes but {len(ends)} offsets; they must match"
                )
            return {"hashes": wire, "offsets": ends}, [], (ends[-1] if ends else 0)
        if tokens is None:
            raise InvalidInputError("tokens (or hashes with offsets) are required")
        if offsets is not None:
            raise InvalidInputError("offsets go with hashes, not with tokens")
        payload = tokens_payload(tokens)
        return {}, [payload], payload.nbytes // 4

    def _prepare(
        self,
        *,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> _Prepared:
        header, payloads, num_tokens = self._key_fields(tokens, hashes, offsets)
        chunk_size = self._welcome.chunk_size if self._welcome is not None else 1
        start = check_mask(mask, num_tokens, chunk_size)
        plan, slots_cpu = self._kv_views.plan(kv_caches, slot_mapping, num_tokens)
        header["start"] = start
        return _Prepared(header, payloads, num_tokens, start, plan, slots_cpu)

    def _check_tiers(self, locations: Sequence[str] | None, name: str) -> list[str] | None:
        if locations is None:
            return None
        if isinstance(locations, str):
            locations = [locations]
        names = list(locations)
        known = self._welcome.tiers if self._welcome is not None else ()
        for location in names:
            if not isinstance(location, str) or (known and location not in known):
                raise InvalidInputError(
                    f"{name}: {location!r} is not an enabled tier (enabled: {list(known)})"
                )
        return names

    def _chunks(self, reply: Message, prepared: _Prepared) -> list[tuple[int, int, int, int]]:
        """The ``(start, end, offset, nbytes)`` of each chunk a reply lends, checked."""
        raw = reply.header.get("chunks")
        if not isinstance(raw, list):
            raise ProtocolError("the reply has no 'chunks' list")
        chunks: list[tuple[int, int, int, int]] = []
        itemsize = self.layout.dtype.itemsize
        for item in raw:
            if (
                not isinstance(item, list)
                or len(item) != 4
                or not all(is_strict_int(value) for value in item)
            ):
                raise ProtocolError("a chunk must be [start, end, offset, nbytes]")
            start, end, offset, nbytes = item
            expected = math.prod(self.layout.payload_shape(max(end - start, 0))) * itemsize
            if not prepared.start <= start < end <= prepared.num_tokens or nbytes != expected:
                raise ProtocolError(f"chunk {item} does not fit the request")
            chunks.append((start, end, offset, nbytes))
        return chunks

    # -- requests -------------------------------------------------------------------------

    async def store(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        store_location: Sequence[str] | None = None,
    ) -> int:
        """As :meth:`CacheEngine.store <lmcache_async.CacheEngine.store>`: copy the KV of
        ``tokens`` into the sidecar's cache; returns the tokens cached from the first
        stored chunk on, 0 when the sidecar is unreachable or too slow.

        Raises:
            InvalidInputError: bad input (nothing stored).
            EngineClosedError: the client is closed.
        """
        self._check_open()
        prepared = self._prepare(
            tokens=tokens,
            hashes=hashes,
            offsets=offsets,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
        )
        header = prepared.header
        locations = self._check_tiers(store_location, "store_location")
        if locations is not None:
            header["store_location"] = locations
        skipped = prepared.plan.first_skipped(prepared.start)
        header["limit"] = prepared.num_tokens if skipped is None else skipped
        header["timeout"] = self._timeout
        if req_id is not None:
            header["req_id"] = str(req_id)
        link = await self._usable()
        if link is None or prepared.num_tokens == 0:
            return 0
        try:
            reply = await self._ask(link, MessageType.STORE, header, prepared.payloads)
            if "stored" in reply.header:
                return _count(reply, "stored")
            txn = reply.header.get("txn")
            try:
                chunks = self._chunks(reply, prepared)
                payloads = await self._gather(link, prepared.plan, chunks)
            except BaseException:
                abort = {"txn": txn, "abort": True}
                await link.notify(MessageType.COMMIT, abort, self._timeout)
                raise
            reply = await self._ask(link, MessageType.COMMIT, {"txn": txn}, payloads)
            return _count(reply, "stored")
        except (_Unavailable, ProtocolError) as exc:
            log.debug("sidecar_store_missed", error=str(exc))
            return 0

    async def _gather(
        self, link: _Link, plan: TransferPlan, chunks: list[tuple[int, int, int, int]]
    ) -> list[memoryview]:
        """Copy the chunks out of the KV caches into the lent payloads: the server's
        memory, or local buffers returned as inline frames."""
        dtype = self.layout.dtype
        segment = link.segment
        nbytes = sum(chunk[3] for chunk in chunks)
        with contextlib.ExitStack() as stack:
            if segment is not None:
                stack.enter_context(segment.use())
                outs = [
                    segment.view(off, size, self.layout.payload_shape(end - start), dtype)
                    for start, end, off, size in chunks
                ]
            else:
                outs = [
                    torch.empty(self.layout.payload_shape(end - start), dtype=dtype)
                    for start, end, _, _ in chunks
                ]
            jobs = [(start, end, out) for (start, end, _, _), out in zip(chunks, outs, strict=True)]
            # Shielded: the payloads must not be handed back while a copy writes into them.
            with anyio.CancelScope(shield=True):
                await self._transfers.run(
                    plan.gather_chunks,
                    jobs,
                    device=plan.device,
                    direction=Direction.STORE,
                    nbytes=nbytes,
                    timeout=self._timeout,
                )
            if segment is not None:
                return []
            return [out.view(-1).view(torch.uint8).numpy().data for out in outs]

    async def retrieve(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        retrieve_locations: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """As :meth:`CacheEngine.retrieve <lmcache_async.CacheEngine.retrieve>`: load the
        cached run of chunks from the mask start on into ``kv_caches``; returns the bool CPU
        mask of the tokens written (all False when the sidecar is unreachable).

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        self._check_open()
        prepared = self._prepare(
            tokens=tokens,
            hashes=hashes,
            offsets=offsets,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
        )
        loaded = torch.zeros(prepared.num_tokens, dtype=torch.bool)
        header = prepared.header
        locations = self._check_tiers(retrieve_locations, "retrieve_locations")
        if locations is not None:
            header["retrieve_locations"] = locations
        if lookup_id is not None:
            header["lookup_id"] = _check_lookup_id(lookup_id)
        if req_id is not None:
            header["req_id"] = str(req_id)
        header["timeout"] = self._timeout
        link = await self._usable()
        if link is None or prepared.num_tokens == 0:
            return loaded
        header["inline"] = link.segment is None
        try:
            reply = await self._ask(link, MessageType.RETRIEVE, header, prepared.payloads)
            txn = reply.header.get("txn")
            if txn is None:
                return loaded
            tokens_loaded = 0
            try:
                chunks = self._chunks(reply, prepared)
                if chunks:
                    await self._scatter(link, prepared.plan, chunks, reply.payloads)
                    start, end = chunks[0][0], chunks[-1][1]
                    if prepared.plan.first_skipped(start) is None:
                        loaded[start:end] = True
                    else:
                        loaded[start:end] = prepared.slots_cpu[start:end] >= 0
                    tokens_loaded = end - start
            finally:
                release = {"txn": txn, "loaded": tokens_loaded}
                await link.notify(MessageType.RELEASE, release, self._timeout)
        except (_Unavailable, ProtocolError) as exc:
            log.debug("sidecar_retrieve_missed", error=str(exc))
        return loaded

    async def _scatter(
        self,
        link: _Link,
        plan: TransferPlan,
        chunks: list[tuple[int, int, int, int]],
        frames: list[memoryview],
    ) -> None:
        dtype = self.layout.dtype
        segment = link.segment
        with contextlib.ExitStack() as stack:
            if segment is not None:
                stack.enter_context(segment.use())
                payloads = [
                    segment.view(off, size, self.layout.payload_shape(end - start), dtype)
                    for start, end, off, size in chunks
                ]
            else:
                if len(frames) != len(chunks):
                    raise ProtocolError(f"{len(frames)} payloads for {len(chunks)} chunks")
                payloads = []
                with warnings.catch_warnings():
                    # The frames are read-only; the scatter only reads them.
                    warnings.simplefilter("ignore", UserWarning)
                    for (start, end, _, size), frame in zip(chunks, frames, strict=True):
                        if frame.nbytes != size:
                            raise ProtocolError(f"a payload of {frame.nbytes} bytes, not {size}")
                        flat = torch.frombuffer(frame, dtype=torch.uint8)
                        shape = self.layout.payload_shape(end - start)
                        payloads.append(flat.view(dtype).view(shape))
            jobs = [
                (start, end, payload)
                for (start, end, _, _), payload in zip(chunks, payloads, strict=True)
            ]
            with anyio.CancelScope(shield=True):
                await self._transfers.run(
                    plan.scatter_chunks,
                    jobs,
                    device=plan.device,
                    direction=Direction.LOAD,
                    nbytes=sum(chunk[3] for chunk in chunks),
                    timeout=self._timeout,
                )

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
    ) -> int:
        """As :meth:`CacheEngine.lookup <lmcache_async.CacheEngine.lookup>`: prefix tokens
        cached in the sidecar (0 when it is unreachable). Pins (``pin=True`` with a
        ``lookup_id``: an int or str) belong to this client and are released by
        :meth:`lookup_unpin`, a retrieve with the id, or when this client goes away.

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        self._check_open()
        if not isinstance(pin, bool):
            raise InvalidInputError(f"pin must be a bool, got {type(pin).__name__}")
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        options: dict[str, Any] = {"pin": pin}
        if lookup_id is not None:
            options["lookup_id"] = _check_lookup_id(lookup_id)
        locations = self._check_tiers(search_range, "search_range")
        if locations is not None:
            options["search_range"] = locations
        hasher = self._hasher
        if hasher is None or tokens is None or hashes is not None or offsets is not None:
            header, key_payloads, num_tokens = self._key_fields(tokens, hashes, offsets)
            header.update(options)
            return await self._hits(MessageType.LOOKUP, header, key_payloads, num_tokens) or 0
        # Chunk digests instead of the tokens: 16 bytes a chunk on the wire, and the server
        # neither converts nor hashes the prompt.
        guess = hasher.guess(tokens)
        if guess is not None:
            hits = await self._guessed_lookup(guess, options)
            if hits is not None:
                return hits
        digests = await self._digests(hasher, tokens)
        header = {"digests_of": len(tokens), **options}
        return await self._hits(MessageType.LOOKUP, header, [b"".join(digests)], len(tokens)) or 0

    async def _guessed_lookup(self, guess: DigestGuess, options: dict[str, Any]) -> int | None:
        """A lookup sent with the digests the memo guesses for the prompt, its tokens
        compared with the remembered ones while the request is in flight: off the round
        trip, which would otherwise wait for reading the whole prompt twice. The hits,
        0 when the sidecar cannot be reached, or None when the guess was wrong (the
        tokens changed in place): then the caller asks again with the right digests,
        and its pins replace any this lookup made."""
        confirmed = False

        def confirm() -> None:
            nonlocal confirmed
            confirmed = guess.confirm()

        header = {"digests_of": guess.num_tokens, **options}
        payloads = [b"".join(guess.digests)]
        hits = await self._hits(
            MessageType.LOOKUP, header, payloads, guess.num_tokens, meanwhile=confirm
        )
        if hits is None:
            return 0  # a miss, whatever the tokens are
        return hits if confirmed else None

    async def prefetch(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
    ) -> int:
        """As :meth:`CacheEngine.prefetch <lmcache_async.CacheEngine.prefetch>`: look up
        and start loading the hits from disk or Redis into the sidecar's memory, for a
        later :meth:`retrieve` with the same ``lookup_id`` (0 when unreachable).

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        self._check_open()
        header, payloads, num_tokens = self._key_fields(tokens, hashes, offsets)
        header["lookup_id"] = _check_lookup_id(lookup_id)
        locations = self._check_tiers(search_range, "search_range")
        if locations is not None:
            header["search_range"] = locations
        return await self._hits(MessageType.PREFETCH, header, payloads, num_tokens) or 0

    async def _hits(
        self,
        msg_type: MessageType,
        header: dict[str, Any],
        payloads: Sequence[object],
        num_tokens: int,
        *,
        meanwhile: Callable[[], object] | None = None,
    ) -> int | None:
        """The ``hits`` a LOOKUP or PREFETCH answers, 0 for no tokens; None when the
        sidecar cannot be reached (logged at debug). ``meanwhile`` runs once the request
        is sent, before its reply is awaited."""
        link = await self._usable()
        if link is None:
            return None
        if num_tokens == 0:
            return 0
        try:
            reply = await self._ask(link, msg_type, header, payloads, meanwhile=meanwhile)
            return _count(reply, "hits")
        except (_Unavailable, ProtocolError) as exc:
            log.debug("sidecar_request_missed", type=msg_type.name, error=str(exc))
            return None

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release this client's pins for ``lookup_id`` (logged when it fails)."""
        self._check_open()
        header = {"lookup_id": _check_lookup_id(lookup_id)}
        link = await self._usable()
        if link is None:
            return
        with contextlib.suppress(_Unavailable, ProtocolError):
            await self._ask(link, MessageType.UNPIN, header)

    async def push_chunks(
        self,
        tokens: Tokens,
        payloads: Sequence[torch.Tensor | bytes | bytearray | memoryview],
        *,
        checksums: Sequence[int],
        start: int = 0,
        location: str | None = None,
    ) -> int:
        """Cache chunk payloads in the sidecar as they are, each verified there against its
        checksum: the receiving half of :meth:`CacheEngine.move
        <lmcache_async.CacheEngine.move>`.

        ``tokens``: the prompt up to the end of the last chunk pushed. ``payloads``: the
        payload of each chunk from token ``start`` on (a multiple of the chunk size), as the
        layout's ``payload_shape(num_tokens)`` in its dtype (a contiguous CPU tensor, or its
        raw bytes). ``checksums``: the xxh3-64 of each payload's bytes
        (:func:`~lmcache_async.backends.record.payload_checksum`). They travel inline; the
        sidecar refuses a payload whose bytes or size do not match, and every chunk after
        it. ``location``: the sidecar's tier to write (default: its ``store_location``);
        queued disk or Redis writes are flushed before it answers.

        Returns the tokens from ``start`` on whose chunks the sidecar took: a prefix of
        those pushed, 0 when the sidecar is unreachable or too slow (logged).

        Raises:
            InvalidInputError: bad input, or a tier the sidecar does not have.
            EngineClosedError: the client is closed.
        """
        self._check_open()
        header, frames, _ = self._key_fields(tokens, None, None)
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
        header["timeout"] = self._timeout
        if location is not None:
            header["store_location"] = self._check_tiers([location], "location")
        if not payloads:
            return 0
        link = await self._usable()
        if link is None:
            log.warning("sidecar_push_unreachable", url=self.url)
            return 0
        try:
            return _count(await self._ask(link, MessageType.PUSH, header, frames), "stored")
        except (_Unavailable, ProtocolError) as exc:
            log.warning("sidecar_push_failed", url=self.url, error=str(exc))
            return 0

    async def move(
        self,
        tokens: Tokens,
        old_position: str,
        new_position: tuple[str, str] | Sequence[str],
        copy: bool = True,
        *,
        timeout: float | None = None,
    ) -> int:
        """Have the sidecar move a prefix to another sidecar: as :meth:`CacheEngine.move
        <lmcache_async.CacheEngine.move>` run by the sidecar's engine.

        ``old_position``: a tier of this sidecar; ``new_position``: ``(url, location)`` of
        the target sidecar and its tier. The sidecar gives each request to the target this
        client's timeout; ``timeout`` bounds the whole wait here (default: ten times the
        client's timeout). Returns the prefix tokens now at the target; 0 when this sidecar
        or the target is unreachable, or the wait ran out (logged; a move that ran out of
        time here may still finish there).

        Raises:
            InvalidInputError: bad tokens, ``old_position`` is not a tier of this sidecar,
                ``new_position`` is not a (URL, tier) pair, or the target refused it
                (another namespace or chunk size, no such tier).
            EngineClosedError: the client is closed.
        """
        self._check_open()
        header, payloads, num_tokens = self._key_fields(tokens, None, None)
        if not isinstance(old_position, str):
            raise InvalidInputError(
                f"old_position must be a tier name, got {type(old_position).__name__}"
            )
        self._check_tiers([old_position], "old_position")
        url, location = check_move_target(new_position)
        if not isinstance(copy, bool):
            raise InvalidInputError(f"copy must be a bool, got {type(copy).__name__}")
        wait = _MOVE_WAIT_FACTOR * self._timeout if timeout is None else timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")
        header["old_position"] = old_position
        header["new_position"] = [url, location]
        header["copy"] = copy
        header["timeout"] = self._timeout
        link = await self._usable()
        if link is None:
            log.warning("sidecar_move_unreachable", url=self.url)
            return 0
        if num_tokens == 0:
            return 0
        self._counters.requests += 1
        try:
            reply = await link.request(MessageType.MOVE, header, payloads, timeout=float(wait))
            return _count(reply, "moved")
        except (_Unavailable, ProtocolError) as exc:
            log.warning("sidecar_move_failed", url=self.url, target=url, error=str(exc))
            return 0

    async def _admin(self, msg_type: MessageType, header: dict[str, Any]) -> Message | None:
        link = await self._usable()
        if link is None:
            log.warning("sidecar_unreachable", request=msg_type.name, url=self.url)
            return None
        try:
            return await self._ask(link, msg_type, header)
        except (_Unavailable, ProtocolError) as exc:
            log.warning("sidecar_request_failed", request=msg_type.name, error=str(exc))
            return None

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all) in the sidecar;
        returns how many chunks were dropped (0 when unreachable)."""
        self._check_open()
        names = self._check_tiers(locations, "locations")
        reply = await self._admin(MessageType.CLEAR, {"locations": names})
        return 0 if reply is None else _count(reply, "chunks")

    async def freeze(self, enabled: bool) -> bool:
        """Switch the sidecar's freeze mode; False when it could not be reached."""
        self._check_open()
        if not isinstance(enabled, bool):
            raise InvalidInputError(f"enabled must be a bool, got {type(enabled).__name__}")
        return await self._admin(MessageType.FREEZE, {"enabled": enabled}) is not None

    async def set_hot_cache(self, enabled: bool) -> bool:
        """Switch the sidecar's CPU hot cache; False when it could not be reached."""
        self._check_open()
        if not isinstance(enabled, bool):
            raise InvalidInputError(f"enabled must be a bool, got {type(enabled).__name__}")
        return await self._admin(MessageType.HOT_CACHE, {"enabled": enabled}) is not None

    async def stats(self) -> dict[str, Any]:
        """The sidecar engine's stats (``"engine"``: the fields of
        :class:`~lmcache_async.EngineStats` as plain data, None when unreachable), the
        server's own state (``"server"``: sessions, transactions, segment) and this client's
        counters (``"client"``)."""
        self._check_open()
        reply = await self._admin(MessageType.STATS, {})
        counters = self._counters
        client = {
            "connected": self._link is not None,
            "requests": counters.requests,
            "unavailable": counters.unavailable,
            "timeouts": counters.timeouts,
            "reconnects": counters.reconnects,
            "refused": counters.refused,
            "shared_memory": self._link is not None and self._link.segment is not None,
        }
        if reply is None:
            return {"engine": None, "server": None, "client": client}
        return {
            "engine": reply.header.get("stats"),
            "server": reply.header.get("server"),
            "client": client,
        }

    async def ping(self) -> bool:
        """One empty round trip to the sidecar: True when it answered within the timeout."""
        link = await self._usable()
        if link is None:
            return False
        try:
            await self._ask(link, MessageType.PING, None)
        except (_Unavailable, ProtocolError):
            return False
        return True

    async def wait_connected(self) -> None:
        """Wait until the client has a session with the sidecar (bound the wait with
        ``anyio.fail_after``). Raises EngineClosedError when the client is closed."""
        self._check_open()
        await self._connected.wait()

    def is_healthy(self) -> bool:
        """True while connected to a sidecar whose last heartbeat said it can serve."""
        return not self._closed and self._link is not None and self._healthy

    @property
    def uses_shared_memory(self) -> bool:
        """Whether payloads move through the sidecar's shared memory now (else inline)."""
        link = self._link
        return link is not None and link.segment is not None

    @property
    def chunk_size(self) -> int | None:
        """The sidecar's chunk size (None before the first hello)."""
        return None if self._welcome is None else self._welcome.chunk_size


def _count(reply: Message, name: str) -> int:
    value = reply.header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"'{name}' in the reply is not an int >= 0")
    return int(value)


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


def _check_lookup_id(lookup_id: object) -> int | str:
    if is_strict_int(lookup_id) or isinstance(lookup_id, str):
        return lookup_id  # type: ignore[return-value]
    raise InvalidInputError(
        f"lookup_id must be an int or str over the sidecar, got {type(lookup_id).__name__}"
    )


class _RemoteContext:
    """What :meth:`RemoteCacheEngine.connect` returns: ``async with`` yields the client."""

    def __init__(self, engine: RemoteCacheEngine, require_server: bool) -> None:
        self._engine = engine
        self._require_server = require_server
        self._task_group: TaskGroup | None = None

    async def __aenter__(self) -> RemoteCacheEngine:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        try:
            await self._engine._start(task_group, self._require_server)
        except BaseException:
            await self._close()
            raise
        return self._engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        """Close the client, then leave the task group: its tasks (the keeper, the receive
        loops) end through their own cancel scopes, so an exception from the ``async with``
        body passes through as it is, not wrapped in an exception group."""
        try:
            await self._engine.aclose()
        finally:
            assert self._task_group is not None
            await self._task_group.__aexit__(None, None, None)
