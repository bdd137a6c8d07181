"""The ZeroMQ wire protocol: how every message between lmcache_async processes is framed.

A message is multipart::

    [type (1 byte), header (msgpack map), payload frame, payload frame, ...]

The header always carries ``"v"`` (:data:`PROTOCOL_VERSION`), may carry ``"id"`` (a request
id, int or str, echoed in the reply) and, when there are payload frames, ``"sizes"`` (the
byte length of each). Payload frames are raw bytes (token ids, tensor bytes) sent
zero-copy. A reply has the type of its request, or :attr:`MessageType.ERROR` with a
``"code"`` (:class:`ErrorCode`) and a ``"message"``. A request about a prompt may name its
tenant in ``"tenant"`` (:func:`put_tenant`, :func:`tenant_of`); absent, the session's own.

msgpack is read with ``raw=False, strict_map_key=True`` and no extension types; nothing on
any socket is ever unpickled. :func:`decode` refuses, with a
:class:`~lmcache_async.errors.ProtocolError` naming the reason, anything malformed,
oversized, of unknown type or of another protocol version, so an endpoint answers it with
an error reply and lives on.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgpack
import numpy as np
import numpy.typing as npt
import zmq

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.tokens import TOKEN_BYTES, Tokens, is_strict_int, token_array
from lmcache_async.tenancy.tenants import check_tenant

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_REQUEST_ID_CHARS",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FrameLike",
    "Message",
    "MessageLimits",
    "MessageType",
    "RequestId",
    "decode",
    "encode",
    "error_reply",
    "hashes_from_wire",
    "hashes_to_wire",
    "put_tenant",
    "request_id_of",
    "tenant_of",
    "to_wire",
    "tokens_from_payload",
    "tokens_payload",
]

PROTOCOL_VERSION: Final = 2
"""Version every header carries; a peer speaking another one gets an error reply.

2: requests name their tenant (``"tenant"``). A peer of version 1 would ignore the field
and serve every tenant from one namespace, so it is refused instead."""

DEFAULT_MAX_HEADER_BYTES: Final = 1 << 20
"""Largest header accepted by default (1 MiB)."""

DEFAULT_MAX_PAYLOAD_BYTES: Final = 1 << 30
"""Largest total of payload frames accepted by default (1 GiB)."""

RequestId: TypeAlias = int | str
FrameLike: TypeAlias = bytes | bytearray | memoryview | zmq.Frame
"""What :func:`decode` accepts for a frame (``recv_multipart`` with or without ``copy``)."""

# Header keys set by encode() itself.
_VERSION_KEY: Final = "v"
_ID_KEY: Final = "id"
MAX_REQUEST_ID_CHARS: Final = 1024
"""Longest str request id: replies echo it, so it must stay small."""
_SIZES_KEY: Final = "sizes"
_RESERVED_KEYS: Final = frozenset({_VERSION_KEY, _ID_KEY, _SIZES_KEY})

# msgpack's own integer range: wider block hashes travel as signed little-endian bytes.
_MSGPACK_INT_MIN: Final = -(2**63)
_MSGPACK_INT_MAX: Final = 2**64 - 1

_TENANT_KEY: Final = "tenant"
_MAX_ERROR_MESSAGE_CHARS: Final = 1000
_TOKEN_DTYPE: Final = np.dtype("<i4")


class MessageType(enum.IntEnum):
    """The type byte: the first frame of every message.

    A reply carries its request's type, or ``ERROR``. Values are part of the protocol:
    never renumber one, only add.
    """

    ERROR = 0
    HELLO = 1
    LOOKUP = 2
    STORE = 3
    RETRIEVE = 4
    PREFETCH = 5
    UNPIN = 6
    CLEAR = 7
    FREEZE = 8
    HOT_CACHE = 9
    STATS = 10
    HEALTH = 11
    SHUTDOWN = 12
    PING = 13
    HEARTBEAT = 14
    COMMIT = 15
    """Ends a store transaction: the payloads are in place (or inline), cache them."""
    RELEASE = 16
    """Ends a retrieve transaction: the payloads were read, release them (no reply)."""
    PUSH = 17
    """Chunks pushed by another instance (a move): a token frame, then one inline payload
    frame per chunk, each with its checksum in ``"checksums"``; the receiver verifies every
    payload before caching it and replies the tokens it took."""
    MOVE = 18
    """Ask the server's engine to move (or copy) a prefix to another sidecar."""
    ERASE = 19
    """Remove every chunk of a tenant (``"tenant"``; absent: the engine's own) from every
    tier; the reply says what each tier removed, or why it could not."""


_TYPES: Final = {int(t): t for t in MessageType}


