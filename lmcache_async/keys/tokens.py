"""Token input: the token ids callers hand over, checked and turned into int32 bytes.

Keys hash tokens as little-endian int32, so every accepted form (a list of int, a 1-D
integer tensor or ndarray) is converted here once, and ids outside ``[0, 2**31)`` are
refused. Store/retrieve masks are validated here too. :func:`tokens_fixed` tells the
int32 arrays whose values can never change (a conversion's, not the caller's memory),
which may be kept without a copy.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from lmcache_async.errors import InvalidInputError

__all__ = [
    "TOKEN_BYTES",
    "Tokens",
    "check_mask",
    "is_strict_int",
    "token_array",
    "token_bytes",
    "tokens_fixed",
]

Tokens: TypeAlias = Sequence[int] | torch.Tensor | npt.NDArray[np.integer[Any]]
"""Token ids: a list/tuple of int, a 1-D integer tensor or a 1-D integer ndarray."""

_TOKEN_DTYPE: Final = np.dtype("<i4")
TOKEN_BYTES: Final = 4
"""Bytes per token in the hashed form (little-endian int32)."""
_TOKEN_LIMIT: Final = 2**31  # token ids must lie in [0, 2**31)


def is_strict_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_range(unsigned: npt.NDArray[Any], signed: npt.NDArray[Any]) -> None:
    """Raise unless every token lies in ``[0, 2**31)``.

    ``unsigned`` is the tokens viewed as unsigned ints, so one max() catches both negative
    and too-large ids; ``signed`` is only used to word the error.
    """
    if unsigned.size and int(unsigned.max()) >= _TOKEN_LIMIT:
        low = int(signed.min())
        if low < 0:
            raise InvalidInputError(f"token ids must be >= 0, found {low}")
        raise InvalidInputError(f"token ids must be < 2**31, found {int(signed.max())}")


class _TokenBuffer(bytearray):
    """Memory of a conversion :func:`token_array` made: only the read-only array over it
    is handed out, so its values never change (:func:`tokens_fixed`)."""

    __slots__ = ()


def _converted(array: npt.NDArray[Any]) -> npt.NDArray[np.int32]:
    """``array`` (checked) as int32, in a buffer of its own, read-only."""
    out = np.frombuffer(_TokenBuffer(array.size * TOKEN_BYTES), dtype=_TOKEN_DTYPE)
    out[...] = array
    out.flags.writeable = False
    return out


def tokens_fixed(array: npt.NDArray[Any]) -> bool:
    """Whether the values of ``array`` (a :func:`token_array` result, or a slice of one)
    can never change, so that it may be kept without a copy: its memory is a ``bytes``
    object (a list's conversion) or a conversion's own buffer. False where it may be the
    caller's memory (an int32 array or CPU tensor passed in)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    while isinstance(base, memoryview):
        base = base.obj
    return type(base) is bytes or type(base) is _TokenBuffer


def _ndarray_tokens(array: npt.NDArray[Any], what: str) -> npt.NDArray[np.int32]:
    if array.ndim != 1:
        raise InvalidInputError(f"tokens must be 1-D, got a {array.ndim}-D {what}")
    kind = array.dtype.kind
    if kind == "i" and array.dtype.itemsize >= TOKEN_BYTES:
        # Same width and byte order, unsigned: negative ids become >= 2**31.
        _check_token_range(array.view(array.dtype.str.replace("i", "u")), array)
    elif kind == "i":
        if array.size and int(array.min()) < 0:
            raise InvalidInputError(f"token ids must be >= 0, found {int(array.min())}")
    elif kind == "u":
        _check_token_range(array, array)
    else:
        raise InvalidInputError(f"tokens must have an integer dtype, got {what} of {array.dtype}")
    if array.dtype == _TOKEN_DTYPE and array.flags.c_contiguous:
        return array
    return _converted(array)


def _sequence_tokens(tokens: Sequence[int]) -> bytes:
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise InvalidInputError(
            "tokens must be a sequence of int, a 1-D integer tensor or a 1-D integer ndarray,"
            f" got {type(tokens).__name__}"
        )
    try:
        data = struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as exc:
        values: Sequence[object] = tokens
        for value in values:
            if not isinstance(value, (int, np.integer)):
                raise InvalidInputError(
                    f"tokens must be ints, found {type(value).__name__} {value!r:.40}"
                ) from None
        raise InvalidInputError(f"token ids must lie in [0, 2**31): {exc}") from None
    _check_token_range(np.frombuffer(data, dtype="<u4"), np.frombuffer(data, dtype=_TOKEN_DTYPE))
    return data


def token_array(tokens: Tokens) -> npt.NDArray[np.int32]:
    """Token ids as a 1-D little-endian int32 ndarray (``'<i4'``).

    Accepts a list/tuple of int, a 1-D integer tensor of any integer dtype on any device
    (copied to the CPU), or a 1-D integer ndarray. The result may share memory with the
    input and may be read-only: treat it as read-only. A conversion (a list, another
    dtype, strided memory) is read-only memory of its own (:func:`tokens_fixed`). In a
    list, ``True``/``False`` count as the ints 1/0 (refusing them would cost a check per
    token).

    Raises:
        InvalidInputError: the input is not 1-D, not of an integer dtype (bool and float
            tensors/arrays and non-int list items are refused), or holds an id outside
            ``[0, 2**31)``.
    """
    if isinstance(tokens, torch.Tensor):
        return _tensor_tokens(tokens)
    if isinstance(tokens, np.ndarray):
        return _ndarray_tokens(tokens, "ndarray")
    return np.frombuffer(_sequence_tokens(tokens), dtype=_TOKEN_DTYPE)


def _tensor_tokens(tensor: torch.Tensor) -> npt.NDArray[np.int32]:
    dtype = tensor.dtype
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise InvalidInputError(f"tokens must have an integer dtype, got tensor of {dtype}")
    if tensor.dim() != 1:
        raise InvalidInputError(f"tokens must be 1-D, got a {tensor.dim()}-D tensor")
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError) as exc:
        raise InvalidInputError(f"tokens of dtype {dtype} are not supported: {exc}") from None
    return _ndarray_tokens(array, "tensor")


