"""A sidecar request's round trips: a pinned lookup lends its hit (the retrieve after it
asks nothing more), a store whose commit cannot keep fewer does not wait for it, and the
session's next requests still see what it committed.

Each test counts the messages the client sends (its link's requests and notifications)
and checks the bytes loaded and what the sidecar holds afterwards.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async import EngineConfig, RemoteCacheEngine
from lmcache_async.config import GB
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.protocol import MessageType
from lmcache_async.rpc.sidecar import SidecarServer, SidecarSettings
from lmcache_async.rpc.sidecar.admission import Admission
from lmcache_async.rpc.sidecar.sessions import InFlight
from tests.rpc.test_sidecar import CHUNK, LAYOUT, MODEL, in_process, kv_for, payload_of, prompt

pytestmark = pytest.mark.anyio

TIMEOUT: Final = 30.0


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """The messages every client link sends: ``("ask", TYPE)`` for a request whose reply
    is waited for, ``("notify", TYPE)`` for one whose is not."""
    counts: Counter[tuple[str, str]] = Counter()
    request, notify = Link.request, Link.notify

    async def counted_request(self: Link, msg_type: MessageType, *args: Any, **kw: Any) -> Any:
        counts["ask", msg_type.name] += 1
        return await request(self, msg_type, *args, **kw)

    async def counted_notify(self: Link, msg_type: MessageType, *args: Any, **kw: Any) -> None:
        counts["notify", msg_type.name] += 1
        await notify(self, msg_type, *args, **kw)

    notify_soon = Link.notify_soon

    def counted_notify_soon(self: Link, msg_type: MessageType, *args: Any, **kw: Any) -> None:
        counts["notify", msg_type.name] += 1
        notify_soon(self, msg_type, *args, **kw)

    send_ahead = Link.send_ahead

    def counted_send_ahead(self: Link, msg_type: MessageType, *args: Any, **kw: Any) -> Any:
        counts["ahead", msg_type.name] += 1
        return send_ahead(self, msg_type, *args, **kw)

    monkeypatch.setattr(Link, "request", counted_request)
    monkeypatch.setattr(Link, "notify", counted_notify)
    monkeypatch.setattr(Link, "notify_soon", counted_notify_soon)
    monkeypatch.setattr(Link, "send_ahead", counted_send_ahead)
    return counts


@contextlib.asynccontextmanager
async def served(
    short_dir: Path, limits: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[tuple[str, SidecarServer]]:
    """A sidecar in this process with ``config`` (engine keys) and ``limits`` (its own)."""
    url = f"ipc://{short_dir}/rt.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, **{"max_local_cpu_size": 0.02, **config}),
        heartbeat_interval=30.0,
        **(limits or {}),
    )
    async with in_process(settings) as server:
        yield url, server


@pytest.fixture
async def sidecar(short_dir: Path) -> AsyncIterator[tuple[str, SidecarServer]]:
    async with served(short_dir) as both:
        yield both


def connect(url: str, *, store_ahead: bool = False) -> Any:
    return RemoteCacheEngine.connect(
        url, LAYOUT, model_name=MODEL, timeout=10, store_ahead=store_ahead
    )


def cpu_tier(server: SidecarServer) -> Any:
    engine = server.host.engine
    assert engine is not None
    return engine.stats().tiers["cpu"]


def held(server: SidecarServer) -> tuple[int, int, int]:
    """What the sidecar holds for its clients: open transactions, lookup ids with pins,
    pinned chunks."""
    engine = server.host.engine
    assert engine is not None
    return (
        server.sessions.transactions(),
        server.sessions.lookup_ids(),
        engine.stats().pinned_chunks,
    )


async def test_a_pinned_lookup_lends_its_hit_and_its_retrieve_asks_nothing_more(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = prompt(5 * CHUNK + 3, 1)
    kv, slots = kv_for(len(tokens), 1)
    expected = payload_of(kv, slots[: 5 * CHUNK])
    empty, _ = kv_for(len(tokens), 2)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            assert await client.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            before = server.host.engine.stats()
            sent.clear()
            hits = await client.lookup(tokens[: 5 * CHUNK], lookup_id="r1", pin=True)
            mask = await client.retrieve(
                tokens[: 5 * CHUNK],
                kv_caches=empty,
                slot_mapping=slots[: 5 * CHUNK],
                lookup_id="r1",
            )
            await client.ping()  # the RELEASE was read before the PING's reply
            after = server.host.engine.stats()
            holds = held(server)
    assert hits == 5 * CHUNK
    assert bool(mask.all()) and mask.numel() == 5 * CHUNK
    assert torch.equal(payload_of(empty, slots[: 5 * CHUNK]), expected)
    assert sent == Counter({("ask", "LOOKUP"): 1, ("notify", "RELEASE"): 1, ("ask", "PING"): 1})
    assert after.retrieve_requests == before.retrieve_requests + 1
    assert holds == (0, 0, 0)  # the lend's RELEASE dropped the pins and the references


async def test_a_retrieve_of_other_tokens_under_the_id_is_not_served_from_the_lend(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    first, second = prompt(4 * CHUNK, 2), prompt(4 * CHUNK, 3)
    kv_a, slots = kv_for(4 * CHUNK, 3)
    kv_b, _ = kv_for(4 * CHUNK, 4)
    empty, _ = kv_for(4 * CHUNK, 5)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            await client.store(first, kv_caches=kv_a, slot_mapping=slots)
            await client.store(second, kv_caches=kv_b, slot_mapping=slots)
            assert await client.lookup(first, lookup_id=7, pin=True) == 4 * CHUNK
            sent.clear()
            mask = await client.retrieve(second, kv_caches=empty, slot_mapping=slots, lookup_id=7)
            await client.ping()
            holds = held(server)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), payload_of(kv_b, slots))  # not the lent ones
    assert sent[("ask", "RETRIEVE")] == 1
    assert holds == (0, 0, 0)


async def test_tokens_changed_in_place_after_the_lookup_are_loaded_as_they_are_now(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = torch.tensor(prompt(3 * CHUNK, 4), dtype=torch.int32)
    other = torch.tensor(prompt(3 * CHUNK, 5), dtype=torch.int32)
    kv, slots = kv_for(3 * CHUNK, 6)
    empty, _ = kv_for(3 * CHUNK, 7)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            await client.store(tokens, kv_caches=kv, slot_mapping=slots)
            assert await client.lookup(tokens, lookup_id=8, pin=True) == 3 * CHUNK
            tokens[CHUNK:] = other[CHUNK:]  # the same tensor, other tokens after chunk 0
            sent.clear()
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots, lookup_id=8)
            await client.ping()
            holds = held(server)
    assert mask.tolist() == [True] * CHUNK + [False] * 2 * CHUNK
    assert torch.equal(payload_of(empty, slots[:CHUNK]), payload_of(kv, slots[:CHUNK]))
    assert sent[("ask", "RETRIEVE")] == 1
    assert holds == (0, 0, 0)


async def test_a_lend_past_its_pins_expiry_is_not_used(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = prompt(2 * CHUNK, 6)
    kv, slots = kv_for(2 * CHUNK, 8)
    empty, _ = kv_for(2 * CHUNK, 9)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            await client.store(tokens, kv_caches=kv, slot_mapping=slots)
            await client.lookup(tokens, lookup_id=9, pin=True)
            lend = client._lends._by_id[9]
            lend.usable_until = anyio.current_time()  # its pins may be gone by now
            sent.clear()
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots, lookup_id=9)
            await client.ping()
            holds = held(server)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), payload_of(kv, slots))
    assert sent == Counter(
        {("notify", "RELEASE"): 2, ("ask", "RETRIEVE"): 1, ("ask", "PING"): 1}
    )  # the lend given back (pins kept), then the retrieve's own transaction
    assert holds == (0, 0, 0)


async def test_unpinning_a_lending_lookup_costs_no_round_trip_and_leaves_nothing_held(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = prompt(3 * CHUNK, 7)
    kv, slots = kv_for(3 * CHUNK, 10)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            await client.store(tokens, kv_caches=kv, slot_mapping=slots)
            await client.lookup(tokens, lookup_id=10, pin=True)
            assert held(server) == (1, 1, 3)
            sent.clear()
            await client.lookup_unpin(10)
            await client.ping()
            holds = held(server)
    assert sent == Counter({("notify", "RELEASE"): 1, ("ask", "PING"): 1})
    assert holds == (0, 0, 0)


async def test_a_store_does_not_wait_for_a_commit_that_cannot_keep_fewer(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = prompt(4 * CHUNK + 5, 8)
    kv, slots = kv_for(len(tokens), 11)
    with anyio.fail_after(TIMEOUT):
        async with connect(url) as client:
            stored = await client.store(tokens, kv_caches=kv, slot_mapping=slots)
            hits = await client.lookup(tokens)
            await client.ping()
            holds = held(server)
    assert stored == hits == len(tokens)
    assert sent[("ask", "STORE")] == 1 and sent[("notify", "COMMIT")] == 1
    assert sent[("ask", "COMMIT")] == 0
    assert holds == (0, 0, 0)


async def test_a_store_waits_for_its_commit_when_the_disk_tier_is_waited_for(
    short_dir: Path, sent: Counter[tuple[str, str]]
) -> None:
    tokens = prompt(3 * CHUNK, 9)
    kv, slots = kv_for(len(tokens), 12)
    disk = short_dir / "disk"
    with anyio.fail_after(TIMEOUT):
        async with served(
            short_dir,
            local_disk=str(disk),
            max_local_disk_size=0.01,
            wait_for_slow_tiers=True,
        ) as (url, _):
            async with connect(url) as client:
                stored = await client.store(tokens, kv_caches=kv, slot_mapping=slots)
            files = [path for path in disk.rglob("*") if path.is_file()]
    assert stored == len(tokens)
    assert sent[("ask", "COMMIT")] == 1 and sent[("notify", "COMMIT")] == 0
    assert len([path for path in files if "manifest" not in path.name]) >= 3  # written


@contextlib.asynccontextmanager
async def on_disk(
    short_dir: Path,
    tokens: Any,
    kv: Any,
    slots: torch.Tensor,
    limits: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[tuple[SidecarServer, Any]]:
    """A sidecar with a disk tier holding ``tokens``' KV (its RAM tier emptied) and a
    client of it."""
    async with (
        served(
            short_dir,
            limits,
            local_disk=str(short_dir / "disk"),
            max_local_disk_size=0.01,
            wait_for_slow_tiers=True,
            **config,
        ) as (url, server),
        connect(url) as client,
    ):
        assert await client.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
        await client.clear(["cpu"])
        yield server, client


@pytest.mark.parametrize(
    ("limits", "asked"),
    [
        # Three parts (2 + 2 + 1 chunks): the first asked, the next two sent ahead.
        ({}, 1),
        # One open transaction allowed: each part sent ahead is refused (busy) while the
        # part before it is held, and asked again once that is released.
        ({"max_session_transactions": 1}, 3),
    ],
)
async def test_a_load_from_disk_asks_for_each_next_part_before_copying_this_one(
    short_dir: Path, sent: Counter[tuple[str, str]], limits: dict[str, Any], asked: int
) -> None:
    """Parts of two chunks read from disk: each part's RETRIEVE goes out before the part
    before it is copied (the sidecar reads it meanwhile); the bytes are exact and nothing
    is held afterwards."""
    tokens = prompt(5 * CHUNK, 21)
    kv, slots = kv_for(len(tokens), 21)
    expected = payload_of(kv, slots)
    empty, _ = kv_for(len(tokens), 22)
    with anyio.fail_after(TIMEOUT):
        async with on_disk(short_dir, tokens, kv, slots, limits, pipeline_batch_chunks=2) as (
            server,
            client,
        ):
            sent.clear()
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
            await client.ping()
            holds = held(server)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), expected)
    assert sent[("ask", "RETRIEVE")] == asked and sent[("ahead", "RETRIEVE")] == 2
    assert sent[("notify", "RELEASE")] == 3
    assert holds == (0, 0, 0)


def pool_share(server: SidecarServer) -> int:
    """Chunks in an eighth of the sidecar's pool (checked fewer than a batch)."""
    engine = server.host.engine
    assert engine is not None
    share = int(engine.core.pool.capacity_bytes // (8 * LAYOUT.token_bytes * CHUNK))
    assert 1 <= share < engine.config.pipeline_batch_chunks
    return share


async def test_a_load_from_ram_comes_in_parts_of_its_share_of_the_pool(
    short_dir: Path, sent: Counter[tuple[str, str]]
) -> None:
    """A pool of a few dozen chunks: a part holds at most an eighth of it, fewer than
    ``pipeline_batch_chunks``, however much the RAM tier holds of the prompt."""
    tokens = prompt(6 * CHUNK, 26)
    kv, slots = kv_for(len(tokens), 26)
    expected = payload_of(kv, slots)
    empty, _ = kv_for(len(tokens), 27)
    with anyio.fail_after(TIMEOUT):
        async with (
            served(short_dir, max_local_cpu_size=24 * 4096 / GB) as (url, server),
            connect(url) as client,
        ):
            share = pool_share(server)
            assert await client.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            sent.clear()
            mask = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
    assert bool(mask.all())
    assert torch.equal(payload_of(empty, slots), expected)
    parts = -(-6 // share)
    assert sent[("ask", "RETRIEVE")] + sent[("ahead", "RETRIEVE")] == parts


async def test_a_promise_that_may_wait_is_answered_once_the_disk_reads_end(
    short_dir: Path,
) -> None:
    tokens = prompt(4 * CHUNK, 23)
    kv, slots = kv_for(len(tokens), 23)
    with anyio.fail_after(TIMEOUT):
        async with on_disk(short_dir, tokens, kv, slots) as (server, client):
            first = await client.promise(tokens, lookup_id="p", wait=TIMEOUT / 4)
            pinned = server.host.engine.stats().pinned_chunks
            await client.lookup_unpin("p")
    assert (first.tokens, first.pending) == (len(tokens), False)
    assert pinned == 4


async def test_a_lookup_after_a_commit_not_waited_for_waits_for_it_on_the_server(
    sidecar: tuple[str, SidecarServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, server = sidecar
    gate = anyio.Event()
    settled = InFlight.settled

    async def opening(self: InFlight, timeout: float) -> None:
        gate.set()  # a later request of the session waits for the commit: let it be served
        await settled(self, timeout)

    monkeypatch.setattr(InFlight, "settled", opening)
    tokens = prompt(3 * CHUNK, 10)
    kv, slots = kv_for(len(tokens), 13)
    try:
        with anyio.fail_after(TIMEOUT):
            async with connect(url) as client:
                assert await client.ping()  # the engine is open
                engine = server.host.engine
                assert engine is not None
                store = engine.core.store
                commit = store.commit

                async def gated_commit(*args: Any, **kw: Any) -> int:
                    await gate.wait()
                    return await commit(*args, **kw)

                monkeypatch.setattr(store, "commit", gated_commit)
                stored = await client.store(tokens, kv_caches=kv, slot_mapping=slots)
                hits = await client.lookup(tokens, lookup_id=11, pin=True)
                await client.lookup_unpin(11)
    finally:
        gate.set()
    assert stored == hits == len(tokens)


async def test_a_store_after_a_lookup_that_sent_it_ahead_waits_for_no_round_trip(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    tokens = prompt(5 * CHUNK, 11)
    kv, slots = kv_for(len(tokens), 14)
    computed, _ = kv_for(len(tokens), 15)  # the engine's caches: the hit loaded, the rest
    computed[0][:] = kv[0]  # computed (here: the same values as the first engine's)
    computed[1][:] = kv[1]
    empty, _ = kv_for(len(tokens), 16)
    with anyio.fail_after(TIMEOUT):
        async with connect(url, store_ahead=True) as client:
            head = 2 * CHUNK
            await client.store(tokens[:head], kv_caches=kv, slot_mapping=slots[:head])
            sent.clear()
            hits = await client.lookup(tokens, lookup_id="p", pin=True)
            loaded = await client.retrieve(
                tokens, kv_caches=computed, slot_mapping=slots, lookup_id="p"
            )
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[head:] = True
            stored = await client.store(tokens, kv_caches=computed, slot_mapping=slots, mask=mask)
            steps = Counter(sent)
            found = await client.lookup(tokens)
            again = await client.retrieve(tokens, kv_caches=empty, slot_mapping=slots)
            await client.ping()
            holds = held(server)
    assert (hits, int(loaded.sum()), stored, found) == (head, head, 3 * CHUNK, len(tokens))
    assert steps == Counter(
        {
            ("ask", "LOOKUP"): 1,
            ("ahead", "STORE"): 1,
            ("notify", "RELEASE"): 1,
            ("notify", "COMMIT"): 1,
        }
    )
    assert bool(again.all()) and torch.equal(payload_of(empty, slots), payload_of(kv, slots))
    assert holds == (0, 0, 0)


async def test_a_store_ahead_of_a_prompt_held_whole_or_of_a_later_mask_counts_right(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    whole, part = prompt(3 * CHUNK, 15), prompt(5 * CHUNK, 16)
    kv, slots = kv_for(5 * CHUNK, 20)
    with anyio.fail_after(TIMEOUT):
        async with connect(url, store_ahead=True) as client:
            await client.store(whole, kv_caches=kv, slot_mapping=slots[: 3 * CHUNK])
            await client.store(part[:CHUNK], kv_caches=kv, slot_mapping=slots[:CHUNK])
            sent.clear()
            # Held whole: the STORE sent ahead answers at once, no commit follows.
            assert await client.lookup(whole, lookup_id=1, pin=True) == 3 * CHUNK
            await client.lookup_unpin(1)
            stored_whole = await client.store(whole, kv_caches=kv, slot_mapping=slots[: 3 * CHUNK])
            steps = Counter(sent)
            # One chunk held: the STORE ahead reserved chunks 1-4, but this store starts at
            # chunk 3 (the mask): it gives the reservation back and asks for its own.
            assert await client.lookup(part, lookup_id=2, pin=True) == CHUNK
            await client.lookup_unpin(2)
            mask = torch.zeros(5 * CHUNK, dtype=torch.bool)
            mask[3 * CHUNK :] = True
            stored_part = await client.store(part, kv_caches=kv, slot_mapping=slots, mask=mask)
            found = await client.lookup(part)
            await client.stats()
            holds = held(server)
    assert steps == Counter({("ask", "LOOKUP"): 1, ("ahead", "STORE"): 1, ("notify", "RELEASE"): 1})
    assert (stored_whole, stored_part, found) == (3 * CHUNK, 2 * CHUNK, CHUNK)
    assert sent[("ask", "STORE")] == 1  # the later mask's own
    assert holds == (0, 0, 0)


async def test_a_store_ahead_replaced_or_of_another_prompt_is_given_back(
    sidecar: tuple[str, SidecarServer], sent: Counter[tuple[str, str]]
) -> None:
    url, server = sidecar
    first, second = prompt(3 * CHUNK, 12), prompt(3 * CHUNK, 13)
    kv, slots = kv_for(3 * CHUNK, 17)
    with anyio.fail_after(TIMEOUT):
        async with connect(url, store_ahead=True) as client:
            await client.lookup(first, lookup_id=1, pin=True)  # reserves 3 chunks
            await client.lookup(first, lookup_id=1, pin=True)  # again: the first given back
            stored = await client.store(second, kv_caches=kv, slot_mapping=slots)  # not it
            stored += await client.store(first, kv_caches=kv, slot_mapping=slots)
            await client.lookup_unpin(1)
            await client.stats()  # served after every message before it
            holds = held(server)
            used = server.host.engine.stats().pool.used_bytes
            tier = cpu_tier(server)
    assert stored == 6 * CHUNK
    assert sent[("ahead", "STORE")] == 2 and sent[("ask", "STORE")] == 1
    assert holds == (0, 0, 0)
    assert (tier.chunks, used) == (6, tier.bytes)  # no reservation left in the pool


async def test_a_store_sent_ahead_evicts_nothing_its_lookup_pins(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = anyio.Event()
    settled = InFlight.settled

    async def opening(self: InFlight, timeout: float) -> None:
        gate.set()  # the STORE waits for the lookup: let the lookup be served
        await settled(self, timeout)

    monkeypatch.setattr(InFlight, "settled", opening)
    tokens = prompt(5 * CHUNK, 14)
    kv, slots = kv_for(len(tokens), 18)
    try:
        with anyio.fail_after(TIMEOUT):
            async with (
                served(
                    short_dir,
                    max_local_cpu_size=0.0002,
                    local_disk=str(short_dir / "disk"),
                    max_local_disk_size=0.01,
                ) as (url, server),
                connect(url, store_ahead=True) as client,
            ):
                head = 2 * CHUNK
                await client.store(tokens[:head], kv_caches=kv, slot_mapping=slots[:head])
                pool = server.host.engine.stats().pool
                room = (pool.capacity_bytes - pool.used_bytes) // (pool.used_bytes // 2)
                for salt in range(room):  # the CPU tier full, the prompt's chunks oldest
                    filler = prompt(CHUNK, 100 + salt)
                    await client.store(filler, kv_caches=kv, slot_mapping=slots[:CHUNK])
                await client.stats()  # served after the last commit
                tier = cpu_tier(server)
                assert (tier.chunks, tier.evictions) == (2 + room, 0)
                engine = server.host.engine

                async def gated(*args: Any, lookup: Any = engine.lookup_digests, **kw: Any) -> int:
                    await gate.wait()  # the lookup is slow: the STORE is read first
                    return int(await lookup(*args, **kw))

                monkeypatch.setattr(engine, "lookup_digests", gated)
                hits = await client.lookup(tokens, lookup_id="q", pin=True)
                empty, _ = kv_for(len(tokens), 19)
                loaded = await client.retrieve(
                    tokens, kv_caches=empty, slot_mapping=slots, lookup_id="q"
                )
                monkeypatch.undo()  # the engine's memory goes with the sidecar, not later
                del engine, gated
    finally:
        gate.set()
    assert hits == int(loaded.sum()) == 2 * CHUNK
    assert torch.equal(payload_of(empty, slots[:head]), payload_of(kv, slots[:head]))


def test_commits_and_releases_are_taken_when_a_peers_slots_are_full() -> None:
    admission = Admission(total=1, per_peer=1)
    assert admission.admit(b"peer", MessageType.STORE)
    assert not admission.admit(b"peer", MessageType.LOOKUP)
    assert not admission.admit(b"other", MessageType.RETRIEVE)
    assert admission.admit(b"peer", MessageType.COMMIT)
    assert admission.admit(b"peer", MessageType.RELEASE)
    for kind in (MessageType.STORE, MessageType.COMMIT, MessageType.RELEASE):
        admission.done(b"peer", kind)
    assert admission.in_flight == 0
    assert admission.admit(b"other", MessageType.LOOKUP)