class ErrorCode(enum.StrEnum):
    """Why a request failed, in an ERROR reply's ``"code"``; the caller acts on it."""

    PROTOCOL = "protocol"
    """The message was malformed, oversized, of unknown type or of another version."""
    UNSUPPORTED = "unsupported"
    """A well-formed message of a type this endpoint does not serve."""
    INVALID_INPUT = "invalid_input"
    """The engine refused the request's arguments (InvalidInputError): fix the call."""
    ENGINE_CLOSED = "engine_closed"
    """The engine behind the endpoint is closed."""
    NO_SESSION = "no_session"
    """The request needs a session and the sender has none (no HELLO yet, or it expired):
    say hello again."""
    BUSY = "busy"
    """The sender has too much in flight or held (requests, transactions, pins), or the
    endpoint is full: nothing was done; retry later."""
    FORBIDDEN = "forbidden"
    """The sender's certificate does not allow this request (it needs an admin one)."""
    INTERNAL = "internal"
    """The endpoint failed while serving a valid request; see its log."""


@dataclass(frozen=True, slots=True)
class MessageLimits:
    """Size limits one endpoint enforces on the messages it receives.

    Raises:
        InvalidInputError: a limit is not a positive int.
    """

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_payload_bytes"):
            value = getattr(self, name)
            if not is_strict_int(value) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")

    @property
    def max_frame_bytes(self) -> int:
        """Hard cap on any single frame, for ZeroMQ's ``MAXMSGSIZE``.

        ZeroMQ drops the connection of a peer that sends a bigger frame before the message
        is ever read, so no peer can make an endpoint buffer more than this per frame.
        Messages under it but over the limits above get an error reply instead.
        """
        return max(self.max_header_bytes, self.max_payload_bytes) + self.max_header_bytes


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message. ``payloads`` are views on the received frames (no copy)."""

    type: MessageType
    header: dict[str, Any]
    payloads: list[memoryview]

    @property
    def request_id(self) -> RequestId | None:
        request_id: RequestId | None = self.header.get(_ID_KEY)
        return request_id


class _Packers(threading.local):
    """One msgpack packer per thread: ``msgpack.packb`` builds a packer per call, which
    costs twice the packing of a request's header."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True, datetime=False)


_PACKERS: Final = _Packers()


def _as_buffer(payload: object, index: int) -> memoryview:
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            f"payload {index} must be a bytes-like object, got {type(payload).__name__}"
        ) from None
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise InvalidInputError(f"payload {index} must be C-contiguous")
        view = view.cast("B")
    return view


def encode(
    msg_type: MessageType,
    header: Mapping[str, Any] | None = None,
    payloads: Sequence[object] = (),
    *,
    request_id: RequestId | None = None,
) -> list[bytes | memoryview]:
    """Frames of one message, ready for ``send_multipart(frames, copy=False)``.

    ``header`` holds the message's fields (str keys; values msgpack can pack without
    extension types); the version, ``request_id`` and payload sizes are added here.
    ``payloads`` are bytes-like objects (bytes, memoryview, a contiguous ndarray) that are
    not copied: keep them unchanged until the message is sent.

    Raises:
        InvalidInputError: a key that is not a str or is reserved (``v``, ``id``, ``sizes``), a bad
            request id, a payload that is not a contiguous buffer, or a header value
            msgpack cannot pack.
    """
    fields: dict[str, Any] = {_VERSION_KEY: PROTOCOL_VERSION}
    if request_id is not None:
        if not (is_strict_int(request_id) or isinstance(request_id, str)):
            raise InvalidInputError(
                f"request_id must be an int or str, got {type(request_id).__name__}"
            )
        fields[_ID_KEY] = request_id
    views = [_as_buffer(payload, i) for i, payload in enumerate(payloads)]
    if views:
        fields[_SIZES_KEY] = [view.nbytes for view in views]
    if header:
        if not all(isinstance(key, str) for key in header):
            raise InvalidInputError("header keys must be str")
        clash = _RESERVED_KEYS.intersection(header)
        if clash:
            raise InvalidInputError(f"header keys {sorted(clash)} are reserved")
        fields.update(header)
    try:
        packed: bytes = _PACKERS.packer.pack(fields)
    except (TypeError, ValueError, OverflowError) as exc:
        _PACKERS.packer.reset()  # nothing half-packed stays for the next message
        raise InvalidInputError(f"header cannot be encoded: {exc}") from None
    return [bytes((int(msg_type),)), packed, *views]


def _frame_view(frame: object, index: int) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    raise ProtocolError(f"frame {index} is a {type(frame).__name__}, not bytes")


def _refuse_ext(code: int, data: bytes) -> object:
    raise ProtocolError(f"header holds a msgpack extension type ({code}); none is allowed")


