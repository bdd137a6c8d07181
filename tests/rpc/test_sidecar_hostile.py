"""No client can silence, stall or bloat the sidecar: each reproducer of a hostile client,
against a real ``lmcache-async serve`` process where the defect showed there, and what the
sidecar now answers.

- a flood of slow requests (64 and 500 MOVEs to an address nobody listens on, with an
  absurd timeout) leaves the control plane and another client's data answered at once;
- an absurd or oversized HELLO is refused and fixes no namespace;
- a client that never commits is stopped at its cap of open transactions, one that pins
  at its cap of lookup ids, and one with too much in flight gets ``busy`` at once;
- a reply that cannot be encoded becomes an ``internal`` ERROR reply, never silence.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import structlog
import torch

from lmcache_async import EngineConfig, RemoteCacheEngine
from lmcache_async.keys.tokens import TOKEN_BYTES
from lmcache_async.rpc.protocol import MessageType, to_wire
from lmcache_async.rpc.sidecar import SidecarNamespace, SidecarSettings
from lmcache_async.rpc.sidecar.admin import AdminHandlers
from lmcache_async.rpc.sidecar.settings import DEFAULT_MAX_SESSION_TRANSACTIONS, MAX_NAME_CHARS
from tests.backends.test_redis import poll_until
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    Sidecar,
    Sidecars,
    in_process,
    kv_for,
    payload_of,
    prompt,
    wait_ready,
)
from tests.rpc.test_sidecar_input_limits import RawClient, raw_client

pytestmark = pytest.mark.anyio

TIMEOUT: Final = 60.0
ANSWERED_WITHIN: Final = 1.0
"""A new client's hello, ping and store/retrieve while the flood is in flight: each takes
a few ms on an idle machine, so 1 s is a bound no VM's noise reaches."""
HELLO: Final = SidecarNamespace(MODEL, LAYOUT).to_wire()


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-ho-", dir="/tmp"))  # ipc paths: 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, short_dir: Path) -> Iterator[Sidecar]:
    launcher = Sidecars(tmp_path_factory.mktemp("hostile-logs"))
    try:
        started = launcher.start(
            f"ipc://{short_dir}/hostile.sock", "--move-targets", f"ipc://{short_dir}/nobody.sock"
        )
        anyio.run(wait_ready, started)
        yield started
    finally:
        launcher.stop_all()


async def busy_count(url: str) -> int:
    client = await raw_client(url)
    try:
        reply = await client.ask(MessageType.STATS, {})
        count: int = reply.header["server"]["busy_replies"]
        return count
    finally:
        client.close()


def threads_of(sidecar: Sidecar) -> int:
    return len(os.listdir(f"/proc/{sidecar.process.pid}/task"))


async def served_exactly(url: str, salt: int) -> None:
    """A new client's hello, ping, store and retrieve, each within :data:`ANSWERED_WITHIN`,
    the KV back bit-exact."""
    tokens = prompt(2 * CHUNK, salt=salt)
    kv, slots = kv_for(len(tokens), seed=salt)
    with anyio.fail_after(ANSWERED_WITHIN):
        async with RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL, timeout=5) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            target = LAYOUT.allocate_kv_caches(2, random=False)
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
            assert bool(loaded.all())
            assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
    client = await raw_client(url)
    try:
        with anyio.fail_after(ANSWERED_WITHIN):
            assert (await client.ask(MessageType.PING, {})).type is MessageType.PING
    finally:
        client.close()


