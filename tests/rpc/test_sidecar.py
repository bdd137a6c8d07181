"""The sidecar cache server and RemoteCacheEngine across real processes.

Sidecars are started with ``lmcache-async serve`` and waited for by a PING handshake retry
loop; client processes are tests/rpc/sidecar_client.py (KV through the shared segment)
and tests/rpc/sidecar_doomed.py (dies between a store's allocation and its commit). The
CURVE and dead-server tests run their server or client in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.lowlevel
import msgpack
import pytest
import structlog
import torch
import zmq
import zmq.asyncio

from lmcache_async import (
    EngineConfig,
    InvalidInputError,
    KVLayout,
    RemoteCacheEngine,
    TierUnavailableError,
)
from lmcache_async.cli import main
from lmcache_async.errors import ConfigError, ProtocolError
from lmcache_async.keys.chunks import DIGEST_SIZE, LINK_SIZE, DigestGuess
from lmcache_async.logging import configure_logging
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.wire import Unavailable
from lmcache_async.rpc.curve import load_client_certificate, load_curve_secret_key
from lmcache_async.rpc.protocol import MessageLimits, MessageType, decode, encode
from lmcache_async.rpc.sidecar import SidecarNamespace, SidecarServer, SidecarSettings, serve
from lmcache_async.rpc.sidecar.access import AccessList
from lmcache_async.rpc.transport import check_listen_url
from lmcache_async.tenancy.tenants import tenant_tag

HERE = Path(__file__).parent
CLIENT_SCRIPT = HERE / "sidecar_client.py"
DOOMED_SCRIPT = HERE / "sidecar_doomed.py"
READY_TIMEOUT = 90.0  # a loaded CI machine takes a while to import torch
STOP_TIMEOUT = 30.0
CHUNK = 16
BLOCK_SIZE = 16
HEARTBEAT = 0.2  # sessions time out after 5 heartbeats: 1 s
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=16, block_size=BLOCK_SIZE, dtype=torch.float16
)
MODEL = "sidecar-test"
SERVE_FLAGS = [
    "--chunk-size",
    str(CHUNK),
    "--max-local-cpu-size",
    "0.02",
    "--heartbeat-interval",
    str(HEARTBEAT),
]


def prompt(length: int, salt: int = 0) -> list[int]:
    """The token ids the client scripts use (sidecar_client.prompt)."""
    return [(i * 7919 + 13 + salt) % 50_000 for i in range(length)]


def kv_for(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-num_tokens // BLOCK_SIZE)
    return LAYOUT.allocate_kv_caches(blocks, generator=generator), torch.arange(num_tokens)


def payload_of(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(LAYOUT.payload_shape(len(slots)), dtype=LAYOUT.dtype)
    LAYOUT.gather(kv_caches, slots, out)
    return out


def serve_command() -> list[str]:
    """``lmcache-async`` as installed next to this interpreter (else ``-m``)."""
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


# -- sidecar processes -----------------------------------------------------------------------


@dataclass
class Sidecar:
    """One ``lmcache-async serve`` process."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        return Path(self.url.removeprefix("ipc://"))

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: the socket file and the segment stay behind."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT)

    def terminate(self) -> int:
        """SIGTERM and wait (SIGKILL if it does not exit); returns the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Sidecars:
    """Starts sidecars; :meth:`stop_all` stops every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._started: list[Sidecar] = []

    def start(self, url: str, *extra: str) -> Sidecar:
        args = [*serve_command(), "serve", "--listen", url, *SERVE_FLAGS, *extra]
        log_path = self._log_dir / f"sidecar-{len(self._started)}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        sidecar = Sidecar(url, process, log_path, log_file)
        self._started.append(sidecar)
        return sidecar

    def stop_all(self) -> None:
        for sidecar in self._started:
            sidecar.terminate()


async def ping(url: str, timeout: float, curve_key: bytes | None = None) -> bool:
    """One PING round trip (no session needed): True when the sidecar answered in time."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if curve_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_key, public, secret
    sock.connect(url)
    try:
        with anyio.move_on_after(timeout):
            await sock.send_multipart(encode(MessageType.PING, request_id=1))
            reply = decode(await sock.recv_multipart())
            return reply.type is MessageType.PING
        return False
    finally:
        sock.close(linger=0)
        context.term()


async def wait_ready(sidecar: Sidecar) -> None:
    """Retry the handshake until the sidecar answers (bounded; no fixed sleep)."""
    with anyio.fail_after(READY_TIMEOUT):
        while not await ping(sidecar.url, 0.5):
            if not sidecar.alive():
                raise RuntimeError(f"the sidecar exited early:\n{sidecar.log()}")


def left_behind(sidecar: Sidecar, segment: str) -> list[str]:
    """The files a stopped sidecar failed to remove: its ipc and stream sockets, its
    segment."""
    socket_path = str(sidecar.socket_path)
    paths = [socket_path, f"{socket_path}.stream", os.path.join("/dev/shm", segment)]
    return [path for path in paths if os.path.exists(path)]


def run_client(url: str, mode: str, tokens: int, seed: int, salt: int = 0) -> dict[str, Any]:
    args = [sys.executable, str(CLIENT_SCRIPT), "--url", url, "--mode", mode]
    args += ["--tokens", str(tokens), "--seed", str(seed), "--salt", str(salt)]
    done = subprocess.run(args, capture_output=True, timeout=READY_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


@pytest.fixture(autouse=True)
def _log_to_stderr(restore_logging: None) -> None:
    """Each test logs to its own stderr, and leaves logging as it found it: ``main``
    configures logging onto a captured stream, which is closed after its test."""
    configure_logging("INFO", stream=sys.stderr)


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (a unix socket path holds at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lmc-sc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    launcher = Sidecars(tmp_path_factory.mktemp("sidecar-logs"))
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def sidecar(sidecars: Sidecars, short_dir: Path) -> Sidecar:
    """A sidecar shared by the module's tests (namespace: LAYOUT, MODEL)."""
    started = sidecars.start(f"ipc://{short_dir}/shared.sock")
    anyio.run(wait_ready, started)
    return started


