"""Segment keys for blending: one unchained key per separator-delimited segment.

Each segment is hashed on its own, ``H(segment || h_0)``, with the same seed ``h_0`` and
hash ``H`` as chunk keys (:mod:`lmcache_async.keys.chunks`, :mod:`lmcache_async.keys.hashing`), so a
document is found wherever it appears.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import ChunkSpan, Namespace, _new_key, _new_span
from lmcache_async.keys.hashing import HashAlgorithm, as_algorithm, hash_function
from lmcache_async.keys.tokens import Tokens, token_array

__all__ = ["SegmentHasher"]


class SegmentHasher:
    """Segment keys for blending: one unchained key per separator-delimited segment.

    Tokens are split at each (non-overlapping, leftmost-first) occurrence of ``separator``;
    each segment, separator tokens excluded, is keyed ``tag || H(segment || seed)`` with no
    chain (the tenant's tag ahead of the whole link, as for chunk keys), so a document's
    KV is found wherever it appears in a prompt.

    Raises:
        InvalidInputError: ``separator`` is empty or not valid tokens, ``namespace`` is not
            a :class:`Namespace`, or ``algorithm`` is unknown.
    """

    __slots__ = ("_algorithm", "_hash", "_namespace", "_seed", "_separator")

    def __init__(
        self,
        namespace: Namespace,
        *,
        separator: Sequence[int],
        algorithm: HashAlgorithm = HashAlgorithm.BLAKE3,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(f"namespace must be a Namespace, got {namespace!r:.80}")
        separator_array = token_array(separator).copy()
        if not separator_array.size:
            raise InvalidInputError("separator must hold at least one token")
        self._separator = separator_array
        self._algorithm = as_algorithm(algorithm)
        self._namespace = namespace
        self._seed = namespace.seed(self._algorithm)
        self._hash = hash_function(self._algorithm)

    @property
    def separator(self) -> tuple[int, ...]:
        """The separator token sequence."""
        return tuple(int(t) for t in self._separator)

    @property
    def algorithm(self) -> HashAlgorithm:
        """The hash ``H``."""
        return self._algorithm

    @property
    def namespace(self) -> Namespace:
        """The namespace bound into every key through the seed."""
        return self._namespace

    def _separator_starts(self, tokens: npt.NDArray[np.int32]) -> list[int]:
        """Start indices of every occurrence of the separator (overlaps included)."""
        sep = self._separator
        width = len(sep)
        if len(tokens) < width:
            return []
        candidates = np.flatnonzero(tokens[: len(tokens) - width + 1] == sep[0])
        for offset in range(1, width):
            if not candidates.size:
                break
            candidates = candidates[tokens[candidates + offset] == sep[offset]]
        return [int(c) for c in candidates]

    def spans(self, tokens: Tokens) -> list[ChunkSpan]:
        """One span per non-empty segment, in order; ``parent`` is always None.

        Raises:
            InvalidInputError: ``tokens`` are invalid (see :func:`token_array`).
        """
        array = token_array(tokens)
        width = len(self._separator)
        bounds: list[tuple[int, int]] = []
        position = 0
        for hit in self._separator_starts(array):
            if hit < position:
                continue  # overlaps the separator just consumed
            if hit > position:
                bounds.append((position, hit))
            position = hit + width
        if position < len(array):
            bounds.append((position, len(array)))
        hash_function = self._hash
        seed, tag = self._seed, self._namespace.tag
        return [
            _new_span(
                start,
                end,
                _new_key(tag + hash_function(array[start:end].tobytes() + seed)),
                None,
            )
            for start, end in bounds
        ]
