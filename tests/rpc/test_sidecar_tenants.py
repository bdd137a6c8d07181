"""Tenants through a real sidecar process: every request about a prompt names its tenant
on the wire, the sidecar keys the prompt for that tenant, and a bad tenant is an error
reply that leaves the connection serving."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import InvalidInputError, RemoteCacheEngine
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.protocol import MessageType, tokens_payload
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    Sidecar,
    Sidecars,
    kv_for,
    payload_of,
    ping,
    prompt,
    server_state,
    wait_ready,
)

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

N = 4 * CHUNK + 5  # four whole chunks and a short one
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    short = Path(tempfile.mkdtemp(prefix="lmc-tn-", dir="/tmp"))  # ipc paths: 107 bytes
    launcher = Sidecars(tmp_path_factory.mktemp("tenant-logs"))
    try:
        started = launcher.start(f"ipc://{short}/tenants.sock")
        anyio.run(wait_ready, started)
        yield started
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)


def connect(url: str, **options: Any) -> Any:
    return RemoteCacheEngine.connect(url, LAYOUT, model_name=MODEL, timeout=10, **options)


def link_of(engine: RemoteCacheEngine) -> Link:
    link = engine._conn.link
    assert link is not None
    return link


async def test_a_prompt_stored_for_a_tenant_is_found_by_that_tenant_only(sidecar: Sidecar) -> None:
    tokens = prompt(N, salt=9100)
    kv, slots = kv_for(N, seed=91)
    with anyio.fail_after(TIMEOUT):
        async with connect(sidecar.url) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="a") == N
            # Lookups by digests (each tenant's own hasher), then by tokens on the wire.
            assert await engine.lookup(tokens, tenant="a") == N
            assert await engine.lookup(tokens, tenant="b") == 0
            assert await engine.lookup(tokens) == 0  # the session's own tenant
            assert await engine.lookup(tokens, tenant="") == 0  # "" is a name, not None
            link = link_of(engine)
            for tenant, hits in (("a", N), ("b", 0), (None, 0)):
                header: dict[str, Any] = {"pin": False}
                if tenant is not None:
                    header["tenant"] = tenant
                reply = await link.request(
                    MessageType.LOOKUP, header, [tokens_payload(tokens)], timeout=10
                )
                assert reply.header["hits"] == hits, tenant
            # A retrieve of another tenant writes nothing.
            for other in ("b", None):
                target = LAYOUT.allocate_kv_caches(5, random=False)
                loaded = await engine.retrieve(
                    tokens, kv_caches=target, slot_mapping=slots, tenant=other
                )
                assert not loaded.any(), other
                assert not payload_of(target, slots).any(), other
            target = LAYOUT.allocate_kv_caches(5, random=False)
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots, tenant="a")
            assert bool(loaded.all())
            assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
            # The same prompt stored for "b" is a store of its own: chunks of its own.
            before, _ = await server_state(engine)
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="b") == N
            after, _ = await server_state(engine)
            assert after["cached_chunks"] - before["cached_chunks"] == 5
            assert await engine.lookup(tokens, tenant="b") == N
            _, server = await server_state(engine)
            assert server["transactions"] == 0


async def test_pins_and_prefetches_are_keyed_by_the_tenant(sidecar: Sidecar) -> None:
    tokens = prompt(N, salt=9200)
    kv, slots = kv_for(N, seed=92)
    with anyio.fail_after(TIMEOUT):
        async with connect(sidecar.url) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="a") == N
            assert await engine.lookup(tokens, lookup_id="p", pin=True, tenant="b") == 0
            assert await engine.lookup(tokens, lookup_id="p", pin=True, tenant="a") == N
            stats, _ = await server_state(engine)
            assert stats["pinned_chunks"] == 5
            target = LAYOUT.allocate_kv_caches(5, random=False)
            loaded = await engine.retrieve(
                tokens, kv_caches=target, slot_mapping=slots, lookup_id="p", tenant="a"
            )
            assert bool(loaded.all())
            stats, _ = await server_state(engine)
            assert stats["pinned_chunks"] == 0  # the retrieve with the id released them
            assert await engine.prefetch(tokens, lookup_id="f", tenant="b") == 0
            assert await engine.prefetch(tokens, lookup_id="f", tenant="a") == N
            await engine.lookup_unpin("f")


async def test_a_prompt_found_by_its_tenants_digests_is_none_of_anothers(
    sidecar: Sidecar,
) -> None:
    """Tenant "a" stores a prompt: its digests under "a" find every token, "b"'s digests of
    the same tokens under "b" find none, "a"'s digests named as another tenant's are
    refused, and a retrieve of the same tokens loads all of them for "a" and none for "b"."""
    num_tokens = 3 * CHUNK
    tokens = prompt(num_tokens, salt=9300)
    kv, slots = kv_for(num_tokens, seed=93)
    with anyio.fail_after(TIMEOUT):
        async with connect(sidecar.url) as engine:
            stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="a")
            assert stored == num_tokens
            hashers, digests = {}, {}
            for tenant in ("a", "b"):
                hasher = engine._conn.hasher_for(tenant)
                assert hasher is not None  # the server said how it hashes
                assert hasher.tag == tenant_tag(tenant)
                hashers[tenant] = hasher
                digests[tenant] = b"".join(hasher.digests(tokens))
                assert digests[tenant][:TAG_BYTES] == tenant_tag(tenant)
            link = link_of(engine)
            header = {"digests_of": num_tokens, "pin": False}
            for tenant, hits in (("a", num_tokens), ("b", 0)):
                reply = await link.request(
                    MessageType.LOOKUP, {**header, "tenant": tenant}, [digests[tenant]], timeout=10
                )
                assert reply.header["hits"] == hits, tenant
            for other in ({"tenant": "b"}, {}):
                with pytest.raises(InvalidInputError, match="not of the tenant named"):
                    await link.request(
                        MessageType.LOOKUP, {**header, **other}, [digests["a"]], timeout=10
                    )
            for tenant in ("b", "a"):
                target = LAYOUT.allocate_kv_caches(3, random=False)
                loaded = await engine.retrieve(
                    tokens, kv_caches=target, slot_mapping=slots, tenant=tenant
                )
                got = payload_of(target, slots)
                if tenant == "a":
                    assert bool(loaded.all())
                    assert torch.equal(got, payload_of(kv, slots))
                else:
                    assert not loaded.any()
                    assert not got.any()
            # The hashers of named tenants are kept, not rebuilt for every lookup.
            for tenant, hasher in hashers.items():
                assert engine._conn.hasher_for(tenant) is hasher
            assert engine._conn.hasher_for(None) is engine._conn.hasher


BAD_TENANTS = [
    (5, "tenant must be None or a str, got int"),
    (b"a", "tenant must be None or a str, got bytes"),
    ("x" * 300, "tenant must be at most 256 UTF-8 bytes"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_TENANTS)
async def test_a_bad_tenant_is_an_error_reply_and_the_session_lives_on(
    sidecar: Sidecar, bad: object, match: str
) -> None:
    tokens = prompt(2 * CHUNK, salt=9400)
    kv, slots = kv_for(2 * CHUNK, seed=94)
    frame = tokens_payload(tokens)
    requests: list[tuple[MessageType, dict[str, Any], list[Any]]] = [
        (MessageType.STORE, {"start": 0}, [frame]),
        (MessageType.RETRIEVE, {"start": 0}, [frame]),
        (MessageType.LOOKUP, {"pin": False}, [frame]),
        (MessageType.LOOKUP, {"pin": False, "digests_of": 2 * CHUNK}, [b"\0" * 32]),
        (MessageType.PREFETCH, {"lookup_id": "x"}, [frame]),
    ]
    with anyio.fail_after(TIMEOUT):
        async with connect(sidecar.url) as engine:
            before, _ = await server_state(engine)
            link = link_of(engine)
            for msg_type, header, payloads in requests:
                with pytest.raises(InvalidInputError, match=match):
                    await link.request(msg_type, {**header, "tenant": bad}, payloads, timeout=10)
            # The client checks the tenant before anything goes out.
            calls = [
                engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant=bad),
                engine.retrieve(tokens, kv_caches=kv, slot_mapping=slots, tenant=bad),
                engine.lookup(tokens, tenant=bad),
                engine.prefetch(tokens, lookup_id="y", tenant=bad),
            ]
            for call in calls:
                with pytest.raises(InvalidInputError, match=match):
                    await call
            after, server = await server_state(engine)
            assert after["cached_chunks"] == before["cached_chunks"]
            assert after["pinned_chunks"] == 0
            assert server["transactions"] == 0
            # The same session serves on.
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="ok") == 32
            assert await engine.lookup(tokens, tenant="ok") == 32
            assert engine.is_healthy()
    assert await ping(sidecar.url, 10)
