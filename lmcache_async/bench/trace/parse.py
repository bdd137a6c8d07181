"""Reading a trace: Mooncake's JSONL, one request a line, checked line by line.

A line is a JSON object with at least:

- ``timestamp``: the request's arrival in milliseconds (a number >= 0, never before the
  previous request's: a trace is in arrival order);
- ``input_length``: prompt tokens (an int > 0);
- ``output_length``: tokens generated (an int >= 0);
- ``hash_ids``: one id (an int >= 0) per ``block_size``-token block of the prompt, its last
  block possibly partial; equal ids mean equal blocks after equal prefixes. It may cover
  fewer blocks than the prompt has (the tokens past it are the request's own), never more.

Other fields are ignored, and so are blank lines (they still count in line numbers). The
file is read as a stream (``.gz`` files decompressed on the fly): :func:`read_trace` yields
one :class:`TraceRequest` at a time, so a trace of any length costs the memory of one line.
A line that breaks a rule raises :class:`~lmcache_async.errors.InvalidInputError` naming the
file and the line.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Final

from lmcache_async.errors import InvalidInputError

__all__ = [
    "FIELDS",
    "MAX_HASH_ID",
    "MAX_PROMPT_BLOCKS",
    "TraceRequest",
    "parse_request",
    "read_trace",
]

FIELDS: Final = ("timestamp", "input_length", "output_length", "hash_ids")
"""The fields every request line must have."""

MAX_HASH_ID: Final = (1 << 62) - 1
"""The largest hash id taken (ids are mapped to tokens and keys with room to spare)."""

MAX_PROMPT_BLOCKS: Final = 1 << 24
"""The most blocks a prompt may have (16M blocks: 8G tokens of 512)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: where it is in the file (``line``, from 1) and its fields."""

    line: int
    timestamp: float
    """Arrival in milliseconds."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_size: int) -> int:
        """Whole ``block_size``-token blocks of the prompt: what a cache can hold of it."""
        return self.input_length // block_size


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _where(source: str, line: int) -> str:
    return f"{source} line {line}"


def parse_request(
    text: str, line: int, *, block_size: int, source: str = "trace"
) -> TraceRequest | None:
    """The request on one line of a trace (None for a blank line).

    Raises:
        InvalidInputError: the line is not a JSON object, a field is missing or of the
            wrong type, a length is negative (or the prompt empty), or ``hash_ids`` names
            more blocks than the prompt has; the message names ``source`` and ``line``.
    """
    if not text.strip():
        return None
    where = _where(source, line)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"{where}: a request is a JSON object, got {type(data).__name__}")
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise InvalidInputError(f"{where}: missing field {', '.join(map(repr, missing))}")
    timestamp = data["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise InvalidInputError(f"{where}: timestamp must be a number, got {timestamp!r}")
    if not (math.isfinite(timestamp) and timestamp >= 0):
        raise InvalidInputError(f"{where}: timestamp must be >= 0, got {timestamp!r}")
    lengths: dict[str, int] = {}
    for name, least in (("input_length", 1), ("output_length", 0)):
        value = data[name]
        if not _is_int(value):
            raise InvalidInputError(f"{where}: {name} must be an int, got {value!r}")
        if value < least:
            bound = "> 0" if least else ">= 0"
            raise InvalidInputError(f"{where}: {name} must be {bound}, got {value}")
        lengths[name] = value
    input_length = lengths["input_length"]
    blocks = -(-input_length // block_size)
    if blocks > MAX_PROMPT_BLOCKS:
        raise InvalidInputError(
            f"{where}: input_length {input_length} is over {MAX_PROMPT_BLOCKS} blocks"
        )
    hash_ids = data["hash_ids"]
    if not isinstance(hash_ids, list):
        raise InvalidInputError(f"{where}: hash_ids must be a list of ints, got {hash_ids!r}")
    for value in hash_ids:
        if not _is_int(value) or not 0 <= value <= MAX_HASH_ID:
            raise InvalidInputError(
                f"{where}: hash_ids must be ints from 0 to 2**62 - 1, got {value!r}"
            )
    if len(hash_ids) > blocks:
        raise InvalidInputError(
            f"{where}: hash_ids has {len(hash_ids)} blocks, more than the {blocks} blocks of "
            f"{block_size} tokens that input_length {input_length} makes"
        )
    return TraceRequest(
        line=line,
        timestamp=float(timestamp),
        input_length=input_length,
        output_length=lengths["output_length"],
        hash_ids=tuple(hash_ids),
    )


def _open(path: str | os.PathLike[str]) -> IO[str]:
    """The trace file as text lines (``.gz``: decompressed as it is read).

    Raises:
        OSError: the file cannot be opened.
    """
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(
    path: str | os.PathLike[str], *, block_size: int, limit: int | None = None
) -> Iterator[TraceRequest]:
    """The requests of the trace at ``path``, in file order, one line read at a time; the
    first ``limit`` only (None: all).

    Raises:
        InvalidInputError: a line breaks a rule of the format (see :func:`parse_request`),
            a timestamp goes back, or the file is not text.
        OSError: the file cannot be read.
    """
    source = os.path.basename(os.fspath(path))
    taken = 0
    last = 0.0
    with _open(path) as lines:
        number = 0
        while limit is None or taken < limit:
            number += 1
            try:
                text = lines.readline()
            except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
                raise InvalidInputError(f"{_where(source, number)}: not text ({exc})") from None
            if not text:
                return
            request = parse_request(text, number, block_size=block_size, source=source)
            if request is None:
                continue
            if request.timestamp < last:
                raise InvalidInputError(
                    f"{_where(source, number)}: timestamp {request.timestamp:g} is before the "
                    f"previous request's ({last:g}): a trace lists requests in arrival order"
                )
            last = request.timestamp
            taken += 1
            yield request
