"""Stores sent ahead. A client made with ``store_ahead`` sends each pinned lookup by tokens
with the prompt's STORE right behind it, not waited for: the sidecar serves it after the
lookup and reserves the chunks it lacks while the serving engine loads the hit and
computes the rest (a prompt held whole: the reply says so at once). The store that comes
after (the same tokens) takes that reply, there long before it is asked for, and copies
into the reserved chunks with no round trip of its own. The reservation evicts what it
needs when the lookup comes, as the store would when it came, so a client that does not
store after its pinned lookups must not ask for it: its reservations would hold memory
until they expire.

A STORE sent ahead is used once, by a store of the same prompt (tenant and chunk digests),
with no tiers named and no slot left out, within half the client's timeout of its
sending (the sidecar holds the reservation for two timeouts, and the copies may take
one); any other is given back.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Final

from lmcache_async.rpc.client.link import Link, Sent

__all__ = ["Ahead", "StoresAhead"]

_KEPT: Final = 64
"""Stores ahead remembered at most; the oldest past it are given back."""


@dataclass(slots=True)
class Ahead:
    """A STORE sent ahead on ``link`` for a prompt of ``num_tokens`` tokens, usable until
    ``usable_until`` (the loop's clock)."""

    link: Link
    sent: Sent
    num_tokens: int
    usable_until: float


class StoresAhead:
    """The stores sent ahead and not yet used, by prompt: ``(tenant, joined digests)``."""

    def __init__(self) -> None:
        self._by_prompt: collections.OrderedDict[tuple[object, bytes], Ahead] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._by_prompt)

    def add(self, prompt: tuple[object, bytes], ahead: Ahead) -> None:
        """Remember ``ahead`` for ``prompt``; one it replaces, or the oldest past
        :data:`_KEPT`, is given back."""
        old = self._by_prompt.pop(prompt, None)
        if old is not None:
            old.link.forget(old.sent)
        self._by_prompt[prompt] = ahead
        while len(self._by_prompt) > _KEPT:
            _, oldest = self._by_prompt.popitem(last=False)
            oldest.link.forget(oldest.sent)

    def take(self, prompt: tuple[object, bytes]) -> Ahead | None:
        """The store ahead of ``prompt``, no longer remembered (the caller uses it or
        forgets it)."""
        return self._by_prompt.pop(prompt, None)

    def forget_all(self) -> None:
        """Give every store ahead back (the client closes)."""
        while self._by_prompt:
            _, ahead = self._by_prompt.popitem(last=False)
            ahead.link.forget(ahead.sent)
