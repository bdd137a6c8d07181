"""The digest memo: the chained digests of recently hashed long prompts, found again
without hashing.

A serving engine asks about the same prompt several times (a lookup from the scheduler, a
retrieve, a store after prefill). :class:`TokenMemo` recognises a prompt asked about
before in whichever form it comes (a CPU tensor, an ndarray, a list, int32 bytes) and
returns the digests :class:`~lmcache_async.keys.chunks.ChunkHasher` made of it; a hit is exact by
construction (the bytes, or the list, are compared). :class:`DigestProbe` and
:class:`DigestGuess` are what a hasher's ``probe`` and ``guess`` return; both are
re-exported by :mod:`lmcache_async.keys.chunks`.
"""

from __future__ import annotations

import collections
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from lmcache_async.keys.digests import lru_put
from lmcache_async.keys.tokens import TOKEN_BYTES, Tokens, token_bytes

__all__ = ["DigestGuess", "DigestProbe", "MemoKey", "TokenMemo"]

MemoKey = tuple[str, int]
"""A memo entry's key: the form the tokens are in (a dtype, or a list), and a fast hash of
them."""

_INT32_TAG: Final = "<i4"  # the hashed form's dtype (see TOKEN_BYTES)
_LIST_TAG: Final = "list"
_MEMO_LISTS: Final = 8
"""Prompts a memo keeps as lists, at most (see :class:`_DigestMemo`)."""
_LIST_ITEM_BYTES: Final = 8
"""What a remembered list costs a token (its pointer; the int objects are the caller's)."""
_DIGEST_ENTRY_BYTES: Final = 72
"""What a remembered digest costs: a small bytes object and its list slot."""
_LIST_SAME_ITEMS: Final = 64
"""Leading items of a probed list that must be the very objects of the remembered copy
before the two are compared on the caller's thread (see :meth:`_DigestMemo.get_list`)."""


def _raw_tokens(tokens: Tokens) -> npt.NDArray[np.integer] | None:
    """A 1-D integer tensor or ndarray as an ndarray on the same memory (no conversion,
    no copy), or None for anything else (a list, a device tensor, strided memory)."""
    if isinstance(tokens, torch.Tensor):
        try:
            array = tokens.numpy()  # only a plain CPU tensor has a view as an ndarray
        except (TypeError, RuntimeError):
            return None
    elif isinstance(tokens, np.ndarray):
        array = tokens
    else:
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu" or not array.flags.c_contiguous:
        return None
    return array


class _ArrayInterface:
    """An object numpy can view through its ``__array_interface__`` (and keeps alive as
    the view's base): a view of memory that holds no reference to its owner."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, object]) -> None:
        self.__array_interface__ = interface


class _TensorView:
    """A probed tensor's token memory as an ndarray, and what the tensor was then; and
    the memo key its tokens had when last probed (see :meth:`TokenMemo.guess`)."""

    __slots__ = ("array", "data", "dtype", "memo_key", "pointer", "ref", "shape", "stride")

    def __init__(self, tensor: torch.Tensor, array: npt.NDArray[np.integer]) -> None:
        self.dtype = tensor.dtype
        self.ref = weakref.ref(tensor)
        self.array = np.asarray(_ArrayInterface(array.__array_interface__))
        self.data = self.array.data.cast("B")  # the same memory as bytes
        self.pointer = tensor.data_ptr()
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.memo_key: MemoKey | None = None

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the viewed tensor, alive, and still lies where it did."""
        return (
            self.ref() is tensor
            and tensor.dtype is self.dtype
            and tensor.is_cpu
            and tensor.data_ptr() == self.pointer
            and tensor.shape == self.shape
            and tensor.stride() == self.stride
        )


class _TensorViews:
    """Views of the token memory of recently probed CPU tensors, by tensor.

    ``Tensor.numpy()`` costs 15-20 µs more than checking a remembered view when torch's
    code is out of the CPU's caches, as it is between a serving engine's requests, and one
    prompt tensor is often asked about again (a lookup, then its retrieve, then its store).
    A view is used again only while its tensor lies where it did: the same object, still
    alive, on the CPU, with the same dtype, data pointer, shape and strides. A view holds
    no reference to the tensor and is read only while the caller holds the tensor; the
    entry of a collected tensor is never used again, and goes as the oldest does.
    """

    __slots__ = ("_capacity", "_lock", "_views")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._views: dict[int, _TensorView] = {}
        self._lock = threading.Lock()

    def known(self, tensor: torch.Tensor) -> _TensorView | None:
        """``tensor``'s view if one was made and the tensor still lies where it did."""
        entry = self._views.get(id(tensor))
        return entry if entry is not None and entry.fits(tensor) else None

    def view(self, tensor: torch.Tensor) -> _TensorView | None:
        """``tensor``'s view (made now if needed): its tokens as a 1-D integer ndarray on
        its memory; None when they are not that (see :func:`_raw_tokens`)."""
        entry = self.known(tensor)
        if entry is not None:
            return entry
        array = _raw_tokens(tensor)
        if array is None:
            return None
        key = id(tensor)
        entry = _TensorView(tensor, array)
        with self._lock:  # other threads probe too
            self._views.pop(key, None)
            while len(self._views) >= self._capacity:
                del self._views[next(iter(self._views))]  # the oldest
            self._views[key] = entry
        return entry


