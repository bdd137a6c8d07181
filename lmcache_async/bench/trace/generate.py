"""A synthetic trace in Mooncake's format, for runs and tests without a production trace.

Three kinds of request arrive, Poisson in time (``mean_gap_ms`` apart on average):

- a *new session*: one of ``system_prompts`` shared system prompts (the first ones chosen
  more often: weights 1, 1/2, 1/3, ...) and a question;
- a *follow-up*: an open session's previous prompt, the answer it got (its
  ``output_length``) and a new question; a session closes after ``max_turns`` turns or once
  its prompt is over ``max_context_blocks`` blocks, and at most ``open_sessions`` are open
  (opening another closes the oldest);
- a *one-off*: a prompt of its own, shared with no one.

Sizes are in blocks, so the shape of the trace is the same at any ``block_size``. Hash ids
are given as a serving engine's prefix cache would: block ``j``'s id stands for its tokens
and everything before them, so a prompt's partial last block gets a new id when a later
turn fills it. The same arguments always write the same file.
"""

from __future__ import annotations

import json
import os
import random
from collections import deque
from dataclasses import dataclass, field

from lmcache_async.errors import InvalidInputError

__all__ = ["TraceShape", "generate_trace"]

Piece = tuple[int, int]
"""A run of prompt content: (piece id, tokens)."""


@dataclass(frozen=True, slots=True)
class TraceShape:
    """The mix and sizes of a synthetic trace (sizes in blocks; fractions in [0, 1])."""

    system_prompts: int = 8
    system_blocks: tuple[float, float] = (2.0, 8.0)
    question_blocks: tuple[float, float] = (0.25, 2.0)
    answer_blocks: tuple[float, float] = (0.125, 0.75)
    one_off_blocks: tuple[float, float] = (0.5, 8.0)
    one_off_share: float = 0.3
    new_session_share: float = 0.2
    open_sessions: int = 256
    max_turns: int = 8
    max_context_blocks: int = 32
    mean_gap_ms: float = 200.0

    def validate(self) -> None:
        """Raises:
        InvalidInputError: a count or size is not positive, a range is upside down, or the
            shares are out of [0, 1] or add up to more than 1.
        """
        for name in ("system_prompts", "open_sessions", "max_turns", "max_context_blocks"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_blocks", "question_blocks", "answer_blocks", "one_off_blocks"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise InvalidInputError(f"{name} must be a range 0 < low <= high, got {low, high}")
        shares = (self.one_off_share, self.new_session_share)
        if not all(0 <= share <= 1 for share in shares) or sum(shares) > 1:
            raise InvalidInputError(f"the shares of requests must be in [0, 1], got {shares}")
        if not self.mean_gap_ms > 0:
            raise InvalidInputError(f"mean_gap_ms must be > 0, got {self.mean_gap_ms}")


@dataclass(slots=True)
class _Session:
    pieces: list[Piece]
    answer: int
    turns: int = 1


@dataclass(slots=True)
class _Writer:
    """Draws the content and assigns the hash ids of the prompts."""

    rng: random.Random
    block_size: int
    pieces: int = 0
    ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = field(default_factory=dict)

    def tokens(self, blocks: tuple[float, float]) -> int:
        low, high = blocks
        return max(1, round(self.rng.uniform(low, high) * self.block_size))

    def piece(self, blocks: tuple[float, float]) -> Piece:
        self.pieces += 1
        return (self.pieces, self.tokens(blocks))

    def hash_ids(self, pieces: list[Piece]) -> list[int]:
        """One id per block (the last may be partial), chained over the prefix."""
        size = self.block_size
        ids: list[int] = []
        block: list[tuple[int, int, int]] = []
        room = size
        parent = -1
        for piece_id, length in pieces:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                block.append((piece_id, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._id(parent, block)
                    ids.append(parent)
                    block, room = [], size
        if block:
            ids.append(self._id(parent, block))
        return ids

    def _id(self, parent: int, block: list[tuple[int, int, int]]) -> int:
        return self.ids.setdefault((parent, tuple(block)), len(self.ids))


def generate_trace(
    path: str | os.PathLike[str],
    *,
    requests: int,
    seed: int = 0,
    block_size: int = 512,
    shape: TraceShape | None = None,
) -> int:
    """Write a synthetic trace of ``requests`` requests to ``path`` (see the module
    docstring); returns how many distinct hash ids it holds.

    Raises:
        InvalidInputError: ``requests`` is negative, ``block_size`` is not positive, or the
            shape is invalid.
        OSError: the file cannot be written.
    """
    shape = shape or TraceShape()
    shape.validate()
    if requests < 0:
        raise InvalidInputError(f"requests must be >= 0, got {requests}")
    if block_size < 1:
        raise InvalidInputError(f"block_size must be > 0, got {block_size}")
    rng = random.Random(seed)
    writer = _Writer(rng, block_size)
    systems = [writer.piece(shape.system_blocks) for _ in range(shape.system_prompts)]
    weights = [1.0 / (rank + 1) for rank in range(shape.system_prompts)]
    sessions: deque[_Session] = deque()
    max_context = shape.max_context_blocks * block_size
    clock = 0.0
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(requests):
            clock += rng.expovariate(1.0 / shape.mean_gap_ms)
            draw = rng.random()
            answer = writer.tokens(shape.answer_blocks)
            question = writer.piece(shape.question_blocks)
            if draw < shape.one_off_share:
                pieces = [writer.piece(shape.one_off_blocks)]
            elif draw < shape.one_off_share + shape.new_session_share or not sessions:
                system = rng.choices(systems, weights)[0]
                pieces = [system, question]
                if len(sessions) >= shape.open_sessions:
                    sessions.popleft()
                sessions.append(_Session(pieces, answer))
            else:
                session = sessions[rng.randrange(len(sessions))]
                writer.pieces += 1
                pieces = [*session.pieces, (writer.pieces, session.answer), question]
                session.pieces, session.answer = pieces, answer
                session.turns += 1
                if session.turns >= shape.max_turns or sum(n for _, n in pieces) > max_context:
                    sessions.remove(session)
            ids = writer.hash_ids(pieces)
            line = {
                "timestamp": round(clock),
                "input_length": sum(length for _, length in pieces),
                "output_length": answer,
                "hash_ids": ids,
            }
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
    return len(writer.ids)
