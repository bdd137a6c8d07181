"""The plan of the sidecar's wire fuzzer (:mod:`tests.rpc.wire_fuzz`): what each hostile
message, scripted sequence and abandoned session is, and the Hypothesis strategies that draw
them from a seed (:func:`plan`). Nothing here sends anything."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.rpc.protocol import PROTOCOL_VERSION, MessageType
from lmcache_async.rpc.sidecar import SidecarNamespace
from lmcache_async.rpc.sidecar.settings import DEFAULT_SIDECAR_LIMITS
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
)

FINE_CODES: Final = frozenset(
    {"protocol", "invalid_input", "no_session", "unsupported", "forbidden", "busy", "engine_closed"}
)
"""Error codes a hostile message may get; ``internal`` (or any other) is a failure."""
SILENT_TYPES: Final = frozenset({int(MessageType.RELEASE)})
"""Type bytes of requests documented to get no reply (when well-formed)."""
FAILURE_EVENTS: Final = ("sidecar_request_failed", "sidecar_handler_failed", "sidecar_reply_failed")
FD_MARGIN: Final = 8
RSS_MARGIN_KIB: Final = 96 * 1024
"""The sidecar's resident memory after the hostile sessions are reaped, above its value
before: the C heap keeps the high-water mark of the largest hostile frames (4 MiB headers,
million-item lists) decoded at once. Measured +30 MiB after 4,000 messages, +54 MiB after
22,000 and +64 MiB after 46,000: levelling off, not growth per message."""
REPLY_TIMEOUT: Final = 20.0
"""Longest wait for one reply: a request waits at most 5 s for pool memory."""
CHECK_TIMEOUT: Final = 60.0
SETTLE_TIMEOUT: Final = 30.0
"""Bound on the hostile sessions being reaped (1 s timeout) and descriptors closing."""
MAX_HEADER: Final = DEFAULT_SIDECAR_LIMITS.max_header_bytes
HELLO_FIELDS: Final = SidecarNamespace(MODEL, LAYOUT).to_wire()
HOSTILE_TOKENS: Final = 50_000
"""Hostile token ids stay below this; the well-behaved prompts' are above, so no hostile
store can put other bytes under them."""
BAIT: Final = [HOSTILE_TOKENS + (i * 7919) % 10_000 for i in range(4 * CHUNK)]
"""A prompt the well-behaved client stores, so hostile retrieves get chunks lent."""
CHUNK_BYTES: Final = CHUNK * LAYOUT.token_bytes
SHUTDOWN: Final = int(MessageType.SHUTDOWN)
WORKERS: Final = 3
"""Hostile clients sending a batch's messages at once."""


