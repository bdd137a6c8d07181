"""The load generator's workloads: which prompts arrive, and the synthetic KV of their tokens.

A workload hands out :class:`Prompt` s, each the token ids of one request plus the
*segments* it is made of. Three shapes of traffic:

- :class:`MultiRoundChat` (``multi-round-chat``): ``users`` conversations share one system
  prompt; each request is a user's whole history plus one new turn, so consecutive requests
  of a user share everything but the new turn. A user has one request in flight at a time
  (its next turn depends on the last); a conversation that would outgrow
  ``max_context_tokens`` starts over from the system prompt.
- :class:`LongDocQA` (``long-doc-qa``): ``documents`` long documents, ``questions``
  questions about each; a request is one document followed by one question, all pairs
  asked in a random order (then again, in a new order).
- :class:`RandomPrompts` (``random``): independent random prompts of random lengths: no
  reuse, so it measures the store path and the lookup of misses.

The KV of a token is a deterministic function of the segment it belongs to and its offset
in it (:class:`KVSource`), the way a model's KV is a function of the token's prefix: every
segment is one draw from the workload's random stream, identified by the draw's index, and
the stream is seeded by the run's seed and the workload's name. A prompt's prefix (whole
segments) therefore always carries the same KV, in every run with the same seed — which is
what lets a run verify retrieves bit for bit, even against a sidecar that kept the cache of
an earlier run.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import KVLayout

__all__ = [
    "WORKLOADS",
    "KVSource",
    "LongDocQA",
    "MultiRoundChat",
    "Prompt",
    "RandomPrompts",
    "Segment",
    "Workload",
    "same_bytes",
    "token_dim",
]

WORKLOADS: Final = ("multi-round-chat", "long-doc-qa", "random")
"""Workload names, as ``lmcache-async bench --workload`` takes them."""

_BASE_TOKENS: Final = 1024
"""Token rows of the random base every segment's KV is cut from (then repeated, biased)."""
_SHIFTS: Final = 61
"""Distinct starting rows into the base; varies KV between segments."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of prompt tokens whose KV comes from one synthetic source (draw ``seg_id``)."""

    seg_id: int
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request: ``tokens`` (int64 ``[n]``), the segments covering them in order, the
    session it belongs to and a readable request id."""

    tokens: torch.Tensor
    segments: tuple[Segment, ...]
    session: int
    name: str

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def _stream_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{name}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise InvalidInputError(f"{name} must be > 0, got {value!r}")


class Workload(ABC):
    """A source of prompts.

    ``sessions`` is how many sessions exist; a session has at most one request in flight
    (None: requests are independent, any number may run at once). ``max_prompt_tokens``
    bounds every prompt's length (the runner sizes its paged KV memory by it).
    """

    name: str
    sessions: int | None
    max_prompt_tokens: int

    def __init__(self, seed: int, vocab_size: int) -> None:
        _positive(vocab_size=vocab_size)
        self._rng = torch.Generator().manual_seed(_stream_seed(seed, self.name))
        self._vocab = vocab_size
        self._draws = 0

    def _draw(self, n: int) -> tuple[int, torch.Tensor]:
        """The next ``n`` random tokens of the stream and the draw's index (its segment id)."""
        tokens = torch.randint(0, self._vocab, (n,), generator=self._rng, dtype=torch.int64)
        index = self._draws
        self._draws += 1
        return index, tokens

    @abstractmethod
    def next_prompt(self, session: int) -> Prompt:
        """The next request of ``session`` (any int in ``[0, sessions)``, or any int at all
        when ``sessions`` is None)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the summary: the workload and its sizes."""


