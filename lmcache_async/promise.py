"""What a cache promises a serving engine's scheduler for a request (:class:`Promise`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Promise"]


@dataclass(frozen=True, slots=True)
class Promise:
    """What a scheduler may count on for a request.

    ``tokens``: prompt prefix tokens (from token 0) verified in host memory and pinned for
    the lookup id. ``pending``: a prefetch is still bringing lower-tier hits into host
    memory; ask again (the count may then grow).
    """

    tokens: int
    pending: bool