def _unpack_header(data: memoryview) -> object:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            timestamp=0,
            use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ...)
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None


_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})


def _check_plain(value: object) -> None:
    """Refuse anything but nil, bool, int, float, str, bytes, lists and str-keyed maps."""
    if type(value) is dict:  # most headers: scalars and lists of scalars, checked in C
        for item in value.values():
            kind = type(item)
            if kind not in _SCALARS and not (kind is list and _SCALARS.issuperset(map(type, item))):
                break
        else:
            return
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, (bool, int, float, str, bytes)):
            continue
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            raise ProtocolError(
                f"header holds an unsupported msgpack value ({type(item).__name__})"
            )


def _sizes_text(sizes: Sequence[object]) -> str:
    text = repr(list(sizes[:8]))
    return text if len(sizes) <= 8 else text[:-1] + f", ... ({len(sizes)} in all)]"


def decode(
    frames: Sequence[FrameLike],
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> Message:
    """Check and decode the frames of one message (without a ROUTER identity frame).

    Raises:
        ProtocolError: no frames; a type frame that is not one byte or names no known
            type; no header frame; a header over ``max_header_bytes``, not valid msgpack,
            not a map, holding an extension type, without ``"v"`` or of another version, or
            with a request id that is neither int nor str; payload frames over
            ``max_payload_bytes`` in total; declared ``"sizes"`` that are missing or do not
            match the payload frames.
    """
    if not frames:
        raise ProtocolError("empty message: no frames")
    type_frame = _frame_view(frames[0], 0)
    if type_frame.nbytes != 1:
        raise ProtocolError(f"the type frame must be 1 byte, got {type_frame.nbytes}")
    if len(frames) < 2:
        raise ProtocolError("message has no header frame")
    header_frame = _frame_view(frames[1], 1)
    if header_frame.nbytes > max_header_bytes:
        raise ProtocolError(
            f"header of {header_frame.nbytes} bytes exceeds max_header_bytes={max_header_bytes}"
        )
    header = _unpack_header(header_frame)
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    _check_plain(header)
    version = header.get(_VERSION_KEY)
    if version is None:
        raise ProtocolError("header has no protocol version ('v')")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r:.40} is not supported (this end speaks "
            f"{PROTOCOL_VERSION})"
        )
    code = type_frame[0]
    msg_type = _TYPES.get(code)
    if msg_type is None:
        raise ProtocolError(f"unknown message type {code}")
    request_id = header.get(_ID_KEY)
    if request_id is not None and type(request_id) is not int and type(request_id) is not str:
        raise ProtocolError(f"request id must be an int or str, got {type(request_id).__name__}")
    if type(request_id) is str and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError(
            f"request id of {len(request_id)} characters: at most {MAX_REQUEST_ID_CHARS}"
        )
    payloads = [_frame_view(frame, i) for i, frame in enumerate(frames[2:], start=2)]
    actual = [view.nbytes for view in payloads]
    total = sum(actual)
    if total > max_payload_bytes:
        raise ProtocolError(
            f"payload of {total} bytes exceeds max_payload_bytes={max_payload_bytes}"
        )
    declared = header.get(_SIZES_KEY)
    if declared is None:
        if payloads:
            raise ProtocolError(f"{len(payloads)} payload frames but the header has no 'sizes'")
    elif not isinstance(declared, list) or declared != actual:
        shown = _sizes_text(declared) if isinstance(declared, list) else repr(declared)[:80]
        raise ProtocolError(
            f"header declares payload sizes {shown} but the frames hold {_sizes_text(actual)}"
        )
    return Message(msg_type, header, payloads)


def request_id_of(frames: Sequence[FrameLike], *, max_header_bytes: int) -> RequestId | None:
    """Best effort: the request id of a message :func:`decode` refused, for its error reply."""
    if len(frames) < 2:
        return None
    try:
        view = _frame_view(frames[1], 1)
        if view.nbytes > max_header_bytes:
            return None
        header = _unpack_header(view)
    except ProtocolError:
        return None
    if not isinstance(header, dict):
        return None
    request_id = header.get(_ID_KEY)
    if is_strict_int(request_id):
        return request_id
    if isinstance(request_id, str) and len(request_id) <= MAX_REQUEST_ID_CHARS:
        return request_id
    return None  # not one to echo (an over-long id would swell the error reply)


def error_reply(
    request_id: RequestId | None, code: ErrorCode, message: str
) -> list[bytes | memoryview]:
    """The frames of an ERROR reply (the message is cut to 1000 characters)."""
    text = message if len(message) <= _MAX_ERROR_MESSAGE_CHARS else message[:997] + "..."
    return encode(MessageType.ERROR, {"code": str(code), "message": text}, request_id=request_id)