@pytest.mark.subprocess
@pytest.mark.parametrize("flood", [64, 500])
async def test_a_flood_of_slow_requests_leaves_every_other_client_served(
    sidecar: Sidecar, short_dir: Path, flood: int
) -> None:
    tokens = b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in prompt(CHUNK, salt=flood))
    move = {
        "old_position": "cpu",
        "new_position": [f"ipc://{short_dir}/nobody.sock", "cpu"],
        "copy": True,
        "timeout": 1e9,
    }
    await served_exactly(sidecar.url, salt=3000 + flood)  # the engine open, its threads up
    baseline = threads_of(sidecar)
    before = await busy_count(sidecar.url)
    hostile: list[RawClient] = []
    try:
        with anyio.fail_after(TIMEOUT):
            for _ in range(8):  # several peers, none of which reads its replies
                hostile.append(await raw_client(sidecar.url))
            for i in range(flood):
                await hostile[i % len(hostile)].send(MessageType.MOVE, move, [tokens])
            # Served while the flood is in flight; every slow MOVE past the caps is busy.
            await served_exactly(sidecar.url, salt=1000 + flood)

            # Every MOVE past the four in flight was answered busy (read from the figures:
            # which four are in flight is the server's to choose).
            async def all_answered() -> bool:
                return await busy_count(sidecar.url) - before >= flood - 4

            await poll_until(all_answered)
            assert threads_of(sidecar) <= baseline + 8  # four moves' connections at most
            await served_exactly(sidecar.url, salt=2000 + flood)
    finally:
        for client in hostile:
            client.close()
    assert sidecar.alive()


@pytest.mark.subprocess
async def test_an_absurd_hello_is_refused_and_fixes_no_namespace(
    tmp_path_factory: pytest.TempPathFactory, short_dir: Path
) -> None:
    launcher = Sidecars(tmp_path_factory.mktemp("hello-logs"))
    absurd: list[dict[str, Any]] = [
        {**HELLO, "model_name": "m" * (3 << 20)},
        {**HELLO, "model_name": "m" * (MAX_NAME_CHARS + 1)},
        {**HELLO, "revision": "r" * (MAX_NAME_CHARS + 1)},
        {**HELLO, "layout": {**HELLO["layout"], "block_size": 2**64 - 1}},
        {**HELLO, "layout": {**HELLO["layout"], "tp_world_size": 2**40}},
        {**HELLO, "layout": {**HELLO["layout"], "num_layers": 10**9}},
        {**HELLO, "tenant": "t" * 300},
        {**HELLO, "tenant": 7},
    ]
    try:
        sidecar = launcher.start(f"ipc://{short_dir}/hello.sock")
        with anyio.fail_after(TIMEOUT):
            await wait_ready(sidecar)
            client = RawClient(sidecar.url)
            try:
                for hello in absurd:
                    reply = await client.ask(MessageType.HELLO, hello)
                    assert reply.type is MessageType.ERROR, reply.header
                    assert reply.header["code"] == "invalid_input", reply.header
            finally:
                client.close()
            await served_exactly(sidecar.url, salt=3000)  # the real namespace is free
    finally:
        launcher.stop_all()
    assert "Traceback" not in sidecar.log()


@pytest.mark.subprocess
async def test_a_client_that_never_commits_is_stopped_at_its_cap(
    tmp_path_factory: pytest.TempPathFactory, short_dir: Path
) -> None:
    """Stores of one chunk each, never committed, in a pool that holds them all: the
    session's transactions stop at their cap, the rest are busy, and others are served."""
    frame = b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in prompt(CHUNK, salt=4000))
    launcher = Sidecars(tmp_path_factory.mktemp("cap-logs"))
    try:
        sidecar = launcher.start(f"ipc://{short_dir}/cap.sock", "--max-local-cpu-size", "0.05")
        with anyio.fail_after(TIMEOUT):
            await wait_ready(sidecar)
            client = await raw_client(sidecar.url)
            try:
                codes = []
                for _ in range(DEFAULT_MAX_SESSION_TRANSACTIONS + 10):
                    reply = await client.ask(MessageType.STORE, {}, [frame])
                    codes.append("txn" if "txn" in reply.header else reply.header.get("code"))
                assert codes.count("txn") == DEFAULT_MAX_SESSION_TRANSACTIONS, codes[-12:]
                assert codes[DEFAULT_MAX_SESSION_TRANSACTIONS:] == ["busy"] * 10
                await served_exactly(sidecar.url, salt=4001)  # others are not held
            finally:
                client.close()
    finally:
        launcher.stop_all()