def connect(url: str, **options: Any) -> Any:
    return RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL, **options)


@contextlib.asynccontextmanager
async def in_process(settings: SidecarSettings) -> AsyncIterator[SidecarServer]:
    """A sidecar served in this process (``serve`` in a task), yielded once it is bound,
    stopped (and waited for) on exit."""
    servers: list[SidecarServer] = []
    ready = anyio.Event()

    def on_ready(server: SidecarServer) -> None:
        servers.append(server)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(settings, on_ready=on_ready, handle_signals=False))
        await ready.wait()
        try:
            yield servers[0]
        finally:
            servers[0].stopping.set()


async def server_state(engine: RemoteCacheEngine) -> tuple[dict[str, Any], dict[str, Any]]:
    stats = await engine.stats()
    assert stats["engine"] is not None and stats["server"] is not None
    return stats["engine"], stats["server"]


async def requests_sent(engine: RemoteCacheEngine) -> int:
    """How many requests ``engine`` has sent (a STATS request itself among them)."""
    requests: int = (await engine.stats())["client"]["requests"]
    return requests


# -- two client processes ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_two_client_processes_share_a_prefix_bit_exact(sidecar: Sidecar) -> None:
    num_tokens = 6 * CHUNK + 5
    with anyio.fail_after(4 * READY_TIMEOUT):
        stored = await anyio.to_thread.run_sync(run_client, sidecar.url, "store", num_tokens, 7)
        assert stored == {"stored": num_tokens, "shm": True}
        got = await anyio.to_thread.run_sync(run_client, sidecar.url, "retrieve", num_tokens, 7)
    assert got == {"hits": num_tokens, "retrieved": num_tokens, "exact": True, "shm": True}
    async with connect(sidecar.url, timeout=10) as engine:
        stats, server = await server_state(engine)
    assert stats["retrieved_tokens"] >= num_tokens
    assert stats["stored_tokens"] >= num_tokens
    assert server["transactions"] == 0
    assert sidecar.alive()