def token_bytes(tokens: Tokens) -> tuple[memoryview, int]:
    """The tokens' little-endian int32 bytes, and the number of tokens."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        array = token_array(tokens)
        return array.data.cast("B"), len(array)
    data = _sequence_tokens(tokens)
    return memoryview(data), len(data) // TOKEN_BYTES


def check_mask(mask: torch.Tensor | None, num_tokens: int, chunk_size: int) -> int:
    """Validate a store/retrieve mask and return where its True part starts.

    The mask is a 1-D bool tensor of length ``num_tokens`` shaped ``F...FT...T``: the
    leading Falses mark tokens the caller already has, and their count must be a multiple of
    ``chunk_size`` (an all-False mask is allowed and returns ``num_tokens``). ``None`` means
    all True and returns 0.

    Raises:
        InvalidInputError: the mask is not a tensor, not bool, not 1-D, of the wrong length,
            not of the form ``F...FT...T``, or its leading Falses are not a multiple of
            ``chunk_size``; or ``num_tokens``/``chunk_size`` are invalid.
    """
    if not is_strict_int(chunk_size) or chunk_size <= 0:
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not is_strict_int(num_tokens) or num_tokens < 0:
        raise InvalidInputError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if mask is None:
        return 0
    if not isinstance(mask, torch.Tensor):
        raise InvalidInputError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise InvalidInputError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.dim() != 1:
        raise InvalidInputError(f"mask must be 1-D, got shape {tuple(mask.shape)}")
    if mask.numel() != num_tokens:
        raise InvalidInputError(
            f"mask length {mask.numel()} does not match the number of tokens {num_tokens}"
        )
    if num_tokens == 0:
        return 0
    flags = mask.cpu().numpy()
    first = int(flags.argmax())
    if not flags[first]:
        return num_tokens
    if not flags[first:].all():
        hole = first + int(flags[first:].argmin())
        raise InvalidInputError(
            "mask must be all False then all True (F...FT...T): "
            f"position {hole} is False after the first True at {first}"
        )
    if first % chunk_size:
        raise InvalidInputError(
            f"mask has {first} leading False tokens, which is not a multiple of "
            f"chunk_size {chunk_size}"
        )
    return first
