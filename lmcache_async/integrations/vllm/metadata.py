"""The orders the scheduler side sends the workers each step, through the connector
metadata: what to load (:class:`LoadSpec`: before the forward pass, or in the background
between steps) and what to store after it (:class:`SaveSpec`), and the slots of vLLM's
paged memory they touch. Each names the request's tenant (its ``cache_salt``, else the
connector's ``tenant``), whose keys the worker stores and loads under.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_async.errors import InvalidInputError

__all__ = ["LMCacheAsyncConnectorMetadata", "LoadSpec", "SaveSpec", "block_slots"]


def block_slots(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The slots (``block_id * block_size + offset``) of a request's first ``num_tokens``
    tokens, as a fresh 1-D int64 tensor.

    Raises:
        InvalidInputError: the blocks hold fewer than ``num_tokens`` tokens.
    """
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise InvalidInputError(
            f"{num_tokens} tokens need {needed} blocks of {block_size}, the request has "
            f"{len(block_ids)}"
        )
    blocks = torch.tensor(list(block_ids[:needed]), dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks.unsqueeze(1) * block_size + offsets).view(-1)[:num_tokens].clone()


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of a request into its blocks: before this step's
    forward, or (an asynchronous load) in the background, finished in a later step.

    ``tokens`` are the prompt's tokens up to the end of the last chunk to read (they key the
    chunks; ``end`` may stop short of it, as it does for a fully cached prompt), and
    ``block_ids`` need to hold only tokens ``[0, end)``.
    ``epoch`` counts the request's restarts (a failed load, a preemption). ``tenant``:
    whose KV it is (None: the worker engine's own tenant).
    """

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    epoch: int
    tenant: str | None = None

    def slots_and_mask(
        self, *, block_size: int, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot mapping and mask of the engine's retrieve: the chunks from the one
        holding ``start`` on are read; only tokens ``[start, end)`` are written.

        Raises:
            InvalidInputError: ``block_ids`` hold fewer tokens than ``end``.
        """
        num = len(self.tokens)
        # Blocks beyond end are never written (an asynchronous load has none yet).
        slots = torch.full((num,), -1, dtype=torch.int64)
        slots[: self.end] = block_slots(self.block_ids, block_size, self.end)
        mask_start = self.start - self.start % chunk_size
        slots[mask_start : self.start] = -1  # vLLM's own prefix: never overwritten
        mask = torch.zeros(num, dtype=torch.bool)
        mask[mask_start:] = True
        return slots, mask

    def retrieve_args(
        self, kv_caches: Sequence[torch.Tensor], *, block_size: int, chunk_size: int
    ) -> dict[str, Any]:
        """The keyword arguments of the engine's retrieve (whole, layerwise or in the
        background) of this load into ``kv_caches``, under the request's id as its lookup
        id (its promise's pins) and its tenant.

        Raises:
            InvalidInputError: as :meth:`slots_and_mask`.
        """
        slots, mask = self.slots_and_mask(block_size=block_size, chunk_size=chunk_size)
        return {
            "kv_caches": kv_caches,
            "slot_mapping": slots,
            "mask": mask,
            "req_id": self.req_id,
            "lookup_id": self.req_id,
            "tenant": self.tenant,
        }


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks of ``tokens`` (a prefix of the request's tokens: of its prompt, or
    with ``store_decode_tokens`` of all it computed) from the chunk holding token ``start``
    on, after this step's forward, as ``tenant``'s KV (None: the worker engine's own
    tenant). ``block_names``: vLLM's names of the whole blocks of ``tokens`` (as its KV
    events name them), when known: the store's KV events name the blocks so."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    epoch: int
    tenant: str | None = None
    block_names: tuple[int, ...] = ()

    def slots_and_mask(
        self, *, block_size: int, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot mapping and mask of the engine's store: the chunks from the one holding
        ``start`` on.

        Raises:
            InvalidInputError: ``block_ids`` hold fewer tokens than ``tokens``.
        """
        num = len(self.tokens)
        slots = block_slots(self.block_ids, block_size, num)
        mask = torch.zeros(num, dtype=torch.bool)
        mask[self.start - self.start % chunk_size :] = True
        return slots, mask


@dataclass(slots=True)
class LMCacheAsyncConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side asks the workers to do in one step.

    ``loads`` finish before the forward pass (layer by layer with ``use_layerwise``);
    ``async_loads`` start in this step and are reported finished in a later one (vLLM
    schedules the request once every worker has). ``releases``: finished requests whose
    blocks vLLM keeps for this step's ``saves``; the workers report them finished sending
    once those are stored (or failed). ``scheduled_tokens``: tokens this step computes.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    async_loads: list[LoadSpec] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    scheduled_tokens: int = 0