# -- one client, several ways ----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_inline_payloads_and_concurrent_requests_are_exact(sidecar: Sidecar) -> None:
    count, num_tokens = 8, 3 * CHUNK + 7
    sources = [kv_for(num_tokens, seed) for seed in range(100, 100 + count)]
    targets = [LAYOUT.allocate_kv_caches(4, random=False) for _ in range(count)]
    masks: list[torch.Tensor] = [torch.zeros(0, dtype=torch.bool)] * count
    stored = [0] * count
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10, shared_memory=False) as engine:
            assert not engine.uses_shared_memory

            async def store(i: int) -> None:
                kv, slots = sources[i]
                stored[i] = await engine.store(
                    prompt(num_tokens, 1000 + i), kv_caches=kv, slot_mapping=slots
                )

            async def retrieve(i: int) -> None:
                _, slots = sources[i]
                masks[i] = await engine.retrieve(
                    prompt(num_tokens, 1000 + i), kv_caches=targets[i], slot_mapping=slots
                )

            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(store, i)
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(retrieve, i)
            _, server = await server_state(engine)
    assert stored == [num_tokens] * count
    for i, (kv, slots) in enumerate(sources):
        assert bool(masks[i].all()), i
        assert torch.equal(payload_of(targets[i], slots), payload_of(kv, slots)), i
    assert server["transactions"] == 0


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_mask_and_negative_slots_bound_what_moves(sidecar: Sidecar) -> None:
    num_tokens = 5 * CHUNK
    kv, slots = kv_for(num_tokens, 55)
    tokens = prompt(num_tokens, 2000)
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10) as engine:
            assert engine.uses_shared_memory
            holed = slots.clone()
            holed[3 * CHUNK + 2] = -1  # chunk 3 and everything after it cannot be stored
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=holed) == 3 * CHUNK
            assert await engine.lookup(tokens) == 3 * CHUNK
            mask = torch.zeros(num_tokens, dtype=torch.bool)
            mask[CHUNK:] = True
            target = LAYOUT.allocate_kv_caches(5, random=False)
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots, mask=mask)
            with pytest.raises(InvalidInputError, match="not a multiple of chunk_size"):
                bad = torch.zeros(num_tokens, dtype=torch.bool)
                bad[3:] = True
                await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots, mask=bad)
            with pytest.raises(InvalidInputError, match="token ids"):
                await engine.lookup([1, -2, 3])
    expected = torch.zeros(num_tokens, dtype=torch.bool)
    expected[CHUNK : 3 * CHUNK] = True
    assert torch.equal(loaded, expected)
    part = slots[CHUNK : 3 * CHUNK]
    assert torch.equal(payload_of(target, part), payload_of(kv, part))
    assert not payload_of(target, slots[:CHUNK]).any()  # nothing written before the mask


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_pinned_lookup_that_finds_nothing_holds_nothing(sidecar: Sidecar) -> None:
    """A pinned lookup answered with no hit leaves nothing under its id on the sidecar (an
    earlier lookup's pins under the id released): its unpin costs no request."""
    num_tokens = 2 * CHUNK
    kv, slots = kv_for(num_tokens, 78)
    tokens = prompt(num_tokens, 5100)
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            assert await engine.lookup(tokens, lookup_id="x", pin=True) == num_tokens
            pinned, server = await server_state(engine)
            assert (pinned["pinned_chunks"], server["session_lookup_ids"]) == (2, 1)
            # The same id, a prompt the sidecar lacks: the earlier pins go with it.
            assert await engine.lookup(prompt(num_tokens, 5101), lookup_id="x", pin=True) == 0
            emptied, server = await server_state(engine)
            assert (emptied["pinned_chunks"], server["session_lookup_ids"]) == (0, 0)
            before = await requests_sent(engine)
            await engine.lookup_unpin("x")
            after_skip = await requests_sent(engine)
            await engine.lookup_unpin("never-used")  # not known to be empty: sent
            after_sent = await requests_sent(engine)
            # Each count itself is a request: one between counts means the unpin was not sent.
            assert (after_skip - before, after_sent - after_skip) == (1, 2)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_pins_prefetch_and_switches_act_on_the_sidecar(sidecar: Sidecar) -> None:
    num_tokens = 4 * CHUNK
    kv, slots = kv_for(num_tokens, 77)
    tokens = prompt(num_tokens, 5000)
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10) as engine:
            assert await engine.ping()
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            assert await engine.lookup(tokens, lookup_id=7, pin=True) == num_tokens
            pinned, server = await server_state(engine)
            assert (pinned["pinned_chunks"], server["session_lookup_ids"]) == (4, 1)
            await engine.lookup_unpin(7)
            unpinned, _ = await server_state(engine)
            assert unpinned["pinned_chunks"] == 0
            assert await engine.prefetch(tokens, lookup_id="p") == num_tokens
            target = LAYOUT.allocate_kv_caches(4, random=False)
            mask = await engine.retrieve(
                tokens, kv_caches=target, slot_mapping=slots, lookup_id="p"
            )
            assert bool(mask.all())
            assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
            released, server = await server_state(engine)
            assert released["active_lookup_ids"] == server["session_lookup_ids"] == 0
            other = prompt(num_tokens, 5001)
            assert await engine.freeze(True)
            assert await engine.store(other, kv_caches=kv, slot_mapping=slots) == 0
            assert await engine.lookup(tokens) == num_tokens  # reads go on
            assert await engine.freeze(False)
            assert await engine.set_hot_cache(False)
            assert await engine.store(other, kv_caches=kv, slot_mapping=slots) == 0
            assert await engine.set_hot_cache(True)
            with pytest.raises(InvalidInputError, match="not an enabled tier"):
                await engine.lookup(tokens, search_range=["disk"])
            assert await engine.clear() >= 4
            assert await engine.lookup(tokens) == 0


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_another_namespace_is_refused_clearly(sidecar: Sidecar) -> None:
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10):
            pass  # fixes the namespace when this test runs first
        other = KVLayout.vllm_flash_attn(
            num_layers=3, num_kv_heads=2, head_size=16, block_size=BLOCK_SIZE, dtype=torch.float16
        )
        with pytest.raises(InvalidInputError, match=r"namespace mismatch.*layout .*layers=3"):
            async with RemoteCacheEngine.connect(sidecar.url, other, model_name=MODEL, timeout=10):
                pass
        with pytest.raises(InvalidInputError, match="model_name 'other-model'"):
            async with RemoteCacheEngine.connect(
                sidecar.url, LAYOUT, model_name="other-model", timeout=10
            ):
                pass
        # Another block size keeps the payload bytes: the same namespace.
        wider_blocks = KVLayout.vllm_flash_attn(
            num_layers=2, num_kv_heads=2, head_size=16, block_size=32, dtype=torch.float16
        )
        async with RemoteCacheEngine.connect(
            sidecar.url, wider_blocks, model_name=MODEL, timeout=10
        ) as engine:
            assert engine.is_healthy()
    assert sidecar.alive()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_other_protocol_version_and_garbage_get_error_replies(sidecar: Sidecar) -> None:
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sidecar.url)
    # A client of version 1 would send no tenant: every tenant would share its keys.
    hello = {"v": 1, "id": 5, "model_name": MODEL, "layout": LAYOUT.to_dict()}
    try:
        with anyio.fail_after(30):
            await sock.send_multipart([bytes([MessageType.HELLO]), msgpack.packb(hello)])
            reply = decode(await sock.recv_multipart())
            assert (reply.type, reply.request_id) == (MessageType.ERROR, 5)
            assert reply.header["code"] == "protocol"
            assert "protocol version 1 is not supported" in reply.header["message"]
            await sock.send_multipart([b"\x03", b"\xc1not msgpack"])
            reply = decode(await sock.recv_multipart())
            assert reply.header["code"] == "protocol"
            # A store without a session is refused, not served.
            await sock.send_multipart(encode(MessageType.STORE, {"start": 0}, [b"\0" * 4]))
            reply = decode(await sock.recv_multipart())
            assert reply.header["code"] == "no_session"
    finally:
        sock.close(linger=0)
        context.term()
    assert await ping(sidecar.url, 10)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_lookups_send_digests_that_match_the_servers_keys(sidecar: Sidecar) -> None:
    """The client hashes the prompt with the key seed the server announced; lookups by
    digests find what a store by tokens put, chunk for chunk, pins included."""
    salt, num_tokens = 4000, 5 * CHUNK + 3
    kv, slots = kv_for(num_tokens, 41)
    tokens = prompt(num_tokens, salt)
    with anyio.fail_after(60):
        async with connect(sidecar.url, timeout=10) as engine:
            hasher = engine._conn.hasher
            assert hasher is not None  # the server said how it hashes
            assert (
                await engine.store(
                    tokens[: 3 * CHUNK], kv_caches=kv, slot_mapping=slots[: 3 * CHUNK]
                )
                == 3 * CHUNK
            )
            for length in (0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 1, 3 * CHUNK, num_tokens):
                want = min(length, 3 * CHUNK) // CHUNK * CHUNK
                assert await engine.lookup(tokens[:length]) == want, length
            assert await engine.lookup(prompt(num_tokens, salt + 1)) == 0
            assert await engine.lookup(torch.tensor(tokens), lookup_id="d", pin=True) == 3 * CHUNK
            stats, _ = await server_state(engine)
            assert stats["pinned_chunks"] == 3
            await engine.lookup_unpin("d")
            stats, _ = await server_state(engine)
            assert stats["pinned_chunks"] == 0
            with pytest.raises(InvalidInputError):
                await engine.lookup([[1, 2]])  # type: ignore[list-item]


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_malformed_digest_lookups_get_error_replies(sidecar: Sidecar) -> None:
    async with connect(sidecar.url, timeout=10) as engine:
        link = engine._conn.link
        assert link is not None
        # Digests of this client's tenant (none named): its tag leads each one.
        digests = (tenant_tag(None) + b"\1" * LINK_SIZE) * 3
        cases = [
            ({"digests_of": 3 * CHUNK, "pin": False}, [digests[:-1]], ProtocolError),
            ({"digests_of": 3 * CHUNK, "pin": False}, [digests, digests], ProtocolError),
            ({"digests_of": 5 * CHUNK, "pin": False}, [digests], InvalidInputError),
            ({"digests_of": -1, "pin": False}, [digests], ProtocolError),
            ({"digests_of": 3 * CHUNK, "pin": False}, [b"\1" * DIGEST_SIZE * 3], InvalidInputError),
        ]
        with anyio.fail_after(30):
            for header, payloads, error in cases:
                with pytest.raises(error):
                    await link.request(MessageType.LOOKUP, header, payloads, timeout=10)
            good = {"digests_of": 3 * CHUNK, "pin": False}
            reply = await link.request(MessageType.LOOKUP, good, [digests], timeout=10)
            assert reply.header["hits"] == 0
    assert await ping(sidecar.url, 10)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_client_killed_mid_store_leaves_nothing_behind(sidecar: Sidecar) -> None:
    salt, held, doomed_len = 3000, 4 * CHUNK, 10 * CHUNK
    kv, slots = kv_for(held, 9)
    with anyio.fail_after(120):
        async with connect(sidecar.url, timeout=10) as engine:
            assert await engine.store(prompt(held, salt), kv_caches=kv, slot_mapping=slots) == held
            before, _ = await server_state(engine)
            doomed = await anyio.run_process(
                [sys.executable, str(DOOMED_SCRIPT), sidecar.url, str(doomed_len), str(salt)],
                check=False,
            )
            assert doomed.returncode == -signal.SIGKILL, doomed.stderr
            assert doomed.stdout.split() == [b"ALLOCATED", b"6", b"PINNED", str(held).encode()]
            during, server = await server_state(engine)
            # Its session may already be gone; if not, it still holds what it took.
            if server["sessions"] > 1:
                assert during["pool"]["num_objects"] > before["pool"]["num_objects"]
            while server["sessions"] > 1 or server["transactions"]:
                # The session times out after 5 heartbeats (1 s); each stats request is
                # a round trip, so this loop is bounded by fail_after, not by a sleep.
                await anyio.sleep(HEARTBEAT / 4)
                after, server = await server_state(engine)
            after, server = await server_state(engine)
    assert server["transactions"] == 0 and server["session_lookup_ids"] == 0
    assert after["pinned_chunks"] == 0 and after["active_lookup_ids"] == 0
    assert after["pool"]["pinned_objects"] == 0
    assert after["pool"]["num_objects"] == after["cached_chunks"] == before["cached_chunks"]
    assert after["pool"]["used_bytes"] == before["pool"]["used_bytes"]


