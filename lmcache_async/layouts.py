"""KV-cache memory layouts: how a serving engine's paged KV memory is shaped, and how chunks
move between it and a contiguous chunk payload.

A serving engine keeps, per attention layer, one tensor of fixed-size blocks. A token's
place in it is its *slot*, ``block_id * block_size + offset_in_block``; a negative slot
means "no place, skip this token". :class:`KVLayout` knows the engine's shape and memory
order and moves the tokens named by a slot mapping to and from a chunk payload:

* ``KV_2LTD`` payload ``[2, num_layers, tokens, num_kv_heads * head_size]`` (K = 0, V = 1);
* ``KV_MLA`` payload ``[1, num_layers, tokens, latent_dim]``.

Every transfer is one vectorised ``index_select`` / ``index_copy_`` per layer and payload
part on a *row view* of the layer (a view of the layer's own memory, no copy). The row
indices of K and V for all tokens are computed once per request from the slots, then reused
for every layer. For most layouts a row is a run of contiguous elements (``H * D``, or
``D`` of one head). vLLM's CPU attention packs each block and head in its own order
(:class:`CpuKVPacking`: keys transposed, or AMX tiles); there a "row" is one token's values
seen through a strided view of the flat layer whose first dimension steps one element, so
the row index of a token is the element offset where its values start.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.tokens import is_strict_int
from lmcache_async.transfer import PlanPart, TransferPlan

__all__ = [
    "DEFAULT_VLLM_CPU_BLOCK_SIZE",
    "SUPPORTED_DTYPES",
    "CpuKVPacking",
    "KVCacheViews",
    "KVFormat",
    "KVLayout",
    "LayoutKind",
    "TransferPlan",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""Element types a KV cache may have."""

DEFAULT_VLLM_CPU_BLOCK_SIZE = 128
"""Block size vLLM's CPU attention backend uses unless told otherwise."""


class KVFormat(enum.StrEnum):
    """Shape of a chunk payload, the bytes that leave and re-enter the engine."""

    KV_2LTD = "KV_2LTD"
    """``[2, num_layers, tokens, num_kv_heads * head_size]``; index 0 is K, 1 is V."""
    KV_T2D = "KV_T2D"
    """Reserved for layerwise payloads, per layer ``[tokens, 2, heads * head_size]``."""
    KV_MLA = "KV_MLA"
    """``[1, num_layers, tokens, latent_dim]``."""


class LayoutKind(enum.StrEnum):
    """Which engine-side memory layout a :class:`KVLayout` describes."""

    VLLM_FLASH_ATTN = "vllm_flash_attn"
    """Per layer ``[2, num_blocks, block_size, H, D]``; NHD is contiguous, HND has the same
    logical shape with memory ordered ``[2, num_blocks, H, block_size, D]``."""
    FLASHINFER = "flashinfer"
    """Per layer ``[num_blocks, 2, block_size, H, D]``, contiguous."""
    MLA = "mla"
    """Per layer ``[num_blocks, block_size, latent_dim]``, contiguous."""
    VLLM_CPU = "vllm_cpu"
    """vLLM's CPU attention backend: per layer ``[num_blocks, H, block_size, 2 * D]``,
    contiguous. Each block and head holds ``block_size * D`` key elements, then as many
    value elements, each region packed as its :class:`CpuKVPacking` says."""


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_AMX_KEY_TOKENS = 16
"""AMX key packing: tokens per group (a 64-byte tile row holds 16 four-byte words)."""
_AMX_VALUE_DIMS = 16
"""AMX value packing: head dimensions per group."""
_AMX_PAIR = 2
"""AMX packing: bf16 elements per four-byte word (two dims of a key, two tokens of a value)."""
_AMX_ALIGNMENT = 32
"""AMX packing: block size and head size must be multiples of this (vLLM's kernel checks)."""

_VLLM_TRANSPOSED_KEY_ISAS = frozenset({"vec", "vec16", "vxe", "vsx", "rvv"})
"""vLLM CPU attention kernels that write keys transposed and values as rows, every dtype."""


