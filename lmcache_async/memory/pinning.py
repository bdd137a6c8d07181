"""Page-locking host memory for CUDA: exactly the bytes asked for, registered with
``cudaHostRegister`` and unregistered once.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's caching host allocator rounds every
pinned request up to a power of two, so a 64 GB CPU tier would lock 128 GiB (and fail on a
128 GiB host). Registering ordinary host memory locks what is configured and no more.

A failed CUDA runtime call also leaves its error in the calling thread's last-error slot,
where the next kernel-launch check on that thread would raise it as if a kernel had failed.
Registering and unregistering therefore run on a short-lived thread of their own (on the
caller's current device), so a failure never reaches the caller's thread: it is logged, and
the memory stays ordinary (pageable) memory.

Callers check :func:`torch.cuda.is_available` first: nothing here is meant to run without
CUDA.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lmcache_async.logging import get_logger

__all__ = ["HOST_REGISTER_PORTABLE", "HostRegistration", "register_host"]

log = get_logger(__name__)

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the range counts as pinned for every CUDA context, not only
the current device's (one process may copy on several devices)."""

_CUDA_SUCCESS = 0


class HostRegistration:
    """One range of host memory registered with CUDA; :meth:`release` unregisters it once.

    The owner keeps the memory allocated until :meth:`release` has run, and calls it only
    when no copy to or from the range is still in flight.
    """

    __slots__ = ("_cudart", "_device", "_released", "nbytes", "ptr")

    def __init__(self, cudart: Any, device: int, ptr: int, nbytes: int) -> None:
        self._cudart = cudart
        self._device = device
        self._released = False
        self.ptr = ptr
        """Start address of the registered range."""
        self.nbytes = nbytes
        """Exact size of the registered range in bytes."""

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run (the range is pageable again)."""
        return self._released

    @property
    def locked_bytes(self) -> int:
        """Bytes locked now: :attr:`nbytes` until :meth:`release`, then 0."""
        return 0 if self._released else self.nbytes

    def release_when_collected(self, owner: object) -> None:
        """Also :meth:`release` when ``owner`` (which holds the memory) is collected, before
        the memory it holds is freed; not at interpreter exit, when the process frees all."""
        weakref.finalize(owner, self.release).atexit = False

    def release(self) -> None:
        """Unregister the range; later calls do nothing.

        Never raises: a failure is logged, and the memory is freed with its owner either way.
        """
        if self._released:
            return
        self._released = True
        cudart, ptr = self._cudart, self.ptr
        code, error = _on_own_thread(self._device, lambda: int(cudart.cudaHostUnregister(ptr)))
        if code != _CUDA_SUCCESS:
            log.warning(
                "host_unregister_failed",
                nbytes=self.nbytes,
                code=code,
                error=error or _error_string(cudart, code),
            )
        else:
            log.debug("host_unregistered", nbytes=self.nbytes)


def register_host(ptr: int, nbytes: int) -> HostRegistration | None:
    """Page-lock the ``nbytes`` bytes at ``ptr`` for CUDA (exactly those, portable to every
    device), or return None, with a warning logged, when CUDA cannot: the memory then stays
    pageable, and copies to or from it are synchronous but correct.

    Call only when :func:`torch.cuda.is_available` is true. Never raises.
    """
    try:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
    except Exception as exc:  # any failure here only means "not pinned"
        log.warning("host_arena_not_pinned", nbytes=nbytes, code=None, error=repr(exc))
        return None
    code, error = _on_own_thread(
        device, lambda: int(cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
    )
    if code != _CUDA_SUCCESS:
        log.warning(
            "host_arena_not_pinned",
            nbytes=nbytes,
            code=code,
            error=error or _error_string(cudart, code),
        )
        return None
    log.debug("host_registered", nbytes=nbytes, device=device)
    return HostRegistration(cudart, device, ptr, nbytes)


def _on_own_thread(device: int, call: Callable[[], int]) -> tuple[int | None, str | None]:
    """Run a CUDA runtime ``call`` on a fresh thread whose current device is ``device``;
    return its code, or None and the error when it raised.

    The thread ends with the call, and so does any error left in its last-error slot.
    Waits as long as the call takes: locking tens of GB takes seconds, and has no bound
    worth guessing.
    """
    result: list[int] = []
    errors: list[str] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            result.append(call())
        except Exception as exc:  # reported to the caller, who logs it
            errors.append(repr(exc))

    thread = threading.Thread(target=run, name="lmcache-host-register", daemon=True)
    thread.start()
    thread.join()
    if result:
        return result[0], None
    return None, errors[0] if errors else "the CUDA call did not return"


def _error_string(cudart: Any, code: int | None) -> str:
    """CUDA's description of ``code`` ("" when it has none)."""
    if code is None:
        return ""
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:  # a description is a nicety; the code is logged anyway
        return ""
