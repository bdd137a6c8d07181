"""A trace request's prompt as token ids: each hash id becomes a block of its own tokens.

Every block of a prompt gets a *block number*: hash id ``h`` is ``2h``; a block past the
request's ``hash_ids`` (its own tokens, shared with no one) is ``2(line * 2**24 + j) + 1``
for block ``j`` of the request on ``line``. A block's tokens are a function of its number
alone:

- the first :attr:`BlockTokens.digits` tokens write the number in base ``vocab_size``, so
  two different numbers never give the same block (nor do two different hash ids);
- the rest are a hash (splitmix64) of the seed, the number and the position, so a block
  does not look like a counter to a model, and another seed gives other tokens.

A prompt is its blocks' tokens cut to ``input_length``: a partial last block is the first
tokens of that block, so a prompt that ends inside a block is a prefix of one that goes on
(only the full blocks are ever cached: :mod:`.bounds`). The KV of each token is the
synthetic KV of its block (a :class:`~lmcache_async.bench.workloads.Segment` per block,
identified by the block number), so it too depends on the block and the offset alone,
which lets a retrieve be checked bit for bit.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from lmcache_async.bench.trace.parse import MAX_PROMPT_BLOCKS, TraceRequest
from lmcache_async.bench.workloads import Prompt, Segment
from lmcache_async.errors import InvalidInputError

__all__ = ["BLOCK_NUMBER_BITS", "BlockTokens", "block_numbers", "digits_for"]

BLOCK_NUMBER_BITS: Final = 63
"""Block numbers are below ``2**63`` (hash ids below ``2**62``, lines below ``2**38``)."""

_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def digits_for(vocab_size: int) -> int:
    """How many base-``vocab_size`` digits write any block number.

    Raises:
        InvalidInputError: ``vocab_size`` is below 2.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise InvalidInputError(f"the vocabulary must have >= 2 tokens, got {vocab_size!r}")
    digits, reach = 1, vocab_size
    while reach < 1 << BLOCK_NUMBER_BITS:
        digits += 1
        reach *= vocab_size
    return digits


def block_numbers(request: TraceRequest, block_size: int) -> np.ndarray:
    """The block number of each block of ``request``'s prompt (uint64 ``[blocks]``)."""
    blocks = -(-request.input_length // block_size)
    numbers = np.empty(blocks, dtype=np.uint64)
    hashed = len(request.hash_ids)
    numbers[:hashed] = np.asarray(request.hash_ids, dtype=np.uint64) * np.uint64(2)
    own = np.arange(hashed, blocks, dtype=np.uint64)
    own += np.uint64(request.line * MAX_PROMPT_BLOCKS)
    numbers[hashed:] = own * np.uint64(2) + np.uint64(1)
    return numbers


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX1
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX2
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


class BlockTokens:
    """Token ids of trace prompts for one block size, vocabulary and seed."""

    def __init__(self, *, block_size: int, vocab_size: int, seed: int) -> None:
        """Raises:
        InvalidInputError: the vocabulary has fewer than 2 tokens, or a block is too short
            to hold the digits that keep blocks distinct.
        """
        self.digits = digits_for(vocab_size)
        if block_size < self.digits:
            raise InvalidInputError(
                f"a block of {block_size} tokens cannot hold the {self.digits} tokens that "
                f"keep blocks distinct with a vocabulary of {vocab_size}: use a larger "
                "block size or vocabulary"
            )
        self.block_size = block_size
        self.vocab_size = vocab_size
        self._seed = np.uint64(seed % (1 << 64))
        self._vocab = np.uint64(vocab_size)
        self._positions = np.arange(block_size, dtype=np.uint64)
        self._powers = np.array([vocab_size**k for k in range(self.digits)], dtype=np.uint64)

    def blocks(self, numbers: np.ndarray) -> np.ndarray:
        """The tokens of the blocks ``numbers`` (uint64 ``[n]``): int64 ``[n, block_size]``."""
        grid = numbers[:, None] * _GOLDEN + self._positions[None, :]
        tokens = _splitmix(grid ^ self._seed) % self._vocab
        digits = self.digits
        tokens[:, :digits] = (numbers[:, None] // self._powers[None, :]) % self._vocab
        return tokens.astype(np.int64)

    def prompt(self, request: TraceRequest) -> Prompt:
        """The prompt of ``request``: ``input_length`` tokens, one segment per block."""
        size = self.block_size
        numbers = block_numbers(request, size)
        tokens = self.blocks(numbers).reshape(-1)[: request.input_length]
        length = request.input_length
        segments = tuple(
            Segment(int(number), j * size, min(size, length - j * size))
            for j, number in enumerate(numbers.tolist())
        )
        return Prompt(torch.from_numpy(tokens.copy()), segments, 0, f"line{request.line}")