# -- a sidecar that dies ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_killed_sidecar_gives_misses_then_recovers_from_disk(
    sidecars: Sidecars, short_dir: Path, tmp_path: Path
) -> None:
    url = f"ipc://{short_dir}/restart.sock"
    flags = ["--local-disk", str(tmp_path / "disk"), "--wait-for-slow-tiers", "true"]
    timeout = 1.0
    num_tokens = 4 * CHUNK + 3
    kv, slots = kv_for(num_tokens, 21)
    tokens = prompt(num_tokens, 4000)
    first = sidecars.start(url, *flags)
    await wait_ready(first)
    with anyio.fail_after(3 * READY_TIMEOUT):
        async with connect(url, timeout=timeout, reconnect_interval=0.2) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            first.kill()
            target = LAYOUT.allocate_kv_caches(5, random=False)
            # Each call waits for the dead sidecar at most its timeout; five times that is
            # a bound no busy machine reaches, and one a call left waiting would break.
            for _ in range(2):
                with anyio.fail_after(5 * timeout):
                    assert await engine.lookup(tokens) == 0
                with anyio.fail_after(5 * timeout):
                    assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 0
                with anyio.fail_after(5 * timeout):
                    mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
                assert not mask.any()
            assert not engine.is_healthy()
            second = sidecars.start(url, *flags)
            await engine.wait_connected()  # by itself: no call from here
            assert engine.uses_stream  # the new sidecar's stream, not the old file
            assert await engine.lookup(tokens) == num_tokens  # the disk tier survived
            mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
            assert bool(mask.all())
            assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
            _, server = await server_state(engine)
    assert second.terminate() == 0
    assert left_behind(second, server["shm"]) == []
    assert "sidecar_stopped" in second.log()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_stopped_sidecar_gives_misses_at_the_timeout_then_answers_again(
    sidecars: Sidecars, short_dir: Path
) -> None:
    # Heartbeats far apart: none is waiting for its reply when the sidecar stops, so the
    # lookup's own deadline is what ends it (not the keeper giving the link up first).
    sidecar = sidecars.start(f"ipc://{short_dir}/stopped.sock", "--heartbeat-interval", "60")
    await wait_ready(sidecar)
    timeout = 0.5
    kv, slots = kv_for(2 * CHUNK, 31)
    tokens = prompt(2 * CHUNK, 5000)
    with anyio.fail_after(3 * READY_TIMEOUT):
        async with connect(sidecar.url, timeout=timeout, reconnect_interval=0.2) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 2 * CHUNK
            sidecar.process.send_signal(signal.SIGSTOP)  # connected, but no reply comes
            try:
                # The lookup's own deadline ends it (the client says so), long before five
                # times its timeout.
                with structlog.testing.capture_logs() as logs, anyio.fail_after(5 * timeout):
                    assert await engine.lookup(tokens) == 0
                timed_out = [e["type"] for e in logs if e["event"] == "sidecar_request_timed_out"]
                assert timed_out == ["LOOKUP"]
                stats = await engine.stats()
                assert stats["engine"] is None and stats["client"]["timeouts"] >= 1
            finally:
                sidecar.process.send_signal(signal.SIGCONT)
            # The late replies are dropped and the client recovers by itself: its keeper
            # probed the link when the lookup timed out, and says hello again if the link
            # was given up (a lookup meanwhile is a miss, not an error).
            while await engine.lookup(tokens) != 2 * CHUNK:
                await engine.wait_connected()