def frame_of(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def check_prompt(index: int) -> list[int]:
    """The well-behaved prompt of check ``index`` (above every hostile token id)."""
    return [2 * HOSTILE_TOKENS + (i * 7919 + index * 104_729) % 1_000_000 for i in range(77)]


# -- what the plan holds ----------------------------------------------------------------------


@dataclass(frozen=True)
class Long:
    """A big value, built only when its message is sent (plans stay small): a str, bytes or
    list of ``size`` units, or ``size`` nested one-element lists (written as raw msgpack:
    deeper than any packer nests)."""

    kind: Literal["str", "bytes", "list", "nest"]
    size: int

    def build(self) -> object:
        if self.kind == "str":
            return "x" * self.size
        if self.kind == "bytes":
            return b"\1" * self.size
        return [0] * self.size


AUTO: Final = "auto"
"""A :class:`Shot`'s ``sizes``: computed from its payloads (anything else is sent as is)."""
OMIT: Final = "omit"


@dataclass(frozen=True)
class Shot:
    """One message: a type frame, a header (a dict with its ``"v"``, built into msgpack
    when sent; or raw bytes; or None: no header frame), and payload frames. ``label`` says
    what was done to it; ``follow`` what to do with a STORE's or RETRIEVE's transaction."""

    label: str
    type_frame: bytes
    header: dict[str, Any] | bytes | None
    payloads: tuple[bytes | Long, ...] = ()
    sizes: object = AUTO
    follow: str = "leave"

    @property
    def silent(self) -> bool:
        """Whether it may get no reply at all (a RELEASE)."""
        return len(self.type_frame) == 1 and self.type_frame[0] in SILENT_TYPES

    def frames(self, request_id: int) -> list[bytes]:
        payloads = [p.build() if isinstance(p, Long) else p for p in self.payloads]
        frames = [self.type_frame]
        if isinstance(self.header, dict):
            header = dict(self.header)
            header.setdefault("id", request_id)
            if self.sizes == AUTO:
                if payloads:
                    header.setdefault("sizes", [len(p) for p in payloads])
            elif self.sizes != OMIT:
                header["sizes"] = self.sizes
            frames.append(pack(header))
        elif self.header is not None:
            frames.append(self.header)
        return [*frames, *(p if isinstance(p, bytes) else bytes(p) for p in payloads)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Script:
    """An out-of-order sequence, run on fresh sockets (see :meth:`FuzzRunner.script`)."""

    name: str
    kind: int
    number: int


@dataclass(frozen=True)
class Abandon:
    """A client that says HELLO, holds what ``ops`` take (open stores, pins, lent loads)
    and closes without giving any of it back."""

    ops: tuple[str, ...]


Case: TypeAlias = Shot | Script | Abandon


@dataclass(frozen=True)
class Batch:
    cases: tuple[Case, ...]
    deaf: int
    """Requests sent by a client that never reads a reply."""


def pack(header: dict[str, Any]) -> bytes:
    """msgpack of a header, its :class:`Long` values built (a ``nest`` spliced in raw)."""
    nests: dict[str, int] = {}

    def build(value: object) -> object:
        if isinstance(value, Long):
            if value.kind == "nest":
                marker = f"\0nest{len(nests)}\0"
                nests[marker] = value.size
                return marker
            return value.build()
        if isinstance(value, list):
            return [build(item) for item in value]
        if isinstance(value, dict):
            return {key: build(item) for key, item in value.items()}
        return value

    packed: bytes = msgpack.packb(build(header), use_bin_type=True)
    for marker, depth in nests.items():
        packed = packed.replace(msgpack.packb(marker), b"\x91" * depth + b"\xc0")
    return packed


# -- strategies -------------------------------------------------------------------------------

HOSTILE_INTS: Final = (-1, 0, 1, 2**31, -(2**63), 2**63 - 1, 2**64 - 1, 2**53 + 1)
HOSTILE_FLOATS: Final = (math.nan, math.inf, -math.inf, -0.0, 1.5, 1e308, 5e-324)
LONG_SIZES: Final = (1025, 65_536, 1 << 20, MAX_HEADER - 64, MAX_HEADER + 1)


def hostile_values() -> st.SearchStrategy[object]:
    """Anything a header field may be sent as: wrong types, extreme ints and floats, long
    strings and bytes (up to past the header limit), deep nesting, maps and lists."""
    longs = st.builds(Long, st.sampled_from(("str", "bytes")), st.sampled_from(LONG_SIZES))
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(HOSTILE_INTS),
        st.integers(-(2**63), 2**64 - 1),
        st.sampled_from(HOSTILE_FLOATS),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=16),
        st.sampled_from(("cpu", "disk", "ipc:///tmp/x.sock", "tcp://127.0.0.1:1", MODEL)),
        longs,
        st.builds(Long, st.just("list"), st.sampled_from((1025, 65_536, 1 << 20))),
        st.builds(Long, st.just("nest"), st.sampled_from((3, 100, 600, 100_000))),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )


def token_frames() -> st.SearchStrategy[bytes]:
    """A prompt's token frame: hostile token ids (1 to 4 chunks and a rest) or the bait's."""
    hostile = st.lists(st.integers(0, HOSTILE_TOKENS - 1), min_size=1, max_size=4 * CHUNK + 5).map(
        frame_of
    )
    return st.one_of(hostile, st.integers(CHUNK, len(BAIT)).map(lambda n: frame_of(BAIT[:n])))


def lookup_ids() -> st.SearchStrategy[object]:
    return st.one_of(st.integers(0, 20), st.sampled_from(("a", "b", "promise")))


def tiers() -> st.SearchStrategy[object]:
    return st.lists(st.sampled_from(("cpu", "disk", "remote", "nope")), max_size=3)


M = MessageType

# Per type: a valid-ish header and its payload frames.
TEMPLATES: Final[dict[MessageType, st.SearchStrategy[tuple[dict[str, Any], list[bytes]]]]] = {
    M.ERROR: st.just(({"code": "internal", "message": "from a client"}, [])),
    M.HELLO: st.builds(
        lambda client: ({**HELLO_FIELDS, "client": client, "host": "h", "boot_id": "b"}, []),
        st.text(max_size=10),
    ),
    M.HEARTBEAT: st.just(({}, [])),
    M.PING: st.just(({}, [])),
    M.STATS: st.just(({}, [])),
    M.HEALTH: st.just(({}, [])),
    M.LOOKUP: st.one_of(
        st.builds(
            lambda pin, lid, rng, frame: (
                {"pin": pin, "lookup_id": lid, "search_range": rng},
                [frame],
            ),
            st.booleans(),
            lookup_ids(),
            tiers(),
            token_frames(),
        ),
        st.builds(
            lambda n: (
                {"digests_of": n * CHUNK},
                [(tenant_tag(None) + bytes(DIGEST_SIZE - TAG_BYTES)) * n],
            ),
            st.integers(1, 4),
        ),
        st.builds(
            lambda lid, done, frame: (
                {
                    "promise": True,
                    "lookup_id": lid,
                    "computed": 0,
                    "prefill_tps": 1e4,
                    "finish": done,
                },
                [frame],
            ),
            lookup_ids(),
            st.booleans(),
            token_frames(),
        ),
        st.builds(
            lambda hashes: (
                {"hashes": hashes, "offsets": [CHUNK * (i + 1) for i in range(len(hashes))]},
                [],
            ),
            st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4),
        ),
    ),
    M.STORE: st.builds(
        lambda limit, wait, frame: (
            {"req_id": "r", "limit": limit, "timeout": wait, "start": 0, "store_location": ["cpu"]},
            [frame],
        ),
        st.integers(0, 200),
        st.sampled_from((0.5, 5.0, 30.0)),
        token_frames(),
    ),
    M.COMMIT: st.builds(
        lambda txn, abort, count: ({"txn": txn, "abort": abort}, [bytes(CHUNK_BYTES)] * count),
        st.integers(0, 50),
        st.booleans(),
        st.integers(0, 2),
    ),
    M.RETRIEVE: st.builds(
        lambda lid, stream, inline, part, frame: (
            {
                "lookup_id": lid,
                "stream": stream,
                "inline": inline,
                "part": part,
                "timeout": 5.0,
                "alloc_wait": 1.0,
                "retrieve_locations": ["cpu"],
                "start": 0,
            },
            [frame],
        ),
        st.one_of(st.none(), lookup_ids()),
        st.booleans(),
        st.booleans(),
        st.integers(0, 3),
        token_frames(),
    ),
    M.RELEASE: st.builds(
        lambda txn, loaded: ({"txn": txn, "loaded": loaded}, []),
        st.integers(0, 50),
        st.integers(0, 100),
    ),
    M.PREFETCH: st.builds(
        lambda lid, frame: ({"lookup_id": lid, "search_range": ["cpu"]}, [frame]),
        lookup_ids(),
        token_frames(),
    ),
    M.UNPIN: st.builds(lambda lid: ({"lookup_id": lid}, []), lookup_ids()),
    M.CLEAR: st.builds(lambda rng: ({"locations": rng}, []), st.sampled_from((None, ["cpu"]))),
    M.ERASE: st.builds(lambda t: ({"tenant": t}, []), st.sampled_from(("victim", "t1"))),
    M.FREEZE: st.builds(lambda on: ({"enabled": on}, []), st.booleans()),
    M.HOT_CACHE: st.builds(lambda on: ({"enabled": on}, []), st.booleans()),
    M.PUSH: st.builds(
        lambda count, frame: (
            {"checksums": [0] * count, "store_location": ["cpu"], "timeout": 5.0},
            [frame, *[bytes(CHUNK_BYTES)] * count],
        ),
        st.integers(0, 2),
        token_frames(),
    ),
    M.MOVE: st.builds(
        lambda copy, frame: (
            {
                "old_position": "cpu",
                "new_position": ["ipc:///tmp/none.sock", "cpu"],
                "copy": copy,
                "timeout": 1.0,
            },
            [frame],
        ),
        st.booleans(),
        token_frames(),
    ),
}
FIELDS: Final = {
    M.ERROR: ("code", "message"),
    M.HELLO: ("model_name", "layout", "revision", "tenant", "client", "host", "boot_id"),
    M.HEARTBEAT: (),
    M.PING: (),
    M.STATS: (),
    M.HEALTH: (),
    M.LOOKUP: (
        "pin",
        "lookup_id",
        "search_range",
        "tenant",
        "digests_of",
        "promise",
        "computed",
        "prefill_tps",
        "finish",
        "hashes",
        "offsets",
    ),
    M.STORE: (
        "req_id",
        "limit",
        "timeout",
        "start",
        "store_location",
        "tenant",
        "hashes",
        "offsets",
    ),
    M.COMMIT: ("txn", "abort"),
    M.RETRIEVE: (
        "lookup_id",
        "stream",
        "inline",
        "part",
        "timeout",
        "alloc_wait",
        "retrieve_locations",
        "start",
        "tenant",
        "hashes",
        "offsets",
    ),
    M.RELEASE: ("txn", "loaded"),
    M.PREFETCH: ("lookup_id", "search_range", "tenant", "hashes", "offsets"),
    M.UNPIN: ("lookup_id",),
    M.CLEAR: ("locations",),
    M.ERASE: ("tenant",),
    M.FREEZE: ("enabled",),
    M.HOT_CACHE: ("enabled",),
    M.PUSH: ("checksums", "store_location", "req_id", "timeout", "tenant", "hashes"),
    M.MOVE: ("old_position", "new_position", "copy", "tenant", "timeout"),
}
KINDS: Final = (M.STORE, *(k for k in TEMPLATES if k not in (M.STORE, M.ERROR)), M.ERROR)
"""Every type a drawn message may be: Hypothesis draws the first one most, the data path's
STORE (ERROR, which no client sends, comes last)."""
RESERVED: Final = ("v", "id", "sizes")
FOLLOWS: Final = ("leave", "commit", "abort", "wrong-size", "release", "release-twice")