class MultiRoundChat(Workload):
    """``users`` conversations over one shared system prompt (see the module docstring)."""

    name = "multi-round-chat"

    def __init__(
        self,
        *,
        seed: int,
        users: int,
        system_prompt_tokens: int,
        turn_tokens: int,
        max_context_tokens: int,
        vocab_size: int,
    ) -> None:
        """Raises:
        InvalidInputError: a size is not positive, or one turn does not fit the context.
        """
        _positive(
            users=users,
            system_prompt_tokens=system_prompt_tokens,
            turn_tokens=turn_tokens,
            max_context_tokens=max_context_tokens,
        )
        if system_prompt_tokens + turn_tokens > max_context_tokens:
            raise InvalidInputError(
                "system_prompt_tokens + turn_tokens must be <= max_context_tokens, got "
                f"{system_prompt_tokens} + {turn_tokens} > {max_context_tokens}"
            )
        super().__init__(seed, vocab_size)
        self.sessions = users
        self.max_prompt_tokens = max_context_tokens
        self.users = users
        self.turn_tokens = turn_tokens
        self.max_context_tokens = max_context_tokens
        seg_id, self._system = self._draw(system_prompt_tokens)
        self._system_segment = Segment(seg_id, 0, system_prompt_tokens)
        self._history = [self._system] * users
        self._segments: list[tuple[Segment, ...]] = [(self._system_segment,)] * users
        self._conversation = [0] * users
        self._turn = [0] * users
        self.conversations = users

    def next_prompt(self, session: int) -> Prompt:
        if not 0 <= session < self.users:
            raise InvalidInputError(f"session must be in [0, {self.users}), got {session}")
        history = self._history[session]
        if history.numel() + self.turn_tokens > self.max_context_tokens:
            history = self._system
            self._segments[session] = (self._system_segment,)
            self._conversation[session] += 1
            self._turn[session] = 0
            self.conversations += 1
        seg_id, turn = self._draw(self.turn_tokens)
        segments = (*self._segments[session], Segment(seg_id, history.numel(), self.turn_tokens))
        tokens = torch.cat([history, turn])
        self._history[session], self._segments[session] = tokens, segments
        self._turn[session] += 1
        name = f"u{session}-c{self._conversation[session]}-t{self._turn[session]}"
        return Prompt(tokens, segments, session, name)

    def describe(self) -> str:
        return (
            f"multi-round-chat: {self.users} users, system prompt "
            f"{self._system_segment.length} tokens, {self.turn_tokens} tokens per turn, "
            f"context <= {self.max_context_tokens}"
        )


class LongDocQA(Workload):
    """``questions`` questions about each of ``documents`` documents, in random order."""

    name = "long-doc-qa"

    def __init__(
        self,
        *,
        seed: int,
        documents: int,
        questions: int,
        document_tokens: int,
        question_tokens: int,
        vocab_size: int,
    ) -> None:
        """Raises:
        InvalidInputError: a count or size is not positive.
        """
        _positive(
            documents=documents,
            questions=questions,
            document_tokens=document_tokens,
            question_tokens=question_tokens,
        )
        super().__init__(seed, vocab_size)
        self.sessions = None
        self.max_prompt_tokens = document_tokens + question_tokens
        self.documents = [self._draw(document_tokens) for _ in range(documents)]
        self.questions = [
            [self._draw(question_tokens) for _ in range(questions)] for _ in range(documents)
        ]
        self._order: list[tuple[int, int]] = []
        self.rounds = 0

    def next_prompt(self, session: int) -> Prompt:
        if not self._order:
            pairs = [
                (d, q) for d in range(len(self.documents)) for q in range(len(self.questions[0]))
            ]
            order = torch.randperm(len(pairs), generator=self._rng).tolist()
            # Popped from the end: reversed so the order reads as drawn.
            self._order = [pairs[i] for i in reversed(order)]
            self.rounds += 1
        d, q = self._order.pop()
        doc_id, doc = self.documents[d]
        question_id, question = self.questions[d][q]
        segments = (
            Segment(doc_id, 0, doc.numel()),
            Segment(question_id, doc.numel(), question.numel()),
        )
        return Prompt(torch.cat([doc, question]), segments, session, f"d{d}-q{q}-r{self.rounds}")

    def describe(self) -> str:
        doc_tokens = self.documents[0][1].numel()
        return (
            f"long-doc-qa: {len(self.documents)} documents of {doc_tokens} tokens, "
            f"{len(self.questions[0])} questions each of "
            f"{self.max_prompt_tokens - doc_tokens} tokens, random order"
        )