@pytest.mark.anyio
async def test_no_server_means_misses_and_bad_input_still_raises(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/nobody.sock"
    kv, slots = kv_for(CHUNK, 1)
    with anyio.fail_after(20):
        with pytest.raises(TierUnavailableError, match="no answer"):
            async with connect(url, timeout=0.3):
                pass
        async with connect(url, timeout=0.3, require_server=False) as engine:
            assert not engine.is_healthy()
            assert await engine.lookup(prompt(CHUNK)) == 0
            assert await engine.store(prompt(CHUNK), kv_caches=kv, slot_mapping=slots) == 0
            mask = await engine.retrieve(prompt(CHUNK), kv_caches=kv, slot_mapping=slots)
            assert mask.dtype == torch.bool and mask.shape == (CHUNK,) and not mask.any()
            with pytest.raises(InvalidInputError, match="token ids"):
                await engine.store([-1] * CHUNK, kv_caches=kv, slot_mapping=slots)
            with pytest.raises(InvalidInputError, match="slot_mapping"):
                await engine.store(prompt(CHUNK), kv_caches=kv, slot_mapping=slots[:3])
            with pytest.raises(InvalidInputError, match="pin=True needs a lookup_id"):
                await engine.lookup(prompt(CHUNK), pin=True)
            assert (await engine.stats())["engine"] is None
        with pytest.raises(Exception, match="closed"):
            await engine.lookup(prompt(CHUNK))


# -- security ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.anyio
async def test_curve_server_refuses_a_client_without_its_key(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    client = zmq.curve_keypair()
    key_file = tmp_path / "server.key"
    key_file.write_bytes(secret + b"\n")
    url = f"tcp://127.0.0.1:{free_port()}"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01),
        heartbeat_interval=HEARTBEAT,
        curve_secret_key=load_curve_secret_key(str(key_file)),
        access=AccessList(frozenset({client[0]})),
    )
    kv, slots = kv_for(2 * CHUNK, 5)
    with anyio.fail_after(60):
        async with in_process(settings):
            with pytest.raises(TierUnavailableError, match="server_public_key"):
                async with connect(url, timeout=0.5):
                    pass
            assert not await ping(url, 0.5)  # a plain socket gets nothing either
            with pytest.raises(TierUnavailableError, match="allow-list"):
                async with connect(url, timeout=0.5, server_public_key=public):
                    pass  # the server's key but a key pair not on its allow-list
            async with connect(
                url, timeout=10, server_public_key=public, client_certificate=client
            ) as engine:
                assert engine.uses_shared_memory  # tcp on this host: same host name and boot
                stored = await engine.store(prompt(2 * CHUNK), kv_caches=kv, slot_mapping=slots)
                hits = await engine.lookup(prompt(2 * CHUNK))
            assert not await ping(url, 0.5, curve_key=public)  # a fresh key pair: refused
            async with connect(
                url, timeout=10, server_public_key=public, client_certificate=client
            ) as engine:
                assert await engine.lookup(prompt(2 * CHUNK)) == 2 * CHUNK  # it lives on
    assert (stored, hits) == (2 * CHUNK, 2 * CHUNK)


