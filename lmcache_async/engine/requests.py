"""Request preparation: a caller's key input and KV caches turned into a request.

:class:`RequestKeys` checks how a request names its chunks (tokens, or the serving
engine's block hashes with offsets, or chunk digests a client computed), decides whether
it is hashed on the event loop or in a worker thread, and builds the request's transfer
plan through the engine's checked view of the KV caches. Nothing here stores or loads.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Final, TypeVar

import anyio.to_thread
import numpy as np
import torch

from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkSpan, DigestFrames, check_mask, token_array
from lmcache_async.keys.key_input import check_key_input, check_sequence
from lmcache_async.keys.tokens import Tokens, is_strict_int
from lmcache_async.tenancy.tenants import TAG_BYTES, tag_hex

from ..config import EngineConfig
from ..errors import InvalidInputError
from ..layouts import KVCacheViews
from ..pipelines.common import Keyer, Request
from .hashers import TenantHashers

__all__ = ["RequestKeys"]

R = TypeVar("R", bound=Request)


class RequestKeys:
    """Turns key input into chunk keys and requests, for one engine's hashers (one per
    tenant) and caches. ``tenant`` None is the engine's own tenant."""

    def __init__(
        self,
        config: EngineConfig,
        hashers: TenantHashers,
        frames: DigestFrames,
        kv_views: KVCacheViews,
    ) -> None:
        self._chunk_size = config.chunk_size
        self._save_unfull = config.save_unfull_chunk
        self._inline_hash_tokens = config.inline_hash_tokens
        self._hashers = hashers
        self._frames = frames
        self._kv_views = kv_views
        self._request_ids = itertools.count()

    def _inline(self, ends: list[int] | None, num_tokens: int) -> bool:
        return ends is not None or num_tokens < self._inline_hash_tokens

    def _keyer(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        ends: list[int] | None,
        num_tokens: int,
        start: int,
        *,
        tenant: str | None,
    ) -> Keyer:
        """The keyer of checked key input: it gives the chunks from token ``start`` (a
        chunk boundary) on."""
        save_unfull = self._save_unfull
        hasher = self._hashers.for_tenant(tenant)
        first = start // self._chunk_size
        if ends is not None:
            assert hashes is not None  # check_key_input: offsets come with hashes
            hash_list = list(hashes)

            def from_hashes() -> tuple[list[ChunkSpan], np.ndarray | None]:
                spans = hasher.spans_from_hashes(hash_list, ends, save_unfull_chunk=save_unfull)
                return spans[first:] if first else spans, None

            return from_hashes
        source = tokens
        assert source is not None

        def from_tokens() -> tuple[list[ChunkSpan], np.ndarray | None]:
            array = token_array(source)  # validated once, here
            spans = hasher.array_spans(array, save_unfull_chunk=save_unfull)
            return spans[first:] if first else spans, array

        return from_tokens

    def prepare(
        self,
        request_type: type[R],
        *,
        tokens: Tokens | None,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        req_id: str | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        tenant: str | None = None,
    ) -> tuple[R, int]:
        """A request of ``request_type`` with its transfer plan, and the mask's start.
        Short prompts are hashed here, so invalid tokens fail before anything is queued.

        Raises:
            InvalidInputError: bad key input, mask, caches or slot mapping.
        """
        ends = check_key_input(tokens, hashes, offsets)
        num_tokens = _length(tokens, ends)
        start = check_mask(mask, num_tokens, self._chunk_size)
        keyer = self._keyer(tokens, hashes, ends, num_tokens, start, tenant=tenant)
        inline = self._inline(ends, num_tokens)
        plan, slots_cpu = self._kv_views.plan(kv_caches, slot_mapping, num_tokens)
        request = request_type(
            req_id=req_id if req_id is not None else f"req-{next(self._request_ids)}",
            keyer=keyer,
            num_tokens=num_tokens,
            hash_inline=inline,
            plan=plan,
            slots_cpu=slots_cpu,
        )
        if inline:
            request.spans, request.tokens = keyer()
            request.keyer = _already_hashed(request)
        return request, start

    async def chunk_spans(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        start: int = 0,
        tenant: str | None = None,
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The chunks of a request from token ``start`` on, and its tokens as int32 (None
        when keyed by ``hashes``). A long prompt is hashed in a worker thread.

        Raises:
            InvalidInputError: bad key input.
        """
        ends = check_key_input(tokens, hashes, offsets)
        num_tokens = _length(tokens, ends)
        keyer = self._keyer(tokens, hashes, ends, num_tokens, start, tenant=tenant)
        if self._inline(ends, num_tokens):
            return keyer()
        return await anyio.to_thread.run_sync(keyer)

    async def lookup_keys(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        tenant: str | None = None,
    ) -> tuple[Sequence[bytes], list[int], int]:
        """The chunk keys of a prompt, the end token of each (empty: every chunk is
        ``chunk_size`` long) and the prompt's length.

        Raises:
            InvalidInputError: bad key input.
        """
        ends = check_key_input(tokens, hashes, offsets)
        num_tokens = _length(tokens, ends)
        if ends is not None:
            spans, _ = self._keyer(tokens, hashes, ends, num_tokens, 0, tenant=tenant)()
            return [span.key for span in spans], [span.end for span in spans], num_tokens
        # Only the digests are needed: a whole-chunk key is its digest.
        assert tokens is not None
        hasher = self._hashers.for_tenant(tenant)
        keys: Sequence[bytes]
        if num_tokens < self._inline_hash_tokens:
            keys = hasher.digests(tokens)
        else:
            # A long prompt asked about again is recognised here, without a thread hop.
            probe = hasher.probe(tokens)
            if probe.digests is not None:
                keys = probe.digests
            else:
                hash_all: Callable[[], Sequence[bytes]] = functools.partial(
                    hasher.digests, tokens, probe=probe
                )
                keys = await anyio.to_thread.run_sync(hash_all)
        if num_tokens % self._chunk_size and not self._save_unfull:
            keys = keys[:-1]
        return keys, [], num_tokens

    def digest_keys(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
        tenant: str | None = None,
    ) -> Sequence[bytes]:
        """The keys a lookup by chunk digests (a client computed them with ``tenant``'s
        hasher) looks for, checked.

        Raises:
            InvalidInputError: ``pin`` without a ``lookup_id``, ``num_tokens`` not an int
                >= 0, a digest not :data:`DIGEST_SIZE` bytes, not one digest per chunk, or
                a digest that is not ``tenant``'s (its tag is another's).
        """
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        if not is_strict_int(num_tokens) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        keys: Sequence[bytes]
        frame: bytes | bytearray | memoryview | None = None
        if isinstance(digests, (bytes, bytearray, memoryview)):
            keys = self._frames.split(digests)  # each DIGEST_SIZE bytes by construction
            frame = digests
        else:
            keys = digests
            # Checked with C-level maps: a 32k-token prompt has 128 digests.
            if keys and (
                not set(map(type, keys)) <= {bytes} or set(map(len, keys)) != {DIGEST_SIZE}
            ):
                raise InvalidInputError(f"every digest must be {DIGEST_SIZE} bytes")
        chunk = self._chunk_size
        if len(keys) != -(-num_tokens // chunk):
            raise InvalidInputError(
                f"{num_tokens} tokens make {-(-num_tokens // chunk)} chunks of {chunk},"
                f" got {len(keys)} digests"
            )
        if keys:
            _check_tags(b"".join(keys) if frame is None else frame, self._hashers.tag(tenant))
        if num_tokens % chunk and not self._save_unfull:
            return keys[:-1]
        return keys


def _length(tokens: Tokens | None, ends: list[int] | None) -> int:
    """The number of tokens of key input checked by ``check_key_input`` (``ends``: its
    offsets when keyed by hashes).

    Raises:
        InvalidInputError: tokens that are not 1-D or not a sequence.
    """
    if ends is not None:
        return ends[-1] if ends else 0
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        if tokens.ndim != 1:
            raise InvalidInputError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        return int(tokens.shape[0])
    return len(check_sequence("tokens", tokens))


def _check_tags(digests: bytes | bytearray | memoryview, tag: bytes) -> None:
    """InvalidInputError unless every digest of ``digests`` (their concatenation) starts
    with ``tag``: a client keys a tenant's prompt with that tenant's hasher, and one tenant
    never asks for another's chunks. One vector compare of the digests' leading 8-byte
    words against the tag's (a set of 128 slices took four times as long)."""
    words = np.frombuffer(digests, dtype=np.uint64).reshape(-1, DIGEST_SIZE // _WORD)
    leads = words[:, : TAG_BYTES // _WORD]
    if not bool((leads == np.frombuffer(tag, dtype=np.uint64)).all()):
        raise InvalidInputError(
            f"digests are not of the tenant named (its keys start with {tag_hex(tag)})"
        )


_WORD: Final = 8
"""Bytes of the words :func:`_check_tags` compares (a tag and a digest are whole words)."""


def _already_hashed(request: Request) -> Keyer:
    spans, tokens = request.spans, request.tokens
    return lambda: (spans, tokens)
