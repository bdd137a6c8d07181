"""``move``: a prefix's chunks copied or moved from one instance's tier to a sidecar's.

Sidecars A and B are real ``lmcache-async serve`` processes (started as tests/rpc's sidecar
tests start them); A is asked to move with ``RemoteCacheEngine.move``, and an embedded
``CacheEngine`` moves with its own ``move``. A client of B then retrieves what arrived and
compares it byte for byte. Corrupt payloads are fed to B through ``push_chunks``, the
receiving half of a move.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import zmq
import zmq.asyncio

from lmcache_async import CacheEngine, EngineConfig, InvalidInputError, RemoteCacheEngine
from lmcache_async.backends.record import payload_checksum, tensor_bytes
from lmcache_async.rpc.client import check_move_target
from lmcache_async.rpc.move import move
from lmcache_async.rpc.protocol import (
    PROTOCOL_VERSION,
    MessageType,
    decode,
    encode,
    tokens_payload,
)
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    Sidecar,
    Sidecars,
    kv_for,
    payload_of,
    prompt,
    wait_ready,
)

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets and B's disk tier (socket paths: 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lmc-mv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, short_dir: Path
) -> Iterator[tuple[Sidecar, Sidecar]]:
    """Sidecars A (CPU only) and B (CPU and a disk tier), shared by the module's tests."""
    launcher = Sidecars(tmp_path_factory.mktemp("move-logs"))
    try:
        # A may move to B and to an address nobody listens on (the unreachable case).
        targets = [f"ipc://{short_dir}/b.sock", f"ipc://{short_dir}/nobody.sock"]
        a = launcher.start(f"ipc://{short_dir}/a.sock", "--move-targets", *targets)
        b = launcher.start(f"ipc://{short_dir}/b.sock", "--local-disk", str(short_dir / "disk"))
        anyio.run(wait_ready, a)
        anyio.run(wait_ready, b)
        yield a, b
    finally:
        launcher.stop_all()


def connect(url: str, **options: Any) -> Any:
    return RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL, timeout=10, **options)


def embedded(**config: Any) -> Any:
    settings: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01} | config
    return CacheEngine.open(EngineConfig(**settings), LAYOUT, model_name=MODEL)


