"""What the GPU benchmark measures: sizes, model shape, device and targets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Final

import torch

from lmcache_async import InvalidInputError, KVLayout
from lmcache_async.bench import parse_dtype

__all__ = ["CPU_NOTE", "DEVICES", "TARGETS", "WARMUP", "GpuOptions"]

TARGETS: Final[Mapping[str, float]] = {"copy_ratio": 0.9, "hidden_fraction": 0.7}
"""On a GPU: store and retrieve at least 0.9x the plain pinned copy of the same bytes, and a
layerwise retrieve that hides at least 70% of its transfer time behind the compute."""

DEVICES: Final = ("auto", "cuda", "cpu")
"""Accepted device names (``cuda:N`` is accepted too); ``auto`` is CUDA when available."""

CPU_NOTE: Final = (
    "no CUDA device: these are CPU figures of the benchmark's CPU path; "
    "CUDA D2H/H2D and overlap figures need a GPU, and the targets apply only to them"
)

WARMUP: Final = 1


@dataclass(frozen=True, slots=True)
class GpuOptions:
    """Sizes, model shape and device of the GPU benchmark (defaults: a Llama-3-8B-like
    model, 32 layers x 8 KV heads x 128, bf16, 128 KiB of KV per token)."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve."""
    repeat: int = 5
    """Measured runs of each figure (after one warm-up run)."""
    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cuda``, ``cuda:N`` or ``cpu``."""
    compute_ratio: float = 1.0
    """Simulated compute per layer, as a multiple of one layer's transfer time."""

    def validate(self) -> None:
        """Check the options (but not whether the device exists: see :meth:`torch_device`).

        Raises:
            InvalidInputError: a count or size is not positive, the dtype or the device name
                is unknown.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype", "device"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        parse_dtype(self.dtype)
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            allowed = ", ".join((*DEVICES, "cuda:N"))
            raise InvalidInputError(f"unknown device {self.device!r}; expected one of {allowed}")

    def torch_device(self) -> torch.device:
        """The device the KV caches live on.

        Raises:
            InvalidInputError: CUDA was asked for and is not available, or the name is bad.
        """
        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"device {self.device!r}: no CUDA device (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda})"
            )
        try:
            device = torch.device(self.device if self.device != "auto" else "cuda")
        except RuntimeError as exc:
            raise InvalidInputError(f"device {self.device!r}: {exc}") from None
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidInputError(
                f"device {self.device!r}: only {torch.cuda.device_count()} CUDA devices"
            )
        return torch.device("cuda", index)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the benchmark."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )
