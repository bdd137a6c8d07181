"""A streamed load's next part read ahead by the sidecar (:mod:`lmcache_async.rpc.sidecar.
read_ahead`): in host memory before the client asks for it, exact, and let go when its
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


async def test_the_next_part_is_in_memory_before_the_client_asks(
    short_dir: Path, no_send_ahead: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Five chunks on disk, parts of two: when the client copies a part, the sidecar has
    # already read the next one into its RAM tier (it would not have without reading
    # ahead: nobody asked for it yet).
    tokens = prompt(5 * CHUNK, 31)
    kv, slots = kv_for(len(tokens), 31)
    expected = payload_of(kv, slots)
    empty, _ = kv_for(len(tokens), 32)
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
