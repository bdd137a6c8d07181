"""Tests for tests/memory/cuda_host.py, the check the CUDA tests of the pinned arena rely on,
on the CPU: ``cudaPointerGetAttributes`` is called through ctypes on a stand-in runtime built
from C with CUDA 13's ``struct cudaPointerAttributes``, so the layout, the truth table and
the error path are exercised as a real libcudart would see them; without CUDA nothing is
registered and no runtime is looked for."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.memory import cuda_host
from tests.memory.cuda_host import (
    ATTRIBUTES_SIZE,
    CUDA_MEMORY_TYPE_DEVICE,
    CUDA_MEMORY_TYPE_HOST,
    CUDA_MEMORY_TYPE_MANAGED,
    CUDA_MEMORY_TYPE_UNREGISTERED,
    PointerAttributes,
    cudart_paths,
    is_host_registered,
    load_cudart,
    pointer_attributes,
)

START = 0x7F00_0000_0000
SIZE = 1 << 20

# The runtime's side, as CUDA 13's headers declare it: one range of memory of one type; the
# reserved words must come in zeroed, and a failure is left as the thread's last error.
STAND_IN_C = r"""
#include <stddef.h>
#include <stdint.h>

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8];
};

static uintptr_t range_start, range_end;
static int range_type, fail_with, last_error, calls;

void standin_set(uintptr_t start, size_t size, int type, int fail) {
    range_start = start;
    range_end = start + size;
    range_type = type;
    fail_with = fail;
}
int standin_last_error(void) { return last_error; }
int standin_calls(void) { return calls; }
size_t standin_attributes_size(void) { return sizeof(struct cudaPointerAttributes); }

int cudaGetLastError(void) {
    int error = last_error;
    last_error = 0;
    return error;
}

int cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    uintptr_t p = (uintptr_t)ptr;
    calls++;
    for (int i = 0; i < 8; i++)
        if (attributes->reserved[i] != 0) return last_error = 1;  /* cudaErrorInvalidValue */
    if (fail_with) return last_error = fail_with;
    for (int i = 0; i < 8; i++) attributes->reserved[i] = -1;
    if (p < range_start || p >= range_end) {
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
        attributes->devicePointer = NULL;
        attributes->hostPointer = NULL;
        return 0;
    }
    attributes->type = (enum cudaMemoryType)range_type;
    attributes->device = 3;
    attributes->devicePointer = range_type == cudaMemoryTypeHost && p >= range_start + 4096
        ? (void *)(p + 0x100000000000) : NULL;
    attributes->hostPointer = range_type == cudaMemoryTypeDevice ? NULL : (void *)p;
    return 0;
}
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The stand-in runtime, built for this run (its name is no libcudart's, so nothing
    else in the process finds it)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    folder = tmp_path_factory.mktemp("cudart")
    source = folder / "stand_in_runtime.c"
    source.write_text(STAND_IN_C)
    library = folder / "stand_in_runtime.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
        check=True,
        timeout=60,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(library))
    lib.standin_set.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
    lib.standin_attributes_size.restype = ctypes.c_size_t
    return lib


def _set(lib: ctypes.CDLL, memory_type: int, fail: int = 0) -> None:
    lib.standin_set(START, SIZE, memory_type, fail)


def test_the_structure_holds_what_cuda_13_writes() -> None:
    assert ATTRIBUTES_SIZE >= 88  # 4 + 4 + 8 + 8 + 8 * 8


def test_the_stand_in_is_cuda_13s_layout(stand_in: ctypes.CDLL) -> None:
    assert stand_in.standin_attributes_size() == 88
    assert stand_in.standin_attributes_size() <= ATTRIBUTES_SIZE


def test_registered_host_memory_is_read_field_by_field(stand_in: ctypes.CDLL) -> None:
    _set(stand_in, CUDA_MEMORY_TYPE_HOST)
    ptr = START + SIZE - 1

    attributes = pointer_attributes(ptr, stand_in)

    assert attributes == PointerAttributes(
        type=CUDA_MEMORY_TYPE_HOST,
        device=3,
        device_pointer=ptr + 0x1000_0000_0000,
        host_pointer=ptr,
    )
    assert is_host_registered(ptr, stand_in)
    assert stand_in.standin_last_error() == 0


@pytest.mark.parametrize(
    ("memory_type", "ptr", "registered"),
    [
        (CUDA_MEMORY_TYPE_HOST, START + 4096, True),
        (CUDA_MEMORY_TYPE_HOST, START, False),  # host memory the GPU has no pointer to
        (CUDA_MEMORY_TYPE_HOST, START - 1, False),  # just before the range: unregistered
        (CUDA_MEMORY_TYPE_HOST, START + SIZE, False),  # just past it
        (CUDA_MEMORY_TYPE_DEVICE, START + 4096, False),
        (CUDA_MEMORY_TYPE_MANAGED, START + 4096, False),
    ],
    ids=["host", "host-no-device-pointer", "before", "past", "device", "managed"],
)
def test_only_host_memory_with_a_device_pointer_counts_as_registered(
    stand_in: ctypes.CDLL, memory_type: int, ptr: int, registered: bool
) -> None:
    _set(stand_in, memory_type)

    assert is_host_registered(ptr, stand_in) is registered


