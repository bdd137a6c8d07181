"""The KV layout: the shape, element type and memory order of a serving engine's paged KV
memory, and the transfers of tokens between it and chunk payloads.

:class:`KVLayout` describes; it delegates the checks of what callers hand it to
:mod:`lmcache_async.layouts.checks`, and where tokens lie in engine memory to
:mod:`lmcache_async.layouts.rows` and :mod:`lmcache_async.layouts.cpu_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts.checks import check_fields, check_kv_caches, check_slot_mapping
from lmcache_async.layouts.cpu_rows import DEFAULT_VLLM_CPU_BLOCK_SIZE, checked_cpu_packing
from lmcache_async.layouts.kinds import (
    CpuKVPacking,
    KVFormat,
    LayoutKind,
    as_cpu_packing,
    dtype_name,
)
from lmcache_async.layouts.plain import layout_args, layout_dict
from lmcache_async.layouts.rows import (
    allocate_layers,
    gather_tokens,
    plan_transfers,
    scatter_tokens,
)
from lmcache_async.transfer.plan import TransferPlan

__all__ = ["KVLayout"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape, element type and memory order of an engine's paged KV memory.

    ``num_kv_heads`` and ``head_size`` are what this tensor-parallel rank holds
    (``num_kv_heads`` is 1 and ``head_size`` is the latent size for MLA). Instances are
    immutable and hashable. Use the named constructors (:meth:`vllm_flash_attn`,
    :meth:`flashinfer`, :meth:`mla`, :meth:`vllm_cpu`) rather than the raw fields.

    Raises:
        InvalidInputError: a field is out of range or the combination is impossible; the
            message starts with the field's name.
    """

    kind: LayoutKind
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    hnd: bool = False
    tp_world_size: int = 1
    tp_rank: int = 0
    cpu_packing: CpuKVPacking | None = None
    """The vLLM CPU layout's packing (:attr:`CpuKVPacking.KEYS_TRANSPOSED` when not given);
    ``None`` for every other kind."""

    def __post_init__(self) -> None:
        kind: object = self.kind
        if not isinstance(kind, LayoutKind):
            try:
                object.__setattr__(self, "kind", LayoutKind(str(kind)))
            except ValueError:
                choices = ", ".join(k.value for k in LayoutKind)
                raise InvalidInputError(f"kind: expected one of {choices}, got {kind!r}") from None
        check_fields(self)
        packing = checked_cpu_packing(
            self.kind, self.cpu_packing, self.dtype, self.block_size, self.head_size
        )
        object.__setattr__(self, "cpu_packing", packing)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def vllm_flash_attn(
        cls,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        hnd: bool = False,
        tp_world_size: int = 1,
        tp_rank: int = 0,
    ) -> KVLayout:
        """vLLM flash-attention layout, per layer ``[2, num_blocks, block_size, H, D]``.

        With ``hnd`` the memory is ordered ``[2, num_blocks, H, block_size, D]``.
        """
        return cls(
            LayoutKind.VLLM_FLASH_ATTN,
            num_layers,
            block_size,
            num_kv_heads,
            head_size,
            dtype,
            hnd,
            tp_world_size,
            tp_rank,
        )

    @classmethod
    def flashinfer(
        cls,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        tp_world_size: int = 1,
        tp_rank: int = 0,
    ) -> KVLayout:
        """FlashInfer-style layout, per layer ``[num_blocks, 2, block_size, H, D]``."""
        return cls(
            LayoutKind.FLASHINFER,
            num_layers,
            block_size,
            num_kv_heads,
            head_size,
            dtype,
            False,
            tp_world_size,
            tp_rank,
        )

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        block_size: int,
        latent_dim: int,
        dtype: torch.dtype,
        tp_world_size: int = 1,
        tp_rank: int = 0,
    ) -> KVLayout:
        """Multi-head latent attention layout, per layer ``[num_blocks, block_size, latent]``."""
        return cls(
            LayoutKind.MLA,
            num_layers,
            block_size,
            1,
            latent_dim,
            dtype,
            False,
            tp_world_size,
            tp_rank,
        )

    @classmethod
    def vllm_cpu(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        block_size: int = DEFAULT_VLLM_CPU_BLOCK_SIZE,
        tp_world_size: int = 1,
        tp_rank: int = 0,
        packing: CpuKVPacking | str = CpuKVPacking.KEYS_TRANSPOSED,
    ) -> KVLayout:
        """vLLM CPU attention layout, per layer ``[num_blocks, H, block_size, 2 * D]``.

        ``packing`` says how vLLM packs each block and head; it depends on the attention
        kernel vLLM picks (:meth:`CpuKVPacking.for_vllm_isa`). The default is what vLLM
        writes on CPUs without AMX, for every dtype. With
        :attr:`CpuKVPacking.TOKEN_ROWS` it is also vLLM 0.32's GPU flash-attention layout.

        Raises:
            InvalidInputError: an unknown packing, or one the dtype or sizes do not fit.
        """
        return cls(
            LayoutKind.VLLM_CPU,
            num_layers,
            block_size,
            num_kv_heads,
            head_size,
            dtype,
            False,
            tp_world_size,
            tp_rank,
            as_cpu_packing(packing),
        )

    # ------------------------------------------------------------------ payload geometry

    @property
    def fmt(self) -> KVFormat:
        """The chunk payload format: ``KV_MLA`` for MLA, else ``KV_2LTD``."""
        return KVFormat.KV_MLA if self.kind is LayoutKind.MLA else KVFormat.KV_2LTD

    @property
    def width(self) -> int:
        """Elements per token per layer per K/V part: ``H * D`` (``latent_dim`` for MLA)."""
        return self.num_kv_heads * self.head_size

    @property
    def _parts(self) -> int:
        return 1 if self.kind is LayoutKind.MLA else 2

    @property
    def token_bytes(self) -> int:
        """Payload bytes per token, all layers, K and V together."""
        return self._parts * self.num_layers * self.width * self.dtype.itemsize

    @property
    def fingerprint(self) -> str:
        """Stable text naming everything that defines the payload bytes.

        Block size, NHD/HND, the vLLM CPU packing and the engine-side kind are left out on
        purpose: they change where tokens live in the engine, not the payload (always the
        logical, token-major K and V), so payloads stored through one are valid for the
        others.
        """
        return (
            f"fmt={self.fmt.value};dtype={dtype_name(self.dtype)};layers={self.num_layers};"
            f"heads={self.num_kv_heads};head_size={self.head_size};"
            f"tp={self.tp_rank}/{self.tp_world_size}"
        )

    def to_dict(self) -> dict[str, str | int | bool]:
        """Every field as plain data (kind and dtype by name), for a wire handshake or a
        file; :meth:`from_dict` rebuilds the layout."""
        return layout_dict(self)

    @classmethod
    def from_dict(cls, data: object) -> KVLayout:
        """The layout described by a :meth:`to_dict` mapping (``hnd``, ``tp_world_size``,
        ``tp_rank`` and ``cpu_packing`` may be left out).

        Raises:
            InvalidInputError: ``data`` is not a mapping, lacks a field, has an unknown
                key, names an unknown kind or dtype, or a value is out of range.
        """
        return cls(*layout_args(data))

    def payload_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the payload for ``num_tokens`` tokens: ``(2, L, T, H*D)`` or ``(1, L, T,
        latent)``.

        Raises:
            InvalidInputError: ``num_tokens`` is negative.
        """
        if not is_strict_int(num_tokens) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        return (self._parts, self.num_layers, num_tokens, self.width)

    def layer_payload_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of one layer's payload for ``num_tokens`` tokens (layerwise transfers):
        ``KV_T2D`` ``(T, 2, H*D)``, or ``(T, latent)`` for MLA.

        Raises:
            InvalidInputError: ``num_tokens`` is negative.
        """
        if not is_strict_int(num_tokens) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        if self.kind is LayoutKind.MLA:
            return (num_tokens, self.width)
        return (num_tokens, 2, self.width)

    # ------------------------------------------------------------------ engine memory

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The logical per-layer tensor shape a caller hands over for ``num_blocks`` blocks.

        Raises:
            InvalidInputError: ``num_blocks`` is not positive.
        """
        if not is_strict_int(num_blocks) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        bs, h, d = self.block_size, self.num_kv_heads, self.head_size
        if self.kind is LayoutKind.VLLM_FLASH_ATTN:
            return (2, num_blocks, bs, h, d)
        if self.kind is LayoutKind.FLASHINFER:
            return (num_blocks, 2, bs, h, d)
        if self.kind is LayoutKind.MLA:
            return (num_blocks, bs, d)
        return (num_blocks, h, bs, 2 * d)

    def allocate_kv_caches(
        self,
        num_blocks: int,
        *,
        device: str | torch.device = "cpu",
        generator: torch.Generator | None = None,
        random: bool = True,
    ) -> list[torch.Tensor]:
        """Allocate ``num_layers`` tensors in this layout (HND with its permuted strides).

        Filled from a standard normal distribution when ``random`` (drawn from
        ``generator``, which must live on ``device``), else with zeros. Meant for tests,
        benchmarks and examples.

        Raises:
            InvalidInputError: ``num_blocks`` is not positive.
        """
        return allocate_layers(self, num_blocks, device, generator, random)

    def check_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> int:
        """Validate the engine's per-layer KV tensors against this layout.

        Checks the number of layers, each layer's shape, dtype and memory order (NHD and
        the other kinds contiguous, HND with strides of memory ``[2, nb, H, bs, D]``) and
        that all layers share one device. Call it once when caches are registered;
        :meth:`gather` and :meth:`scatter` repeat only the cheap per-layer checks (shape,
        dtype, memory order).

        Returns:
            The number of blocks per layer.

        Raises:
            InvalidInputError: naming the layer and what is wrong with it.
        """
        return check_kv_caches(self, kv_caches)

    def check_slot_mapping(
        self,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        num_blocks: int,
        *,
        device: str | torch.device | None = None,
    ) -> torch.Tensor:
        """Validate a slot mapping and return it as int64.

        ``slot_mapping`` must be a 1-D integer tensor of exactly ``num_tokens`` entries,
        each ``< num_blocks * block_size``; negative entries mean "skip this token". The
        range check runs where the tensor is, so checking a CPU mapping costs no device
        synchronisation. The result is on ``device`` when given (normally the kv caches'
        device), else on the mapping's own device; :meth:`gather` and :meth:`scatter` also
        accept a CPU mapping for device caches and move it themselves.

        Raises:
            InvalidInputError: wrong type, rank, dtype, length, or a slot out of range.
        """
        return check_slot_mapping(self.block_size, slot_mapping, num_tokens, num_blocks, device)

    # ------------------------------------------------------------------ transfers

    def plan(
        self,
        kv_caches: Sequence[torch.Tensor],
        slots: torch.Tensor,
        *,
        slots_cpu: torch.Tensor | None = None,
        row_views: list[torch.Tensor] | None = None,
    ) -> TransferPlan:
        """Prepare the transfers of one request: row views and row indices computed once.

        ``slots`` must have passed :meth:`check_slot_mapping` for these caches (int64, in
        range); negative slots are allowed and are skipped by :meth:`TransferPlan.scatter`.
        ``slots_cpu`` is the same mapping on the CPU when ``slots`` lives on a device (it
        spares a host synchronisation). ``row_views``: these caches' row views, as
        :class:`KVCacheViews` keeps them (made here when None). Per-chunk gathers and
        scatters then only slice.

        Raises:
            InvalidInputError: a layer does not match this layout.
        """
        return plan_transfers(self, kv_caches, slots, slots_cpu, row_views)

    def gather(
        self, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Copy the tokens at ``slots`` out of engine memory into the payload ``out``.

        Args:
            kv_caches: the layer tensors, as accepted by :meth:`check_kv_caches`.
            slots: 1-D integer tensor, one slot per token, all ``>= 0``. May be on the CPU
                for device caches (checked there, then moved); a device tensor costs one
                host synchronisation for the range check.
            out: contiguous ``payload_shape(len(slots))`` tensor of ``dtype``. It may live
                on another device than the caches: the tokens are gathered into a staging
                tensor on the caches' device and copied with ``non_blocking=True``, so a
                pinned CPU ``out`` is complete only once the current stream is.

        Raises:
            InvalidInputError: a negative or out-of-range slot, or a malformed ``out``,
                ``slots`` or cache list.
        """
        gather_tokens(self, kv_caches, slots, out)

    def scatter(
        self, payload: torch.Tensor, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor
    ) -> None:
        """Write the payload's tokens into engine memory at ``slots``.

        Tokens whose slot is negative are skipped: nothing is written for them. Slots must
        be distinct (two tokens written to one slot leave either value).

        Args:
            payload: ``payload_shape(len(slots))`` tensor of ``dtype``, on any device; one
                on another device than the caches is copied over with
                ``non_blocking=True``, so the caller keeps it unchanged until the current
                stream has finished.
            kv_caches: the layer tensors, as accepted by :meth:`check_kv_caches`.
            slots: 1-D integer tensor, one slot per payload token. May be on the CPU for
                device caches; a device tensor costs one host synchronisation.

        Raises:
            InvalidInputError: an out-of-range slot, or a malformed payload, ``slots`` or
                cache list.
        """
        scatter_tokens(self, payload, kv_caches, slots)