class CpuKVPacking(enum.StrEnum):
    """How vLLM's CPU attention packs one block and head of the KV cache.

    vLLM writes the cache with ``cpu_attn_reshape_and_cache`` in the order its attention
    kernel (the "ISA" it picks for the dtype, block size and CPU) reads fastest. Per
    block ``b`` and head ``h`` the layer holds a key region of ``block_size * D`` elements
    followed by a value region of the same size; the packings differ in where token ``t``,
    dimension ``d`` sits inside each region.
    """

    KEYS_TRANSPOSED = "keys_transposed"
    """Keys ``[D, block_size]`` (``d * block_size + t``), values ``[block_size, D]``
    (``t * D + d``). vLLM's ``vec``, ``vec16``, ``vxe``, ``vsx`` and ``rvv`` kernels, and
    ``neon`` for fp32 and fp16: every dtype on x86 CPUs without AMX."""
    TOKEN_ROWS = "token_rows"
    """Each token one row of ``2 * D``, its keys then its values: per block and head
    ``[block_size, 2 * D]`` (``t * 2D + d``, values at ``+ D``). Not a CPU kernel's packing:
    vLLM 0.32's GPU flash-attention backend keeps its cache ``[num_blocks, H, block_size,
    2 * D]`` this way (it reads ``kv_cache.transpose(1, 2).split(D, -1)``)."""
    AMX = "amx"
    """bf16 on CPUs with AMX: keys ``[block_size / 16, D / 2, 16, 2]`` (groups of 16 tokens,
    pairs of dimensions), values ``[D / 16, block_size / 2, 16, 2]`` (groups of 16
    dimensions, pairs of tokens). Block size and head size must be multiples of 32."""

    @classmethod
    def for_vllm_isa(cls, isa: str, dtype: torch.dtype) -> CpuKVPacking:
        """The packing vLLM's CPU attention kernel ``isa`` writes for ``dtype``.

        Raises:
            InvalidInputError: an ISA (or ISA and dtype) whose packing is not described
                here, such as ``neon`` with bf16 (vLLM's BFMMLA kernels pack their own way).
        """
        name = str(isa).lower()
        if name in _VLLM_TRANSPOSED_KEY_ISAS:
            return cls.KEYS_TRANSPOSED
        if name == "neon" and dtype in (torch.float32, torch.float16):
            return cls.KEYS_TRANSPOSED
        if name == "amx" and dtype == torch.bfloat16:
            return cls.AMX
        known = ", ".join(sorted({*_VLLM_TRANSPOSED_KEY_ISAS, "neon (fp32, fp16)", "amx (bf16)"}))
        raise InvalidInputError(
            f"isa: vLLM's CPU attention kernel {isa!r} with {_dtype_name(dtype)} packs the KV "
            f"cache in a way lmcache_async does not describe; supported: {known}"
        )