def test_unregistered_memory_reads_as_such(stand_in: ctypes.CDLL) -> None:
    _set(stand_in, CUDA_MEMORY_TYPE_HOST)

    attributes = pointer_attributes(START - 4096, stand_in)

    assert attributes == PointerAttributes(CUDA_MEMORY_TYPE_UNREGISTERED, -2, 0, 0)


def test_each_call_hands_the_runtime_zeroed_reserved_words(stand_in: ctypes.CDLL) -> None:
    """The stand-in fills the reserved words after each call and refuses any that come in
    set: a structure reused across calls would fail the second."""
    _set(stand_in, CUDA_MEMORY_TYPE_HOST)
    before = stand_in.standin_calls()

    for _ in range(3):
        assert is_host_registered(START + 4096, stand_in)

    assert stand_in.standin_calls() == before + 3
    assert stand_in.standin_last_error() == 0


def test_a_failed_call_raises_and_clears_the_threads_last_error(stand_in: ctypes.CDLL) -> None:
    _set(stand_in, CUDA_MEMORY_TYPE_HOST, fail=217)

    with pytest.raises(RuntimeError, match=r"cudaPointerGetAttributes\(0x7f0000001000\) .* 217"):
        is_host_registered(START + 4096, stand_in)

    assert stand_in.standin_last_error() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_without_cuda_nothing_is_registered_and_no_runtime_is_looked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_lookup() -> ctypes.CDLL:
        raise AssertionError("looked for a CUDA runtime without CUDA")

    monkeypatch.setattr(cuda_host, "find_cudart", no_lookup)
    buffer = torch.zeros(16, dtype=torch.uint8)

    assert is_host_registered(buffer.data_ptr()) is False


def test_the_runtime_is_found_among_the_process_mappings() -> None:
    maps = "\n".join(
        [
            "7f1000000000-7f1000200000 r-xp 00000000 08:01 42   /usr/lib/libc.so.6",
            "7f2000000000-7f2000100000 r--p 00000000 08:01 43   "
            "/venv/nvidia/cu12/lib/libcudart.so.12",
            "7f3000000000-7f3000100000 r--p 00000000 08:01 44   "
            "/venv/nvidia/cu13/lib/libcudart.so.13",
            "7f3000100000-7f3000200000 r-xp 00100000 08:01 44   "
            "/venv/nvidia/cu13/lib/libcudart.so.13",
            "7f4000000000-7f4000100000 r-xp 00000000 08:01 45   "
            "/venv/torch/lib/libcudart-d0da41ae.so.11.0",
            "7f5000000000-7f5000100000 rw-p 00000000 00:00 0 ",
            "7f6000000000-7f6000100000 rw-p 00000000 00:00 0    [heap]",
            "7f7000000000-7f7000100000 r-xp 00000000 08:01 46   /opt/lib/libcudart_static.a",
        ]
    )

    assert cudart_paths(maps) == [
        "/venv/nvidia/cu12/lib/libcudart.so.12",
        "/venv/nvidia/cu13/lib/libcudart.so.13",
        "/venv/torch/lib/libcudart-d0da41ae.so.11.0",
    ]


def test_torchs_cuda_version_is_loaded_first_and_missing_ones_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded: list[str] = []

    def cdll(name: str) -> str:
        loaded.append(name)
        if name.startswith("/missing/"):
            raise OSError(f"{name}: cannot open shared object file")
        return f"library {name}"

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    paths = ["/missing/libcudart.so.12", "/missing/libcudart.so.13", "/found/libcudart.so.12"]

    found: object = load_cudart(paths, "13.0")

    assert found == "library /found/libcudart.so.12"
    assert loaded == [
        "/missing/libcudart.so.13",
        "/missing/libcudart.so.12",
        "/found/libcudart.so.12",
    ]


def test_no_loadable_runtime_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def cdll(name: str) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", cdll)

    with pytest.raises(RuntimeError, match=r"tried /gone/libcudart.so.13, libcudart.so.13\)"):
        load_cudart(["/gone/libcudart.so.13"], "13.0")
    with pytest.raises(RuntimeError, match=r"\(tried none\)"):
        load_cudart([], None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_a_process_without_a_cuda_runtime_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own mappings are read: a CPU torch maps no libcudart."""
    assert cudart_paths(Path("/proc/self/maps").read_text()) == []
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.version, "cuda", None)

    with pytest.raises(RuntimeError, match=r"no CUDA runtime library loads \(tried none\)"):
        cuda_host.find_cudart()
