"""A client's connection to its sidecar: the current link, the hellos that open one, the
heartbeats that keep it, and the reconnects when it is lost.

While no link is up every call is a miss; a background task (the *keeper*) says hello every
``reconnect_interval`` until the sidecar answers. A restarted sidecar (a new instance id in
a heartbeat reply) or a lost session gives the link up and the keeper starts over, mapping
the new server's segment afresh.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.lowlevel
import zmq.asyncio
from anyio.abc import TaskGroup

from lmcache_async.engine.hashers import TenantHashers
from lmcache_async.errors import (
    EngineClosedError,
    InvalidInputError,
    ProtocolError,
    TierUnavailableError,
)
from lmcache_async.keys.chunks import ChunkHasher
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.link import Link, Sent
from lmcache_async.rpc.client.segment import Segment
from lmcache_async.rpc.client.settings import ClientSettings
from lmcache_async.rpc.client.welcome import Welcome, key_hasher
from lmcache_async.rpc.client.wire import SessionLost, Unavailable
from lmcache_async.rpc.protocol import Message, MessageType
from lmcache_async.rpc.stream import stream_path

__all__ = ["ClientCounters", "Connection"]

log = get_logger(__name__)

_PROBE_TIMEOUT_FLOOR: Final = 0.05


@dataclass(slots=True)
class ClientCounters:
    """What a client counts of its requests (reported in its stats)."""

    requests: int = 0
    unavailable: int = 0
    timeouts: int = 0
    reconnects: int = 0
    refused: int = 0


class Connection:
    """The sidecar ``settings.url`` names, as one client sees it.

    ``link``, ``welcome`` and ``hasher`` are the current link (None while down), the last
    welcome and the hasher it allows (lookups then send chunk digests, not tokens);
    :meth:`hasher_for` gives each tenant's.
    """

    def __init__(self, settings: ClientSettings) -> None:
        self.url = settings.url
        self._hello = settings.hello()
        self._label = str(self._hello["client"])
        self._namespace = settings.key_namespace()
        self.timeout = float(settings.timeout)
        self._curve = settings.curve
        self._shared_memory = settings.shared_memory
        self._reconnect_interval = float(settings.reconnect_interval)
        self._limits = settings.limits
        usable = settings.stream and settings.curve is None
        self._stream = stream_path(self.url) if usable else None
        self._context: zmq.asyncio.Context | None = None
        self.link: Link | None = None
        self._links: set[Link] = set()  # every open link, the current one and hellos
        self.welcome: Welcome | None = None
        self.hasher: ChunkHasher | None = None
        self._hashers: TenantHashers | None = None
        self._task_group: TaskGroup | None = None
        self._keeper = anyio.CancelScope()
        self._probe = anyio.Event()
        self._serial = itertools.count()
        self.counters = ClientCounters()
        self.healthy = False
        self.connected = anyio.Event()
        self.closed = False

    async def start(self, task_group: TaskGroup, require_server: bool) -> None:
        """Say hello, then keep the link (in ``task_group``).

        Raises:
            TierUnavailableError: with ``require_server``, no answer within the timeout.
            InvalidInputError, ProtocolError: the server refused this client.
        """
        self._context = zmq.asyncio.Context()
        self._task_group = task_group
        try:
            await self._say_hello()
        except Unavailable as exc:
            if require_server:
                raise TierUnavailableError(
                    f"no answer from the sidecar at {self.url} within {self.timeout} s ({exc}):"
                    " is it running, and if it uses CURVE keys, were server_public_key and a"
                    " client_certificate on its allow-list given?"
                ) from None
            log.warning("sidecar_unreachable", url=self.url)
        task_group.start_soon(self._keep, name="sidecar-keeper")

    def close(self) -> None:
        """Stop the keeper and close every link (waiting requests fail at once)."""
        self.closed = True
        self._drop_link()
        self._keeper.cancel()
        for link in list(self._links):  # a hello in flight
            link.close()
        self._links.clear()

    def term(self) -> None:
        """End the ZeroMQ context (after :meth:`close`: every socket is closed, so this
        returns at once)."""
        if self._context is not None:
            self._context.term()
            self._context = None

    def check_open(self) -> None:
        """Raises EngineClosedError once the client is closed."""
        if self.closed:
            raise EngineClosedError("the remote cache engine is closed")

    async def _say_hello(self) -> None:
        """Open a new link and say hello; on success it replaces the current one.

        Raises:
            Unavailable: no answer in time.
            InvalidInputError, ProtocolError: the server refused us.
        """
        assert self._context is not None and self._task_group is not None
        link = self._stream_link()
        if link is not None:
            try:
                welcome = await self._greet(link)
            except Unavailable:  # refused (another user's sidecar) or gone: ZeroMQ then
                link = None
        if link is None:
            link = self._zmq_link()
            welcome = await self._greet(link)
            # A sidecar that came up while this hello waited has its stream now.
            faster = self._stream_link()
            if faster is not None:
                try:
                    welcome = await self._greet(faster)  # closes it when that fails
                except Unavailable:
                    pass
                except BaseException:
                    self._close_link(link)
                    raise
                else:
                    self._close_link(link)
                    link = faster
        self._drop_link()
        self.link, self.welcome = link, welcome
        self.hasher = key_hasher(self._namespace, welcome, self.url)
        self._hashers = None if self.hasher is None else TenantHashers(self.hasher)
        self.healthy = True
        self.connected.set()
        log.info(
            "sidecar_connected",
            url=self.url,
            server=welcome.server,
            stream=link.stream,
            shared_memory=link.segment is not None,
        )

    async def _greet(self, link: Link) -> Welcome:
        """Say hello on ``link`` and map the segment its welcome offers; ``link`` is closed
        when that fails.

        Raises:
            Unavailable: no answer in time.
            InvalidInputError, ProtocolError: the server refused us.
        """
        self._links.add(link)
        try:
            reply = await link.request(MessageType.HELLO, self._hello, timeout=self.timeout)
            welcome = Welcome.parse(reply.header)
            link.welcome = welcome
            link.segment = self._attach(welcome)
        except InvalidInputError as exc:
            self._close_link(link)
            refusal = f"the sidecar at {self.url} refused this client: {exc}"
            raise InvalidInputError(refusal) from None
        except BaseException:
            self._close_link(link)
            raise
        return welcome

    def _identity(self) -> bytes:
        return f"{self._label}/{next(self._serial)}/{secrets.token_hex(4)}".encode()

    def _stream_link(self) -> Link | None:
        """A link over the sidecar's same-host stream socket, or None when it has none
        (or this client may not use it)."""
        assert self._context is not None
        path = self._stream
        if path is None or not os.path.exists(path):
            return None
        try:
            return Link(
                self._context,
                self.url,
                self._identity(),
                None,
                self._limits,
                on_disconnect=self._disconnected,
                stream=path,
            )
        except OSError as exc:  # a file left by a sidecar that is gone, or busy
            log.debug("sidecar_stream_unreachable", path=path, error=str(exc))
            return None

    def _zmq_link(self) -> Link:
        assert self._context is not None
        return Link(
            self._context,
            self.url,
            self._identity(),
            self._curve,
            self._limits,
            on_disconnect=self._disconnected,
        )

    @property
    def tenant(self) -> str | None:
        """This client's own tenant (the one its requests name by default)."""
        return self._namespace.tenant_salt

    def hasher_for(self, tenant: str | None) -> ChunkHasher | None:
        """The hasher of ``tenant``'s chunk keys as the server computes them (None: this
        client's own tenant), or None when the server did not say how it hashes. Named
        tenants' hashers are kept among the most recently used few.

        Raises:
            InvalidInputError: ``tenant`` is not a valid tenant name.
        """
        hashers = self._hashers
        return None if hashers is None else hashers.for_tenant(tenant)

    def _attach(self, welcome: Welcome) -> Segment | None:
        """The server's segment mapped here, or None (payloads then travel inline).

        Raises:
            InvalidInputError: ``shared_memory=True`` but the segment cannot be had.
        """
        if welcome.shm is None or self._shared_memory is False:
            if self._shared_memory:
                raise InvalidInputError(
                    f"the sidecar at {self.url} offers no shared memory to this client"
                )
            return None
        try:
            return Segment(welcome.shm, welcome.shm_bytes, owner_pid=welcome.pid)
        except OSError as exc:
            if self._shared_memory:
                raise InvalidInputError(
                    f"cannot map the sidecar's shared memory {welcome.shm}: {exc}"
                ) from None
            log.warning("sidecar_shm_unavailable", name=welcome.shm, error=str(exc))
            return None

    def _drop_link(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            self._close_link(link)

    def _close_link(self, link: Link) -> None:
        self._links.discard(link)
        link.close()

    def _disconnected(self, link: Link) -> None:
        """The connection under ``link`` dropped (the sidecar died or restarted): its
        requests end now, as misses, and the keeper says hello again (to a hello in
        flight, the same: it fails now and is retried)."""
        if link is self.link:
            self._lost(link, "the connection to the sidecar dropped")
        elif link in self._links:
            self._close_link(link)

    def _lost(self, link: Link, reason: str) -> None:
        """Give up on ``link`` (calls are misses) and let the keeper reconnect."""
        if self.link is link:
            self._drop_link()
            self.healthy = False
            self.connected = anyio.Event()
            log.warning("sidecar_lost", url=self.url, reason=reason)
            self._probe.set()

    async def _keep(self) -> None:
        """Heartbeats while connected; hellos every ``reconnect_interval`` while not."""
        with self._keeper:
            await self._keep_up()

    async def _keep_up(self) -> None:
        while not self.closed:
            link = self.link
            if link is None:
                try:
                    await self._say_hello()
                    self.counters.reconnects += 1
                except Unavailable:
                    await anyio.sleep(self._reconnect_interval)
                except (InvalidInputError, ProtocolError) as exc:
                    # A sidecar restarted for another namespace: said once, retried quietly.
                    if not self.counters.refused:
                        log.error("sidecar_refused", url=self.url, error=str(exc))
                    self.counters.refused += 1
                    await anyio.sleep(self._reconnect_interval)
                except Exception:  # the keeper must outlive any one failed hello
                    log.exception("sidecar_hello_failed", url=self.url)
                    await anyio.sleep(self._reconnect_interval)
                continue
            assert link.welcome is not None
            with anyio.move_on_after(link.welcome.heartbeat_interval):
                await self._probe.wait()
            self._probe = anyio.Event()
            if self.link is not link:
                continue
            try:
                reply = await link.request(
                    MessageType.HEARTBEAT, None, timeout=self._heartbeat_timeout(link)
                )
            except (Unavailable, ProtocolError, InvalidInputError) as exc:
                self._lost(link, str(exc) or type(exc).__name__)
                continue
            if reply.header.get("server") != link.welcome.server:
                self._lost(link, "the sidecar restarted")
                continue
            self.healthy = bool(reply.header.get("healthy", False))

    def _heartbeat_timeout(self, link: Link) -> float:
        assert link.welcome is not None
        return max(_PROBE_TIMEOUT_FLOOR, min(self.timeout, link.welcome.client_timeout))

    async def usable(self) -> Link | None:
        """The live link, or None (counted: the call is a miss). A miss still yields to
        the event loop, so a caller looping over misses lets the keeper reconnect.

        Raises:
            EngineClosedError: the client is closed.
        """
        self.check_open()
        link = self.link
        if link is None or link.dead:
            self.counters.unavailable += 1
            await anyio.lowlevel.checkpoint()
            return None
        return link

    def send_ahead(
        self,
        link: Link,
        msg_type: MessageType,
        header: dict[str, Any],
        payloads: Sequence[object] = (),
        *,
        timeout: float | None = None,
    ) -> Sent | None:
        """A request on ``link`` whose reply is waited for later (:meth:`Link.send_ahead`),
        counted as :meth:`ask` counts; None when it could not be sent now."""
        sent = link.send_ahead(
            msg_type, header, payloads, timeout=self.timeout if timeout is None else timeout
        )
        if sent is not None:
            self.counters.requests += 1
        return sent

    async def ask(
        self,
        link: Link,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object] = (),
        *,
        meanwhile: Callable[[], object] | None = None,
        timeout: float | None = None,
    ) -> Message:
        """A request on ``link``, waiting ``timeout`` seconds (default: the client's) for
        its reply; a timeout or lost session gives up the link.

        Raises:
            Unavailable, InvalidInputError, ProtocolError: as :meth:`Link.request`.
        """
        self.counters.requests += 1
        wait = self.timeout if timeout is None else timeout
        try:
            return await link.request(msg_type, header, payloads, timeout=wait, meanwhile=meanwhile)
        except SessionLost:
            self._lost(link, "the sidecar has no session for this client")
            raise
        except Unavailable as exc:
            if not link.dead:
                self.counters.timeouts += 1
                log.warning("sidecar_request_timed_out", type=msg_type.name, error=str(exc))
                self._probe.set()  # let the keeper check the server now
            raise
