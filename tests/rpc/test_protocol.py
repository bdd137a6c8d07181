"""The wire protocol: framing round trips, every refusal with its reason, and fuzzing of a
running LookupServer process, which must answer everything and change nothing."""

from __future__ import annotations

import concurrent.futures
import enum
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_async import InvalidInputError, ProtocolError
from lmcache_async.rpc.lookup import SyncLookupClient
from lmcache_async.rpc.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
    error_reply,
    hashes_from_wire,
    hashes_to_wire,
    put_tenant,
    request_id_of,
    tenant_of,
    to_wire,
    tokens_from_payload,
    tokens_payload,
)


def header(**fields: Any) -> bytes:
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


LOOKUP = bytes([MessageType.LOOKUP])

# -- round trips -----------------------------------------------------------------------------


def test_round_trip_with_payloads_of_every_buffer_kind() -> None:
    tokens = np.arange(10, dtype="<i4")
    payloads = [b"abc", memoryview(b"\x00" * 5), bytearray(b"xy"), tokens, b""]
    frames = encode(MessageType.STORE, {"key": "k", "n": [1, 2]}, payloads, request_id=42)
    assert frames[0] == bytes([MessageType.STORE])
    as_frames = [zmq.Frame(bytes(f)) for f in frames]
    for given_frames in (frames, as_frames, [bytes(f) for f in frames]):
        message = decode(given_frames)
        assert message.type is MessageType.STORE
        assert message.request_id == 42
        assert message.header == {
            "v": PROTOCOL_VERSION,
            "id": 42,
            "sizes": [3, 5, 2, 40, 0],
            "key": "k",
            "n": [1, 2],
        }
        assert [bytes(p) for p in message.payloads] == [
            b"abc",
            b"\x00" * 5,
            b"xy",
            tokens.tobytes(),
            b"",
        ]


def test_payloads_are_not_copied_on_either_side() -> None:
    array = np.zeros(8, dtype=np.uint8)
    frames = encode(MessageType.STORE, None, [array])
    array[0] = 7
    assert bytes(frames[2])[0] == 7, "encode keeps a view, not a copy"
    buffer = bytearray(bytes(frames[2]))
    message = decode([frames[0], frames[1], buffer])
    buffer[1] = 9
    assert message.payloads[0][1] == 9, "decode returns views on the frames"


def test_message_without_payloads_and_string_request_id() -> None:
    message = decode(encode(MessageType.PING, request_id="r-1"))
    assert message == Message(MessageType.PING, {"v": PROTOCOL_VERSION, "id": "r-1"}, [])
    assert decode(encode(MessageType.PING)).request_id is None


def test_tokens_travel_as_raw_int32_little_endian() -> None:
    for tokens in ([5, 0, 2**31 - 1], torch.tensor([5, 0, 2**31 - 1]), np.array([5, 0, 2**31 - 1])):
        payload = tokens_payload(tokens)
        assert bytes(payload) == b"\x05\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\x7f"
        assert tokens_from_payload(payload).tolist() == [5, 0, 2**31 - 1]
    assert tokens_from_payload(memoryview(b"")).tolist() == []
    with pytest.raises(InvalidInputError, match=">= 0"):
        tokens_payload([-1])
    with pytest.raises(ProtocolError, match="multiple of 4 bytes, got 5"):
        tokens_from_payload(memoryview(b"\x00" * 5))


@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-(2**255), max_value=2**255 - 1),
            st.binary(max_size=40),
        ),
        max_size=30,
    )
)
def test_block_hashes_round_trip_through_msgpack(hashes: list[int | bytes]) -> None:
    frames = encode(MessageType.LOOKUP, {"hashes": hashes_to_wire(hashes)})
    assert hashes_from_wire(decode(frames).header["hashes"]) == hashes


def test_block_hash_errors() -> None:
    with pytest.raises(InvalidInputError, match=r"hashes\[1\] must be an int or bytes"):
        hashes_to_wire([1, 2.0])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="sequence"):
        hashes_to_wire(b"abc")
    for value, match in [(5, "must be a list"), ([1.5], r"'hashes'\[0\]"), ([[1]], r"\[0\]")]:
        with pytest.raises(ProtocolError, match=match):
            hashes_from_wire(value)


class Color(enum.Enum):
    RED = "red"


@dataclass
class Inner:
    a: int
    b: tuple[int, ...]


