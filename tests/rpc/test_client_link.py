"""A client link's deferred notifications (:meth:`Link.notify_soon`): sent on the loop's
next pass without another call, always before the link's next message, in order when the
socket could not take them at once, and not lost by a close."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import zmq
import zmq.asyncio

from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.settings import DEFAULT_CLIENT_LIMITS
from lmcache_async.rpc.protocol import Message, MessageType, decode, encode

pytestmark = pytest.mark.anyio

LIMIT: Final = 10.0


@pytest.fixture
def url() -> Iterator[str]:
    path = Path(tempfile.mkdtemp(prefix="lmc-link-", dir="/tmp"))  # ipc paths: 107 bytes
    yield f"ipc://{path}/link.sock"
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def opened(context: zmq.asyncio.Context, url: str) -> AsyncIterator[Link]:
    link = Link(context, url, b"client", None, DEFAULT_CLIENT_LIMITS)
    try:
        yield link
    finally:
        link.close()


@contextlib.asynccontextmanager
async def peer(context: zmq.asyncio.Context, url: str) -> AsyncIterator[zmq.asyncio.Socket]:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(url)
    try:
        yield router
    finally:
        router.close()


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def received(router: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    frames = await router.recv_multipart(copy=True)
    return frames[0], decode(frames[1:])


def release(txn: int) -> dict[str, Any]:
    return {"txn": txn, "loaded": 0}


async def test_a_deferred_message_goes_out_on_the_next_pass(
    context: zmq.asyncio.Context, url: str
) -> None:
    async with peer(context, url) as router, opened(context, url) as link:
        link.notify_soon(MessageType.RELEASE, release(7), LIMIT)
        with anyio.fail_after(LIMIT):
            _, message = await received(router)
        assert (message.type, message.header["txn"]) == (MessageType.RELEASE, 7)


async def test_deferred_messages_go_before_the_next_request(
    context: zmq.asyncio.Context, url: str
) -> None:
    async with peer(context, url) as router, opened(context, url) as link:

        async def answer() -> None:
            order = []
            while True:
                identity, message = await received(router)
                order.append((message.type, message.header.get("txn")))
                if message.type is MessageType.PING:
                    reply = encode(
                        MessageType.PING, {"order": order}, request_id=message.request_id
                    )
                    await router.send_multipart([identity, *reply])
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            with anyio.fail_after(LIMIT):
                # No await between them: the request itself sends what was deferred first.
                link.notify_soon(MessageType.RELEASE, release(1), LIMIT)
                link.notify_soon(MessageType.COMMIT, {"txn": 2, "quiet": True}, LIMIT)
                reply = await link.request(MessageType.PING, {}, timeout=LIMIT)
        assert reply.header["order"] == [
            [int(MessageType.RELEASE), 1],
            [int(MessageType.COMMIT), 2],
            [int(MessageType.PING), None],
        ]


async def test_deferred_messages_wait_for_a_peer_and_keep_their_order(
    context: zmq.asyncio.Context, url: str
) -> None:
    """With no server yet (the socket takes nothing), the deferred messages wait, and the
    request after them waits behind them: all go in order once the server is there."""
    async with opened(context, url) as link:
        link.notify_soon(MessageType.RELEASE, release(1), LIMIT)
        link.notify_soon(MessageType.RELEASE, release(2), LIMIT)
        sent = link.send_ahead(MessageType.STORE, {"ahead": True}, timeout=LIMIT)
        assert sent is None  # it would pass the messages still waiting
        results: list[Message] = []
        answered = anyio.Event()

        async def ask() -> None:
            results.append(await link.request(MessageType.PING, {}, timeout=LIMIT))
            answered.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            async with peer(context, url) as router:
                with anyio.fail_after(LIMIT):
                    seen = [await received(router) for _ in range(3)]
                    identity, ping = seen[-1]
                    reply = encode(MessageType.PING, {}, request_id=ping.request_id)
                    await router.send_multipart([identity, *reply])
                    await answered.wait()  # the router stays until its reply is read
        assert [(m.type, m.header.get("txn")) for _, m in seen] == [
            (MessageType.RELEASE, 1),
            (MessageType.RELEASE, 2),
            (MessageType.PING, None),
        ]
        assert results[0].type is MessageType.PING


async def test_a_close_sends_what_was_deferred(context: zmq.asyncio.Context, url: str) -> None:
    async with peer(context, url) as router:
        async with opened(context, url) as link:
            # The link's connection is up once a first message went through.
            link.notify_soon(MessageType.RELEASE, release(1), LIMIT)
            with anyio.fail_after(LIMIT):
                await received(router)
            link.notify_soon(MessageType.RELEASE, release(2), LIMIT)
        # closed at once, before the loop's next pass
        with anyio.fail_after(LIMIT):
            _, message = await received(router)
        assert (message.type, message.header["txn"]) == (MessageType.RELEASE, 2)