async def retrieved_exactly(
    engine: RemoteCacheEngine,
    tokens: list[int],
    kv: list[torch.Tensor],
    slots: torch.Tensor,
    **options: Any,
) -> bool:
    """Whether ``engine`` loads every token of ``tokens`` with exactly the bytes of ``kv``."""
    target = LAYOUT.allocate_kv_caches(-(-len(tokens) // LAYOUT.block_size), random=False)
    mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots, **options)
    return bool(mask.all()) and torch.equal(payload_of(target, slots), payload_of(kv, slots))


# -- sidecar to sidecar -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_copy_moves_a_prefix_bit_exact_and_keeps_the_source(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    num_tokens = 5 * CHUNK + 5
    tokens = prompt(num_tokens, 100)
    kv, slots = kv_for(num_tokens, 1)
    with anyio.fail_after(TIMEOUT):
        async with connect(a.url) as on_a, connect(b.url) as on_b:
            assert await on_a.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            assert await on_b.lookup(tokens) == 0
            moved = await on_a.move(tokens, "cpu", (b.url, "cpu"))
            assert moved == num_tokens
            assert await on_a.lookup(tokens) == num_tokens  # a copy: A keeps it
            assert await on_b.lookup(tokens) == num_tokens
            assert await retrieved_exactly(on_b, tokens, kv, slots)
            stats = (await on_b.stats())["engine"]
    assert stats["stored_tokens"] >= num_tokens
    assert a.alive() and b.alive()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_move_without_copy_removes_the_source_and_reaches_a_disk_tier(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    num_tokens = 4 * CHUNK
    tokens = prompt(num_tokens, 200)
    kv, slots = kv_for(num_tokens, 2)
    with anyio.fail_after(TIMEOUT):
        async with connect(a.url) as on_a, connect(b.url) as on_b:
            assert await on_a.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            assert await on_a.move(tokens, "cpu", [b.url, "disk"], copy=False) == num_tokens
            assert await on_a.lookup(tokens) == 0
            assert await on_b.lookup(tokens, search_range=["cpu"]) == 0
            assert await on_b.lookup(tokens, search_range=["disk"]) == num_tokens
            assert await retrieved_exactly(on_b, tokens, kv, slots, retrieve_locations=["disk"])


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_move_stops_at_the_first_chunk_the_source_lacks(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    tokens = prompt(6 * CHUNK, 300)
    kv, slots = kv_for(3 * CHUNK, 3)
    with anyio.fail_after(TIMEOUT):
        async with connect(a.url) as on_a, connect(b.url) as on_b:
            stored = await on_a.store(tokens[: 3 * CHUNK], kv_caches=kv, slot_mapping=slots)
            assert stored == 3 * CHUNK
            assert await on_a.move(tokens, "cpu", (b.url, "cpu")) == 3 * CHUNK
            assert await on_b.lookup(tokens) == 3 * CHUNK
            assert await on_a.move(prompt(2 * CHUNK, 301), "cpu", (b.url, "cpu")) == 0


# -- what the receiver refuses ----------------------------------------------------------------


def chunk_payloads(
    kv: list[torch.Tensor], slots: torch.Tensor, ends: list[int]
) -> list[torch.Tensor]:
    starts = [0, *ends[:-1]]
    return [payload_of(kv, slots[s:e]) for s, e in zip(starts, ends, strict=True)]


def checksum(payload: torch.Tensor) -> int:
    return payload_checksum(tensor_bytes(payload))


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_chunk_corrupted_in_flight_is_refused_with_the_rest(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    _, b = pair
    num_tokens = 4 * CHUNK
    tokens = prompt(num_tokens, 400)
    kv, slots = kv_for(num_tokens, 4)
    payloads = chunk_payloads(kv, slots, [CHUNK, 2 * CHUNK, 3 * CHUNK, 4 * CHUNK])
    sums = [checksum(p) for p in payloads]
    bad = payloads[2].clone()
    bad.view(-1).view(torch.uint8)[7] ^= 0x10  # one bit flipped on the way
    with anyio.fail_after(TIMEOUT):
        async with connect(b.url, shared_memory=False) as on_b:
            pushed = [payloads[0], payloads[1], bad, payloads[3]]
            assert await on_b.push_chunks(tokens, pushed, checksums=sums) == 2 * CHUNK
            assert await on_b.lookup(tokens) == 2 * CHUNK
            assert "bad checksum" in b.log()
            # The wrong size is refused too; the chunks before it are taken.
            short = [bytes(tensor_bytes(payloads[2]))[:-2], payloads[3]]
            took = await on_b.push_chunks(tokens, short, checksums=sums[2:], start=2 * CHUNK)
            assert took == 0
            assert "bytes, the chunk holds" in b.log()
            assert await on_b.lookup(tokens) == 2 * CHUNK
            # The sound bytes, from the third chunk on, complete the prefix.
            took = await on_b.push_chunks(tokens, payloads[2:], checksums=sums[2:], start=2 * CHUNK)
            assert took == 2 * CHUNK
            assert await retrieved_exactly(on_b, tokens, kv, slots)
            with pytest.raises(InvalidInputError, match="checksums"):
                await on_b.push_chunks(tokens, payloads, checksums=sums[:3])
            with pytest.raises(InvalidInputError, match="unsigned 64-bit"):
                await on_b.push_chunks(tokens, payloads[:1], checksums=[-1])
            with pytest.raises(InvalidInputError, match="tape"):
                await on_b.push_chunks(tokens, payloads[:1], checksums=sums[:1], location="tape")
            with pytest.raises(InvalidInputError, match="chunk boundary"):
                await on_b.push_chunks(tokens, payloads[:1], checksums=sums[:1], start=3)


# -- unreachable targets and bad positions ------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_unreachable_target_moves_nothing_within_the_timeout(
    pair: tuple[Sidecar, Sidecar], short_dir: Path
) -> None:
    a, _ = pair
    nowhere = f"ipc://{short_dir}/nobody.sock"
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 500)
    kv, slots = kv_for(num_tokens, 5)
    with anyio.fail_after(TIMEOUT):
        async with RemoteCacheEngine.connect(a.url, LAYOUT, model_name=MODEL, timeout=0.5) as on_a:
            assert await on_a.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            began = time.monotonic()
            assert await on_a.move(tokens, "cpu", (nowhere, "cpu"), copy=False) == 0
            assert time.monotonic() - began < 3.0
            assert await on_a.lookup(tokens) == num_tokens  # nothing was removed
        async with embedded() as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            began = time.monotonic()
            assert await move(engine, tokens, "cpu", (nowhere, "cpu"), timeout=0.3) == 0
            assert time.monotonic() - began < 2.0
            assert await engine.lookup(tokens) == num_tokens


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_bad_positions_are_refused_clearly(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    tokens = prompt(CHUNK, 600)
    cases: list[tuple[Any, Any, str]] = [
        ("tape", (b.url, "cpu"), "old_position: 'tape' is not an enabled tier"),
        (3, (b.url, "cpu"), "old_position must be a tier name"),
        ("cpu", b.url, r"new_position must be a \(url, location\) pair"),
        ("cpu", (b.url, "cpu", "x"), "pair"),
        ("cpu", ("http://host:1", "cpu"), "url must be ipc://PATH or tcp://HOST:PORT"),
        ("cpu", (b.url, ""), "location must be a tier name"),
    ]
    with anyio.fail_after(TIMEOUT):
        async with connect(a.url) as on_a, embedded() as engine:
            for old, new, message in cases:
                with pytest.raises(InvalidInputError, match=message):
                    await on_a.move(tokens, old, new)
                with pytest.raises(InvalidInputError, match=message):
                    await move(engine, tokens, old, new)
            with pytest.raises(InvalidInputError, match="copy must be a bool"):
                await move(engine, tokens, "cpu", (b.url, "cpu"), copy="no")
            with pytest.raises(InvalidInputError, match="timeout"):
                await move(engine, tokens, "cpu", (b.url, "cpu"), timeout=0)
            # A tier the target lacks is refused by the target, through A for a client.
            kv, slots = kv_for(CHUNK, 6)
            assert await on_a.store(tokens, kv_caches=kv, slot_mapping=slots) == CHUNK
            with pytest.raises(InvalidInputError, match="'redis' is not an enabled tier"):
                await on_a.move(tokens, "cpu", (b.url, "redis"))
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == CHUNK
            with pytest.raises(InvalidInputError, match="'redis' is not an enabled tier"):
                await move(engine, tokens, "cpu", (b.url, "redis"))
        assert a.alive() and b.alive()


def test_move_targets_are_checked_without_a_connection() -> None:
    assert check_move_target(("tcp://127.0.0.1:5555", "disk")) == ("tcp://127.0.0.1:5555", "disk")
    assert check_move_target(["ipc:///tmp/b.sock", "cpu"]) == ("ipc:///tmp/b.sock", "cpu")
    for bad in ("ipc:///tmp/b.sock", b"xy", ("tcp://", "cpu"), (1, "cpu"), ("ipc:///b", None)):
        with pytest.raises(InvalidInputError, match="new_position"):
            check_move_target(bad)
    numbers = [int(MessageType.RELEASE), int(MessageType.PUSH), int(MessageType.MOVE)]
    assert numbers == [16, 17, 18]  # appended, nothing renumbered


# -- an embedded engine moving to a sidecar ------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_embedded_engine_moves_from_its_disk_tier_to_a_sidecar(
    pair: tuple[Sidecar, Sidecar], tmp_path: Path
) -> None:
    _, b = pair
    num_tokens = 3 * CHUNK + 7
    tokens = prompt(num_tokens, 700)
    kv, slots = kv_for(num_tokens, 7)
    with anyio.fail_after(TIMEOUT):
        async with embedded(local_disk=str(tmp_path / "disk")) as engine, connect(b.url) as on_b:
            stored = await engine.store(
                tokens, kv_caches=kv, slot_mapping=slots, store_location=["disk"]
            )
            assert stored == num_tokens
            assert await engine.flush()
            assert await engine.lookup(tokens, search_range=["cpu"]) == 0
            moved = await move(engine, tokens, "disk", (b.url, "cpu"), copy=False)
            assert moved == num_tokens
            assert await engine.lookup(tokens) == 0
            assert await on_b.lookup(tokens) == num_tokens
            assert await retrieved_exactly(on_b, tokens, kv, slots)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_an_embedded_engine_of_another_namespace_or_chunk_size_is_refused(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    _, b = pair
    tokens = prompt(2 * CHUNK, 800)
    kv, slots = kv_for(2 * CHUNK, 8)
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config, LAYOUT, model_name="another-model") as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 2 * CHUNK
            with pytest.raises(InvalidInputError, match="namespace mismatch"):
                await move(engine, tokens, "cpu", (b.url, "cpu"))
        async with embedded(chunk_size=2 * CHUNK) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 2 * CHUNK
            with pytest.raises(InvalidInputError, match="chunk_size"):
                await move(engine, tokens, "cpu", (b.url, "cpu"))


# -- malformed pushes and moves on the wire -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_malformed_pushes_and_moves_get_error_replies(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    _, b = pair
    tokens = tokens_payload(prompt(CHUNK, 900))
    payload = bytes(LAYOUT.dtype.itemsize * math.prod(LAYOUT.payload_shape(CHUNK)))
    hello = {"model_name": MODEL, "layout": LAYOUT.to_dict(), "client": "raw"}
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(b.url)

    async def ask(msg_type: MessageType, header: dict[str, Any], *frames: object) -> Any:
        await sock.send_multipart(encode(msg_type, header, frames, request_id=1))
        return decode(await sock.recv_multipart())

    try:
        with anyio.fail_after(TIMEOUT):
            reply = await ask(MessageType.PUSH, {"checksums": [0]}, tokens, payload)
            assert (reply.type, reply.header["code"]) == (MessageType.ERROR, "no_session")
            assert (await ask(MessageType.HELLO, hello)).type is MessageType.HELLO
            cases: list[tuple[MessageType, dict[str, Any], tuple[object, ...], str]] = [
                (MessageType.PUSH, {"checksums": [0, 1]}, (tokens, payload), "one unsigned"),
                (MessageType.PUSH, {"checksums": ["x"]}, (tokens, payload), "one unsigned"),
                (MessageType.PUSH, {"checksums": []}, (), "token frame"),
                (MessageType.MOVE, {"copy": True}, (), "one token frame"),
                (MessageType.MOVE, {"old_position": "cpu"}, (tokens,), "'copy' must be a bool"),
            ]
            for msg_type, header, frames, message in cases:
                reply = await ask(msg_type, header, *frames)
                assert reply.type is MessageType.ERROR, (msg_type, header)
                assert reply.header["code"] == "protocol"
                assert message in reply.header["message"]
            header = {"old_position": "cpu", "new_position": "nowhere", "copy": True}
            reply = await ask(MessageType.MOVE, header, tokens)
            assert (reply.header["code"], reply.type) == ("invalid_input", MessageType.ERROR)
            # A well-formed push of zeros with a wrong checksum: refused, not counted.
            reply = await ask(MessageType.PUSH, {"checksums": [1]}, tokens, payload)
            assert reply.header == {
                "v": PROTOCOL_VERSION,
                "id": 1,
                "stored": 0,
                "chunks": 0,
                "refused": 1,
            }
    finally:
        sock.close(linger=0)
        context.term()
    assert b.alive()