def _cpu_packing(value: object) -> CpuKVPacking:
    if isinstance(value, CpuKVPacking):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return CpuKVPacking(value)
    choices = ", ".join(p.value for p in CpuKVPacking)
    raise InvalidInputError(f"cpu_packing: expected one of {choices}, got {value!r:.40}")


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
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size", "tp_world_size"):
            value = getattr(self, name)
            if not is_strict_int(value) or value <= 0:
                raise InvalidInputError(f"{name}: expected a positive int, got {value!r}")
        if not is_strict_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_world_size:
            raise InvalidInputError(
                f"tp_rank: expected an int in [0, {self.tp_world_size}), got {self.tp_rank!r}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
            raise InvalidInputError(f"dtype: expected one of {names}, got {self.dtype!r}")
        hnd: object = self.hnd
        if not isinstance(hnd, bool):
            raise InvalidInputError(f"hnd: expected a bool, got {hnd!r}")
        if self.hnd and self.kind is not LayoutKind.VLLM_FLASH_ATTN:
            raise InvalidInputError(
                f"hnd: only meaningful for {LayoutKind.VLLM_FLASH_ATTN.value}, "
                f"not {self.kind.value}"
            )
        if self.kind is LayoutKind.MLA and self.num_kv_heads != 1:
            raise InvalidInputError(
                f"num_kv_heads: must be 1 for the mla layout, got {self.num_kv_heads}"
            )
        self._check_cpu_packing()

    def _check_cpu_packing(self) -> None:
        packing: object = self.cpu_packing
        if self.kind is not LayoutKind.VLLM_CPU:
            if packing is not None:
                raise InvalidInputError(
                    f"cpu_packing: only meaningful for {LayoutKind.VLLM_CPU.value}, "
                    f"not {self.kind.value}"
                )
            return
        packing = CpuKVPacking.KEYS_TRANSPOSED if packing is None else _cpu_packing(packing)
        object.__setattr__(self, "cpu_packing", packing)
        if packing is CpuKVPacking.AMX:
            if self.dtype != torch.bfloat16:
                raise InvalidInputError(
                    f"cpu_packing: the amx packing holds bfloat16, got {_dtype_name(self.dtype)}"
                )
            for name in ("block_size", "head_size"):
                if getattr(self, name) % _AMX_ALIGNMENT:
                    raise InvalidInputError(
                        f"{name}: the amx packing needs a multiple of {_AMX_ALIGNMENT}, "
                        f"got {getattr(self, name)}"
                    )

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
            _cpu_packing(packing),
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
            f"fmt={self.fmt.value};dtype={_dtype_name(self.dtype)};layers={self.num_layers};"
            f"heads={self.num_kv_heads};head_size={self.head_size};"
            f"tp={self.tp_rank}/{self.tp_world_size}"
        )

    def to_dict(self) -> dict[str, str | int | bool]:
        """Every field as plain data (kind and dtype by name), for a wire handshake or a
        file; :meth:`from_dict` rebuilds the layout."""
        return {
            "kind": self.kind.value,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": _dtype_name(self.dtype),
            "hnd": self.hnd,
            "tp_world_size": self.tp_world_size,
            "tp_rank": self.tp_rank,
            **({} if self.cpu_packing is None else {"cpu_packing": self.cpu_packing.value}),
        }

    @classmethod
    def from_dict(cls, data: object) -> KVLayout:
        """The layout described by a :meth:`to_dict` mapping (``hnd``, ``tp_world_size``,
        ``tp_rank`` and ``cpu_packing`` may be left out).

        Raises:
            InvalidInputError: ``data`` is not a mapping, lacks a field, has an unknown
                key, names an unknown kind or dtype, or a value is out of range.
        """
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"layout: expected a mapping, got {type(data).__name__}")
        required = ("kind", "num_layers", "block_size", "num_kv_heads", "head_size", "dtype")
        known = (*required, "hnd", "tp_world_size", "tp_rank", "cpu_packing")
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise InvalidInputError(f"layout: unknown keys {unknown}; expected {list(known)}")
        missing = [key for key in required if key not in data]
        if missing:
            raise InvalidInputError(f"layout: missing keys {missing}")
        dtypes = {_dtype_name(dtype): dtype for dtype in SUPPORTED_DTYPES}
        dtype = dtypes.get(data["dtype"]) if isinstance(data["dtype"], str) else None
        if dtype is None:
            raise InvalidInputError(
                f"dtype: expected one of {', '.join(dtypes)}, got {data['dtype']!r:.40}"
            )
        return cls(
            data["kind"],
            data["num_layers"],
            data["block_size"],
            data["num_kv_heads"],
            data["head_size"],
            dtype,
            data.get("hnd", False),
            data.get("tp_world_size", 1),
            data.get("tp_rank", 0),
            data.get("cpu_packing"),
        )

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
        shape = self.kv_cache_shape(num_blocks)
        if self.hnd:
            # Memory ordered [2, nb, H, bs, D]; the caller sees [2, nb, bs, H, D].
            shape = (shape[0], shape[1], shape[3], shape[2], shape[4])
        layers: list[torch.Tensor] = []
        for _ in range(self.num_layers):
            if random:
                t = torch.randn(shape, generator=generator, dtype=self.dtype, device=device)
            else:
                t = torch.zeros(shape, dtype=self.dtype, device=device)
            layers.append(t.transpose(2, 3) if self.hnd else t)
        return layers

    def _num_blocks_of(self, layer: torch.Tensor) -> int:
        return int(layer.shape[1] if self.kind is LayoutKind.VLLM_FLASH_ATTN else layer.shape[0])

    def _has_memory_order(self, layer: torch.Tensor) -> bool:
        if self.hnd:
            return layer.transpose(2, 3).is_contiguous()
        return layer.is_contiguous()

    def _memory_order_text(self) -> str:
        if self.hnd:
            return "[2, num_blocks, num_kv_heads, block_size, head_size] (HND)"
        if self.kind is LayoutKind.VLLM_CPU:
            return "contiguous [num_blocks, num_kv_heads, block_size, 2 * head_size]"
        return "contiguous"

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
        given: object = kv_caches
        if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
            raise InvalidInputError(
                f"kv_caches: expected a sequence of {self.num_layers} layer tensors, "
                f"got {type(given).__name__}"
            )
        if len(kv_caches) != self.num_layers:
            raise InvalidInputError(
                f"kv_caches: expected {self.num_layers} layer tensors, got {len(kv_caches)}"
            )
        expected_ndim = len(self.kv_cache_shape(1))
        first = kv_caches[0]
        if not isinstance(first, torch.Tensor) or first.ndim != expected_ndim:
            raise InvalidInputError(
                f"kv_caches[0]: expected a {expected_ndim}-D tensor, "
                f"got {_describe(first)} for the {self.kind.value} layout"
            )
        num_blocks = self._num_blocks_of(first)
        if num_blocks <= 0:
            raise InvalidInputError("kv_caches[0]: has no blocks (num_blocks is 0)")
        shape = torch.Size(self.kv_cache_shape(num_blocks))
        device = first.device
        for i, layer in enumerate(kv_caches):
            if not isinstance(layer, torch.Tensor):
                raise InvalidInputError(
                    f"kv_caches[{i}]: expected a tensor, got {_describe(layer)}"
                )
            if layer.shape != shape:
                raise InvalidInputError(
                    f"kv_caches[{i}]: expected shape {tuple(shape)}, got {tuple(layer.shape)}"
                )
            if layer.dtype != self.dtype:
                raise InvalidInputError(
                    f"kv_caches[{i}]: expected dtype {_dtype_name(self.dtype)}, "
                    f"got {_dtype_name(layer.dtype)}"
                )
            if layer.device != device:
                raise InvalidInputError(
                    f"kv_caches[{i}]: on device {layer.device}, but kv_caches[0] is on {device}"
                )
            if not self._has_memory_order(layer):
                raise InvalidInputError(
                    f"kv_caches[{i}]: expected memory ordered {self._memory_order_text()}, "
                    f"got strides {layer.stride()}"
                )
        return num_blocks

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
        if not is_strict_int(num_tokens) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        if not is_strict_int(num_blocks) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        slots = self._check_slots_tensor(slot_mapping)
        if slots.shape[0] != num_tokens:
            raise InvalidInputError(
                f"slot_mapping: expected {num_tokens} entries, got {slots.shape[0]}"
            )
        self._slot_range(slots, num_blocks * self.block_size)
        return slots.to(device=slots.device if device is None else device, dtype=torch.int64)

    @staticmethod
    def _check_slots_tensor(slot_mapping: object) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor):
            raise InvalidInputError(
                f"slot_mapping: expected a tensor, got {type(slot_mapping).__name__}"
            )
        if slot_mapping.ndim != 1:
            raise InvalidInputError(
                f"slot_mapping: expected a 1-D tensor, got shape {tuple(slot_mapping.shape)}"
            )
        if not _is_integer_dtype(slot_mapping.dtype):
            raise InvalidInputError(
                f"slot_mapping: expected an integer dtype, got {_dtype_name(slot_mapping.dtype)}"
            )
        return slot_mapping

    @staticmethod
    def _slot_range(slots: torch.Tensor, num_slots: int) -> int:
        """Check every slot is ``< num_slots`` and return the smallest (0 when empty).

        One reduction: a host synchronisation when ``slots`` lives on an accelerator.
        """
        if slots.numel() == 0:
            return 0
        low, high = (int(v) for v in torch.aminmax(slots))
        if high >= num_slots:
            raise InvalidInputError(
                f"slot_mapping: slot {high} out of range, the caches hold {num_slots} slots"
            )
        return low

    # ------------------------------------------------------------------ transfers

    def _row_views(self, kv_caches: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
        """Each layer as a 2-D ``[rows, row_width]`` view of its own memory (no copy).

        Every layer gets a cheap shape, dtype and memory-order check, so a bad layer fails
        here with a clear error rather than as an out-of-range index on the device.

        Raises:
            InvalidInputError: a layer does not match this layout.
        """
        shape = torch.Size(self.kv_cache_shape(num_blocks))
        dtype = self.dtype
        views: list[torch.Tensor] = []
        if self.hnd:
            bs, h, d = self.block_size, self.num_kv_heads, self.head_size
            rows_shape = (2 * num_blocks * h * bs, d)
            # Strides of memory [2, nb, H, bs, D] seen as [2, nb, bs, H, D].
            strides = (num_blocks * h * bs * d, h * bs * d, d, bs * d, 1)
            for layer in kv_caches:
                if layer.shape != shape or layer.dtype != dtype:
                    self.check_kv_caches(kv_caches)
                if layer.stride() == strides:
                    # as_strided skips the transpose and is bounds-checked against storage.
                    views.append(layer.as_strided(rows_shape, (d, 1)))
                    continue
                memory = layer.transpose(2, 3)
                if not memory.is_contiguous():
                    self.check_kv_caches(kv_caches)
                views.append(memory.view(rows_shape))
            return views
        for layer in kv_caches:
            if layer.shape != shape or layer.dtype != dtype or not layer.is_contiguous():
                self.check_kv_caches(kv_caches)
            views.append(layer.view(-1, self.width))
        return views

    def _rows(self, slots: torch.Tensor, num_blocks: int) -> tuple[list[torch.Tensor], int]:
        """Row indices into the row views for each payload part (K, V or the MLA latent).

        ``slots`` is int64 with no negative entries. Returns the index tensors and the row
        width; for HND a token spans ``num_kv_heads`` rows of ``head_size``, listed
        token-major so they line up with a payload part viewed as rows. (vLLM CPU: see
        :meth:`_cpu_parts`.)
        """
        bs = self.block_size
        kind = self.kind
        if kind is LayoutKind.MLA:
            return [slots], self.width
        if kind is LayoutKind.VLLM_FLASH_ATTN and not self.hnd:
            return [slots, slots + num_blocks * bs], self.width
        blocks = torch.div(slots, bs, rounding_mode="floor")
        if kind is LayoutKind.FLASHINFER:
            # [nb, 2, bs] rows: block b's K rows start at 2*b*bs, its V rows bs later.
            rows_k = slots + blocks * bs
            return [rows_k, rows_k + bs], self.width
        # HND: [2, nb, H, bs] rows of head_size.
        h = self.num_kv_heads
        base = slots + blocks * (h * bs - bs)
        heads = torch.arange(0, h * bs, bs, device=slots.device)
        rows_k = (base.unsqueeze(1) + heads).view(-1)
        return [rows_k, rows_k + num_blocks * h * bs], self.head_size

    def _cpu_parts(
        self, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, num_blocks: int
    ) -> list[PlanPart]:
        """K and V of vLLM's CPU layout as one row per token of strided views of each layer.

        Per block and head a layer holds ``block_size * D`` key elements, then as many
        value elements, packed as :attr:`cpu_packing` says. All of a token's K (or V)
        values sit at fixed strides from the element where its head-0 values start, so a
        view of the flat layer sized ``[rows, H, *dims]`` with strides ``[1, head_stride,
        *dim_strides]`` holds the token's values, in payload order, as row ``start``. The
        rows overlap; a transfer touches only the rows of distinct slots, whose elements
        are distinct.

        Raises:
            InvalidInputError: a layer does not match this layout.
        """
        shape = torch.Size(self.kv_cache_shape(num_blocks))
        flats: list[torch.Tensor] = []
        for layer in kv_caches:
            if layer.shape != shape or layer.dtype != self.dtype or not layer.is_contiguous():
                self.check_kv_caches(kv_caches)
            flats.append(layer.view(-1))
        bs, h, d = self.block_size, self.num_kv_heads, self.head_size
        region = bs * d  # one head's keys (or values) in one block
        head_stride = 2 * region
        blocks = torch.div(slots, bs, rounding_mode="floor")
        offsets = slots - blocks * bs
        keys = blocks * (h * head_stride)
        values = keys + region
        specs: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]
        if self.cpu_packing is CpuKVPacking.AMX:
            # Keys [bs/16, D/2, 16, 2]: token t in group t // 16, at word t % 16 of each
            # group row; a row holds one pair of dimensions of 16 tokens.
            tokens, pair = _AMX_KEY_TOKENS, _AMX_PAIR
            group = torch.div(offsets, tokens, rounding_mode="floor")
            keys = keys + group * (tokens * d) + (offsets - group * tokens) * pair
            # Values [D/16, bs/2, 16, 2]: a pair of tokens per 16 dimensions of a group.
            dims = _AMX_VALUE_DIMS
            pairs = torch.div(offsets, pair, rounding_mode="floor")
            values = values + pairs * (dims * pair) + (offsets - pairs * pair)
            specs = [
                (keys, (h, d // pair, pair), (head_stride, tokens * pair, 1)),
                (values, (h, d // dims, dims), (head_stride, dims * bs, pair)),
            ]
        elif self.cpu_packing is CpuKVPacking.TOKEN_ROWS:
            # [bs, 2D]: a token's row holds its keys, then its values.
            rows = keys + offsets * (2 * d)
            specs = [(rows, (h, d), (head_stride, 1)), (rows + d, (h, d), (head_stride, 1))]
        else:
            # Keys [D, bs] (a token is a column), values [bs, D] (a token is a row).
            specs = [
                (keys + offsets, (h, d), (head_stride, bs)),
                (values + offsets * d, (h, d), (head_stride, 1)),
            ]
        numel = num_blocks * h * head_stride
        parts: list[PlanPart] = []
        for index, dims_shape, strides in specs:
            extent = sum((n - 1) * stride for n, stride in zip(dims_shape, strides, strict=True))
            size, stride = (numel - extent, *dims_shape), (1, *strides)
            parts.append(PlanPart([f.as_strided(size, stride) for f in flats], index, dims_shape))
        return parts

    def _check_payload(self, name: str, payload: object, num_tokens: int) -> torch.Tensor:
        if not isinstance(payload, torch.Tensor):
            raise InvalidInputError(f"{name}: expected a tensor, got {type(payload).__name__}")
        expected = self.payload_shape(num_tokens)
        if tuple(payload.shape) != expected:
            raise InvalidInputError(
                f"{name}: expected shape {expected} for {num_tokens} slots, "
                f"got {tuple(payload.shape)}"
            )
        if payload.dtype != self.dtype:
            raise InvalidInputError(
                f"{name}: expected dtype {_dtype_name(self.dtype)}, "
                f"got {_dtype_name(payload.dtype)}"
            )
        return payload

    def _cache_geometry(self, kv_caches: Sequence[torch.Tensor]) -> tuple[int, torch.device]:
        if len(kv_caches) != self.num_layers:
            raise InvalidInputError(
                f"kv_caches: expected {self.num_layers} layer tensors, got {len(kv_caches)}"
            )
        first = kv_caches[0]
        if not isinstance(first, torch.Tensor) or first.ndim != len(self.kv_cache_shape(1)):
            self.check_kv_caches(kv_caches)  # raises, naming what is wrong
        return self._num_blocks_of(first), first.device

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
        num_blocks, device = self._cache_geometry(kv_caches)
        host = slots if slots_cpu is None else slots_cpu
        negative: list[int] = []
        if host.numel() and int(host.min()) < 0:
            negative = torch.nonzero(host < 0).view(-1).tolist()
        slots = slots.to(device=device, dtype=torch.int64, non_blocking=True)
        if negative:
            slots = slots.clamp(min=0)  # keeps the row arithmetic in range; never copied
        parts: list[PlanPart]
        if self.kind is LayoutKind.VLLM_CPU:
            parts = self._cpu_parts(kv_caches, slots, num_blocks)
        else:
            rows, width = self._rows(slots, num_blocks)
            views = row_views if row_views is not None else self._row_views(kv_caches, num_blocks)
            parts = [PlanPart(views, index, (width,)) for index in rows]
        return TransferPlan(
            self,
            parts=parts,
            rows_per_token=parts[0].index.shape[0] // max(int(slots.shape[0]), 1),
            negative=negative,
            device=device,
        )

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
        num_blocks, _ = self._cache_geometry(kv_caches)
        slots = self._check_slots_tensor(slots)
        num_tokens = int(slots.shape[0])
        out = self._check_payload("out", out, num_tokens)
        if not out.is_contiguous():
            raise InvalidInputError("out: must be contiguous")
        low = self._slot_range(slots, num_blocks * self.block_size)
        if low < 0:
            raise InvalidInputError(
                f"slots: gather needs every slot >= 0, got {low}; drop skipped tokens first"
            )
        if num_tokens:
            self.plan(kv_caches, slots).gather(0, num_tokens, out)

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
        num_blocks, _ = self._cache_geometry(kv_caches)
        slots = self._check_slots_tensor(slots)
        num_tokens = int(slots.shape[0])
        payload = self._check_payload("payload", payload, num_tokens)
        self._slot_range(slots, num_blocks * self.block_size)
        if num_tokens:
            self.plan(kv_caches, slots).scatter(payload, 0, num_tokens)


_LayerSignature = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def _signature(layer: torch.Tensor) -> _LayerSignature:
    """What a layer's row view depends on: memory address, shape, strides, dtype, device."""
    return (layer.data_ptr(), layer.shape, layer.stride(), layer.dtype, layer.device)


class KVCacheViews:
    """The checked KV caches of the last request, with their row views, for the next one.

    A serving engine passes the same per-layer tensors with every request, and checking
    each layer and viewing it as rows costs microseconds a layer, every request. A request
    over the very same tensor objects, each with the memory address, shape, strides, dtype
    and device it had when checked, reuses the check and the views; anything else is
    checked and viewed anew. Only weak references to the tensors are kept, and the views
    are dropped as soon as one of them is collected: this never keeps the serving
    engine's memory alive. For one event loop (or one thread) at a time.
    """

    __slots__ = ("__weakref__", "_layers", "_layout", "_num_blocks", "_signatures", "_views")

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self._layers: list[weakref.ref[torch.Tensor]] = []
        self._signatures: list[_LayerSignature] = []
        self._num_blocks = 0
        self._views: list[torch.Tensor] | None = None

    def check(self, kv_caches: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor] | None]:
        """:meth:`KVLayout.check_kv_caches`, and the caches' row views for
        :meth:`KVLayout.plan` (None for the vLLM CPU layout, whose plan makes its own).

        Raises:
            InvalidInputError: as :meth:`KVLayout.check_kv_caches`.
        """
        layers = self._layers
        given: object = kv_caches
        if (
            layers
            and isinstance(given, (list, tuple))
            and len(kv_caches) == len(layers)
            and all(ref() is layer for ref, layer in zip(layers, kv_caches, strict=True))
            and list(map(_signature, kv_caches)) == self._signatures
        ):
            return self._num_blocks, self._views
        self.forget()
        layout = self._layout
        num_blocks = layout.check_kv_caches(kv_caches)
        views = None
        if layout.kind is not LayoutKind.VLLM_CPU:
            # Detached, a view no longer refers to the tensor it was made from (only to
            # its memory), so the weak references below can see the tensors go.
            views = [view.detach() for view in layout._row_views(kv_caches, num_blocks)]
        forget = weakref.WeakMethod(self.forget)

        def on_collected(_: weakref.ref[torch.Tensor]) -> None:
            method = forget()
            if method is not None:
                method()

        self._layers = [weakref.ref(layer, on_collected) for layer in kv_caches]
        self._signatures = list(map(_signature, kv_caches))
        self._num_blocks = num_blocks
        self._views = views
        return num_blocks, views

    def plan(
        self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, num_tokens: int
    ) -> tuple[TransferPlan, torch.Tensor]:
        """One request's transfer plan over ``kv_caches`` (checked as :meth:`check` does)
        and its slot mapping on the CPU.

        Raises:
            InvalidInputError: ``kv_caches`` is not a list of tensors of this layout, or the
                slot mapping is not a 1-D int64 tensor of ``num_tokens`` slots in range.
        """
        given: object = kv_caches  # checked at run time: callers are not type-checked
        if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
            raise InvalidInputError("kv_caches must be a list of per-layer tensors")
        if not isinstance(slot_mapping, torch.Tensor):
            raise InvalidInputError("slot_mapping must be a 1-D integer tensor")
        num_blocks, row_views = self.check(kv_caches)
        layout = self._layout
        slots = layout.check_slot_mapping(slot_mapping, num_tokens, num_blocks)
        slots_cpu = slots if slots.device.type == "cpu" else slots.cpu()
        plan = layout.plan(kv_caches, slots, slots_cpu=slots_cpu, row_views=row_views)
        return plan, slots_cpu

    @property
    def remembered(self) -> bool:
        """Whether caches (and their views) are remembered for the next :meth:`check`."""
        return bool(self._layers)

    def forget(self) -> None:
        """Drop what is remembered (the next :meth:`check` checks in full)."""
        self._layers = []
        self._signatures = []
        self._views = None


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.ndim}-D tensor of shape {tuple(value.shape)}"
    return type(value).__name__
