"""Where a rank's lookup server listens (:func:`lookup_endpoint`), what a lookup id may
be, and how large lookup messages may grow: what the server and its clients agree on."""

from __future__ import annotations

import os
import re
import tempfile
from typing import Final

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.rpc.protocol import MessageLimits

__all__ = ["DEFAULT_LOOKUP_LIMITS", "LookupId", "check_lookup_id", "lookup_endpoint"]

LookupId = int | str
"""Lookup ids cross the wire, so they are ints or strings."""

DEFAULT_LOOKUP_LIMITS: Final = MessageLimits(max_header_bytes=1 << 20, max_payload_bytes=64 << 20)
"""Lookup messages: a 1 MiB header (block hashes) and 64 MiB of tokens (16M tokens)."""

_INSTANCE_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UNIX_PATH_MAX: Final = 107  # sun_path holds 108 bytes with the final NUL


def lookup_endpoint(instance_id: str, rank: int, socket_dir: str | None = None) -> str:
    """``ipc://{socket_dir}/lmcache-async-{instance_id}-{rank}.lookup``.

    ``socket_dir`` defaults to the system's temporary directory.

    Raises:
        InvalidInputError: ``instance_id`` is empty, longer than 64 characters or has a
            character outside ``[A-Za-z0-9_.-]``; ``rank`` is not a non-negative int;
            ``socket_dir`` is not a str; or the path is too long for a unix socket.
    """
    if not isinstance(instance_id, str) or not _INSTANCE_ID.fullmatch(instance_id):
        raise InvalidInputError(
            f"instance_id must be 1-64 characters of [A-Za-z0-9_.-], got {instance_id!r:.80}"
        )
    if not is_strict_int(rank) or rank < 0:
        raise InvalidInputError(f"rank must be a non-negative int, got {rank!r}")
    if socket_dir is not None and not isinstance(socket_dir, str):
        raise InvalidInputError(f"socket_dir must be a str, got {type(socket_dir).__name__}")
    directory = socket_dir if socket_dir is not None else tempfile.gettempdir()
    path = os.path.join(directory, f"lmcache-async-{instance_id}-{rank}.lookup")
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise InvalidInputError(
            f"socket path {path!r} is longer than {_UNIX_PATH_MAX} bytes, the unix socket "
            "limit: use a shorter socket_dir or instance_id"
        )
    return f"ipc://{path}"


def check_lookup_id(lookup_id: object) -> LookupId:
    """``lookup_id`` as it crosses the wire. Raises InvalidInputError: not an int or str."""
    if isinstance(lookup_id, (int, str)) and not isinstance(lookup_id, bool):
        return lookup_id
    raise InvalidInputError(f"lookup_id must be an int or str, got {type(lookup_id).__name__}")
