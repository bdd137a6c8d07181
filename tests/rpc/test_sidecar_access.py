"""Who may use a sidecar, played by an attacker against real ``lmcache-async serve``
processes: CURVE with allow-lists of client and admin certificates.

One sidecar (the *source*) serves ``tcp`` on loopback under CURVE with a client directory
and an admin directory, and publishes events; a second (the *target*) is the only MOVE
target the source lists. Strangers — a plain socket, a socket with the server's key but a
key pair of its own — get no answer to any message type while an allowed client is served
throughout; a client certificate's admin requests are refused with a clear error and an
admin's succeed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import zmq
import zmq.asyncio
import zmq.auth

from lmcache_async import EngineConfig, PermissionDeniedError, RemoteCacheEngine
from lmcache_async.rpc.admin import AdminClient
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.event_subscriber import EventSubscriber
from lmcache_async.rpc.protocol import MessageType, decode, encode, tokens_payload
from lmcache_async.rpc.sidecar import SidecarSettings
from lmcache_async.rpc.sidecar.access import AccessList, Peer, Role
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    READY_TIMEOUT,
    SERVE_FLAGS,
    Sidecar,
    Sidecars,
    in_process,
    kv_for,
    payload_of,
    prompt,
    serve_command,
)
from tests.servers import free_port
from tests.test_engine import poll_until

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

TIMEOUT = 60.0
SILENCE = 1.0
"""How long a refused peer is listened to for an answer that must not come. The same run's
allowed client is answered throughout, so the server is known to be responsive."""
N = 2 * CHUNK


@dataclass
class Keys:
    """Certificates of one run: the two servers', an allowed client's, an admin's and a
    stranger's (secret halves), and the directories of public ones each server allows."""

    directory: Path

    def make(self, name: str, where: str) -> tuple[Path, Path]:
        (self.directory / where).mkdir(exist_ok=True)
        public, secret = zmq.auth.create_certificates(str(self.directory / where), name)
        return Path(public), Path(secret)

    def server_key(self, public: Path) -> bytes:
        key, _ = zmq.auth.load_certificate(str(public))
        return key


@dataclass
class World:
    source: Sidecar
    target: Sidecar
    events: str
    source_key: bytes
    target_key: bytes
    client: Path
    admin: Path
    stranger: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("curve")
    keys = Keys(root)
    source_public, source_secret = keys.make("source", "servers")
    target_public, target_secret = keys.make("target", "servers")
    _, client = keys.make("client", "client-secrets")
    _, admin = keys.make("admin", "admin-secrets")
    _, stranger = keys.make("stranger", "strangers")
    for name, directory in (("client", "clients"), ("admin", "admins")):
        (root / directory).mkdir()
        shutil.copy(root / f"{name}-secrets" / f"{name}.key", root / directory)
    # The target admits the source sidecar's own key (the source moves as that client).
    (root / "target-clients").mkdir()
    shutil.copy(source_public, root / "target-clients")
    launcher = Sidecars(tmp_path_factory.mktemp("curve-logs"))
    target_url = f"tcp://127.0.0.1:{free_port()}"
    events = f"tcp://127.0.0.1:{free_port()}"
    try:
        target = launcher.start(
            target_url,
            "--curve-secret-key-file",
            str(target_secret),
            "--curve-clients",
            str(root / "target-clients"),
            "--curve-admins",
            str(root / "admins"),
        )
        source = launcher.start(
            f"tcp://127.0.0.1:{free_port()}",
            "--curve-secret-key-file",
            str(source_secret),
            "--curve-clients",
            str(root / "clients"),
            "--curve-admins",
            str(root / "admins"),
            "--events",
            events,
            "--move-targets",
            f"{target_url}={target_public}",
        )
        world = World(
            source,
            target,
            events,
            keys.server_key(source_public),
            keys.server_key(target_public),
            client,
            admin,
            stranger,
        )
        for sidecar, key in ((source, world.source_key), (target, world.target_key)):
            anyio.run(wait_ready, sidecar, key, admin)
        yield world
    finally:
        launcher.stop_all()