@st.composite
def field_shots(draw: st.DrawFn) -> Shot:
    """A message of any type but SHUTDOWN, valid or with one to three fields mutated,
    dropped or added, or its payload frames changed."""
    kind = draw(st.sampled_from(KINDS))
    header, payloads = draw(TEMPLATES[kind])
    header = {"v": PROTOCOL_VERSION, **header}
    frames: list[bytes | Long] = list(payloads)
    sizes: object = AUTO
    done = []
    for _ in range(draw(st.sampled_from((1, 2, 3, 0)))):
        how = draw(st.sampled_from(("field", "field", "drop", "extra", "reserved", "payload")))
        if how == "field" and FIELDS[kind]:
            name = draw(st.sampled_from(FIELDS[kind]))
            header[name] = draw(hostile_values())
        elif how == "drop" and len(header) > 1:
            name = draw(st.sampled_from(sorted(k for k in header if k != "v")))
            del header[name]
        elif how == "extra":
            name = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in RESERVED))
            header[name] = draw(hostile_values())
        elif how == "reserved":
            name = draw(st.sampled_from(RESERVED))
            value = draw(hostile_values())
            if name == "sizes":
                sizes = value
            else:
                header[name] = value
        elif how == "payload":
            change = draw(st.sampled_from(("ragged", "empty", "extra", "drop", "long")))
            if change == "ragged":
                frames.append(b"\1\2\3")
            elif change == "empty":
                frames = [b""]
            elif change == "extra":
                frames.extend([bytes(CHUNK_BYTES)] * draw(st.integers(1, 3)))
            elif change == "drop" and frames:
                frames.pop()
            elif change == "long":
                frames = [Long("bytes", draw(st.sampled_from((1 << 16, 1 << 20))))]
            name = change
        else:
            continue
        done.append(f"{how}:{name}")
    label = f"{kind.name} {' '.join(done) or 'valid'}"
    follow = draw(st.sampled_from(FOLLOWS)) if kind in (M.STORE, M.RETRIEVE) else "leave"
    return Shot(label, bytes((int(kind),)), header, tuple(frames), sizes, follow)