async def flush_sidecar(server: SidecarServer) -> None:
    """Wait for the in-process sidecar's engine to finish its writes behind the CPU tier
    (no reference to the engine is kept: its memory lives in the server's segment)."""
    engine = server.engine
    assert engine is not None
    assert await engine.flush()


@pytest.mark.anyio
async def test_pings_and_digest_lookups_the_cpu_tier_answers_skip_the_request_task(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"ipc://{short_dir}/now.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(
            chunk_size=CHUNK,
            max_local_cpu_size=0.01,
            local_disk=str(short_dir / "disk"),
            max_local_disk_size=0.01,
        ),
    )
    tasked: list[MessageType] = []
    answer = SidecarServer._answer

    async def counting(self: SidecarServer, identity: bytes, body: Any, peer: Any) -> Any:
        tasked.append(MessageType(bytes(body[0])[0]))
        return await answer(self, identity, body, peer)

    monkeypatch.setattr(SidecarServer, "_answer", counting)
    tokens = prompt(3 * CHUNK + 5, 77)
    kv, slots = kv_for(len(tokens), 12)
    with anyio.fail_after(60):
        async with in_process(settings) as server, connect(url, timeout=10) as engine:
            stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
            # The store did not wait for its commit: the next lookup waits for it in a task.
            assert await engine.lookup(tokens) == len(tokens)
            tasked.clear()
            assert await engine.lookup(tokens) == len(tokens)
            assert await engine.lookup(tokens, lookup_id="n", pin=True) == len(tokens)
            assert await engine.ping()
            assert tasked == []  # all answered in the reader callback
            engine_stats, _ = await server_state(engine)
            assert engine_stats["pinned_chunks"] == 4
            await engine.lookup_unpin("n")
            engine_stats, _ = await server_state(engine)
            assert engine_stats["pinned_chunks"] == 0
            # Only the disk holds the prefix now: the lookup takes a task to read it.
            await flush_sidecar(server)
            assert await engine.clear(["cpu"]) == 4
            tasked.clear()
            assert await engine.lookup(tokens) == len(tokens)
            assert await engine.lookup(prompt(2 * CHUNK, 78)) == 0
            assert tasked == [MessageType.LOOKUP, MessageType.LOOKUP]
    assert stored == len(tokens)
    assert server.latency.summary("lookup").count == 5  # the fast ones are timed too


@pytest.mark.anyio
async def test_a_lookup_sent_on_a_guess_counts_only_if_the_tokens_are_unchanged(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"ipc://{short_dir}/guess.sock"
    settings = SidecarSettings(
        listen=url, config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.04)
    )
    confirmed: list[bool] = []
    confirm = DigestGuess.confirm

    def recording(self: DigestGuess) -> bool:
        confirmed.append(confirm(self))
        return confirmed[-1]

    monkeypatch.setattr(DigestGuess, "confirm", recording)
    tokens = torch.tensor(prompt(4096 + 40, 91))  # long enough for the client's memo
    kv, slots = kv_for(len(tokens), 13)
    changed_chunk = 6
    with anyio.fail_after(60):
        async with in_process(settings), connect(url, timeout=10) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            assert await engine.lookup(tokens) == len(tokens)
            assert await engine.lookup(tokens) == len(tokens)  # sent on the guess
            tokens[changed_chunk * CHUNK + 3] += 1  # changed in place: the guess is wrong
            hits = await engine.lookup(tokens, lookup_id="g", pin=True)
            engine_stats, _ = await server_state(engine)
            # The exact lookup's pins replaced those the guessed one made.
            assert engine_stats["pinned_chunks"] == changed_chunk
            assert await engine.lookup(tokens) == changed_chunk * CHUNK
            await engine.lookup_unpin("g")
    assert hits == changed_chunk * CHUNK
    assert confirmed == [True, False, True]


@pytest.mark.anyio
async def test_a_namespace_given_at_start_is_the_only_one_served(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/fixed.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01),
        namespace=SidecarNamespace(MODEL, LAYOUT, revision="r1"),
    )
    with anyio.fail_after(60):
        async with in_process(settings) as server:
            assert server.engine is not None  # opened before any client
            with pytest.raises(InvalidInputError, match="revision None"):
                async with connect(url, timeout=10):
                    pass
            async with connect(url, timeout=10, revision="r1") as engine:
                assert engine.chunk_size == CHUNK
                assert await engine.lookup(prompt(CHUNK)) == 0
    assert not await anyio.Path(url.removeprefix("ipc://")).exists()
    huge = KVLayout.vllm_flash_attn(
        num_layers=64, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.float16
    )
    cannot = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=4096, max_local_cpu_size=0.01),
        namespace=SidecarNamespace(MODEL, huge),
    )
    with anyio.fail_after(30), pytest.raises(ConfigError, match="holds less than one chunk"):
        await serve(cannot, handle_signals=False)
    assert not await anyio.Path(url.removeprefix("ipc://")).exists()