@pytest.mark.subprocess
async def test_a_client_holding_stores_open_leaves_the_pool_to_the_others(
    sidecar: Sidecar,
) -> None:
    """The longest prompt a frame may carry, stored again and again and never committed:
    the session holds at most its share of the pool, and another client stores whole."""
    frame = b"\x01" * (1 << 20)  # 262,144 tokens of id 16843009: the whole pool and more
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(TIMEOUT):
            for _ in range(20):
                await client.ask(MessageType.STORE, {}, [frame])
            await served_exactly(sidecar.url, salt=4500)
    finally:
        client.close()


async def test_per_peer_caps_on_requests_and_pins_answer_busy(short_dir: Path) -> None:
    """In this process, with small caps: a third slow request of a peer allowed two is
    busy at once while another peer is served; a third pinned lookup id is busy."""
    url = f"ipc://{short_dir}/caps.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01),
        max_peer_requests=2,
        max_session_pins=2,
        move_targets={f"ipc://{short_dir}/nobody.sock": None},
    )
    tokens = prompt(CHUNK, salt=5000)
    frame = b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in tokens)
    move = {
        "old_position": "cpu",
        "new_position": [f"ipc://{short_dir}/nobody.sock", "cpu"],
        "copy": True,
        "timeout": 30,
    }
    with anyio.fail_after(TIMEOUT):
        async with in_process(settings) as server:
            slow = await raw_client(url)
            other = await raw_client(url)
            try:
                for _ in range(3):
                    await slow.send(MessageType.MOVE, move, [frame])
                third = await slow.recv()  # the first two are still connecting out
                assert third.header["code"] == "busy", third.header
                assert server.admission.in_flight == 2
                reply = await other.ask(MessageType.LOOKUP, {}, [frame])
                assert reply.type is MessageType.LOOKUP  # another peer has slots of its own
                # A lookup that finds nothing holds no id: the prompt is stored first.
                lent = await other.ask(MessageType.STORE, {}, [frame])
                nbytes = lent.header["chunks"][0][3]
                done = await other.ask(
                    MessageType.COMMIT, {"txn": lent.header["txn"]}, [bytes(nbytes)]
                )
                assert done.header["stored"] == CHUNK, done.header
                for lookup_id, code in (("a", None), ("b", None), ("c", "busy"), ("a", None)):
                    header = {"pin": True, "lookup_id": lookup_id}
                    reply = await other.ask(MessageType.LOOKUP, header, [frame])
                    assert reply.header.get("code") == code, (lookup_id, reply.header)
            finally:
                slow.close()
                other.close()


async def test_a_reply_that_cannot_be_encoded_is_an_internal_error_not_silence(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"ipc://{short_dir}/unencodable.sock"
    settings = SidecarSettings(
        listen=url, config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    )

    async def broken(self: AdminHandlers, session: Any, message: Any) -> Any:
        return {"figure": object()}, ()  # msgpack cannot pack it

    monkeypatch.setattr(AdminHandlers, "on_stats", broken)
    with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs() as logs:
        async with in_process(settings) as server:
            client = await raw_client(url)
            try:
                for _ in range(3):
                    reply = await client.ask(MessageType.STATS, {})
                    assert reply.type is MessageType.ERROR
                    assert reply.header["code"] == "internal"
                assert (await client.ask(MessageType.PING, {})).type is MessageType.PING
            finally:
                client.close()
            assert server.failed_replies == 3
    logged = [entry for entry in logs if entry["event"] == "sidecar_reply_unencodable"]
    assert len(logged) == 1  # once per cause, counted every time


def test_figures_past_msgpacks_range_are_shown_at_its_bounds() -> None:
    assert to_wire({"a": 2**70, "b": -(2**70), "c": [2**64 - 1, 5]}) == {
        "a": 2**64 - 1,
        "b": -(2**63),
        "c": [2**64 - 1, 5],
    }
    assert to_wire(True) is True