async def ask(
    url: str,
    keys: CurveClientKeys | None,
    kind: MessageType,
    header: dict[str, Any] | None = None,
    payloads: tuple[Any, ...] = (),
    *,
    timeout: float,
) -> dict[str, Any] | None:
    """One raw request over a fresh DEALER socket: the reply's header, or None when no
    reply came within ``timeout``."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(sock)
    sock.connect(url)
    try:
        with anyio.move_on_after(timeout):
            await sock.send_multipart(encode(kind, header or {}, payloads, request_id=7))
            reply = decode(await sock.recv_multipart())
            return {"type": reply.type, **reply.header}
        return None
    finally:
        sock.close(linger=0)
        context.term()


async def wait_ready(sidecar: Sidecar, server_key: bytes, certificate: Path) -> None:
    keys = CurveClientKeys.make(server_key, str(certificate))
    with anyio.fail_after(READY_TIMEOUT):
        while await ask(sidecar.url, keys, MessageType.PING, timeout=0.5) is None:
            if not sidecar.alive():
                raise RuntimeError(f"the sidecar exited early:\n{sidecar.log()}")


def open_files(sidecar: Sidecar) -> int:
    """How many file descriptors the sidecar process holds now."""
    return len(os.listdir(f"/proc/{sidecar.process.pid}/fd"))


def connect(world: World, certificate: Path, **options: Any) -> Any:
    return RemoteCacheEngine.connect(
        world.source.url,
        LAYOUT,
        model_name=MODEL,
        timeout=10,
        server_public_key=world.source_key,
        client_certificate=str(certificate),
        **options,
    )


def admin_client(world: World, certificate: Path, url: str | None = None) -> AdminClient:
    return AdminClient(
        url or world.source.url,
        timeout=10,
        server_public_key=world.target_key if url else world.source_key,
        client_certificate=str(certificate),
    )


EVERY_REQUEST: list[tuple[MessageType, dict[str, Any], bool]] = [
    (MessageType.HELLO, {"model_name": MODEL, "layout": LAYOUT.to_dict()}, False),
    (MessageType.PING, {}, False),
    (MessageType.HEARTBEAT, {}, False),
    (MessageType.STATS, {}, False),
    (MessageType.HEALTH, {}, False),
    (MessageType.LOOKUP, {}, True),
    (MessageType.PREFETCH, {"lookup_id": 1}, True),
    (MessageType.STORE, {}, True),
    (MessageType.RETRIEVE, {}, True),
    (MessageType.CLEAR, {}, False),
    (MessageType.ERASE, {"tenant": "victim"}, False),
    (MessageType.FREEZE, {"enabled": True}, False),
    (MessageType.HOT_CACHE, {"enabled": False}, False),
    (MessageType.MOVE, {"old_position": "cpu", "new_position": ["tcp://10.0.0.1:1", "cpu"]}, True),
    (MessageType.SHUTDOWN, {}, False),
]


async def test_strangers_get_no_answer_to_any_request_and_the_allowed_client_is_served(
    world: World,
) -> None:
    tokens = prompt(N, salt=27_100)
    kv, slots = kv_for(N, seed=271)
    strangers: list[tuple[str, CurveClientKeys | None]] = [
        ("plain", None),
        ("fresh key pair", CurveClientKeys.make(world.source_key, None)),
        ("stranger's certificate", CurveClientKeys.make(world.source_key, str(world.stranger))),
    ]
    with anyio.fail_after(TIMEOUT):
        async with connect(world, world.client) as engine:
            baseline = open_files(world.source)
            for kind, header, with_tokens in EVERY_REQUEST:
                payloads = (tokens_payload(tokens),) if with_tokens else ()
                for name, keys in strangers:
                    reply = await ask(
                        world.source.url, keys, kind, header, payloads, timeout=SILENCE
                    )
                    assert reply is None, (name, kind.name, reply)
                # Served throughout: a store and exact bytes back after every type.
                assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == N
                target = LAYOUT.allocate_kv_caches(2, random=False)
                loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
                assert bool(loaded.all()), kind.name
                assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
            # Refused peers hold nothing: the descriptors go back to what they were.
            await poll_until(lambda: open_files(world.source) <= baseline, timeout=10)
        assert world.source.alive()
        with admin_client(world, world.admin) as admin:
            stats = await admin.stats()
    refused = stats["server"]["peers_refused"]
    # Two key-carrying strangers, each refused once per connection (one per request).
    assert refused >= 2 * len(EVERY_REQUEST), refused
    log = world.source.log()
    assert log.count("sidecar_peer_refused") == 2, "each refused key is logged once"


async def test_a_client_certificate_may_not_administer_and_an_admin_may(world: World) -> None:
    tokens = prompt(N, salt=27_200)
    kv, slots = kv_for(N, seed=272)
    with anyio.fail_after(TIMEOUT):
        async with connect(world, world.client) as engine:
            stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="alice")
            assert stored == N
            with pytest.raises(PermissionDeniedError, match="admin"):
                await engine.move(tokens, "cpu", (world.target.url, "cpu"), tenant="alice")
            stats = await engine.stats()
            assert "tenants" not in json.dumps(stats)  # no per-tenant figures for a client
        with admin_client(world, world.client) as client:
            for call in (
                client.clear(),
                client.erase("alice"),
                client.freeze(True),
                client.set_hot_cache(False),
                client.request(MessageType.SHUTDOWN),
            ):
                with pytest.raises(PermissionDeniedError, match="admin certificate"):
                    await call
            assert "tenants" not in json.dumps(await client.stats())
        assert world.source.alive()
        async with connect(world, world.client) as engine:
            assert await engine.lookup(tokens, tenant="alice") == N  # nothing erased
        with admin_client(world, world.admin) as admin:
            assert "tenants" in (await admin.stats())["stats"]
            removed = await admin.erase("alice")
            assert removed.get("cpu") == 2, removed
            assert await admin.freeze(False) is False
        async with connect(world, world.client) as engine:
            assert await engine.lookup(tokens, tenant="alice") == 0


async def test_an_admin_moves_a_tenants_prefix_only_to_a_listed_target_over_curve(
    world: World,
) -> None:
    tokens = prompt(N, salt=27_300)
    kv, slots = kv_for(N, seed=273)
    with anyio.fail_after(TIMEOUT):
        async with connect(world, world.client) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="bob") == N
        async with connect(world, world.admin) as admin:
            with pytest.raises(PermissionDeniedError, match="move target"):
                await admin.move(tokens, "cpu", ("tcp://127.0.0.1:9", "cpu"), tenant="bob")
            moved = await admin.move(tokens, "cpu", (world.target.url, "cpu"), tenant="bob")
        assert moved == N
        async with RemoteCacheEngine.connect(
            world.target.url,
            LAYOUT,
            model_name=MODEL,
            timeout=10,
            server_public_key=world.target_key,
            client_certificate=str(world.admin),
        ) as target:
            assert await target.lookup(tokens, tenant="bob") == N  # moved as bob's
            assert await target.lookup(tokens) == 0
            out = LAYOUT.allocate_kv_caches(2, random=False)
            loaded = await target.retrieve(tokens, kv_caches=out, slot_mapping=slots, tenant="bob")
            assert bool(loaded.all())
            assert torch.equal(payload_of(out, slots), payload_of(kv, slots))


class Collected:
    """What one subscriber received, and a way to wait until it holds something."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._arrived = anyio.Event()

    def add(self, event: Any) -> None:
        self.events.append(event)
        self._arrived.set()
        self._arrived = anyio.Event()

    async def until(self, predicate: Any) -> None:
        while not any(predicate(event) for event in self.events):
            await self._arrived.wait()


