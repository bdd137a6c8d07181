"""Whether host memory is registered with CUDA (page-locked), as the CUDA runtime itself
says: ``cudaPointerGetAttributes`` on the address, called through ctypes on the libcudart
that torch loaded.

``Tensor.is_pinned()`` cannot say: under torch 2.11 it answers False for memory torch's own
allocator did not pin, such as the pool's arena registered with ``cudaHostRegister``. And
``torch.cuda.cudart()`` binds ``cudaHostRegister`` and ``cudaHostUnregister`` but not
``cudaPointerGetAttributes``.

What the runtime reports (CUDA 11 and later): registered or CUDA-allocated host memory has
type ``cudaMemoryTypeHost`` and a device pointer through which the GPU reaches it; ordinary
pageable memory is reported, with success, as ``cudaMemoryTypeUnregistered``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "CUDA_MEMORY_TYPE_DEVICE",
    "CUDA_MEMORY_TYPE_HOST",
    "CUDA_MEMORY_TYPE_MANAGED",
    "CUDA_MEMORY_TYPE_UNREGISTERED",
    "ATTRIBUTES_SIZE",
    "PointerAttributes",
    "cudart_paths",
    "find_cudart",
    "is_host_registered",
    "load_cudart",
    "pointer_attributes",
]

# enum cudaMemoryType
CUDA_MEMORY_TYPE_UNREGISTERED = 0
CUDA_MEMORY_TYPE_HOST = 1
CUDA_MEMORY_TYPE_DEVICE = 2
CUDA_MEMORY_TYPE_MANAGED = 3

_CUDA_SUCCESS = 0


class _CudaPointerAttributes(ctypes.Structure):
    """``struct cudaPointerAttributes``: ``type``, ``device``, ``devicePointer`` and
    ``hostPointer`` at offsets 0, 4, 8 and 16 (24 bytes in CUDA 11 and 12); the current
    runtime (CUDA 13's documentation) appends ``long reserved[8]`` that must be zero (88
    bytes). The tail here is zeroed and larger than either, so the runtime never writes past
    the structure whichever it is."""

    _fields_ = (
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_long * 16),
    )


ATTRIBUTES_SIZE = ctypes.sizeof(_CudaPointerAttributes)
"""Bytes handed to ``cudaPointerGetAttributes`` (at least CUDA 13's 88)."""

_GET_ATTRIBUTES = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p
)
"""``cudaError_t cudaPointerGetAttributes(cudaPointerAttributes*, const void*)``."""
_GET_LAST_ERROR = ctypes.CFUNCTYPE(ctypes.c_int)
"""``cudaError_t cudaGetLastError(void)``: returns and clears the thread's last error."""


class PointerAttributes(NamedTuple):
    """What ``cudaPointerGetAttributes`` reports for one address (pointers as ints, 0 for
    NULL)."""

    type: int
    device: int
    device_pointer: int
    host_pointer: int


def cudart_paths(maps: str) -> list[str]:
    """The CUDA runtime libraries among the mappings in ``maps`` (the text of
    ``/proc/<pid>/maps``), each once, in the order listed."""
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        name = Path(path).name
        if name.startswith("libcudart") and ".so" in name and path not in found:
            found.append(path)
    return found


def load_cudart(paths: list[str], cuda_version: str | None) -> ctypes.CDLL:
    """The first of ``paths`` that loads, those of CUDA ``cuda_version``'s major first, else
    that version's ``libcudart.so.<major>`` from the loader's search path.

    Raises:
        RuntimeError: none loads.
    """
    major = (cuda_version or "").split(".")[0]
    ordered = sorted(paths, key=lambda path: f".so.{major}" not in Path(path).name)
    # A libcudart linked into torch statically leaves none mapped: then the runtime of
    # torch's CUDA version, which reaches the same driver and primary context.
    names = [*ordered, *([f"libcudart.so.{major}"] if major else [])]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"no CUDA runtime library loads (tried {', '.join(names) or 'none'})")


def find_cudart() -> ctypes.CDLL:
    """The libcudart this process already runs (torch's, as mapped once CUDA is
    initialised), so that what it reports is what torch's registrations did.

    Raises:
        RuntimeError: no CUDA runtime library is loaded or loadable.
    """
    torch.cuda.init()  # type: ignore[no-untyped-call]
    return load_cudart(cudart_paths(Path("/proc/self/maps").read_text()), torch.version.cuda)


def pointer_attributes(ptr: int, cudart: ctypes.CDLL) -> PointerAttributes:
    """``cudaPointerGetAttributes`` of ``ptr`` through ``cudart`` (a library with that
    function and ``cudaGetLastError``).

    Raises:
        RuntimeError: the call failed; its error is cleared from the calling thread first,
            so that it does not surface later as if a kernel had failed.
    """
    get_attributes = _GET_ATTRIBUTES(("cudaPointerGetAttributes", cudart))
    attributes = _CudaPointerAttributes()
    code = int(get_attributes(ctypes.byref(attributes), ctypes.c_void_p(ptr)))
    if code != _CUDA_SUCCESS:
        _GET_LAST_ERROR(("cudaGetLastError", cudart))()
        raise RuntimeError(f"cudaPointerGetAttributes({ptr:#x}) failed with CUDA error {code}")
    return PointerAttributes(
        type=attributes.type,
        device=attributes.device,
        device_pointer=attributes.devicePointer or 0,
        host_pointer=attributes.hostPointer or 0,
    )


def is_host_registered(ptr: int, cudart: ctypes.CDLL | None = None) -> bool:
    """Whether ``ptr`` lies in page-locked host memory that the GPU reaches directly: CUDA
    reports it as host memory with a device pointer. False without CUDA (nothing can be
    registered then); ``cudart`` defaults to :func:`find_cudart`'s.

    Raises:
        RuntimeError: CUDA is there but its runtime cannot be reached, or the call failed.
    """
    if cudart is None:
        if not torch.cuda.is_available():
            return False
        cudart = find_cudart()
    attributes = pointer_attributes(ptr, cudart)
    return attributes.type == CUDA_MEMORY_TYPE_HOST and attributes.device_pointer != 0