@pytest.mark.parametrize(
    ("url", "allow_remote", "ok"),
    [
        ("ipc:///tmp/x.sock", False, True),
        ("tcp://127.0.0.1:5555", False, True),
        ("tcp://localhost:5555", False, True),
        ("tcp://[::1]:5555", False, True),
        ("tcp://0.0.0.0:5555", False, False),
        ("tcp://*:5555", False, False),
        ("tcp://10.1.2.3:5555", False, False),
        ("tcp://0.0.0.0:5555", True, True),
        ("http://127.0.0.1:80", True, False),
        ("tcp://127.0.0.1", False, False),
        ("ipc://", False, False),
    ],
)
def test_listen_urls(url: str, allow_remote: bool, ok: bool) -> None:
    if ok:
        assert check_listen_url(url, allow_remote=allow_remote) == url
    else:
        with pytest.raises(ConfigError, match="listen"):
            check_listen_url(url, allow_remote=allow_remote)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "tcp://0.0.0.0:5999"], "--allow-remote"),
        (["--max-local-cpu-size", "lots"], "max_local_cpu_size"),
        (["--chunk-size", "0"], "chunk_size"),
        (["--model-name", "m"], "--layout go together"),
        (["--model-name", "m", "--layout", '{"kind": "x"}'], "layout"),
        (["--curve-secret-key-file", "/nonexistent/key"], "curve_secret_key_file"),
    ],
)
def test_serve_refuses_bad_settings_before_serving(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], short_dir: Path
) -> None:
    listen = [] if "--listen" in argv else ["--listen", f"ipc://{short_dir}/refused.sock"]
    assert main(["serve", *listen, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (short_dir / "refused.sock").exists()


def test_curve_key_files_and_settings_are_checked(tmp_path: Path) -> None:
    import zmq.auth

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "server")
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None
    assert load_curve_secret_key(secret_file) == secret
    assert zmq.curve_public(load_curve_secret_key(secret_file)) == public
    with pytest.raises(ConfigError, match="curve_secret_key_file"):
        load_curve_secret_key(public_file)  # a public certificate holds no secret key
    bad = tmp_path / "bad.key"
    bad.write_text("~" * 40)  # not z85
    with pytest.raises(ConfigError, match="invalid CURVE secret key"):
        load_curve_secret_key(str(bad))
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        SidecarSettings(listen="ipc:///tmp/x.sock", heartbeat_interval=0)
    with pytest.raises(ConfigError, match="client_timeout"):
        SidecarSettings(listen="ipc:///tmp/x.sock", client_timeout=float("nan"))
    settings = SidecarSettings(listen="ipc:///tmp/x.sock", heartbeat_interval=0.5)
    assert settings.session_timeout == 2.5
    # A client proves itself with a secret certificate; a public one is refused.
    assert load_client_certificate(secret_file) == (public, secret)
    with pytest.raises(ConfigError, match="not a secret certificate"):
        load_client_certificate(public_file)
    # CURVE and an allow-list go together; remote binds need both; plain move targets
    # are local only, keyed ones need the sidecar's own key pair.
    access = AccessList(frozenset({zmq.curve_keypair()[0]}))
    refused: list[tuple[dict[str, Any], str]] = [
        ({"curve_secret_key": secret}, "curve_clients"),
        ({"access": access}, "curve_clients"),
        ({"listen": "tcp://0.0.0.0:1", "allow_remote": True}, "allow_remote"),
        ({"move_targets": {"tcp://10.0.0.1:5": None}}, "move_targets"),
        ({"move_targets": {"tcp://10.0.0.1:5": public}}, "move_targets"),
        ({"move_targets": {"http://x": None}}, "move_targets"),
    ]
    for options, field_name in refused:
        options.setdefault("listen", "ipc:///tmp/x.sock")
        with pytest.raises(ConfigError, match=field_name):
            SidecarSettings(**options)
    remote = SidecarSettings(
        listen="tcp://0.0.0.0:1",
        allow_remote=True,
        curve_secret_key=secret,
        access=access,
        move_targets={"tcp://10.0.0.1:5": public, "ipc:///tmp/y.sock": None},
    )
    assert remote.move_targets["tcp://10.0.0.1:5"] == public


def test_pool_carved_from_a_shared_segment_is_seen_by_another_mapping() -> None:
    from multiprocessing import shared_memory

    from lmcache_async.memory.pool import MemoryPool

    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    other = shared_memory.SharedMemory(name=segment.name)
    try:
        assert segment.buf is not None
        pool = MemoryPool.from_buffer(segment.buf, page_size=64 * 1024)
        assert pool.capacity_bytes == 1 << 20 and not pool.pinned
        first = pool.allocate_nowait((2, 3, 1000), torch.float16)
        second = pool.allocate_nowait((2, 3, 1000), torch.float16)
        assert first is not None and second is not None
        assert (first.offset, second.offset) == (0, 64 * 1024)
        second.tensor.copy_(torch.arange(6000, dtype=torch.float16).view(2, 3, 1000))
        start = pool.arena_offset + second.offset
        seen = torch.frombuffer(other.buf, dtype=torch.uint8)[start : start + second.nbytes]
        assert torch.equal(seen.view(torch.float16).view(2, 3, 1000), second.tensor)
        del seen
        first.unref()
        second.unref()
        pool.close()
        del pool, first, second
        with pytest.raises(InvalidInputError, match="writable"):
            MemoryPool.from_buffer(memoryview(bytes(1 << 20)))
        with pytest.raises(InvalidInputError, match="less than one page"):
            MemoryPool.from_buffer(bytearray(4096 * 3), page_size=64 * 1024)
        with pytest.raises(InvalidInputError, match="pin_memory"):
            MemoryPool(4096, page_size=4096, pin_memory=True, buffer=bytearray(1 << 16))
    finally:
        import gc

        gc.collect()
        other.close()
        segment.close()
        segment.unlink()


def test_layout_description_round_trips() -> None:
    for layout in (
        LAYOUT,
        KVLayout.vllm_flash_attn(
            num_layers=3, num_kv_heads=4, head_size=8, block_size=16, dtype=torch.bfloat16, hnd=True
        ),
        KVLayout.mla(num_layers=2, block_size=64, latent_dim=576, dtype=torch.float32),
        KVLayout.vllm_cpu(num_layers=2, num_kv_heads=2, head_size=16, dtype=torch.float16),
    ):
        assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    with pytest.raises(InvalidInputError, match="unknown keys"):
        KVLayout.from_dict({**LAYOUT.to_dict(), "extra": 1})
    with pytest.raises(InvalidInputError, match="missing keys"):
        KVLayout.from_dict({"kind": "mla"})
    with pytest.raises(InvalidInputError, match="dtype"):
        KVLayout.from_dict({**LAYOUT.to_dict(), "dtype": "int8"})


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_sidecar_bench_reports_every_figure() -> None:
    from lmcache_async.bench.sidecar import SidecarBenchOptions, format_sidecar, run_sidecar_bench

    options = SidecarBenchOptions(
        tokens=256,
        repeat=2,
        lookup_tokens=1024,
        lookup_iterations=10,
        num_layers=2,
        num_kv_heads=2,
        head_size=16,
        dtype="float16",
        startup_timeout=READY_TIMEOUT,
        curve=True,
    )
    with anyio.fail_after(3 * READY_TIMEOUT):
        results = await run_sidecar_bench(options, EngineConfig(chunk_size=64))
    assert results["problems"] == []
    assert results["verified_bit_exact"] and results["shared_memory"]
    for name in ("store", "retrieve"):
        assert results[name]["sidecar_gbps"] > 0 and results[name]["inprocess_gbps"] > 0
    lookup = results["lookup"]
    for key in ("sidecar", "sidecar_first_sight", "inprocess", "sidecar_ping", "echo"):
        assert 0 < lookup[key]["p50_ms"] <= lookup[key]["p99_ms"]
    table = format_sidecar(results)
    assert "store 256 tok" in table and "lookup 1024 tok (sidecar) p50" in table
    assert "round trip (bare ZeroMQ echo, same frames) p50" in table
    curve = results["curve"]  # the same work through a CURVE sidecar with an allow-list
    for name in ("store", "retrieve"):
        assert curve[name]["curve_gbps"] > 0 and curve[name]["ratio"] > 0
    assert curve["lookup"]["curve_p50_ms"] > 0
    assert "lookup (CURVE sidecar) p50" in table


def test_rpc_modules_never_touch_pickle() -> None:
    import lmcache_async.rpc

    forbidden = ("import pickle", "from pickle", "cloudpickle", "import dill", "_pyobj")
    checked = set()
    root = Path(lmcache_async.rpc.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        name = path.relative_to(root).as_posix()
        for word in forbidden:
            assert word not in text, f"{name} mentions {word!r}"
        checked.add(name)
    assert checked >= {
        "protocol.py",
        "transport.py",
        "sidecar/server.py",
        "sidecar/transfers.py",
        "client/link.py",
        "client/transfers.py",
        "lookup/server.py",
        "lookup/core.py",
    }


@pytest.mark.anyio
async def test_a_request_fails_at_its_own_deadline_beside_longer_ones(short_dir: Path) -> None:
    """A link arms one timer for its earliest deadline: a short request sent after a long
    one still fails on time, and the long one is not failed early."""
    context = zmq.asyncio.Context()
    url = f"ipc://{short_dir}/silent.sock"
    silent = context.socket(zmq.ROUTER)  # takes requests and never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(url)
    link = Link(context, url, b"client-1", None, MessageLimits())
    long_failed = anyio.Event()

    async def long_request() -> None:
        with pytest.raises(Unavailable):
            await link.request(MessageType.PING, None, timeout=30.0)
        long_failed.set()

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_request)
                while not link._deadlines:  # the long request is on its way
                    await anyio.lowlevel.checkpoint()
                started = time.monotonic()
                with pytest.raises(Unavailable, match=r"within 0\.2 s"):
                    await link.request(MessageType.PING, None, timeout=0.2)
                assert time.monotonic() - started < 10
                assert not long_failed.is_set() and len(link._deadlines) == 1
                link.close()  # fails the long request at once
                await long_failed.wait()
    finally:
        link.close()
        silent.close(linger=0)
        context.term()
    assert link._deadlines == {} and link._timer is None
