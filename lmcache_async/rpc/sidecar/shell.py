"""The sidecar's process shell: :func:`serve` binds the socket, creates the shared-memory
segment, runs a :class:`SidecarServer` until SIGTERM, SIGINT or a SHUTDOWN request, and
takes everything down in order. Beside an ``ipc://`` address without CURVE keys it also
listens on the same-host stream socket (:mod:`~lmcache_async.rpc.stream`).

With a CURVE secret key the ZAP handler (:class:`~lmcache_async.rpc.sidecar.access.Gatekeeper`)
starts before any socket binds, so no peer is ever served before the allow-list applies;
an ``ipc://`` socket file is made readable and writable by its owner only (mode 0600).

Shutdown: requests in flight finish (bounded by :data:`SHUTDOWN_GRACE_SECONDS`),
transactions and pins are released, queued tier writes are flushed, the tiers close, the
shared memory is unlinked and the socket files removed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import signal
import socket
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Final

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup

from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.events import EventPublisher
from lmcache_async.rpc.metrics import MetricsServer, make_registry
from lmcache_async.rpc.sidecar.access import Gatekeeper
from lmcache_async.rpc.sidecar.server import SidecarServer
from lmcache_async.rpc.sidecar.settings import SidecarNamespace, SidecarSettings
from lmcache_async.rpc.stream import bind_stream, stream_path

__all__ = ["SHUTDOWN_GRACE_SECONDS", "serve"]

log = get_logger(__name__)

SHUTDOWN_GRACE_SECONDS: Final = 10.0
"""How long shutdown waits for requests in flight before cancelling them."""

_SHM_DIR: Final = "/dev/shm"


def _create_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A new shared-memory segment for the host arena.

    Raises:
        ConfigError: ``max_local_cpu_size`` does not fit in the shared-memory filesystem
            (writing past it would kill the process with SIGBUS), or it cannot be created.
    """
    size = -(-nbytes // 4096) * 4096
    with contextlib.suppress(OSError):
        stat = os.statvfs(_SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
        if size > free:
            raise ConfigError(
                "max_local_cpu_size",
                f"{size} bytes of shared memory asked, but {_SHM_DIR} has {free} free: "
                "lower max_local_cpu_size or enlarge /dev/shm",
            )
    name = f"lmcache-async-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except OSError as exc:
        raise ConfigError(
            "max_local_cpu_size", f"cannot create {size} bytes of shared memory: {exc}"
        ) from exc


def _owner_only(url: str) -> None:
    """Make the socket file of an ``ipc://`` address readable and writable by its owner
    only (nothing for tcp)."""
    if url.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(url.removeprefix("ipc://"), 0o600)


def _bind(settings: SidecarSettings, context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    """The ROUTER socket bound to ``settings.listen`` (CURVE server with a secret key).

    Raises:
        ConfigError: ``field="listen"``: the address cannot be bound.
    """
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.limits.max_frame_bytes)
    if settings.curve_secret_key is not None:
        sock.curve_secretkey = settings.curve_secret_key
        sock.curve_server = True
    try:
        sock.bind(settings.listen)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError("listen", f"cannot listen on {settings.listen}: {exc}") from None
    _owner_only(settings.listen)
    return sock


def _bind_stream(settings: SidecarSettings) -> socket.socket | None:
    """The same-host stream listener beside an ``ipc://`` address without CURVE keys (None
    otherwise, or when its path cannot be bound: clients then use ZeroMQ)."""
    path = stream_path(settings.listen)
    if path is None or settings.curve_secret_key is not None or not settings.stream:
        return None
    try:
        return bind_stream(path)
    except OSError as exc:
        log.warning("sidecar_stream_unavailable", path=path, error=str(exc))
        return None


def _close_segment(segment: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()
    gc.collect()  # views on the mapping held in reference cycles go first
    try:
        segment.close()
    except BufferError:
        # A payload view still refers to the mapping; it goes with the process.
        log.debug("sidecar_segment_still_mapped", name=segment.name)


async def serve(
    settings: SidecarSettings,
    *,
    on_ready: Callable[[SidecarServer], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Run a sidecar until SIGTERM or SIGINT (with ``handle_signals``) or a SHUTDOWN request.

    ``on_ready`` is called once the socket is bound (and, when ``settings.namespace`` is
    set, the engine is open). Shutdown is orderly: requests in flight get up to
    :data:`SHUTDOWN_GRACE_SECONDS`, transactions and pins are released, the engine flushes
    queued tier writes and closes, the segment is unlinked and the ipc file removed.

    Raises:
        ConfigError: the address cannot be bound, shared memory cannot be had, or the
            engine cannot open with ``settings.namespace``.
    """
    segment = _create_segment(settings.config.cpu_capacity_bytes)
    context = zmq.asyncio.Context()
    gatekeeper: Gatekeeper | None = None
    sock: zmq.asyncio.Socket | None = None
    stream: socket.socket | None = None
    server: SidecarServer | None = None
    try:
        if settings.access is not None:
            gatekeeper = Gatekeeper(context, settings.access)
            gatekeeper.start()
        sock = _bind(settings, context)
        stream = _bind_stream(settings)
        server = SidecarServer(settings, sock, segment)
        server.stream_listener = stream
        server.gatekeeper = gatekeeper
        if settings.events is not None:
            server.publisher = EventPublisher(
                settings.events,
                topic=settings.events_topic.encode("utf-8"),
                replay=settings.events_replay,
                allow_remote=settings.allow_remote,
                context=context,
                curve_secret_key=settings.curve_secret_key,
                tenant_events=settings.tenant_events,
            )
            _owner_only(settings.events)
            if settings.events_replay is not None:
                _owner_only(settings.events_replay)
        if settings.metrics_port is not None:
            server.metrics = await MetricsServer.bind(
                make_registry(server.collector()), port=settings.metrics_port
            )
        refused: ConfigError | None = None
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(server.host_engine, name="sidecar-engine")
            if settings.namespace is not None:
                refused = await _open_given(server, settings.namespace)
            if refused is not None:
                await server.host.close()
                task_group.cancel_scope.cancel()
            else:
                if handle_signals:
                    task_group.start_soon(_watch_signals, server.stopping, name="sidecar-signals")
                await _run(server, task_group, on_ready)
        server.host.release_buffer()
        if refused is not None:
            raise refused  # after the task group, so the caller gets it as it is
    finally:
        if server is not None and server.metrics is not None:
            with anyio.CancelScope(shield=True):
                await server.metrics.aclose()
        if server is not None and server.publisher is not None:
            server.publisher.close()
        if sock is not None:
            sock.close(linger=0)
        if stream is not None:
            path = stream.getsockname()
            stream.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if gatekeeper is not None:
            gatekeeper.stop()
        context.term()
        if settings.listen.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.listen.removeprefix("ipc://"))
        _close_segment(segment)
        log.info("sidecar_stopped", endpoint=settings.listen)


async def _run(
    server: SidecarServer,
    task_group: TaskGroup,
    on_ready: Callable[[SidecarServer], None] | None,
) -> None:
    """Serve until :attr:`SidecarServer.stopping`, then shut down in order."""
    settings = server.settings
    task_group.start_soon(server.sessions.reap, name="sidecar-reaper")
    if server.publisher is not None:
        task_group.start_soon(server.publisher.watch_subscriptions, name="sidecar-subscriptions")
    if server.metrics is not None:
        task_group.start_soon(server.metrics.serve, name="sidecar-metrics")
    receiving = anyio.CancelScope()

    async def receive() -> None:
        with receiving:
            await server.receive()

    task_group.start_soon(receive, name="sidecar-receive")
    log.info(
        "sidecar_ready",
        endpoint=settings.listen,
        stream=server.stream_listener is not None,
        shm=server.segment_name,
        curve=settings.curve_secret_key is not None,
        clients=0 if settings.access is None else len(settings.access.clients),
        admins=0 if settings.access is None else len(settings.access.admins),
    )
    if on_ready is not None:
        on_ready(server)
    await server.stopping.wait()
    log.info("sidecar_stopping", **server.info())
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            await server.wait_idle()
        receiving.cancel()
        await server.host.close()
    task_group.cancel_scope.cancel()


async def _open_given(server: SidecarServer, namespace: SidecarNamespace) -> ConfigError | None:
    """Open the engine for a namespace given at start; the error that prevents it, if any."""
    try:
        await server.host.open(namespace)
    except ConfigError as exc:
        return exc
    except InvalidInputError as exc:
        return ConfigError("namespace", str(exc))
    return None


async def _watch_signals(stopping: anyio.Event) -> None:
    """Turn SIGTERM and SIGINT into ``stopping``. The handlers stay installed until the
    shutdown is over (this task is cancelled then), so a second signal cannot kill the
    process halfway through it."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if stopping.is_set():
                log.info("sidecar_signal_while_stopping", signal=name)
            else:
                log.info("sidecar_signal", signal=name)
                stopping.set()