GARBAGE: Final = (
    "type-byte",
    "type-empty",
    "type-two-bytes",
    "no-header",
    "not-msgpack",
    "truncated",
    "not-a-map",
    "no-version",
    "old-version",
    "ext-value",
    "ext-header",
    "timestamp",
    "trailing-data",
    "int-keys",
    "deep-nesting",
    "over-limit",
    "sizes-missing",
    "sizes-wrong",
    "many-frames",
)


@st.composite
def garbage_shots(draw: st.DrawFn, how: str | None = None) -> Shot:
    """A message broken below the fields (``how``, else drawn from :data:`GARBAGE`): its
    type frame, its header's msgpack, its frame count and sizes. Never one that decodes as
    a SHUTDOWN."""
    kind = draw(st.sampled_from(KINDS))
    header, payloads = draw(TEMPLATES[kind])
    header = {"v": PROTOCOL_VERSION, "id": 1, **header}
    if payloads:
        header["sizes"] = [len(p) for p in payloads]
    how = draw(st.sampled_from(GARBAGE)) if how is None else how
    type_frame = bytes((int(kind),))
    raw: dict[str, Any] | bytes | None = header
    sizes: object = OMIT
    frames: list[bytes | Long] = list(payloads)
    if how == "type-byte":
        type_frame = bytes((draw(st.integers(0, 255).filter(lambda b: b != SHUTDOWN)),))
    elif how == "type-empty":
        type_frame = b""
    elif how == "type-two-bytes":
        type_frame = bytes((int(kind), draw(st.integers(0, 255))))
    elif how == "no-header":
        raw, frames = None, []
    elif how == "not-msgpack":
        raw = b"\xc1" + draw(st.binary(max_size=32))  # 0xc1 is never used by msgpack
    elif how == "truncated":
        packed = pack(header)
        raw = packed[: draw(st.integers(0, len(packed) - 1))]
    elif how == "not-a-map":
        raw = msgpack.packb(
            draw(st.one_of(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3), st.text()))
        )
    elif how == "no-version":
        del header["v"]
    elif how == "old-version":
        header["v"] = draw(st.sampled_from((1, 3, "2", 2.0, True, None, -(2**63))))
    elif how == "ext-value":
        raw = msgpack.packb({**header, "ext": msgpack.ExtType(draw(st.integers(0, 127)), b"x")})
    elif how == "ext-header":
        raw = msgpack.packb(msgpack.ExtType(draw(st.integers(0, 127)), pack(header)))
    elif how == "timestamp":
        raw = msgpack.packb({**header, "when": msgpack.Timestamp(1, 2)})
    elif how == "trailing-data":
        raw = pack(header) + draw(st.binary(min_size=1, max_size=8))
    elif how == "int-keys":
        raw = msgpack.packb({**header, draw(st.integers(-5, 5)): 1}, strict_types=False)
    elif how == "deep-nesting":
        raw = b"\x82\xa1v\x02\xa1x" + b"\x91" * draw(st.sampled_from((2000, 100_000))) + b"\xc0"
    elif how == "over-limit":
        header["pad"] = Long("str", MAX_HEADER + 1)
    elif how == "sizes-missing":
        frames = [*frames, b"\0"]
        header.pop("sizes", None)
    elif how == "sizes-wrong":
        header["sizes"] = [len(p) + 1 for p in payloads] or [0]
    elif how == "many-frames":
        count = draw(st.sampled_from((10, 1000)))
        frames = [b""] * count
        header["sizes"] = [0] * count
    if type_frame == bytes((SHUTDOWN,)):  # a template never is one; belt and braces
        type_frame = b"\xff"
    return Shot(f"garbage:{how} ({kind.name})", type_frame, raw, tuple(frames), sizes)