class RandomPrompts(Workload):
    """Independent random prompts, lengths uniform in ``[min_tokens, max_tokens]``."""

    name = "random"

    def __init__(self, *, seed: int, min_tokens: int, max_tokens: int, vocab_size: int) -> None:
        """Raises:
        InvalidInputError: a length is not positive, or ``min_tokens > max_tokens``.
        """
        _positive(min_prompt_tokens=min_tokens, max_prompt_tokens=max_tokens)
        if min_tokens > max_tokens:
            raise InvalidInputError(
                f"min_prompt_tokens must be <= max_prompt_tokens, got {min_tokens} > {max_tokens}"
            )
        super().__init__(seed, vocab_size)
        self.sessions = None
        self.min_tokens = min_tokens
        self.max_prompt_tokens = max_tokens
        self._count = 0

    def next_prompt(self, session: int) -> Prompt:
        n = int(
            torch.randint(self.min_tokens, self.max_prompt_tokens + 1, (1,), generator=self._rng)
        )
        seg_id, tokens = self._draw(n)
        self._count += 1
        return Prompt(tokens, (Segment(seg_id, 0, n),), session, f"r{self._count}")

    def describe(self) -> str:
        return f"random: prompts of {self.min_tokens}..{self.max_prompt_tokens} tokens"


def token_dim(layout: KVLayout) -> int:
    """The dimension of ``layout.payload_shape(T)`` that counts tokens.

    Raises:
        InvalidInputError: no single dimension grows with the token count.
    """
    one, two = tuple(layout.payload_shape(1)), tuple(layout.payload_shape(2))
    dims = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(dims) != 1:
        raise InvalidInputError(f"cannot find the token dimension of payload shape {one}")
    return dims[0]


class KVSource:
    """Deterministic synthetic KV: a token's payload depends on its segment and offset.

    A random base payload of ``payload_shape(_BASE_TOKENS + _SHIFTS)`` is drawn once from
    ``seed`` (its size does not depend on the workload, so every run with the same seed and
    layout agrees). The payload of token ``a`` of segment ``s`` is base row ``k + a mod
    _BASE_TOKENS`` plus a constant, with ``k`` derived from ``s`` and the constant from ``s``
    and ``a // _BASE_TOKENS`` (so a long segment does not repeat). Cheap (one gather and one
    add per element), finite (no NaN bit patterns), and computed by one code path for any
    set of positions, so the same token always gets the same bits.
    """

    def __init__(self, layout: KVLayout, seed: int) -> None:
        self._dim = token_dim(layout)
        gen = torch.Generator().manual_seed(seed)
        shape = tuple(layout.payload_shape(_BASE_TOKENS + _SHIFTS))
        self._base = torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)

    def payload(self, segments: Sequence[Segment], positions: torch.Tensor) -> torch.Tensor:
        """Payload of the prompt tokens at ``positions`` (int64 ``[n]``, in any order).

        Returns a contiguous ``layout.payload_shape(n)`` tensor of the layout's dtype.
        """
        starts = torch.tensor([seg.start for seg in segments], dtype=torch.int64)
        ids = torch.tensor([seg.seg_id for seg in segments], dtype=torch.int64)
        which = torch.searchsorted(starts, positions, right=True) - 1
        offsets = positions - starts[which]
        seg = ids[which]
        rows = (seg * 7919) % _SHIFTS + offsets % _BASE_TOKENS
        biases = ((seg * 2654435761 + (offsets // _BASE_TOKENS) * 40503) % 1021).float() / 128.0
        out = self._base.index_select(self._dim, rows)
        view = [1] * out.dim()
        view[self._dim] = int(positions.numel())
        out.add_(biases.view(view))
        return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold exactly the same bytes (bit-exact, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