def starts_with(tokens: list[int]) -> Any:
    def matches(received: Any) -> bool:
        return any(
            getattr(event, "token_ids", ())[:CHUNK] == tuple(tokens[:CHUNK])
            for event in received.events
        )

    return matches


async def test_events_reach_allowed_subscribers_only_and_never_a_named_tenants(
    world: World,
) -> None:
    named, unnamed = prompt(N, salt=27_400), prompt(N, salt=27_401)
    kv, slots = kv_for(N, seed=274)
    subscribers = {
        "plain": EventSubscriber(world.events),
        "stranger": EventSubscriber(
            world.events, keys=CurveClientKeys.make(world.source_key, str(world.stranger))
        ),
        "client": EventSubscriber(
            world.events, keys=CurveClientKeys.make(world.source_key, str(world.client))
        ),
    }
    received = {name: Collected() for name in subscribers}

    async def listen(name: str) -> None:
        while True:
            received[name].add(await subscribers[name].receive())

    try:
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as group:
                for name in subscribers:
                    group.start_soon(listen, name)
                async with connect(world, world.client) as engine:
                    # A subscription reaches the publisher a moment after the connect:
                    # store fresh prompts until the allowed subscriber sees one.
                    for salt in range(27_500, 27_600):
                        probe = prompt(N, salt=salt)
                        assert await engine.store(probe, kv_caches=kv, slot_mapping=slots) == N
                        with anyio.move_on_after(0.5):
                            await received["client"].until(starts_with(probe))
                        if received["client"].events:
                            break
                    stored = await engine.store(
                        named, kv_caches=kv, slot_mapping=slots, tenant="carol"
                    )
                    assert stored == N
                    assert await engine.store(unnamed, kv_caches=kv, slot_mapping=slots) == N
                    # Events go out in order: once the later one is in, the named one
                    # would have been too.
                    await received["client"].until(starts_with(unnamed))
                group.cancel_scope.cancel()
    finally:
        for subscriber in subscribers.values():
            subscriber.close()
    assert received["plain"].events == [] and received["stranger"].events == []
    assert not any(starts_with(named)(event) for event in received["client"].events)
    with admin_client(world, world.admin) as admin:
        info = (await admin.stats())["events"]
    assert info["withheld"] >= 1