def test_to_wire_makes_plain_data() -> None:
    value = {"x": Inner(1, (2, 3)), 4: Color.RED, "s": {5}, "m": MessageType.PING}
    assert to_wire(value) == {"x": {"a": 1, "b": [2, 3]}, "4": "red", "s": [5], "m": 13}
    with pytest.raises(InvalidInputError, match="object has no wire form"):
        to_wire(object())


def test_encode_refuses_reserved_keys_and_bad_values() -> None:
    for key in ("v", "id", "sizes"):
        with pytest.raises(InvalidInputError, match="reserved"):
            encode(MessageType.PING, {key: 1})
    with pytest.raises(InvalidInputError, match="keys must be str"):
        encode(MessageType.PING, {1: 2})  # type: ignore[dict-item]
    with pytest.raises(InvalidInputError, match="payload 0 must be a bytes-like"):
        encode(MessageType.STORE, None, ["text"])
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        encode(MessageType.STORE, None, [np.zeros((4, 4))[:, 1]])
    with pytest.raises(InvalidInputError, match="cannot be encoded"):
        encode(MessageType.PING, {"x": object()})
    with pytest.raises(InvalidInputError, match="cannot be encoded"):
        encode(MessageType.PING, {"a": [1, 2, "three"], "b": object()})  # fails half-way
    with pytest.raises(InvalidInputError, match="request_id"):
        encode(MessageType.PING, request_id=1.5)  # type: ignore[arg-type]
    # Nothing of a refused header leaks into the next message.
    header = decode(encode(MessageType.PING, {"ok": 1}, request_id=3)).header
    assert header == {"v": PROTOCOL_VERSION, "id": 3, "ok": 1}


def test_threads_encode_at_once_and_each_gets_its_own_header() -> None:
    def work(n: int) -> list[dict[str, Any]]:
        return [
            decode(
                encode(
                    MessageType.LOOKUP, {"n": n, "i": i, "pad": "x" * (n * 37 % 200)}, request_id=i
                )
            ).header
            for i in range(2000)
        ]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(8)))
    for n, headers in enumerate(results):
        assert headers == [
            {"v": PROTOCOL_VERSION, "id": i, "n": n, "i": i, "pad": "x" * (n * 37 % 200)}
            for i in range(2000)
        ]


def test_limits_are_validated() -> None:
    with pytest.raises(InvalidInputError, match="max_header_bytes"):
        MessageLimits(max_header_bytes=0)
    with pytest.raises(InvalidInputError, match="max_payload_bytes"):
        MessageLimits(max_payload_bytes=True)
    assert MessageLimits(10, 100).max_frame_bytes == 110


# -- every refusal ---------------------------------------------------------------------------

V = PROTOCOL_VERSION
ext_header = msgpack.packb({"v": V, "x": msgpack.ExtType(5, b"z")}, use_bin_type=True)
timestamp_header = msgpack.packb(
    {"v": V, "t": msgpack.Timestamp(1, 0)}, use_bin_type=True, datetime=False
)

