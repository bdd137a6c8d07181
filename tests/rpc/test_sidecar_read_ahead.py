"""A streamed load's next part read ahead by the sidecar (:mod:`lmcache_async.rpc.sidecar.
read_ahead`): in host memory before the client asks for it, its reading started while the
part before it is still read, exact, and let go when the load ends short of it or its
session ends.

The client here does not send its next part's RETRIEVE ahead (it asks once it has copied
the part before), so what is in the sidecar's memory before it asks was read ahead.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async.core import LoadCore
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.copies import CopyPath
from lmcache_async.rpc.sidecar import SidecarServer
from lmcache_async.rpc.sidecar.sessions import Session, Sessions
from tests.rpc.test_sidecar import CHUNK, kv_for, payload_of, prompt
from tests.rpc.test_sidecar_round_trips import held, on_disk

pytestmark = pytest.mark.anyio

TIMEOUT: Final = 30.0


@pytest.fixture
def no_send_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients ask for each next part only once the part before is copied."""
    monkeypatch.setattr(Connection, "send_ahead", lambda self, *args, **kw: None)


def cpu_chunks(server: SidecarServer) -> int:
    engine = server.host.engine
    assert engine is not None
    return engine.stats().tiers["cpu"].chunks


def five_chunks(seed: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor, Any]:
    """A prompt of five chunks, the KV caches it is stored from, its slots, and caches of
    the same shape to load into."""
    tokens = prompt(5 * CHUNK, seed)
    kv, slots = kv_for(len(tokens), seed)
    empty, _ = kv_for(len(tokens), seed + 1)
    return tokens, kv, slots, empty


async def keys_of(server: SidecarServer, tokens: list[int]) -> list[Any]:
    """The chunk keys the sidecar's engine gives ``tokens``."""
    engine = server.host.engine
    assert engine is not None
    return [span.key for span in (await engine.chunk_spans(tokens))[0]]


async def test_the_next_part_is_in_memory_before_the_client_asks(
    short_dir: Path, no_send_ahead: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Five chunks on disk, parts of two: when the client copies a part, the sidecar has
    # already read the next one into its RAM tier (it would not have without reading
    # ahead: nobody asked for it yet).
    tokens, kv, slots, empty = five_chunks(31)
    expected = payload_of(kv, slots)
    in_memory: list[int] = []
    scatter = CopyPath.scatter

    async def watched(self: CopyPath, *args: Any, **kw: Any) -> None:
        # The sidecar replied this part; the reading of the next one, if any, is under way.
        engine = server.host.engine
        assert engine is not None
        for session in server.sessions.by_identity.values():
            for ahead in session.read_aheads.values():
                reading = engine.core.load.prefetching(ahead)
                if reading is not None:
                    await reading.done.wait()
        in_memory.append(cpu_chunks(server))
        await scatter(self, *args, **kw)

    monkeypatch.setattr(CopyPath, "scatter", watched)
    with anyio.fail_after(TIMEOUT):
        async with on_disk(short_dir, tokens, kv, slots, pipeline_batch_chunks=2) as (
            server,
            client,
        ):
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
            await client.ping()
            holds = held(server)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), expected)
    assert in_memory == [4, 5, 5]  # parts 0, 1, 2: each found the next one read
    assert holds == (0, 0, 0)  # no transaction, lookup id or pin left


async def test_the_next_part_is_read_while_the_part_before_it_is_still_read(
    short_dir: Path, no_send_ahead: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Five chunks on disk, parts of two: each part's request starts the reading of the
    # part after it before its own chunks are read, so the tier never waits between parts.
    tokens, kv, slots, empty = five_chunks(33)
    expected = payload_of(kv, slots)
    events: list[tuple[str, object]] = []
    prefetch, reserve = LoadCore.prefetch, LoadCore.reserve

    def watched_prefetch(self: LoadCore, keys: Any, *args: Any, **kw: Any) -> Any:
        events.append(("read ahead", keys[0]))
        return prefetch(self, keys, *args, **kw)

    async def watched_reserve(self: LoadCore, keys: Any, *args: Any, **kw: Any) -> Any:
        objs = await reserve(self, keys, *args, **kw)
        events.append(("part read", keys[0]))
        return objs

    monkeypatch.setattr(LoadCore, "prefetch", watched_prefetch)
    monkeypatch.setattr(LoadCore, "reserve", watched_reserve)
    with anyio.fail_after(TIMEOUT):
        async with on_disk(short_dir, tokens, kv, slots, pipeline_batch_chunks=2) as (
            server,
            client,
        ):
            keys = await keys_of(server, tokens)
            events.clear()
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
            await client.ping()
            holds = held(server)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), expected)
    assert events == [
        ("read ahead", keys[2]),
        ("part read", keys[0]),
        ("read ahead", keys[4]),
        ("part read", keys[2]),
        ("part read", keys[4]),
    ]
    assert holds == (0, 0, 0)


async def test_a_part_read_ahead_for_a_load_that_ends_before_it_is_let_go(
    short_dir: Path, no_send_ahead: None
) -> None:
    # Chunk 1 of five is gone: the first part ends the load at chunk 0, so the part read
    # ahead from chunk 2 will never be asked for. Its pins go when the part is served, not
    # when the session ends.
    tokens, kv, slots, empty = five_chunks(35)
    expected = payload_of(kv, slots[:CHUNK])
    with anyio.fail_after(TIMEOUT):
        async with on_disk(short_dir, tokens, kv, slots, pipeline_batch_chunks=2) as (
            server,
            client,
        ):
            keys = await keys_of(server, tokens)
            engine = server.host.engine
            assert engine is not None
            assert await engine._parts.manager.remove([keys[1]]) == 1
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
            await client.ping()
            sessions = list(server.sessions.by_identity.values())
            for session in sessions:  # a part still read ahead: its reading over
                for ahead in session.read_aheads.values():
                    reading = engine.core.load.prefetching(ahead)
                    if reading is not None:
                        await reading.done.wait()
            holds = held(server)
            del engine  # nothing here holds on to the sidecar's memory
    assert mask.tolist() == [True] * CHUNK + [False] * 4 * CHUNK
    assert torch.equal(payload_of(empty, slots[:CHUNK]), expected)
    assert [session.read_aheads for session in sessions] == [{}]
    assert holds == (0, 0, 0)


async def test_a_session_that_ends_lets_go_of_the_parts_read_for_it() -> None:
    # A part read ahead that its client never asked for: when the session ends (the
    # reaper, a shutdown), its reading is stopped and its pins dropped.
    dropped: list[object] = []
    load = SimpleNamespace(drop_prefetch=dropped.append)
    host = SimpleNamespace(engine=SimpleNamespace(core=SimpleNamespace(load=load)))
    sessions = Sessions(host, timeout=30.0, heartbeat_interval=10.0)  # type: ignore[arg-type]
    session = Session(b"\x00client", "client", last_seen=0.0)
    session.read_aheads = {"first-key": ("sidecar-ahead", b"\x00client", "first-key")}
    sessions.add(session)
    await sessions.drop(session, "gone")
    assert dropped == [("sidecar-ahead", b"\x00client", "first-key")]
    assert session.read_aheads == {} and len(sessions) == 0