def test_a_sidecar_without_an_allow_list_refuses_to_start(tmp_path: Path) -> None:
    _, secret = zmq.auth.create_certificates(str(tmp_path), "server")
    cases = [
        (["--listen", "tcp://0.0.0.0:0", "--allow-remote"], "allow_remote"),
        (["--curve-secret-key-file", secret], "curve_clients"),
    ]
    for flags, field in cases:
        done = subprocess.run(
            [*serve_command(), "serve", *SERVE_FLAGS, *flags],
            capture_output=True,
            timeout=READY_TIMEOUT,
            check=False,
        )
        assert done.returncode == 2, done
        assert field in done.stderr.decode(), done.stderr


async def test_an_ipc_socket_is_its_owners_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    short = Path(tempfile.mkdtemp(prefix="lmc-ac-", dir="/tmp"))
    launcher = Sidecars(tmp_path_factory.mktemp("ipc-logs"))
    old = os.umask(0)  # the most open umask: the sidecar must not depend on it
    try:
        sidecar = launcher.start(f"ipc://{short}/private.sock")
    finally:
        os.umask(old)
    try:
        from tests.rpc.test_sidecar import wait_ready as wait_plain

        with anyio.fail_after(TIMEOUT):
            await wait_plain(sidecar)
        mode = stat.S_IMODE(os.stat(sidecar.socket_path).st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)


async def test_a_session_serves_only_the_key_that_opened_it(tmp_path: Path) -> None:
    """A peer that presents another client's ROUTER identity (as one could after taking it
    over) finds no session: transactions and pins stay with the key that made them."""
    owner, other = zmq.curve_keypair(), zmq.curve_keypair()
    server_public, server_secret = zmq.curve_keypair()
    url = f"tcp://127.0.0.1:{free_port()}"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01),
        curve_secret_key=server_secret,
        access=AccessList(frozenset({owner[0], other[0]})),
    )
    tokens = prompt(N, salt=27_600)
    kv, slots = kv_for(N, seed=276)
    with anyio.fail_after(TIMEOUT):
        async with (
            in_process(settings) as server,
            RemoteCacheEngine.connect(
                url,
                LAYOUT,
                model_name=MODEL,
                timeout=10,
                server_public_key=server_public,
                client_certificate=owner,
            ) as engine,
        ):
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == N
            assert await engine.lookup(tokens, lookup_id="mine", pin=True) == N
            (identity,) = server.sessions.by_identity
            body = encode(MessageType.UNPIN, {"lookup_id": "mine"}, request_id=3)
            intruder = Peer(Role.CLIENT, other[0].decode())
            reply = decode(await server._answer(identity, body, intruder) or [])
            assert (reply.type, reply.header["code"]) == (MessageType.ERROR, "no_session")
            hello = encode(MessageType.HELLO, {"model_name": MODEL}, request_id=4)
            reply = decode(await server._answer(identity, hello, intruder) or [])
            assert reply.header["code"] == "protocol"  # the identity is taken
            stats = (await engine.stats())["engine"]
            assert stats["pinned_chunks"] == 2  # the owner's pins are still there


async def test_an_admins_clear_and_shutdown_succeed_where_a_clients_are_refused(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("curve-shutdown")
    keys = Keys(root)
    server_public, server_secret = keys.make("server", "servers")
    client_public, client = keys.make("client", "clients")
    admin_public, admin = keys.make("admin", "admins")
    launcher = Sidecars(tmp_path_factory.mktemp("curve-shutdown-logs"))
    url = f"tcp://127.0.0.1:{free_port()}"
    key = keys.server_key(server_public)
    tokens = prompt(N, salt=27_700)
    kv, slots = kv_for(N, seed=277)
    try:
        sidecar = launcher.start(
            url,
            "--curve-secret-key-file",
            str(server_secret),
            "--curve-clients",
            str(client_public.parent),
            "--curve-admins",
            str(admin_public.parent),
        )
        with anyio.fail_after(TIMEOUT):
            await wait_ready(sidecar, key, admin)
            async with RemoteCacheEngine.connect(
                url,
                LAYOUT,
                model_name=MODEL,
                timeout=10,
                server_public_key=key,
                client_certificate=str(client),
            ) as engine:
                assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == N
            with AdminClient(
                url, timeout=10, server_public_key=key, client_certificate=str(client)
            ) as c:
                for call in (c.clear(), c.request(MessageType.SHUTDOWN)):
                    with pytest.raises(PermissionDeniedError, match="admin certificate"):
                        await call
            assert sidecar.alive()
            with AdminClient(
                url, timeout=10, server_public_key=key, client_certificate=str(admin)
            ) as a:
                assert await a.clear() == 2
                assert await a.request(MessageType.SHUTDOWN) == {}
            assert await anyio.to_thread.run_sync(sidecar.process.wait, READY_TIMEOUT) == 0
    finally:
        launcher.stop_all()