REFUSALS: list[tuple[str, list[bytes], str]] = [
    ("no frames", [], "no frames"),
    ("empty type frame", [b"", header(v=V)], "type frame must be 1 byte, got 0"),
    ("long type frame", [b"\x02\x00", header(v=V)], "type frame must be 1 byte, got 2"),
    ("no header", [LOOKUP], "no header frame"),
    ("unknown type", [b"\xee", header(v=V)], "unknown message type 238"),
    ("not msgpack", [LOOKUP, b"\xc1"], "not valid msgpack"),
    ("truncated header", [LOOKUP, header(v=V, key="abcdef")[:-3]], "not valid msgpack"),
    ("trailing bytes", [LOOKUP, header(v=V) + b"\x01"], "not valid msgpack"),
    ("header a list", [LOOKUP, msgpack.packb([1, 2])], "must be a msgpack map, got list"),
    ("int map keys", [LOOKUP, msgpack.packb({1: 2})], "not valid msgpack"),
    ("ext type", [LOOKUP, ext_header], "extension type"),
    ("timestamp", [LOOKUP, timestamp_header], "unsupported msgpack value"),
    ("no version", [LOOKUP, header(id=1)], "no protocol version"),
    ("old version", [LOOKUP, header(v=0)], "protocol version 0 is not supported"),
    ("previous version", [LOOKUP, header(v=V - 1)], f"protocol version {V - 1} is not"),
    ("new version", [LOOKUP, header(v=V + 1)], f"protocol version {V + 1} is not supported"),
    ("text version", [LOOKUP, header(v="1")], "protocol version '1' is not supported"),
    ("bool version", [LOOKUP, header(v=True)], "protocol version True is not supported"),
    ("float id", [LOOKUP, header(v=V, id=1.5)], "request id must be an int or str"),
    ("payload without sizes", [LOOKUP, header(v=V), b"abc"], "has no 'sizes'"),
    (
        "wrong sizes",
        [LOOKUP, header(v=V, sizes=[4]), b"abc"],
        r"declares payload sizes \[4\] but the frames hold \[3\]",
    ),
    (
        "huge declared sizes",
        [LOOKUP, header(v=V, sizes=[2**63, 2**64 - 1]), b"a", b"b"],
        r"declares payload sizes \[9223372036854775808, 18446744073709551615\]",
    ),
    ("sizes not a list", [LOOKUP, header(v=V, sizes=3), b"abc"], "declares payload sizes 3"),
    (
        "sizes for no frame",
        [LOOKUP, header(v=V, sizes=[1])],
        r"sizes \[1\] but the frames hold \[\]",
    ),
    ("header too big", [LOOKUP, header(v=V, pad="x" * 200)], "exceeds max_header_bytes=100"),
    (
        "payload too big",
        [LOOKUP, header(v=V, sizes=[600, 600]), b"a" * 600, b"b" * 600],
        "payload of 1200 bytes exceeds max_payload_bytes=1000",
    ),
]


REFUSAL_CASES = [pytest.param(frames, match, id=name) for name, frames, match in REFUSALS]
# Those a server can be sent (there are frames) and that do not rest on tiny limits.
SERVER_REFUSAL_CASES = [
    pytest.param(frames, match, id=name)
    for name, frames, match in REFUSALS
    if frames and "exceeds" not in match
]


@pytest.mark.parametrize(("frames", "match"), REFUSAL_CASES)
def test_decode_refuses_with_the_reason(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames, max_header_bytes=100, max_payload_bytes=1000)