class _DigestMemo:
    """The chained digests of recently hashed long prompts.

    A serving engine asks about the same prompt several times (a lookup from the
    scheduler, a retrieve, a store after prefill), and hashing a long prompt costs far more
    than recognising it. An entry is found by a fast hash of the token bytes and used only
    if the stored bytes are equal to the new ones, so a hit is exact by construction.
    A prompt that came as, say, int64 is also remembered in that form, so asking again
    with the same tensor spares its conversion to int32 as well. One that came as a list
    is remembered as a copy of the list, in a table of its own: a list holds 8 bytes a
    token and keeps its int objects alive, several times the bytes of the other forms, so
    fewer of them are kept (``list_capacity``).

    The entries of both tables together hold at most ``max_bytes`` (tokens and digests,
    as :func:`_entry_bytes` counts them): the oldest go first, and a prompt that alone
    would pass the budget is not remembered, so no client's prompts can make the memo
    large whatever their length.
    """

    __slots__ = (
        "_bytes",
        "_capacity",
        "_entries",
        "_list_capacity",
        "_lists",
        "_lock",
        "_max_bytes",
        "_sizes",
    )

    def __init__(self, capacity: int, list_capacity: int, max_bytes: int) -> None:
        self._capacity = capacity
        self._list_capacity = list_capacity
        self._max_bytes = max_bytes
        self._bytes = 0
        self._sizes: dict[tuple[bool, MemoKey], int] = {}
        self._entries: collections.OrderedDict[MemoKey, tuple[bytes, list[bytes]]] = (
            collections.OrderedDict()
        )
        self._lists: collections.OrderedDict[MemoKey, tuple[list[int], list[bytes]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # digests() may run on worker threads too

    def get(self, fingerprint: MemoKey, data: bytes | memoryview) -> list[bytes] | None:
        """The digests remembered for ``data`` (bytes, or a view of bytes: compared in
        place, one memcmp, where ``==`` on a view goes item by item)."""
        entry = self.peek(fingerprint)
        if entry is None or not self.confirm(fingerprint, entry, data):
            return None
        return list(entry[1])

    def peek(self, fingerprint: MemoKey) -> tuple[bytes, list[bytes]] | None:
        """The entry under ``fingerprint``, not compared with anything (nor made newest).
        An entry is never changed: it may be read outside the lock."""
        with self._lock:
            return self._entries.get(fingerprint)

    def confirm(
        self, fingerprint: MemoKey, entry: tuple[bytes, list[bytes]], data: bytes | memoryview
    ) -> bool:
        """Whether ``data`` equals the bytes of ``entry`` (from :meth:`peek`); if so, the
        entry becomes the newest."""
        if len(entry[0]) != len(data) or not entry[0].startswith(data):
            return False
        with self._lock:
            if self._entries.get(fingerprint) is entry:
                self._entries.move_to_end(fingerprint)
        return True

    def put(self, fingerprint: MemoKey, data: bytes, digests: list[bytes]) -> None:
        size = _entry_bytes(len(data), len(digests))
        if size > self._max_bytes:
            return
        with self._lock:
            self._forget(False, fingerprint)
            lru_put(self._entries, self._capacity, fingerprint, (data, list(digests)))
            self._admit(False, fingerprint, size)

    def get_list(self, fingerprint: MemoKey, tokens: list[int]) -> list[bytes] | None:
        """The digests remembered for a list equal to ``tokens``.

        The remembered copy holds the objects of the list it was made from, so the same
        list, or a copy of it, compares equal by identity, item after item, in about a
        microsecond per thousand tokens. A list of equal values in other int objects
        (built anew, say by ``tolist()``) compares value by value, ten times slower:
        unless its first items are the copy's very objects it is not compared here, and
        is left to the hashing (which converts it and finds its int32 form remembered).
        """
        entry = self.peek_list(fingerprint, tokens)
        if entry is None or not self.confirm_list(fingerprint, entry, tokens):
            return None
        return list(entry[1])

    def peek_list(
        self, fingerprint: MemoKey, tokens: list[int]
    ) -> tuple[list[int], list[bytes]] | None:
        """The list entry under ``fingerprint`` if its copy is as long as ``tokens`` and
        starts with the very objects ``tokens`` does (see :meth:`get_list`); the rest is
        not compared. An entry is never changed: it may be read outside the lock."""
        with self._lock:
            entry = self._lists.get(fingerprint)
        if entry is None:
            return None
        stored, head = entry[0], _LIST_SAME_ITEMS
        if len(stored) != len(tokens) or not all(map(operator.is_, tokens[:head], stored[:head])):
            return None
        return entry

    def confirm_list(
        self, fingerprint: MemoKey, entry: tuple[list[int], list[bytes]], tokens: list[int]
    ) -> bool:
        """Whether ``tokens`` equal the copy of ``entry`` (from :meth:`peek_list`); if so,
        the entry becomes the newest."""
        if tokens != entry[0]:
            return False
        with self._lock:
            if self._lists.get(fingerprint) is entry:
                self._lists.move_to_end(fingerprint)
        return True

    def put_list(self, fingerprint: MemoKey, copy: list[int], digests: list[bytes]) -> None:
        size = _entry_bytes(_LIST_ITEM_BYTES * len(copy), len(digests))
        if size > self._max_bytes:
            return
        with self._lock:
            self._forget(True, fingerprint)
            lru_put(self._lists, self._list_capacity, fingerprint, (copy, list(digests)))
            self._admit(True, fingerprint, size)

    def _forget(self, is_list: bool, fingerprint: MemoKey) -> None:
        """Drop the size of an entry about to be replaced (under the lock)."""
        self._bytes -= self._sizes.pop((is_list, fingerprint), 0)

    def _admit(self, is_list: bool, fingerprint: MemoKey, size: int) -> None:
        """Count a new entry, then forget what the tables' LRU dropped and the oldest
        entries beyond the byte budget (under the lock)."""
        self._sizes[(is_list, fingerprint)] = size
        self._bytes += size
        for table, listed in ((self._entries, False), (self._lists, True)):
            for key in [k for (lst, k) in self._sizes if lst is listed and k not in table]:
                self._bytes -= self._sizes.pop((listed, key))
        while self._bytes > self._max_bytes:
            table = self._lists if self._lists else self._entries
            key, _ = table.popitem(last=False)
            self._bytes -= self._sizes.pop((table is self._lists, key), 0)


@dataclass(frozen=True, slots=True)
class DigestProbe:
    """What :meth:`~lmcache_async.keys.chunks.ChunkHasher.probe` found: the remembered digests,
    or None; on a miss, what the hashing that follows reuses (the int32 token bytes when
    they were converted, and the memo entries to fill)."""

    digests: list[bytes] | None
    data: memoryview | None = None
    entries: tuple[tuple[MemoKey, bytes], ...] = ()
    list_key: MemoKey | None = None
    """A list's memo key, when the list is long enough to be remembered."""


class DigestGuess:
    """What :meth:`~lmcache_async.keys.chunks.ChunkHasher.guess` found: the digests of
    ``num_tokens`` tokens that are most likely the ones asked about (the memo's own: read
    them, never change them), and the exact comparison that tells."""

    __slots__ = ("_compare", "digests", "num_tokens")

    def __init__(
        self, digests: Sequence[bytes], num_tokens: int, compare: Callable[[], bool]
    ) -> None:
        self.digests = digests
        self.num_tokens = num_tokens
        self._compare = compare

    def confirm(self) -> bool:
        """Whether the tokens now equal those the digests were made of: read in full and
        compared with the remembered copy (about 10 µs for 32k tokens)."""
        return self._compare()


def _entry_bytes(token_bytes: int, digests: int) -> int:
    """The memory an entry of ``token_bytes`` of tokens and ``digests`` digests holds."""
    return token_bytes + digests * _DIGEST_ENTRY_BYTES


class TokenMemo:
    """The memo as :class:`~lmcache_async.keys.chunks.ChunkHasher` asks it: the digests of up to
    ``prompts`` recent prompts of at least ``min_tokens`` tokens, found by the tokens in
    the form they come in, and what a miss fills once they are hashed; at most
    ``max_bytes`` in all. Safe to share between threads.
    """

    __slots__ = ("_memo", "_min_bytes", "tensor_views")

    def __init__(self, prompts: int, min_tokens: int, max_bytes: int) -> None:
        # Two entries a prompt at most: its int32 form and the form it came in.
        self._memo = _DigestMemo(2 * prompts, min(prompts, _MEMO_LISTS), max_bytes)
        self._min_bytes = min_tokens * TOKEN_BYTES
        self.tensor_views = _TensorViews(prompts)
        """Views of the token memory of recently probed CPU tensors."""

    def probe(self, tokens: Tokens) -> DigestProbe:
        """As :meth:`ChunkHasher.probe <lmcache_async.keys.chunks.ChunkHasher.probe>`, which
        documents what is cheap, what is compared and what is left to the hashing.

        Raises:
            InvalidInputError: ``tokens`` are invalid (see
                :func:`~lmcache_async.keys.tokens.token_array`).
        """
        memo = self._memo
        if type(tokens) is list:
            return self._probe_list(memo, tokens)
        seen: _TensorView | None = None
        if isinstance(tokens, torch.Tensor):
            seen = self.tensor_views.view(tokens)
            array = None if seen is None else seen.array
        elif isinstance(tokens, np.ndarray):
            array = _raw_tokens(tokens)
        else:
            return DigestProbe(None)
        if array is None:  # a device tensor or strided memory: converted (and checked) first
            data, _ = token_bytes(tokens)
            digests, entries = self.recall_int32(data)
            return DigestProbe(digests, data, entries)
        if len(array) * TOKEN_BYTES < self._min_bytes:
            return DigestProbe(None)
        # Only bytes that are equal to a remembered prompt's (which passed the checks of
        # token_array) are used, so a hit needs neither the conversion nor the checks.
        view = array.data.cast("B") if seen is None else seen.data
        tag = array.dtype.str
        key = (tag, xxhash.xxh3_64_intdigest(view))
        if seen is not None:
            seen.memo_key = key  # what the tensor is guessed to hold when asked again
        digests = memo.get(key, view)
        if digests is not None:
            return DigestProbe(digests)
        raw = (key, view.tobytes())  # what a miss remembers: copied only then
        if tag == _INT32_TAG:
            return DigestProbe(None, None, (raw,))  # an int32 form is the hashed form
        data, _ = token_bytes(tokens)
        digests, entries = self.recall_int32(data)
        if digests is not None:
            memo.put(*raw, digests)
        return DigestProbe(digests, data, (raw, *entries))

    def guess(self, tokens: Tokens) -> DigestGuess | None:
        """As :meth:`ChunkHasher.guess <lmcache_async.keys.chunks.ChunkHasher.guess>`: the
        digests held for what are most likely ``tokens``, found without reading them."""
        memo = self._memo
        if type(tokens) is list:
            key = self._list_key(tokens)
            copied = None if key is None else memo.peek_list(key, tokens)
            if key is None or copied is None:
                return None
            compare = functools.partial(memo.confirm_list, key, copied, tokens)
            return DigestGuess(copied[1], len(tokens), compare)
        if not isinstance(tokens, torch.Tensor):
            return None
        seen = self.tensor_views.known(tokens)
        key = None if seen is None else seen.memo_key
        entry = None if key is None else memo.peek(key)
        if seen is None or key is None or entry is None:
            return None
        compare = functools.partial(memo.confirm, key, entry, seen.data)
        return DigestGuess(entry[1], len(seen.array), compare)

    def _list_key(self, tokens: list[int]) -> MemoKey | None:
        """A list's memo key (its length and three items), or None when it is too short to
        be remembered or an item cannot be hashed (invalid: the conversion refuses it)."""
        count = len(tokens)
        if not count or count * TOKEN_BYTES < self._min_bytes:
            return None
        try:
            return (_LIST_TAG, hash((count, tokens[0], tokens[count >> 1], tokens[-1])))
        except TypeError:
            return None

    def _probe_list(self, memo: _DigestMemo, tokens: list[int]) -> DigestProbe:
        """:meth:`probe` for a list: found by its length and three items, then compared."""
        key = self._list_key(tokens)
        if key is None:
            return DigestProbe(None)
        digests = memo.get_list(key, tokens)
        return DigestProbe(digests, list_key=None if digests is not None else key)

    def recall_int32(
        self, data: memoryview
    ) -> tuple[list[bytes] | None, tuple[tuple[MemoKey, bytes], ...]]:
        """The memo's digests of int32 token bytes (compared in place), or None and the
        entry a miss fills, its bytes copied only then (none when the memo takes none)."""
        memo = self._memo
        if len(data) < self._min_bytes:
            return None, ()
        key = (_INT32_TAG, xxhash.xxh3_64_intdigest(data))
        digests = memo.get(key, data)
        if digests is not None:
            return digests, ()
        return None, ((key, data.tobytes()),)

    def remember(self, entries: Sequence[tuple[MemoKey, bytes]], digests: list[bytes]) -> None:
        """Remember ``digests`` under each of ``entries`` (what a probe's miss named)."""
        for key, content in entries:
            self._memo.put(key, content, digests)

    def put_list(self, key: MemoKey, copy: list[int], digests: list[bytes]) -> None:
        """Remember ``digests`` for a list under ``key``, ``copy`` being a copy of the
        list that was hashed (see :meth:`_DigestMemo.get_list`)."""
        self._memo.put_list(key, copy, digests)
