"""The routing benchmark's workload: requests that each repeat one of a few shared
prefixes, then add a few tokens of their own, in a seeded random order."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final, NamedTuple

from lmcache_async.bench.routing.options import RoutingOptions
from lmcache_async.errors import InvalidInputError

__all__ = ["FIRST_TOKEN", "Request", "make_requests"]

FIRST_TOKEN: Final = 3
"""The lowest token id drawn (0, 1 and 2 are the model's padding, start and end)."""


class Request(NamedTuple):
    """One prompt: ``prefix`` (an index into the prefixes) followed by its own suffix."""

    prefix: int
    tokens: list[int]


def make_requests(options: RoutingOptions, vocab_size: int) -> list[Request]:
    """``options.requests`` prompts of ``options.prompt_tokens`` token ids in
    ``[FIRST_TOKEN, vocab_size)``, the same for the same options and vocabulary.

    Each prefix is used as evenly as the count allows (``requests // prefixes`` or one
    more times), in a shuffled order; no two prefixes share their first block, and no two
    suffixes are equal, so only a prefix is ever reused.

    Raises:
        InvalidInputError: ``vocab_size`` leaves fewer than two token ids to draw from.
    """
    if vocab_size - FIRST_TOKEN < 2:
        raise InvalidInputError(f"vocab_size {vocab_size} leaves too few token ids")
    rng = random.Random(options.seed)

    def draw(count: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(count)]

    prefixes = _distinct(draw, options.prefixes, options.prefix_tokens, options.block_size)
    rounds = -(-options.requests // options.prefixes)
    order = [index for _ in range(rounds) for index in range(options.prefixes)]
    rng.shuffle(order)
    order = order[: options.requests]
    suffixes = _distinct(draw, options.requests, options.suffix_tokens, options.suffix_tokens)
    return [
        Request(index, prefixes[index] + suffix)
        for index, suffix in zip(order, suffixes, strict=True)
    ]


def _distinct(
    draw: Callable[[int], list[int]], count: int, length: int, head: int, *, attempts: int = 100
) -> list[list[int]]:
    """``count`` draws of ``length`` tokens whose first ``head`` tokens all differ.

    Raises:
        InvalidInputError: the vocabulary is too small for that many distinct heads.
    """
    found: list[list[int]] = []
    heads: set[tuple[int, ...]] = set()
    for _ in range(count):
        for _ in range(attempts):
            tokens = draw(length)
            key = tuple(tokens[:head])
            if key not in heads:
                heads.add(key)
                found.append(tokens)
                break
        else:
            raise InvalidInputError(f"cannot draw {count} distinct sequences of {head} tokens")
    return found