def test_a_tenant_travels_in_the_header_and_none_adds_nothing() -> None:
    for tenant in ("a", "", "é" * 128, "x" * 256):
        fields: dict[str, Any] = {}
        put_tenant(fields, tenant)
        assert fields == {"tenant": tenant}
        assert tenant_of(decode(encode(MessageType.STORE, fields)).header) == tenant
    fields = {}
    put_tenant(fields, None)
    assert fields == {}
    assert tenant_of({}) is None
    assert tenant_of({"tenant": None}) is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (7, "tenant must be None or a str, got int"),
        (b"a", "tenant must be None or a str, got bytes"),
        ("x" * 257, "tenant must be at most 256 UTF-8 bytes"),
        ("é" * 129, "tenant must be at most 256 UTF-8 bytes"),
        (["a"], "tenant must be None or a str, got list"),
    ],
)
def test_a_bad_tenant_is_refused_naming_the_field(bad: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        put_tenant({}, bad)
    with pytest.raises(InvalidInputError, match=match):
        tenant_of({"tenant": bad})


def test_error_reply_and_request_id_salvage() -> None:
    reply = decode(error_reply(9, ErrorCode.PROTOCOL, "x" * 5000))
    assert reply.type is MessageType.ERROR
    assert reply.request_id == 9
    assert reply.header["code"] == "protocol"
    assert len(reply.header["message"]) == 1000
    assert request_id_of([LOOKUP, header(v=2, id="a")], max_header_bytes=100) == "a"
    assert request_id_of([LOOKUP, header(v=2, id=7)], max_header_bytes=100) == 7
    assert request_id_of([LOOKUP, header(v=2, id=1.5)], max_header_bytes=100) is None
    assert request_id_of([LOOKUP, b"\xc1"], max_header_bytes=100) is None
    assert request_id_of([LOOKUP, header(id=1, pad="x" * 200)], max_header_bytes=100) is None
    assert request_id_of([LOOKUP], max_header_bytes=100) is None


# -- a running server under fire -------------------------------------------------------------

MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 1 << 20
STORED = 80
CHUNK = 16


class RawPeer:
    """A bare DEALER socket talking to a LookupServer: any frames out, one reply back."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context: zmq.Context[zmq.Socket[Any]] = zmq.Context()
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket[Any]:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        return socket

    def reconnect(self) -> None:
        self.socket.close(linger=0)
        self.socket = self._connect()

    def ask(self, frames: list[Any], timeout: float = 5.0) -> Message:
        self.socket.send_multipart(frames, copy=False)
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply within {timeout}s")
        return decode(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@dataclass
class Served:
    peer: RawPeer
    client: SyncLookupClient
    worker: Any
    tokens: list[int]

    def snapshot(self) -> tuple[int, int, int]:
        """(hits, cached chunks, pinned chunks): what fuzzing must not change."""
        stats = self.client.stats()[0]
        assert stats is not None
        return self.client.lookup(self.tokens), stats["cached_chunks"], stats["pinned_chunks"]


@pytest.fixture(scope="module")
def served(module_workers: Any, prompt_tokens: Callable[[int], list[int]]) -> Iterator[Served]:
    (worker,) = module_workers(
        "fuzz",
        [(0, STORED)],
        "--max-header-bytes",
        str(MAX_HEADER),
        "--max-payload-bytes",
        str(MAX_PAYLOAD),
        prompt_len=100,
    )
    peer = RawPeer(worker.endpoint)
    client = SyncLookupClient("fuzz", 1, socket_dir=str(module_workers.socket_dir), timeout=5.0)
    try:
        yield Served(peer, client, worker, prompt_tokens(100))
    finally:
        client.close()
        peer.close()


def lookup_frames(tokens: list[int], request_id: int = 1, **fields: Any) -> list[Any]:
    return encode(MessageType.LOOKUP, fields, [tokens_payload(tokens)], request_id=request_id)


@pytest.mark.subprocess
def test_server_answers_a_valid_lookup_over_a_raw_socket(served: Served) -> None:
    reply = served.peer.ask(lookup_frames(served.tokens, request_id=5))
    assert (reply.type, reply.request_id, reply.header["hits"]) == (MessageType.LOOKUP, 5, STORED)
    reply = served.peer.ask(encode(MessageType.PING, request_id="p"))
    assert reply.header == {"v": V, "id": "p", "instance_id": "fuzz", "rank": 0}
    # The worker stored for its own tenant: another tenant's lookup finds nothing.
    reply = served.peer.ask(lookup_frames(served.tokens, request_id=6, tenant="other"))
    assert (reply.type, reply.header["hits"]) == (MessageType.LOOKUP, 0)
    assert served.client.lookup(served.tokens, tenant="other") == 0
    assert served.snapshot() == (STORED, STORED // CHUNK, 0)


@pytest.mark.subprocess
@pytest.mark.parametrize(("frames", "match"), SERVER_REFUSAL_CASES)
def test_server_replies_to_a_refused_message_with_an_error(
    served: Served, frames: list[bytes], match: str
) -> None:
    reply = served.peer.ask(frames)
    assert reply.type is MessageType.ERROR
    assert reply.header["code"] == ErrorCode.PROTOCOL
    assert re.search(match, reply.header["message"])
    assert served.worker.alive()


@pytest.mark.subprocess
def test_server_reports_bad_fields_unsupported_types_and_engine_errors(served: Served) -> None:
    cases: list[tuple[list[Any], str, str]] = [
        (lookup_frames([1], pin="yes"), "protocol", "'pin' must be a bool"),
        (lookup_frames([1], lookup_id=1.5), "protocol", "'lookup_id' must be an int or str"),
        (encode(MessageType.LOOKUP, {}, request_id=3), "protocol", "exactly one token payload"),
        (
            encode(MessageType.LOOKUP, {"hashes": [1]}, request_id=3),
            "protocol",
            "needs an 'offsets' list",
        ),
        (
            encode(MessageType.LOOKUP, {"hashes": [1], "offsets": [16]}, [b"x"], request_id=3),
            "protocol",
            "carries no payload frames",
        ),
        (
            encode(MessageType.LOOKUP, {"hashes": [1], "offsets": [5, 9]}, request_id=3),
            "invalid_input",
            "got 1 hashes but 2 offsets",
        ),
        (lookup_frames([1, 2], pin=True), "invalid_input", "pin=True needs a lookup_id"),
        (
            encode(MessageType.LOOKUP, {}, [b"\xff\xff\xff\xff"], request_id=3),
            "invalid_input",
            "token ids must be >= 0",
        ),
        (lookup_frames([1], tenant=5), "invalid_input", "tenant must be None or a str"),
        (lookup_frames([1], tenant="x" * 300), "invalid_input", "tenant must be at most 256"),
        (encode(MessageType.UNPIN, {}, request_id=3), "protocol", "'lookup_id' must be"),
        (encode(MessageType.STORE, {}, request_id=3), "unsupported", "does not serve STORE"),
        (encode(MessageType.ERROR, {}, request_id=3), "unsupported", "does not serve ERROR"),
    ]
    for frames, code, match in cases:
        reply = served.peer.ask(frames)
        assert reply.type is MessageType.ERROR, match
        assert reply.header["code"] == code, match
        assert match in reply.header["message"]
    assert served.snapshot() == (STORED, STORED // CHUNK, 0)


@pytest.mark.subprocess
def test_oversized_messages_are_refused_and_the_server_lives_on(served: Served) -> None:
    big_header = header(v=V, id=11, pad="x" * MAX_HEADER)
    reply = served.peer.ask([LOOKUP, big_header])
    assert (reply.type, reply.request_id) == (MessageType.ERROR, None)
    assert f"exceeds max_header_bytes={MAX_HEADER}" in reply.header["message"]
    half = b"\x00" * (MAX_PAYLOAD // 2 + 4)
    reply = served.peer.ask(encode(MessageType.LOOKUP, {}, [half, half], request_id=12))
    assert (reply.type, reply.request_id) == (MessageType.ERROR, 12)
    assert f"exceeds max_payload_bytes={MAX_PAYLOAD}" in reply.header["message"]
    # A single frame over the hard cap: ZeroMQ drops the connection before reading it.
    huge = b"\x00" * (MAX_PAYLOAD + 2 * MAX_HEADER)
    served.peer.socket.send_multipart(encode(MessageType.LOOKUP, {}, [huge]), copy=False)
    assert not served.peer.socket.poll(300), "no reply to a frame ZeroMQ refused"
    served.peer.reconnect()
    assert served.peer.ask(encode(MessageType.PING)).type is MessageType.PING
    assert served.worker.alive()
    assert served.snapshot() == (STORED, STORED // CHUNK, 0)


LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
NESTED = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=5,
)


@st.composite
def hostile_messages(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "structured", "truncated"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    if kind == "structured":
        fields = draw(st.dictionaries(st.text(max_size=8), LEAVES, max_size=4))
        fields["v"] = draw(st.sampled_from([V, V, 0, 2, "1", None, -1, 2**40]))
        if draw(st.booleans()):
            fields["id"] = draw(LEAVES)
        if draw(st.booleans()):
            fields["sizes"] = draw(
                st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=4)
            )
        if draw(st.booleans()):
            fields["hashes"] = draw(NESTED)
        payloads = draw(st.lists(st.binary(max_size=64), max_size=3))
        type_byte = draw(st.sampled_from([*range(16), 99, 255]))
        return [bytes([type_byte]), msgpack.packb(fields, use_bin_type=True), *payloads]
    valid = [bytes(f) for f in lookup_frames([1, 2, 3, 4], request_id=77)]
    index = draw(st.integers(0, len(valid) - 1))
    cut = draw(st.integers(0, max(0, len(valid[index]) - 1)))
    damaged = [*valid[:index], valid[index][:cut], *valid[index + 1 :]]
    if draw(st.booleans()):
        damaged = damaged[: draw(st.integers(1, len(damaged)))]
    return damaged


@pytest.mark.subprocess
def test_fuzzed_messages_get_one_reply_each_and_change_nothing(served: Served) -> None:
    before = served.snapshot()
    replies: set[MessageType] = set()

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(frames=hostile_messages())
    def fire(frames: list[bytes]) -> None:
        reply = served.peer.ask(frames)
        replies.add(reply.type)
        if reply.type is MessageType.ERROR:
            assert reply.header["code"] in {code.value for code in ErrorCode}
            assert reply.header["message"]
        assert served.worker.alive()

    fire()
    assert MessageType.ERROR in replies
    assert served.worker.alive()
    assert served.snapshot() == before == (STORED, STORED // CHUNK, 0)
