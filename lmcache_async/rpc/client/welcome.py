"""The server's HELLO reply as a client reads it (:class:`Welcome`), and what follows from
it: the tiers a request may name (:func:`check_tiers`) and the hasher that gives the
server's chunk keys (:func:`key_hasher`), so lookups can send digests instead of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.chunks import ChunkHasher, HashAlgorithm, Namespace
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.logging import get_logger

__all__ = ["Welcome", "check_tiers", "key_hasher"]

log = get_logger(__name__)

_DIGEST_MEMO_PROMPTS: Final = 8  # recent long prompts whose digests a client remembers

_T = TypeVar("_T")


def _optional(header: dict[str, Any], name: str, kind: type[_T]) -> _T | None:
    value = header.get(name)
    return value if isinstance(value, kind) else None


@dataclass(frozen=True, slots=True)
class Welcome:
    """What the server said in its HELLO reply."""

    server: str
    pid: int | None
    shm: str | None
    shm_bytes: int
    chunk_size: int
    save_unfull_chunk: bool
    heartbeat_interval: float
    client_timeout: float
    tiers: tuple[str, ...]
    hash_algorithm: str | None = None
    key_seed: bytes | None = None

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Welcome:
        """The welcome in a HELLO reply's header.

        Raises:
            ProtocolError: a field is missing or malformed.
        """
        try:
            welcome = cls(
                server=str(header["server"]),
                pid=header.get("pid") if is_strict_int(header.get("pid")) else None,
                shm=header.get("shm"),
                shm_bytes=int(header["shm_bytes"]),
                chunk_size=int(header["chunk_size"]),
                save_unfull_chunk=bool(header["save_unfull_chunk"]),
                heartbeat_interval=float(header["heartbeat_interval"]),
                client_timeout=float(header["client_timeout"]),
                tiers=tuple(str(t) for t in header.get("tiers", ())),
                hash_algorithm=_optional(header, "hash_algorithm", str),
                key_seed=_optional(header, "key_seed", bytes),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed HELLO reply: {exc!r}") from None
        if welcome.shm is not None and not isinstance(welcome.shm, str):
            raise ProtocolError("malformed HELLO reply: 'shm' is not a name")
        if welcome.chunk_size <= 0 or welcome.heartbeat_interval <= 0:
            raise ProtocolError("malformed HELLO reply: non-positive chunk size or interval")
        return welcome


def check_tiers(
    welcome: Welcome | None, locations: Sequence[str] | None, name: str
) -> list[str] | None:
    """``locations`` (one name or several) as a list, each a tier the server announced
    (any name before the first welcome); None stays None.

    Raises:
        InvalidInputError: a name that is not one of the server's tiers.
    """
    if locations is None:
        return None
    if isinstance(locations, str):
        locations = [locations]
    names = list(locations)
    known = welcome.tiers if welcome is not None else ()
    for location in names:
        if not isinstance(location, str) or (known and location not in known):
            raise InvalidInputError(
                f"{name}: {location!r} is not an enabled tier (enabled: {list(known)})"
            )
    return names


def key_hasher(namespace: Namespace, welcome: Welcome, url: str) -> ChunkHasher | None:
    """A hasher giving the server's chunk keys for ``namespace``, or None (lookups then
    send tokens): the server did not say how it hashes, or its seed is not ours."""
    if welcome.hash_algorithm is None or welcome.key_seed is None:
        return None
    try:
        hasher = ChunkHasher(
            namespace,
            chunk_size=welcome.chunk_size,
            algorithm=HashAlgorithm(welcome.hash_algorithm),
            memo_size=_DIGEST_MEMO_PROMPTS,
        )
    except (ValueError, InvalidInputError) as exc:
        log.warning("sidecar_key_hasher_unavailable", error=str(exc))
        return None
    if hasher.seed != welcome.key_seed:
        log.warning("sidecar_key_seed_differs", url=url)
        return None
    return hasher
