"""The Redis tier's bulk path (``backends/redis_wire``): values received into, and sent
from, pool memory on connections of the tier's own, against real servers.

Every URL form reaches the server on the bulk path (TCP, Unix socket, TLS, Valkey's
scheme, a three-node cluster, ACL users and a database); values of every size around a
pool page come back byte-exact; replies cut at every boundary by a proxy read correctly;
a server that breaks off, lies about a length or stalls costs a miss within the deadline,
marks the tier down, and leaves nothing allocated; a retrieve cancelled mid-value leaves
no page behind. The pool's counters (objects, used bytes) are checked after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
import torch

from lmcache_async.backends.record import RecordSpec
from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX, RedisBackend
from lmcache_async.backends.redis_wire import WireStream
from lmcache_async.backends.redis_wire.resp import read_reply
from lmcache_async.errors import TierError, TierUnavailableError
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from tests.servers import RedisCluster, RedisServer, free_port

pytestmark = pytest.mark.subprocess

MIB = 1 << 20
ACL_USER, ACL_PASSWORD = "alice", "s3cr3t pass"
ACL_ARGS = (
    # The default user may only PING (how the fixture sees the server is up): every other
    # command, the bulk path's included, works only after AUTH as the ACL user.
    *("--user", "default", "on", "nopass", "-@all", "+ping"),
    *("--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all"),
)


def byte_spec(max_bytes: int) -> RecordSpec:
    """Records whose payload is ``n`` raw bytes, ``1 <= n <= max_bytes``."""
    return RecordSpec(
        fingerprint="wire-test",
        fmt="BYTES",
        dtype=torch.uint8,
        max_tokens=max_bytes,
        shape_of=lambda n: (n,),
    )


def key(i: int, salt: int = 0) -> ChunkKey:
    return ChunkKey((i + (salt << 64)).to_bytes(DIGEST_SIZE, "little"))


def rkey(k: ChunkKey) -> bytes:
    return (DEFAULT_KEY_PREFIX + k.to_str()).encode()


@dataclass
class Env:
    pool: MemoryPool
    spec: RecordSpec
    tier: RedisBackend
    objs: list[MemoryObj] = field(default_factory=list)

    def live(self) -> tuple[int, int]:
        """Objects and bytes the pool has handed out."""
        stats = self.pool.stats()
        return stats.num_objects, stats.used_bytes

    async def filled(self, sizes: Sequence[int], seed: int = 0) -> list[MemoryObj]:
        """Pool objects of random bytes, kept by the test (released at the end)."""
        gen = torch.Generator().manual_seed(seed)
        made = []
        for size in sizes:
            obj = await self.pool.allocate((size,), torch.uint8, timeout=1)
            obj.tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
            made.append(obj)
        self.objs += made
        return made


Opener = Callable[..., Any]


@pytest.fixture
async def open_tier() -> AsyncIterator[Opener]:
    """Open tiers on fresh pools; at the end close them and check the pools are empty."""
    envs: list[Env] = []

    async def opener(
        url: str,
        *,
        max_bytes: int = 33 * MIB,
        capacity: int | None = None,
        page_size: int | None = None,
        **options: Any,
    ) -> Env:
        spec = byte_spec(max_bytes)
        sizing = {} if page_size is None else {"page_size": page_size}
        capacity = capacity or 3 * max_bytes + 8 * MIB
        pool = MemoryPool(capacity, pin_memory=False, **sizing)
        options.setdefault("timeout", 10.0)
        options.setdefault("batch_bytes", 2 * max_bytes)
        tier = await RedisBackend.open(url, pool=pool, spec=spec, allocation_timeout=2.0, **options)
        env = Env(pool, spec, tier)
        envs.append(env)
        return env

    yield opener
    for env in envs:
        await env.tier.aclose()
        for obj in env.objs:
            obj.unref()
        assert env.live() == (0, 0), "the tier left pool memory allocated"


def edge_sizes(pool: MemoryPool, *large: int) -> list[int]:
    """1 byte, a page less one, a page and one (the pool's page), then ``large``."""
    page = pool.page_size
    return [1, page - 1, page + 1, *large]


async def assert_round_trip(env: Env, keys: list[ChunkKey], objs: list[MemoryObj]) -> None:
    """Every key reads back byte-exact (get and get_prefix); what was read is released and
    the pool is back to the caller's objects alone."""
    before = env.live()
    for read in (env.tier.get, env.tier.get_prefix):
        got = await read(keys)
        try:
            assert len(got) == len(objs)
            for obj, back in zip(objs, got, strict=True):
                assert back is not None
                assert back.nbytes == obj.nbytes
                assert torch.equal(back.tensor, obj.tensor)
        finally:
            for back in got:
                if back is not None:
                    back.unref()
        assert env.live() == before


# -- every URL form, values around a page ----------------------------------------------


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) PEMs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    begin, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lmcache-async test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.fixture
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A redis-server speaking TLS on ``tls_port`` (and plain TCP for the fixture's own
    checks), with the ACL user; yields ``(server, rediss URL in db 2 as that user)``."""
    directory = tmp_path_factory.mktemp("redis-tls")
    ca, cert, private = make_certificates(directory)
    tls_port = free_port()
    args = (
        *("--tls-port", str(tls_port)),
        *("--tls-cert-file", str(cert), "--tls-key-file", str(private)),
        *("--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"),
        *ACL_ARGS,
    )
    with RedisServer(directory / "data", args=args).start() as server:
        url = f"rediss://{ACL_USER}:{ACL_PASSWORD.replace(' ', '%20')}@127.0.0.1:{tls_port}/2"
        yield server, f"{url}?ssl_ca_certs={ca}"


@pytest.fixture
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with RedisServer(tmp_path_factory.mktemp("redis-acl"), args=ACL_ARGS).start() as server:
        yield server


@pytest.fixture(params=["redis", "unix", "valkey", "rediss", "acl", "cluster"])
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    """``(url, kind)`` of each deployment the bulk path must reach."""
    kind = request.param
    if kind == "rediss":
        _, url = request.getfixturevalue("tls_server")
        return url, kind
    if kind == "acl":
        server: RedisServer = request.getfixturevalue("acl_server")
        secret = ACL_PASSWORD.replace(" ", "%20")
        return f"redis://{ACL_USER}:{secret}@127.0.0.1:{server.port}/3", kind
    if kind == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url, kind
    server = request.getfixturevalue("redis_server")
    if kind == "unix":
        return server.unix_url, kind
    return server.url.replace("redis://", f"{kind}://"), kind


@pytest.mark.anyio
async def test_values_round_trip_byte_exact_on_every_url_form(
    target: tuple[str, str], open_tier: Opener
) -> None:
    url, kind = target
    env = await open_tier(url)
    sizes = edge_sizes(env.pool, 3 * MIB, 32 * MIB)
    if kind == "cluster":
        sizes += [100 + i for i in range(24)]  # enough keys to land on every node
    keys = [key(i) for i in range(len(sizes))]
    objs = await env.filled(sizes)
    with anyio.fail_after(60):
        assert await env.tier.put(keys, objs) == len(keys)
        await assert_round_trip(env, keys, objs)
        # EXISTS on the bulk path too: each key's answer in its place, on every node.
        missing = [key(i, salt=1) for i in range(3)]
        asked = [missing[0], *keys[:5], missing[1], *keys[5:], missing[2]]
        present = await env.tier._conn.exists([rkey(k) for k in asked])
        assert present == [k not in missing for k in asked]
        assert await env.tier.contains_prefix([*keys, missing[0], *keys]) == len(keys)
    wire = env.tier._conn.wire
    assert wire.in_use == 0
    if kind == "cluster":
        assert len(wire.idle) == 3, "each primary's values on a connection of its own"
    else:
        assert len(wire.idle) == 1, "the values went on the bulk path's own connection"
    if kind == "acl":
        # Written as the ACL user into database 3: where a client logged in alike sees it.
        raw: Any = redis.asyncio.Redis.from_url(url)
        try:
            assert await raw.strlen(rkey(keys[0])) > 1
        finally:
            await raw.aclose()


@pytest.mark.anyio
async def test_the_bulk_path_logs_in_as_the_url_says(
    acl_server: RedisServer, open_tier: Opener
) -> None:
    # Without credentials the server refuses every command but PING: redis-py's EXISTS
    # and the bulk GET alike are refused, a TierError each, the tier not marked down.
    env = await open_tier(f"redis://127.0.0.1:{acl_server.port}", max_bytes=MIB)
    with anyio.fail_after(10):
        with pytest.raises(TierError):
            await env.tier.get([key(0)])
        with pytest.raises(TierError):
            await env.tier.put([key(0)], await env.filled([10]))
    assert env.live() == (1, env.pool.page_size)


# -- replies cut at every boundary --------------------------------------------------------


class Proxy:
    """A TCP proxy between the tier and a server: requests pass as they come, replies in
    pieces of ``piece`` bytes (each received on its own); with ``hold_after`` it stops
    forwarding replies after that many bytes until :meth:`release`."""

    def __init__(self, upstream: int, piece: int, hold_after: int | None = None) -> None:
        self.upstream = upstream
        self.piece = piece
        self.hold_after = hold_after
        self.forwarded = 0
        self.held = asyncio.Event()
        self._gate = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    def release(self) -> None:
        self.hold_after = None
        self._gate.set()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.release()
        for writer in list(self._writers):
            writer.close()  # each pipe then ends at its end of stream
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        ends = [writer]
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
            ends.append(up_writer)
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pipe(reader, up_writer, None), self._pipe(up_reader, writer, self.piece)
            )
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for end in ends:
                end.close()
                self._writers.discard(end)
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, piece: int | None
    ) -> None:
        while data := await reader.read(1 << 20):
            if piece is None:
                writer.write(data)
                await writer.drain()
                continue
            for at in range(0, len(data), piece):
                if self.hold_after is not None and self.forwarded >= self.hold_after:
                    self.held.set()
                    await self._gate.wait()
                writer.write(data[at : at + piece])
                self.forwarded += len(data[at : at + piece])
                await writer.drain()
                # Two turns of the loop: the tier reads this piece before the next is sent.
                await asyncio.sleep(0)
                await asyncio.sleep(0)
        writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("piece", [1, 7, 4096])
async def test_replies_split_at_every_boundary_read_correctly(
    redis_server: RedisServer, open_tier: Opener, piece: int
) -> None:
    async with Proxy(redis_server.port, piece) as proxy:
        env = await open_tier(f"redis://127.0.0.1:{proxy.port}", max_bytes=4 * MIB, page_size=4096)
        large = [3 * MIB] if piece == 4096 else [50_000] if piece == 7 else []
        sizes = edge_sizes(env.pool, *large)
        keys = [key(i) for i in range(len(sizes))]
        objs = await env.filled(sizes)
        with anyio.fail_after(120):
            assert await env.tier.put(keys, objs) == len(keys)
            await assert_round_trip(env, keys, objs)
            # A missing key among them is a None, the values around it intact.
            got = await env.tier.get([keys[0], key(99), keys[1]])
        try:
            assert got[1] is None
            for obj, back in ((objs[0], got[0]), (objs[1], got[2])):
                assert back is not None and torch.equal(back.tensor, obj.tensor)
        finally:
            for back in got:
                if back is not None:
                    back.unref()
        assert env.tier.stats().corrupt == 0 and env.tier.healthy()
        await env.tier.aclose()


async def _fed(stream: WireStream, data: bytes, piece: int) -> None:
    """Feed ``data`` to ``stream`` as its transport would, ``piece`` bytes per receive."""
    at = 0
    while at < len(data):
        buffer = stream.get_buffer(-1)
        count = min(piece, len(buffer), len(data) - at)
        buffer[:count] = data[at : at + count]
        stream.buffer_updated(count)
        at += count
        await asyncio.sleep(0)


@pytest.mark.anyio
@pytest.mark.parametrize("piece", [1, 2, 7, 13, 4096])
async def test_a_stream_reads_replies_split_anywhere(piece: int) -> None:
    # The stream without a socket, fed by hand: a line, a value received into its
    # destination (seen piece by piece as it lands), a skipped value, simple replies.
    payload = os.urandom(70_000)
    data = (
        b"$%d\r\n%s\r\n" % (len(payload), payload)
        + b"$5\r\nhello\r\n"
        + b"+OK\r\n$-1\r\n-MOVED 1 127.0.0.1:1\r\n:42\r\n"
    )
    stream = WireStream()
    dest = memoryview(bytearray(len(payload)))
    seen = bytearray()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_fed, stream, data, piece)
        with anyio.fail_after(30):
            assert await stream.read_line() == b"$%d" % len(payload)
            await stream.read_into(dest, seen.extend)
            assert await stream.read_exact(2) == b"\r\n"
            assert await stream.read_line() == b"$5"
            await stream.skip(7)
            replies = [await read_reply(stream) for _ in range(4)]
    assert bytes(dest) == payload and bytes(seen) == payload
    assert replies[0] == b"OK" and replies[1] is None and replies[3] == 42
    assert getattr(replies[2], "redirect", False)
    assert stream.reusable is False  # never connected


class _CountingTransport:
    """The transport side a :class:`WireStream` drives: counts pauses and resumes."""

    def __init__(self) -> None:
        self.paused = False
        self.pauses = self.resumes = 0

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False
        self.resumes += 1


@pytest.mark.anyio
async def test_a_full_buffer_resumes_reading_once_a_value_not_per_read() -> None:
    # A fast sender fills the 64 KiB scratch buffer while the reader handles a value's
    # header: reading pauses. Reads of the header out of the full buffer must not resume
    # it each (the transport would receive a few bytes and pause again, several times a
    # value); it resumes when the value's destination waits for the rest.
    values = [os.urandom(256 * 1024) for _ in range(16)]
    data = b"".join(b"$%d\r\n%s%s\r\n" % (40 + len(v), b"h" * 40, v) for v in values)
    transport = _CountingTransport()
    stream = WireStream()
    stream.connection_made(transport)  # type: ignore[arg-type]

    async def feed() -> None:
        at = 0
        while at < len(data):
            while not transport.paused and at < len(data):  # as fast as the buffers allow
                buffer = stream.get_buffer(-1)
                count = min(16 * 1024, len(buffer), len(data) - at)
                buffer[:count] = data[at : at + count]
                stream.buffer_updated(count)
                at += count
            await asyncio.sleep(0)

    got = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed)
        with anyio.fail_after(30):
            for value in values:
                assert await stream.read_line() == b"$%d" % (40 + len(value))
                assert await stream.read_exact(40) == b"h" * 40
                await asyncio.sleep(0)  # the pool allocation, meanwhile the sender sends
                dest = memoryview(bytearray(len(value)))
                await stream.read_into(dest)
                assert await stream.read_exact(2) == b"\r\n"
                got.append(bytes(dest))
    assert got == values
    assert transport.pauses >= len(values)  # the case this is about did happen
    assert transport.resumes <= len(values) + 1


# -- a server that breaks off, lies or stalls ---------------------------------------------


class FakeRedis:
    """Enough of a Redis server for the tier: PING, HELLO (refused), CLIENT, AUTH, SELECT,
    EXISTS, UNLINK, and GET of ``values`` answered as :attr:`mode` says: ``ok``;
    ``closed`` (half the value, then the connection closed); ``short`` (fewer bytes than
    announced, then silence); ``oversized`` (a length past any record, then silence);
    ``stalled`` (no answer)."""

    def __init__(self, values: dict[bytes, bytes]) -> None:
        self.values = values
        self.mode = "ok"
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FakeRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                args = await self._command(reader)
                name = args[0].upper()
                if name == b"GET":
                    if not await self._get(args[1], writer):
                        return
                elif name == b"EXISTS" and self.mode == "garbled":
                    writer.write(b"$3\r\nyes\r\n")  # not an integer
                elif name == b"EXISTS":
                    writer.write(b":%d\r\n" % sum(arg in self.values for arg in args[1:]))
                elif name in (b"UNLINK", b"DEL"):
                    writer.write(b":0\r\n")
                elif name == b"PING":
                    writer.write(b"+PONG\r\n")
                elif name == b"HELLO":  # no RESP3 here: redis-py falls back to RESP2
                    writer.write(b"-ERR unknown command 'HELLO'\r\n")
                else:
                    writer.write(b"+OK\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    @staticmethod
    async def _command(reader: asyncio.StreamReader) -> list[bytes]:
        line = await reader.readline()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)  # the client left
        count = int(line[1:])
        args = []
        for _ in range(count):
            size = int((await reader.readline())[1:])
            args.append((await reader.readexactly(size + 2))[:-2])
        return args

    async def _get(self, name: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one GET; False when the connection is to end."""
        value = self.values.get(name)
        if value is None:
            writer.write(b"$-1\r\n")
            return True
        mode = self.mode
        if mode == "ok":
            writer.write(b"$%d\r\n%s\r\n" % (len(value), value))
        elif mode == "closed":
            writer.write(b"$%d\r\n%s" % (len(value), value[: len(value) // 2]))
            await writer.drain()
            return False
        elif mode == "short":
            writer.write(b"$%d\r\n%s\r\n" % (len(value), value[:-100]))
        elif mode == "oversized":
            writer.write(b"$%d\r\n%s" % (len(value) * 4, value[:1000]))
        return True


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["closed", "short", "oversized", "stalled"])
async def test_a_server_failing_mid_value_costs_a_miss_within_the_deadline(
    open_tier: Opener, mode: str
) -> None:
    timeout = 0.5
    k = key(7)
    payload = os.urandom(MIB)
    obj_bytes = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    async with FakeRedis({}) as fake:
        env = await open_tier(f"redis://127.0.0.1:{fake.port}", max_bytes=MIB, timeout=timeout)
        (source,) = await env.filled([MIB])
        source.tensor.copy_(obj_bytes)
        header, body = env.spec.encode(k, source)
        fake.values[rkey(k)] = bytes(header) + bytes(body)
        deadline = timeout + 2 * MIB / 50e6  # the call's: see RedisConnection.guard
        before = env.live()

        fake.mode = mode
        with anyio.fail_after(5 * deadline), pytest.raises(TierUnavailableError):
            await env.tier.get([k])
        assert not env.tier.healthy(), "a server that fails mid-value marks the tier down"
        assert env.live() == before, "nothing the read allocated is left"
        assert env.tier._conn.wire.in_use == 0

        fake.mode = "ok"  # the server is back
        with anyio.fail_after(10):
            assert await env.tier.check_health()
            got = await env.tier.get([k])
        try:
            assert got[0] is not None and torch.equal(got[0].tensor, obj_bytes)
        finally:
            if got[0] is not None:
                got[0].unref()
        assert env.live() == before and env.tier.stats().corrupt == 0
        await env.tier.aclose()


@pytest.mark.anyio
async def test_a_garbled_exists_reply_marks_the_tier_down_until_it_answers_again(
    open_tier: Opener,
) -> None:
    async with FakeRedis({rkey(key(1)): b"x"}) as fake:
        env = await open_tier(f"redis://127.0.0.1:{fake.port}", max_bytes=MIB, timeout=0.5)
        with anyio.fail_after(10):
            assert await env.tier.contains_prefix([key(1), key(2)]) == 1
            fake.mode = "garbled"
            with pytest.raises(TierUnavailableError, match="EXISTS"):
                await env.tier.contains_prefix([key(1)])
            assert not env.tier.healthy()
            assert env.tier._conn.wire.in_use == 0 and not env.tier._conn.wire.idle
            fake.mode = "ok"
            assert await env.tier.check_health()
            assert await env.tier.contains_prefix([key(1), key(2)]) == 1
        await env.tier.aclose()


# -- cancelled mid-transfer ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_retrieve_cancelled_mid_value_leaves_no_page_behind(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    async with Proxy(redis_server.port, 64 * 1024) as proxy:
        env = await open_tier(f"redis://127.0.0.1:{proxy.port}", max_bytes=4 * MIB)
        keys = [key(i) for i in range(3)]
        objs = await env.filled([3 * MIB] * 3)
        with anyio.fail_after(30):
            assert await env.tier.put(keys, objs) == 3
        before = env.live()

        # Replies stop a megabyte into the second value: the first object is loaded,
        # the second half written, when the caller gives up.
        proxy.forwarded = 0
        proxy.hold_after = 4 * MIB
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def retrieve() -> None:
                with scope:
                    await env.tier.get(keys)

            tg.start_soon(retrieve)
            with anyio.fail_after(30):
                await proxy.held.wait()
                while env.live()[0] < before[0] + 2:  # the tier takes what came  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            scope.cancel()
        assert env.live() == before, "no page of the cancelled read survives"
        assert env.tier.healthy(), "a caller giving up is no fault of the server"
        assert env.tier._conn.wire.in_use == 0

        proxy.release()
        with anyio.fail_after(30):
            await assert_round_trip(env, keys, objs)
        await env.tier.aclose()


@pytest.mark.anyio
async def test_reads_cut_short_at_any_moment_leak_nothing(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    env = await open_tier(redis_server.url, max_bytes=8 * MIB, capacity=100 * MIB)
    keys = [key(i) for i in range(6)]
    objs = await env.filled([8 * MIB] * 6)
    with anyio.fail_after(30):
        assert await env.tier.put(keys, objs) == 6
    before = env.live()
    for delay in (0, 0.0005, 0.002, 0.005, 0.01, 0.02, 0.05):
        for read in (env.tier.get, env.tier.get_prefix):
            with anyio.move_on_after(delay):
                for back in await read(keys):
                    if back is not None:
                        back.unref()
            assert env.live() == before
        assert env.tier._conn.wire.in_use == 0
    with anyio.fail_after(30):
        await assert_round_trip(env, keys, objs)


# -- deadlines and a stale slot map ---------------------------------------------------------


@pytest.mark.anyio
async def test_waiting_for_pool_memory_does_not_count_against_the_deadline(
    redis_server: RedisServer, open_tier: Opener
) -> None:
    # The pool is full when the value arrives; the call's deadline (0.3 s and a little)
    # stops while the read waits for memory, which comes after half a second.
    env = await open_tier(redis_server.url, max_bytes=MIB, capacity=2 * MIB, timeout=0.3)
    env.tier._loader.allocation_timeout = 10.0
    keys = [key(0)]
    first, second = await env.filled([MIB, MIB])
    with anyio.fail_after(10):
        assert await env.tier.put(keys, [first]) == 1

    async def free_later() -> None:
        await anyio.sleep(0.5)
        env.objs.remove(second)
        second.unref()

    async with anyio.create_task_group() as tg:
        tg.start_soon(free_later)
        with anyio.fail_after(20):
            got = await env.tier.get(keys)
    try:
        assert got[0] is not None and torch.equal(got[0].tensor, first.tensor)
    finally:
        if got[0] is not None:
            got[0].unref()
    assert env.tier.healthy() and env.tier.stats().errors == 0


@pytest.mark.anyio
async def test_a_stale_slot_map_costs_misses_then_is_refreshed(
    redis_cluster: RedisCluster, open_tier: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_async.backends.redis_wire import client

    env = await open_tier(redis_cluster.url, max_bytes=MIB)
    keys = [key(i) for i in range(24)]
    objs = await env.filled([1000 + i for i in range(24)])
    # Every key sent to the node of slot 0: the others answer MOVED, which is a write
    # not made and a read that missed, never an error.
    monkeypatch.setattr(client, "key_slot", lambda rkey: 0)
    with anyio.fail_after(30):
        stored = await env.tier.put(keys, objs)
        got = await env.tier.get(keys)
    found = [back is not None for back in got]
    for back in got:
        if back is not None:
            back.unref()
    assert 0 < stored < len(keys) and sum(found) == stored
    assert env.tier.healthy() and env.tier.stats().errors == 0
    monkeypatch.undo()
    with anyio.fail_after(30):
        assert await env.tier.put(keys, objs) == len(keys) - stored
        await assert_round_trip(env, keys, objs)


@pytest.mark.anyio
async def test_waits_of_several_nodes_stop_the_deadline_once() -> None:
    # Two primaries' reads wait for memory in overlapping spans (A starts, B starts, A
    # ends, B ends): the deadline stops from the first start to the last end.
    from lmcache_async.backends.redis_conn import Deadline

    with anyio.CancelScope(deadline=anyio.current_time() + 100) as scope:
        deadline = Deadline(scope)
        before = scope.deadline
        first, second = deadline.paused(), deadline.paused()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert scope.deadline == math.inf
        await anyio.sleep(0.01)
        second.__exit__(None, None, None)
        assert before + 0.01 <= scope.deadline < math.inf