def tokens_payload(tokens: Tokens) -> memoryview:
    """Token ids as one payload frame: raw little-endian int32 (4 bytes per token).

    May share memory with ``tokens`` when they already are int32: do not change them
    until the message is sent. Raises InvalidInputError as ``token_array`` does.
    """
    return token_array(tokens).data.cast("B")


def tokens_from_payload(payload: memoryview) -> npt.NDArray[np.int32]:
    """The token ids of a payload frame made by :func:`tokens_payload` (a read-only view).

    Raises:
        ProtocolError: the frame's length is not a multiple of 4 bytes.
    """
    if payload.nbytes % TOKEN_BYTES:
        raise ProtocolError(
            f"a token payload must be a multiple of {TOKEN_BYTES} bytes, got {payload.nbytes}"
        )
    return np.frombuffer(payload, dtype=_TOKEN_DTYPE)


def hashes_to_wire(hashes: Sequence[int | bytes]) -> list[int | bytes | list[bytes]]:
    """Engine block hashes as a msgpack-ready list.

    An int in msgpack's range and a bytes value travel as they are; a wider int travels as
    ``[signed little-endian bytes]``, a one-element list, so no precision is lost.

    Raises:
        InvalidInputError: ``hashes`` is not a sequence, or an item is not int or bytes.
    """
    if isinstance(hashes, (str, bytes, bytearray)) or not isinstance(hashes, Sequence):
        raise InvalidInputError(f"hashes must be a sequence, got {type(hashes).__name__}")
    wire: list[int | bytes | list[bytes]] = []
    for index, value in enumerate(hashes):
        if isinstance(value, (bytes, bytearray)):
            wire.append(bytes(value))
        elif is_strict_int(value):
            if _MSGPACK_INT_MIN <= value <= _MSGPACK_INT_MAX:
                wire.append(value)
            else:
                length = (value.bit_length() + 8) // 8  # room for the sign bit
                wire.append([value.to_bytes(length, "little", signed=True)])
        else:
            raise InvalidInputError(
                f"hashes[{index}] must be an int or bytes, got {type(value).__name__}"
            )
    return wire


def hashes_from_wire(value: object) -> list[int | bytes]:
    """The block hashes of a header field written by :func:`hashes_to_wire`.

    Raises:
        ProtocolError: the field is not a list of ints, bytes and one-element bytes lists.
    """
    if not isinstance(value, list):
        raise ProtocolError(f"'hashes' must be a list, got {type(value).__name__}")
    hashes: list[int | bytes] = []
    for index, item in enumerate(value):
        if is_strict_int(item) or isinstance(item, bytes):
            hashes.append(item)
        elif isinstance(item, list) and len(item) == 1 and isinstance(item[0], bytes):
            hashes.append(int.from_bytes(item[0], "little", signed=True))
        else:
            raise ProtocolError(f"'hashes'[{index}] is not an int, bytes or [bytes]")
    return hashes


_WIRE_INT_MIN: Final = -(1 << 63)
_WIRE_INT_MAX: Final = (1 << 64) - 1


def to_wire(value: object) -> Any:
    """``value`` as plain msgpack-ready data: dataclasses and mappings become maps (str
    keys), enums their value, tuples and other iterables lists, ints clamped to msgpack's
    range.

    Raises:
        InvalidInputError: a value that has no plain form (an arbitrary object).
    """
    if type(value) is int:
        # msgpack holds [-2**63, 2**64): a figure past it is shown at the bound, never
        # left to make the whole reply unencodable.
        return min(max(value, _WIRE_INT_MIN), _WIRE_INT_MAX)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return to_wire(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): to_wire(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)) or (
        isinstance(value, Iterable) and not isinstance(value, (bytearray, memoryview))
    ):
        return [to_wire(item) for item in value]
    raise InvalidInputError(f"{type(value).__name__} has no wire form")


def put_tenant(header: dict[str, Any], tenant: object) -> None:
    """Name ``tenant`` in a request's header; None (the session's own tenant) adds nothing.

    Raises:
        InvalidInputError: ``tenant`` is not None or a valid tenant name (see
            :func:`~lmcache_async.tenancy.tenants.check_tenant`).
    """
    name = check_tenant(tenant)
    if name is not None:
        header[_TENANT_KEY] = name


def tenant_of(header: Mapping[str, Any]) -> str | None:
    """The tenant a request's header names; None when it names none (the session's own).

    Raises:
        InvalidInputError: the field is not a valid tenant name (the message names
            ``tenant``), which the endpoint answers with an ``INVALID_INPUT`` reply.
    """
    return check_tenant(header.get(_TENANT_KEY))