SCRIPTS: Final = (
    "before-hello",
    "foreign-commit",
    "foreign-release",
    "double-commit",
    "double-release",
    "release-a-store",
    "commit-a-retrieve",
    "unknown-txn",
    "hello-twice",
    "unpin-unknown",
    "stream-late-part",
)
BEFORE_HELLO: Final = tuple(
    int(k)
    for k in (
        M.LOOKUP,
        M.STORE,
        M.COMMIT,
        M.RETRIEVE,
        M.RELEASE,
        M.PREFETCH,
        M.UNPIN,
        M.PUSH,
        M.HEARTBEAT,
    )
)
ABANDON_OPS: Final = ("store", "store", "pin", "prefetch", "retrieve", "promise")


def cases() -> st.SearchStrategy[Case]:
    return st.one_of(
        field_shots(),
        field_shots(),
        field_shots(),
        garbage_shots(),
        st.builds(
            Script,
            st.sampled_from(SCRIPTS),
            st.sampled_from(BEFORE_HELLO),
            st.sampled_from((-1, 0, 7, 2**63 - 1, 2**64 - 1)),
        ),
        st.builds(
            Abandon, st.lists(st.sampled_from(ABANDON_OPS), min_size=1, max_size=5).map(tuple)
        ),
    )


def batches(size: int) -> st.SearchStrategy[Batch]:
    return st.builds(
        Batch,
        st.lists(cases(), min_size=size, max_size=size).map(tuple),
        st.sampled_from((50, 0, 300, 0)),
    )


def plan(seed: int, count: int, size: int) -> list[Batch]:
    """``count`` batches of ``size`` cases, drawn by Hypothesis from ``seed`` alone (no
    example database, no shrinking): the same arguments give the same plan. Hypothesis's
    first example is its simplest (every case the same valid ERROR): it is left out. The
    last batch also sends one message broken each way of :data:`GARBAGE`, so that every
    way is sent whatever Hypothesis draws."""
    drawn: list[Batch] = []
    every_way: list[Shot] = []

    @settings(
        database=None,
        max_examples=count + 1,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis_seed(seed)
    @given(batches(size), st.tuples(*(garbage_shots(how) for how in GARBAGE)))
    def collect(batch: Batch, garbage: tuple[Shot, ...]) -> None:
        drawn.append(batch)
        every_way[:] = garbage

    collect()
    if len(drawn) <= count:
        raise RuntimeError(f"Hypothesis drew {len(drawn)} batches of the {count + 1} asked")
    last = drawn[-1]
    return [*drawn[1:-1], Batch((*last.cases, *every_way), last.deaf)]
