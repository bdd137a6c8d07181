"""Tests for lmcache_async.keys.chunks: chained chunk keys, masks, block-hash keys, segment keys."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import operator
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import (
    DIGEST_SIZE,
    ChunkHasher,
    ChunkKey,
    ChunkSpan,
    DigestFrames,
    HashAlgorithm,
    Namespace,
    check_mask,
    split_digests,
    token_array,
)
from lmcache_async.keys.segments import SegmentHasher

NS = Namespace("org/model", "layout-v1", revision="abc123")
ALGORITHMS = list(HashAlgorithm)
REPO_ROOT = Path(__file__).resolve().parents[1]


def reference_hash(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """``H`` written straight from the design, independent of the module's helpers."""
    if algorithm is HashAlgorithm.BLAKE3:
        return lambda data: blake3.blake3(data).digest(length=16)
    return xxhash.xxh3_128_digest


def reference_seed(ns: Namespace, algorithm: HashAlgorithm) -> bytes:
    def field(value: str | None) -> bytes:
        if value is None:
            return b"\x00"
        data = value.encode()
        return b"\x01" + len(data).to_bytes(8, "little") + data

    fields = (ns.model_name, ns.layout_fingerprint, ns.revision, ns.tenant_salt)
    encoded = b"lmcache_async/namespace/v1\x00" + b"".join(field(f) for f in fields)
    return reference_hash(algorithm)(encoded)


def reference_tag(tenant: str | None) -> bytes:
    """The tenant tag, from the design: blake3 of a domain and the tagged name, 16 bytes."""
    data = b"\x00" if tenant is None else b"\x01" + tenant.encode()
    return blake3.blake3(b"lmcache_async/tenant/v1\x00" + data).digest(length=16)


def reference_key(link: bytes, ns: Namespace = NS) -> bytes:
    """A chain link as a key: the namespace tenant's 16-byte tag, then the whole link."""
    return reference_tag(ns.tenant_salt) + link


def reference_digests(
    tokens: list[int], chunk_size: int, algorithm: HashAlgorithm, ns: Namespace = NS
) -> list[bytes]:
    h = reference_hash(algorithm)
    prev = reference_seed(ns, algorithm)
    out = []
    for start in range(0, len(tokens), chunk_size):
        chunk = np.array(tokens[start : start + chunk_size], dtype="<i4").tobytes()
        prev = h(chunk + prev)
        out.append(reference_key(prev, ns))
    return out


def suffix_mask(n: int, start: int) -> torch.Tensor:
    mask = torch.ones(n, dtype=torch.bool)
    mask[:start] = False
    return mask


# --------------------------------------------------------------------------- exact bytes


@pytest.mark.parametrize(
    ("algorithm", "seed_hex", "first_hex"),
    [
        (
            HashAlgorithm.BLAKE3,
            "89be4f38e4c05e157a1646221dc65c09",
            ["89417729de91a74f97b368de359f3be6", "b24016c74221b1250177c8698f1e286b"],
        ),
        (
            HashAlgorithm.XXH3_128,
            "ed89e6c3d1ceeea03280b67179ac4204",
            ["aaae913cfb3033db2953954c1b647aec", "17c596a497582852532bc1c78d7d9144"],
        ),
    ],
)
def test_keys_are_pinned(algorithm: HashAlgorithm, seed_hex: str, first_hex: list[str]) -> None:
    # Keys name files on disk and values in Redis: a change here orphans every stored entry.
    # A key is the unnamed tenant's 16-byte tag, then the chain's whole 16-byte link (the
    # links are those of the 4-byte-tag keys, whose first 4 bytes the tag overwrote).
    assert NS.seed(algorithm).hex() == seed_hex
    digests = ChunkHasher(NS, chunk_size=4, algorithm=algorithm).digests(list(range(10)))
    tag = "095826d85f4b69268ac79df79707721e"
    assert [d.hex() for d in digests[:2]] == [tag + link for link in first_hex]
    assert len(digests) == 3 and all(len(d) == 32 == DIGEST_SIZE for d in digests)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digests_follow_the_chain_formula(algorithm: HashAlgorithm) -> None:
    tokens = [7, 0, 2**31 - 1, 5, 123456, 9, 1]
    hasher = ChunkHasher(NS, chunk_size=3, algorithm=algorithm)
    assert NS.seed(algorithm) == reference_seed(NS, algorithm)
    digests = hasher.digests(tokens)
    assert digests == reference_digests(tokens, 3, algorithm)
    assert all(len(d) == DIGEST_SIZE for d in digests)


@pytest.mark.subprocess
def test_keys_are_identical_in_another_process() -> None:
    tokens = list(range(1000, 1700))
    script = (
        "import json, sys\n"
        "from lmcache_async.keys.chunks import ChunkHasher, HashAlgorithm, Namespace\n"
        "ns = Namespace('org/model', 'layout-v1', revision='abc123', tenant_salt='t')\n"
        "tokens = json.loads(sys.argv[1])\n"
        "out = {a.value: [s.key.to_str() for s in ChunkHasher(ns, chunk_size=64, algorithm=a)"
        ".spans(tokens)] for a in HashAlgorithm}\n"
        "sys.stdout.write(json.dumps(out))\n"
    )
    ns = Namespace("org/model", "layout-v1", revision="abc123", tenant_salt="t")
    local = {
        a.value: [s.key.to_str() for s in ChunkHasher(ns, chunk_size=64, algorithm=a).spans(tokens)]
        for a in HashAlgorithm
    }
    # this process runs with a random (or the caller's) hash seed; the child gets another
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(tokens)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        cwd=REPO_ROOT,
        timeout=120,
        check=True,
    )
    assert json.loads(result.stdout) == local
    assert len(local["blake3"]) == 11
    assert local["blake3"] != local["xxh3_128"]


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_list_tensor_and_ndarray_give_the_same_keys(algorithm: HashAlgorithm) -> None:
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 50_000, 1000)]
    hasher = ChunkHasher(NS, chunk_size=16, algorithm=algorithm)
    expected = reference_digests(tokens, 16, algorithm)
    inputs: list[Any] = [
        tokens,
        tuple(tokens),
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=">i4"),  # big-endian
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # strided view
        torch.tensor(tokens, dtype=torch.int64).repeat_interleave(2)[::2],  # strided tensor
    ]
    for item in inputs:
        assert hasher.digests(item) == expected, type(item)
        assert [s.key.digest for s in hasher.spans(item)] == expected
    small = [1, 2, 255]
    for dtype in (torch.uint8, torch.int16, torch.uint16):
        assert hasher.digests(torch.tensor(small, dtype=dtype)) == hasher.digests(small)


def test_token_array_converts_to_little_endian_int32() -> None:
    for item in ([3, 1, 2], torch.tensor([3, 1, 2]), np.array([3, 1, 2], dtype=np.uint64)):
        array = token_array(item)
        assert array.dtype == np.dtype("<i4")
        assert array.ndim == 1
        assert array.tolist() == [3, 1, 2]
    assert token_array([]).shape == (0,)
    assert token_array([2**31 - 1, 0]).tobytes() == b"\xff\xff\xff\x7f\x00\x00\x00\x00"
    assert token_array(torch.tensor([5, 6], dtype=torch.int64)[[1, 0]]).tolist() == [6, 5]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor(3), "1-D"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
        (torch.tensor([1.0, 2.0]), "integer dtype"),
        (torch.tensor([True, False]), "integer dtype"),
        (np.array([1.5]), "integer dtype"),
        (np.array([True]), "integer dtype"),
        (np.array([], dtype=np.float32), "integer dtype"),
        (torch.tensor([1, -1]), ">= 0"),
        (np.array([0, -5], dtype=np.int8), ">= 0"),
        (np.array([2**31], dtype=np.int64), "< 2\\*\\*31"),
        (np.array([2**32 - 1], dtype=np.uint32), "< 2\\*\\*31"),
        (torch.tensor([2**40]), "< 2\\*\\*31"),
        ([1, -1], ">= 0"),
        ([1, 2**31], "2\\*\\*31"),
        ([1, 2.0], "must be ints, found float"),
        ([1, None], "must be ints, found NoneType"),
        ([[1, 2]], "must be ints, found list"),
        ("abc", "got str"),
        (b"abc", "got bytes"),
        (42, "got int"),
        ({1, 2}, "got set"),
    ],
)
def test_bad_tokens_are_refused(tokens: Any, message: str) -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    with pytest.raises(InvalidInputError, match=message):
        token_array(tokens)
    with pytest.raises(InvalidInputError, match=message):
        hasher.digests(tokens)
    with pytest.raises(InvalidInputError, match=message):
        hasher.spans(tokens)


def test_empty_tokens_have_no_chunks() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    assert hasher.digests([]) == []
    assert hasher.spans(torch.empty(0, dtype=torch.int64)) == []
    assert hasher.spans([], mask=torch.zeros(0, dtype=torch.bool)) == []


# --------------------------------------------------------------------------- chain properties


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_prefix_keys_and_change_propagation(algorithm: HashAlgorithm) -> None:
    hasher = ChunkHasher(NS, chunk_size=8, algorithm=algorithm)
    tokens = list(range(100, 180))  # 10 chunks
    full = hasher.digests(tokens)
    assert len(full) == 10
    assert len(set(full)) == 10
    assert hasher.digests(tokens[:40]) == full[:5]
    # a short prefix shares the full chunks; its trailing short chunk has its own key
    partial = hasher.digests(tokens[:45])
    assert partial[:5] == full[:5]
    assert partial[5] != full[5]
    changed = list(tokens)
    changed[8 * 4 + 3] += 1  # chunk 4
    other = hasher.digests(changed)
    assert other[:4] == full[:4]
    assert all(a != b for a, b in zip(other[4:], full[4:], strict=True))


def test_same_chunk_at_a_different_position_gets_a_different_key() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    a, b = hasher.digests([1, 2, 3, 4, 1, 2, 3, 4])
    assert a != b


@pytest.mark.parametrize(
    "other",
    [
        Namespace("org/model2", "layout-v1", revision="abc123"),
        Namespace("org/model", "layout-v2", revision="abc123"),
        Namespace("org/model", "layout-v1", revision="abc124"),
        Namespace("org/model", "layout-v1", revision=None),
        Namespace("org/model", "layout-v1", revision=""),
        Namespace("org/model", "layout-v1", revision="abc123", tenant_salt="tenant-a"),
        Namespace("org/model", "layout-v1", revision="abc123", tenant_salt=""),
        # field boundaries are part of the encoding
        Namespace("org/mode", "llayout-v1", revision="abc123"),
        Namespace("org/model", "layout-v1", revision=None, tenant_salt="abc123"),
    ],
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_namespace_field_changes_the_keys(other: Namespace, algorithm: HashAlgorithm) -> None:
    tokens = list(range(32))
    mine = ChunkHasher(NS, chunk_size=16, algorithm=algorithm).digests(tokens)
    theirs = ChunkHasher(other, chunk_size=16, algorithm=algorithm).digests(tokens)
    assert NS.seed(algorithm) != other.seed(algorithm)
    assert set(mine).isdisjoint(theirs)
    assert other.seed(algorithm) == reference_seed(other, algorithm)


def test_equal_namespaces_give_equal_seeds_and_algorithms_differ() -> None:
    twin = Namespace("org/model", "layout-v1", revision="abc123")
    assert twin == NS
    assert hash(twin) == hash(NS)
    assert twin.seed(HashAlgorithm.BLAKE3) == NS.seed(HashAlgorithm.BLAKE3)
    assert NS.seed(HashAlgorithm.BLAKE3) != NS.seed(HashAlgorithm.XXH3_128)
    assert NS.seed("xxh3_128") == NS.seed(HashAlgorithm.XXH3_128)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_name": "", "layout_fingerprint": "x"}, "model_name"),
        ({"model_name": 3, "layout_fingerprint": "x"}, "model_name"),
        ({"model_name": "m", "layout_fingerprint": ""}, "layout_fingerprint"),
        ({"model_name": "m", "layout_fingerprint": "x", "revision": 5}, "revision"),
        ({"model_name": "m", "layout_fingerprint": "x", "tenant_salt": b"s"}, "tenant_salt"),
        ({"model_name": "m\ud800", "layout_fingerprint": "x"}, "unicode"),
    ],
)
def test_bad_namespaces_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        Namespace(**kwargs)


def test_hasher_arguments_are_validated() -> None:
    for bad in (0, -4, 2.0, True, None):
        with pytest.raises(InvalidInputError, match="chunk_size"):
            ChunkHasher(NS, chunk_size=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="unknown hash algorithm 'md5'"):
        ChunkHasher(NS, chunk_size=4, algorithm="md5")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="Namespace"):
        ChunkHasher("ns", chunk_size=4)  # type: ignore[arg-type]
    hasher = ChunkHasher(NS, chunk_size=4, algorithm="xxh3_128")  # type: ignore[arg-type]
    assert hasher.algorithm is HashAlgorithm.XXH3_128
    assert hasher.chunk_size == 4
    assert hasher.namespace is NS
    assert ChunkHasher(NS, chunk_size=4).algorithm is HashAlgorithm.BLAKE3
    with pytest.raises(AttributeError):
        hasher.chunk_size = 8  # type: ignore[misc]


# --------------------------------------------------------------------------- spans and masks


def test_spans_cover_the_chunks_and_chain_parents() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    tokens = list(range(10))
    spans = hasher.spans(tokens)
    digests = hasher.digests(tokens)
    assert [(s.start, s.end, s.num_tokens) for s in spans] == [(0, 4, 4), (4, 8, 4), (8, 10, 2)]
    assert [s.key for s in spans] == [ChunkKey(d) for d in digests]
    assert [s.parent for s in spans] == [None, ChunkKey(digests[0]), ChunkKey(digests[1])]
    assert all(s.key.layer is None for s in spans)
    assert spans[1].parent is spans[0].key
    # spans built on the fast path behave like ordinary frozen dataclasses
    assert spans[0] == ChunkSpan(0, 4, ChunkKey(digests[0]), None)
    assert hash(spans[2].key) == hash(ChunkKey(digests[2]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spans[0].start = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        spans[0].key.layer = 1  # type: ignore[misc]


def test_save_unfull_chunk_drops_the_short_tail() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    tokens = list(range(10))
    kept = hasher.spans(tokens, save_unfull_chunk=False)
    assert [(s.start, s.end) for s in kept] == [(0, 4), (4, 8)]
    assert [s.key for s in kept] == [s.key for s in hasher.spans(tokens)[:2]]
    assert hasher.spans(tokens[:3], save_unfull_chunk=False) == []
    exact = hasher.spans(tokens[:8], save_unfull_chunk=False)
    assert [(s.start, s.end) for s in exact] == [(0, 4), (4, 8)]


def test_mask_skips_the_leading_chunks_but_keeps_the_chain() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    tokens = list(range(14))
    everything = hasher.spans(tokens)
    masked = hasher.spans(tokens, mask=suffix_mask(14, 8))
    assert masked == everything[2:]
    assert masked[0].parent == everything[1].key
    assert hasher.spans(tokens, mask=suffix_mask(14, 8), save_unfull_chunk=False) == everything[2:3]
    assert hasher.spans(tokens, mask=torch.zeros(14, dtype=torch.bool)) == []
    assert hasher.spans(tokens, mask=torch.ones(14, dtype=torch.bool)) == everything
    assert hasher.spans(tokens[:12], mask=suffix_mask(12, 12)) == []


def test_check_mask_returns_the_start() -> None:
    assert check_mask(None, 10, 4) == 0
    assert check_mask(torch.ones(10, dtype=torch.bool), 10, 4) == 0
    assert check_mask(suffix_mask(10, 8), 10, 4) == 8
    assert check_mask(torch.zeros(10, dtype=torch.bool), 10, 4) == 10
    assert check_mask(torch.zeros(0, dtype=torch.bool), 0, 4) == 0


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(9, dtype=torch.bool), "mask length 9 does not match the number of tokens 10"),
        (torch.ones(10, dtype=torch.int64), "dtype torch.bool"),
        (torch.ones(10, dtype=torch.float32), "dtype torch.bool"),
        (torch.ones(2, 5, dtype=torch.bool), "1-D"),
        ([True] * 10, "torch.Tensor"),
        (np.ones(10, dtype=bool), "torch.Tensor"),
        (torch.tensor([False] * 4 + [True] * 3 + [False] + [True] * 2), "position 7 is False"),
        (torch.tensor([True] * 9 + [False]), "position 9 is False after the first True at 0"),
        (suffix_mask(10, 3), "3 leading False tokens, which is not a multiple of chunk_size 4"),
        (suffix_mask(10, 9), "not a multiple of chunk_size"),
    ],
)
def test_bad_masks_are_refused(mask: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        check_mask(mask, 10, 4)
    with pytest.raises(InvalidInputError, match=message):
        ChunkHasher(NS, chunk_size=4).spans(list(range(10)), mask=mask)


def test_check_mask_validates_its_sizes() -> None:
    with pytest.raises(InvalidInputError, match="chunk_size"):
        check_mask(None, 10, 0)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        check_mask(None, -1, 4)


# --------------------------------------------------------------------------- block hashes


def reference_hash_spans(
    hashes: list[int | bytes], algorithm: HashAlgorithm = HashAlgorithm.BLAKE3
) -> list[bytes]:
    h = reference_hash(algorithm)
    prev = reference_seed(NS, algorithm)
    out = []
    for item in hashes:
        if isinstance(item, bytes):
            padding = bytes(-len(item) % 4)
            encoded = b"\x02" + len(item).to_bytes(8, "little") + item + padding
        else:
            encoded = b"\x01" + item.to_bytes(32, "little", signed=True)
        prev = h(encoded + prev)
        out.append(reference_key(prev))
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_spans_from_hashes_chain_the_block_hashes(algorithm: HashAlgorithm) -> None:
    hasher = ChunkHasher(NS, chunk_size=4, algorithm=algorithm)
    hashes: list[int | bytes] = [-(2**255), b"\x00" * 32, 2**255 - 1, b"", b"\x07" * 5]
    spans = hasher.spans_from_hashes(hashes, [4, 8, 12, 16, 18])
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 18)]
    expected = reference_hash_spans(hashes, algorithm)
    assert [s.key.digest for s in spans] == expected
    assert [s.parent for s in spans] == [None, *[ChunkKey(d) for d in expected[:4]]]
    # an int and bytes with the same 32 bytes are different blocks
    as_int = hasher.spans_from_hashes([0], [4])
    as_bytes = hasher.spans_from_hashes([b"\x00" * 32], [4])
    assert as_int[0].key != as_bytes[0].key
    # block-hash keys never equal token keys of the same length
    assert as_int[0].key.digest not in hasher.digests([0, 0, 0, 0])


@pytest.mark.parametrize("length", [3, 7, 11, 27, 31, 55])
def test_a_bytes_block_hash_never_shares_a_key_with_a_chunk_of_tokens(length: int) -> None:
    # Without padding, a bytes hash of 3 mod 4 bytes is linked in as long as a chunk of
    # int32 tokens: these tokens would spell its encoding and get its key.
    hasher = ChunkHasher(NS, chunk_size=16)
    value = b"\x01" * length
    unpadded = b"\x02" + length.to_bytes(8, "little") + value
    tokens = np.frombuffer(unpadded, dtype="<i4").tolist()
    assert all(token >= 0 for token in tokens) and len(tokens) <= 16
    by_hash = hasher.spans_from_hashes([value], [len(tokens)])
    by_tokens = hasher.spans(tokens)
    assert by_hash[0].key != by_tokens[0].key


def test_spans_from_hashes_prefix_mask_and_unfull() -> None:
    hasher = ChunkHasher(NS, chunk_size=4)
    hashes: list[int | bytes] = [11, 22, 33]
    full = hasher.spans_from_hashes(hashes, [4, 8, 10])
    assert hasher.spans_from_hashes(hashes[:2], [4, 8]) == full[:2]
    assert hasher.spans_from_hashes(hashes, [4, 8, 10], save_unfull_chunk=False) == full[:2]
    assert hasher.spans_from_hashes(hashes, [4, 8, 10], mask=suffix_mask(10, 4)) == full[1:]
    assert hasher.spans_from_hashes(hashes, [4, 8, 12], save_unfull_chunk=False)[2].end == 12
    assert hasher.spans_from_hashes([], []) == []
    with pytest.raises(InvalidInputError, match="mask length 8"):
        hasher.spans_from_hashes(hashes, [4, 8, 10], mask=torch.ones(8, dtype=torch.bool))
    with pytest.raises(InvalidInputError, match="not a multiple"):
        hasher.spans_from_hashes(hashes, [4, 8, 10], mask=suffix_mask(10, 2))


@pytest.mark.parametrize(
    ("hashes", "offsets", "message"),
    [
        ([1, 2], [4], "2 hashes but 1 offsets"),
        ([1], [], "1 hashes but 0 offsets"),
        ([1, 2], [4, 4], "strictly increasing"),
        ([1], [0], "strictly increasing"),
        ([1, 2], [4, 3], "strictly increasing"),
        ([1], [-4], "strictly increasing"),
        ([1, 2], [3, 7], "hashes\\[0\\] covers 3 tokens"),
        ([1, 2], [4, 9], "hashes\\[1\\] covers 5 tokens"),
        ([1], [5], "hashes\\[0\\] covers 5 tokens"),
        ([1, 2], [4, 8.0], "offsets\\[1\\] must be an int"),
        ([1], [True], "offsets\\[0\\] must be an int"),
        ([1.5], [4], "hashes\\[0\\] must be an int or bytes, got float"),
        ([True], [4], "hashes\\[0\\] must be an int or bytes, got bool"),
        (["ab"], [4], "hashes\\[0\\] must be an int or bytes, got str"),
        ([2**255], [4], "does not fit in 32 signed bytes"),
        ([-(2**255) - 1], [4], "does not fit"),
        ("ab", [4, 8], "hashes must be a sequence"),
        ([1], 4, "offsets must be a sequence"),
    ],
)
def test_spans_from_hashes_validation(hashes: Any, offsets: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        ChunkHasher(NS, chunk_size=4).spans_from_hashes(hashes, offsets)


# --------------------------------------------------------------------------- segments

SEP = [900, 901]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_segment_keys_do_not_depend_on_position(algorithm: HashAlgorithm) -> None:
    hasher = SegmentHasher(NS, separator=SEP, algorithm=algorithm)
    doc_a, doc_b, question = [1, 2, 3], [4, 5, 6, 7], [8, 9]
    first = hasher.spans(doc_a + SEP + doc_b + SEP + question)
    second = hasher.spans(doc_b + SEP + question + SEP + doc_a)
    assert [(s.start, s.end) for s in first] == [(0, 3), (5, 9), (11, 13)]
    assert [(s.start, s.end) for s in second] == [(0, 4), (6, 8), (10, 13)]
    assert [s.key for s in first] == [second[2].key, second[0].key, second[1].key]
    assert all(s.parent is None for s in first + second)
    h = reference_hash(algorithm)
    seed = NS.seed(algorithm)
    for span, doc in zip(first, (doc_a, doc_b, question), strict=True):
        assert span.key.digest == reference_key(h(np.array(doc, dtype="<i4").tobytes() + seed))


def test_segments_skip_empty_pieces_and_handle_edges() -> None:
    hasher = SegmentHasher(NS, separator=SEP)
    assert hasher.spans([]) == []
    assert hasher.spans(SEP + SEP) == []
    assert [(s.start, s.end) for s in hasher.spans([*SEP, 1, *SEP, *SEP, 2, 3, *SEP])] == [
        (2, 3),
        (7, 9),
    ]
    # no separator: one segment, the whole input; a lone half separator is ordinary text
    assert [(s.start, s.end) for s in hasher.spans([5, 900, 6])] == [(0, 3)]
    assert [(s.start, s.end) for s in hasher.spans([901, 900])] == [(0, 2)]
    # overlapping occurrences: leftmost first; the leftover 7 opens the next segment
    triple = SegmentHasher(NS, separator=[7, 7])
    assert [(s.start, s.end) for s in triple.spans([1, 7, 7, 7, 2])] == [(0, 1), (3, 5)]
    lists = hasher.spans([1, 2, *SEP, 3])
    assert hasher.spans(torch.tensor([1, 2, *SEP, 3])) == lists
    assert hasher.spans(np.array([1, 2, *SEP, 3], dtype=np.uint16)) == lists
    assert hasher.separator == (900, 901)
    assert hasher.algorithm is HashAlgorithm.BLAKE3
    assert hasher.namespace is NS


def test_segment_hasher_validation() -> None:
    with pytest.raises(InvalidInputError, match="at least one token"):
        SegmentHasher(NS, separator=[])
    with pytest.raises(InvalidInputError, match=">= 0"):
        SegmentHasher(NS, separator=[-1])
    with pytest.raises(InvalidInputError, match="Namespace"):
        SegmentHasher(None, separator=[1])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="integer dtype"):
        SegmentHasher(NS, separator=[1]).spans(torch.tensor([1.0]))


# --------------------------------------------------------------------------- ChunkKey


HEX = bytes(range(DIGEST_SIZE)).hex()
"""The text form of the key whose digest is ``0, 1, ..., 31``."""


def test_chunk_key_text_round_trip() -> None:
    digest = bytes(range(DIGEST_SIZE))
    key = ChunkKey(digest)
    assert key.to_str() == HEX and len(HEX) == 64
    assert str(key) == key.to_str()
    assert repr(key) == f"ChunkKey('{HEX}')"
    layered = key.with_layer(12)
    assert layered == ChunkKey(digest, 12)
    assert layered.to_str() == HEX + "@L12"
    assert key.with_layer(0).to_str().endswith("@L0")
    for item in (key, layered, key.with_layer(0)):
        assert ChunkKey.from_str(item.to_str()) == item
    assert key != layered
    assert len({key, ChunkKey(bytes(digest)), layered}) == 2
    # A whole-chunk key is its digest: a tier's index can be probed with the bare digest.
    assert {key: 1}.get(digest) == 1
    assert layered.digest == digest and layered.layer == 12 and key.layer is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "00" * 31,
        "00" * 33,
        "00" * 16,  # a key of the 16-byte format
        HEX.upper(),
        HEX[:-1] + "g",
        HEX + "@L",
        HEX + "@L-1",
        HEX + "@L01",
        HEX + "@l1",
        HEX + "@L1 ",
        HEX + "\n",
        " " + HEX,
        HEX + "@L\u0661",
    ],
)
def test_chunk_key_from_str_refuses_other_forms(text: str) -> None:
    with pytest.raises(InvalidInputError, match="not a chunk key"):
        ChunkKey.from_str(text)


def test_chunk_key_validation() -> None:
    with pytest.raises(InvalidInputError, match="32 bytes"):
        ChunkKey(b"\x00" * 31)
    with pytest.raises(InvalidInputError, match="32 bytes"):
        ChunkKey(bytearray(DIGEST_SIZE))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="32 bytes"):
        ChunkKey("00" * DIGEST_SIZE)  # type: ignore[arg-type]
    for layer in (-1, True, 1.0, "1"):
        with pytest.raises(InvalidInputError, match="layer"):
            ChunkKey(b"\x00" * DIGEST_SIZE, layer)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="layer"):
        ChunkKey(b"\x00" * DIGEST_SIZE).with_layer(-2)
    with pytest.raises(InvalidInputError, match="must be a str"):
        ChunkKey.from_str(b"00" * DIGEST_SIZE)  # type: ignore[arg-type]


def test_chunk_span_validation() -> None:
    key = ChunkKey(b"\x01" * DIGEST_SIZE)
    assert ChunkSpan(3, 7, key, None).num_tokens == 4
    for start, end in ((4, 4), (5, 4), (-1, 2), (0.0, 2)):
        with pytest.raises(InvalidInputError, match="start < end"):
            ChunkSpan(start, end, key, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="key must be a ChunkKey"):
        ChunkSpan(0, 1, b"\x01" * DIGEST_SIZE, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="parent must be a ChunkKey"):
        ChunkSpan(0, 1, key, "x")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- properties


@st.composite
def token_cases(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """(tokens, chunk_size, mask start): the start is a multiple of chunk_size or len(tokens)."""
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), max_size=80))
    chunk_size = draw(st.integers(1, 12))
    full = len(tokens) // chunk_size
    start = draw(st.sampled_from([*(k * chunk_size for k in range(full + 1)), len(tokens)]))
    return tokens, chunk_size, start


@settings(max_examples=150, deadline=None)
@given(token_cases(), st.booleans(), st.sampled_from(ALGORITHMS))
def test_spans_cover_the_masked_range(
    case: tuple[list[int], int, int], save_unfull: bool, algorithm: HashAlgorithm
) -> None:
    tokens, chunk_size, start = case
    n = len(tokens)
    hasher = ChunkHasher(NS, chunk_size=chunk_size, algorithm=algorithm)
    mask = suffix_mask(n, start)
    spans = hasher.spans(tokens, mask=mask, save_unfull_chunk=save_unfull)
    end = n if save_unfull else n - n % chunk_size
    if start >= end:
        assert spans == []
    else:
        assert spans[0].start == start
        assert spans[-1].end == end
        for left, right in itertools.pairwise(spans):
            assert left.end == right.start
            assert right.parent == left.key
        assert all(s.num_tokens == chunk_size for s in spans[:-1])
        assert 0 < spans[-1].num_tokens <= chunk_size
    tensor_spans = hasher.spans(
        torch.tensor(tokens, dtype=torch.int64), mask=mask, save_unfull_chunk=save_unfull
    )
    assert tensor_spans == spans
    all_digests = hasher.digests(tokens)
    assert all_digests == reference_digests(tokens, chunk_size, algorithm)
    assert [s.key.digest for s in spans] == all_digests[start // chunk_size :][: len(spans)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=60), st.integers(1, 10), st.data())
def test_prefix_keys_are_a_prefix(tokens: list[int], chunk_size: int, data: st.DataObject) -> None:
    hasher = ChunkHasher(NS, chunk_size=chunk_size)
    cut = data.draw(st.integers(0, len(tokens)))
    full_chunks = cut // chunk_size
    assert hasher.digests(tokens[:cut])[:full_chunks] == hasher.digests(tokens)[:full_chunks]
    assert hasher.digests(np.array(tokens[:cut], dtype=np.int64)) == hasher.digests(tokens[:cut])


def test_split_digests_gives_each_digest_whole() -> None:
    size = DIGEST_SIZE
    digests = [
        bytes(size),
        b"a" * (size - 1) + b"\0",
        b"\0" + b"b" * (size - 1),
        bytes(range(size)),
    ]
    for joined in (b"".join(digests), bytearray(b"".join(digests)), memoryview(b"".join(digests))):
        got = split_digests(joined)
        assert got == digests  # zero bytes kept
        assert all(type(digest) is bytes for digest in got)
    assert split_digests(b"") == []
    with pytest.raises(InvalidInputError, match="multiple of 32"):
        split_digests(bytes(DIGEST_SIZE + 1))
    with pytest.raises(InvalidInputError, match="multiple of 32"):
        split_digests(bytes(16))  # one digest of the 16-byte format
    as_words = memoryview(b"".join(digests)).cast("Q")  # any item format: read as bytes
    assert split_digests(as_words) == digests
    with pytest.raises(InvalidInputError, match="contiguous"):
        split_digests(memoryview(b"".join(digests))[::2])


def test_a_digest_frame_cut_again_gives_the_same_keys_in_a_new_list() -> None:
    frames = DigestFrames(2)
    digests = [bytes([i]) * (DIGEST_SIZE - 1) + b"\0" for i in range(8)]
    joined = b"".join(digests)
    first = frames.split(memoryview(joined))
    again = frames.split(bytearray(joined))  # equal bytes, another buffer
    assert first == again == digests
    assert again is not first and all(map(operator.is_, first, again))  # hashed once
    again.clear()  # the caller's own list
    assert frames.split(joined) == digests
    # Another frame of the same length, one byte changed: cut anew, never confused.
    changed = bytearray(joined)
    changed[80] ^= 1
    assert frames.split(changed) == split_digests(bytes(changed)) != digests
    changed[80] ^= 1  # the buffer now holds the first frame's bytes again
    assert frames.split(changed) == digests
    assert len(frames) == 2
    frames.split(bytes(2 * DIGEST_SIZE))
    frames.split(bytes(3 * DIGEST_SIZE))
    assert len(frames) == 2  # the oldest went
    assert frames.split(b"") == []
    with pytest.raises(InvalidInputError, match="multiple of 32"):
        frames.split(bytes(DIGEST_SIZE + 1))
    with pytest.raises(InvalidInputError, match="contiguous"):
        frames.split(memoryview(joined)[::2])
    with pytest.raises(InvalidInputError, match="capacity"):
        DigestFrames(0)


# --------------------------------------------------------------------------- digest memo


def test_memo_returns_exact_digests_and_never_confuses_prompts() -> None:
    plain = ChunkHasher(NS, chunk_size=16)
    memo = ChunkHasher(NS, chunk_size=16, memo_size=2, memo_min_tokens=64)
    tokens = list(range(1000, 1200))
    first = memo.digests(tokens)
    assert first == plain.digests(tokens)
    first.clear()  # callers get their own list: the memo cannot be corrupted through it
    assert memo.digests(tokens) == plain.digests(tokens)
    for position in (0, 99, 199):  # same length, one token changed: never a memo hit
        changed = list(tokens)
        changed[position] += 1
        assert memo.digests(changed) == plain.digests(changed)
    assert memo.spans(tokens, save_unfull_chunk=False) == plain.spans(
        tokens, save_unfull_chunk=False
    )
    short = tokens[:50]  # below memo_min_tokens: hashed directly
    assert memo.digests(short) == plain.digests(short)


def test_memo_size_is_validated() -> None:
    with pytest.raises(InvalidInputError, match="memo_size"):
        ChunkHasher(NS, chunk_size=16, memo_size=-1)


def test_remembered_probes_the_memo_without_hashing() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    tokens = torch.arange(100, 300)
    assert memo.remembered(tokens) is None
    digests = memo.digests(tokens)
    assert memo.remembered(tokens) == digests
    assert memo.remembered(tokens.tolist()) is None  # a list is known once hashed as one
    assert ChunkHasher(NS, chunk_size=16).remembered(tokens) is None  # no memo


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_remembered_knows_a_prompt_in_the_dtype_it_came_in(dtype: torch.dtype) -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=2, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = torch.arange(0, 200).to(dtype)
    assert memo.digests(tokens) == plain.digests(tokens)
    for same in (tokens, tokens.clone(), tokens.to(torch.int32), tokens.numpy()):
        assert memo.remembered(same) == plain.digests(tokens)
    changed = tokens.clone()
    changed[150] += 1
    assert memo.remembered(changed) is None
    assert memo.remembered(tokens[::2]) is None  # strided: hashed, never misread
    if dtype.is_signed:
        negative = tokens.clone()
        negative[3] = -1
        # Bytes that match no remembered prompt are never a hit (checked now, or by the
        # hashing that follows a miss).
        with contextlib.suppress(InvalidInputError):
            assert memo.remembered(negative) is None
        with pytest.raises(InvalidInputError, match=">= 0"):
            memo.digests(negative)


def test_the_memo_compares_bytes_when_fingerprints_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: 7)  # every key collides
    tokens = torch.arange(300, 500, dtype=torch.int64)
    memo.digests(tokens)
    changed = tokens.clone()
    changed[-1] += 1
    for other in (changed, tokens[:192], torch.cat([tokens, tokens[:16]])):
        assert memo.probe(other).digests is None  # a changed, a shorter, a longer prompt
        assert memo.digests(other) == plain.digests(other)
    assert memo.remembered(tokens.clone()) is None  # the last one hashed took the key
    assert memo.digests(tokens) == plain.digests(tokens)


def viewed(views: Any, tensor: torch.Tensor) -> np.ndarray | None:
    """The ndarray a hasher's tensor views give for ``tensor``."""
    view = views.view(tensor)
    return None if view is None else view.array


def test_a_tensor_asked_about_again_is_viewed_once_while_it_lies_where_it_did() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = torch.arange(1000, 1300, dtype=torch.int64)
    expected = plain.digests(tokens)
    assert memo.digests(tokens) == expected
    views = None if memo._memo is None else memo._memo.tensor_views
    assert views is not None
    first = viewed(views, tokens)
    assert first is not None and viewed(views, tokens) is first  # viewed once
    assert first.base is not None and not isinstance(first.base, torch.Tensor)
    tokens[7] += 1  # new content in the same memory: seen through the view, a miss
    assert memo.remembered(tokens) is None
    assert memo.digests(tokens) == plain.digests(tokens)
    tokens[7] -= 1
    assert memo.remembered(tokens) == expected
    # Moved, reshaped or retyped in place: viewed anew, never read through the old view.
    tokens.resize_(200)
    assert viewed(views, tokens) is not first
    assert memo.digests(tokens) == plain.digests(tokens)
    moved = torch.arange(5000, 5300, dtype=torch.int64)
    tokens.set_(moved.untyped_storage(), 0, (300,), (1,))
    assert memo.digests(tokens) == plain.digests(moved)
    tokens.data = torch.arange(1000, 1300, dtype=torch.int32)
    assert memo.remembered(tokens) == expected  # its int32 form was remembered
    retyped = viewed(views, tokens)
    assert retyped is not None and retyped.dtype == np.int32


def test_tensor_views_keep_no_tensor_alive_and_stay_bounded() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=2, memo_min_tokens=64)
    views = None if memo._memo is None else memo._memo.tensor_views
    assert views is not None
    tokens = torch.arange(1000, 1300, dtype=torch.int64)
    gone = weakref.ref(tokens)
    expected = memo.digests(tokens)
    assert len(views._views) == 1
    del tokens
    gc.collect()
    assert gone() is None  # the view did not keep it
    # A new tensor, wherever it lies (even at the collected one's address), is viewed anew.
    again = torch.arange(1000, 1300, dtype=torch.int64)
    assert memo.remembered(again) == expected
    assert views._views[id(again)].ref() is again
    kept = [torch.arange(i, i + 300, dtype=torch.int64) for i in range(5)]
    for tensor in kept:
        memo.remembered(tensor)
    assert len(views._views) == 2  # the two most recent
    assert {id(kept[3]), id(kept[4])} == set(views._views)


def test_a_guess_holds_only_while_the_tensor_keeps_the_tokens_it_was_made_of() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = torch.arange(1000, 1300, dtype=torch.int64)
    assert memo.guess(tokens) is None  # never probed
    expected = memo.digests(tokens)
    guess = memo.guess(tokens)
    assert guess is not None and guess.num_tokens == 300
    assert list(guess.digests) == expected and guess.confirm()
    tokens[150] += 1  # changed in place: still guessed, never confirmed
    stale = memo.guess(tokens)
    assert stale is not None and list(stale.digests) == expected
    assert not stale.confirm() and not guess.confirm()  # compared when asked, not before
    changed = memo.digests(tokens)
    assert changed == plain.digests(tokens) != expected
    fresh = memo.guess(tokens)
    assert fresh is not None and list(fresh.digests) == changed and fresh.confirm()
    tokens[150] -= 1
    assert fresh.confirm() is False
    # Equal tokens in another tensor, or the same tensor moved, are not guessed.
    assert memo.guess(torch.arange(1000, 1300, dtype=torch.int64)) is None
    tokens.set_(torch.arange(1000, 1300, dtype=torch.int64).untyped_storage(), 0, (300,), (1,))
    assert memo.guess(tokens) is None
    # Too short to remember, a device-less memo, other kinds of tokens: nothing to go on.
    short = torch.arange(1000, 1030, dtype=torch.int64)
    memo.digests(short)
    assert memo.guess(short) is None
    none = ChunkHasher(NS, chunk_size=16)
    none.digests(tokens)
    assert none.guess(tokens) is None
    array = np.arange(1000, 1300, dtype=np.int64)
    memo.digests(array)
    assert memo.guess(array) is None and memo.guess(b"\0" * 1200) is None


def test_a_guess_for_a_list_needs_its_objects_and_holds_only_while_it_is_unchanged() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = list(range(100_000, 100_300))
    assert memo.guess(tokens) is None
    expected = memo.digests(tokens)
    for same in (tokens, list(tokens)):
        guess = memo.guess(same)
        assert guess is not None and guess.num_tokens == 300
        assert list(guess.digests) == expected and guess.confirm()
    # A change past the objects compared up front, and not at a sampled item: guessed,
    # then refused by the comparison.
    changed = list(tokens)
    changed[70] += 1
    wrong = memo.guess(changed)
    assert wrong is not None and not wrong.confirm()
    assert memo.digests(changed) == plain.digests(changed)
    # New int objects, a change among the first items, another length: no guess.
    assert memo.guess([int(str(token)) for token in tokens]) is None
    early = list(tokens)
    early[3] += 1
    assert memo.guess(early) is None
    assert memo.guess(tokens[:-1]) is None
    kept = memo.guess(tokens)
    assert kept is not None
    tokens[200] += 1  # the caller's own list changed after the guess
    assert not kept.confirm()


def test_a_list_asked_about_again_is_recognised_and_never_confused() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = list(range(100_000, 100_300))  # ints beyond the small-int cache: own objects
    expected = plain.digests(tokens)
    assert memo.remembered(tokens) is None
    assert memo.digests(tokens) == expected
    assert memo.remembered(tokens) == expected  # the same list
    assert memo.remembered(list(tokens)) == expected  # a copy: the same int objects
    # Three items find the entry, so a change anywhere else must be caught by comparing.
    for position in (1, 70, 151, 298):
        changed = list(tokens)
        changed[position] += 1
        assert memo.remembered(changed) is None
        assert memo.digests(changed) == plain.digests(changed)
    assert memo.remembered(tokens[:-1]) is None
    assert memo.remembered([*tokens, 5]) is None
    # Equal values in new int objects are not compared on the caller's thread; hashing
    # finds their int32 form remembered.
    rebuilt = [int(str(token)) for token in tokens]
    assert memo.remembered(rebuilt) is None
    assert memo.digests(rebuilt) == expected


def test_a_remembered_list_is_a_copy_the_caller_cannot_change() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = list(range(200_000, 200_200))
    memo.digests(tokens)
    tokens[37] = 7  # changed in place after it was hashed (not one of the three items)
    assert memo.remembered(tokens) is None
    assert memo.digests(tokens) == plain.digests(tokens)
    assert memo.remembered(tokens) == plain.digests(tokens)


def test_the_memo_keeps_fewer_lists_than_prompts() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=16, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    prompts = [list(range(start, start + 100)) for start in range(10_000, 22_000, 1000)]
    for tokens in prompts:
        memo.digests(tokens)
    kept = [memo.remembered(tokens) is not None for tokens in prompts]
    assert kept == [False] * (len(prompts) - 8) + [True] * 8  # the newest 8 lists
    for tokens in prompts:  # the int32 forms are all kept: hashing is spared for every one
        assert memo.remembered(np.array(tokens, dtype=np.int32)) == plain.digests(tokens)


@pytest.mark.parametrize(
    "bad",
    [[[1]] * 100, [1.5] * 100, [*range(99), "x"], [*range(99), -1], [*range(50), None, *range(49)]],
    ids=["unhashable", "float", "str", "negative", "none"],
)
def test_a_bad_list_is_refused_whether_or_not_the_memo_was_asked(bad: list[object]) -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=4, memo_min_tokens=64)
    assert memo.probe(bad).digests is None  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        memo.digests(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        memo.digests(bad)  # type: ignore[arg-type]


def test_the_memo_holds_memo_size_prompts_in_both_forms() -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=2, memo_min_tokens=64)
    prompts = [torch.arange(start, start + 100, dtype=torch.int64) for start in (0, 1000, 2000)]
    for tokens in prompts:
        memo.digests(tokens)  # the third makes room: the first goes, in both forms
    assert memo.remembered(prompts[0]) is None
    assert memo.remembered(prompts[0].to(torch.int32)) is None
    assert all(memo.remembered(t) is not None for t in prompts[1:])
    assert all(memo.remembered(t.to(torch.int32)) is not None for t in prompts[1:])


def test_the_memo_holds_at_most_its_bytes_whatever_the_prompts() -> None:
    """Four prompts of 1,000 tokens (~8.5 KB each as the memo keeps them, with their
    digests) in a memo of 20 KB: only the newest two stay; a prompt larger than the budget
    is not kept at all."""
    memo = ChunkHasher(NS, chunk_size=16, memo_size=8, memo_min_tokens=64, memo_max_bytes=20_000)
    prompts = [np.arange(start, start + 1000, dtype=np.int32) for start in range(0, 4000, 1000)]
    for tokens in prompts:
        memo.digests(tokens)
    assert [memo.remembered(t) is not None for t in prompts] == [False, False, True, True]
    huge = np.arange(10**6, 10**6 + 10_000, dtype=np.int32)  # over 20 KB of tokens alone
    memo.digests(huge)
    assert memo.remembered(huge) is None
    assert memo.remembered(prompts[3]) is not None  # nothing else was pushed out for it


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_hashing_after_a_probe_reuses_it_and_fills_the_memo(dtype: torch.dtype) -> None:
    memo = ChunkHasher(NS, chunk_size=16, memo_size=2, memo_min_tokens=64)
    plain = ChunkHasher(NS, chunk_size=16)
    tokens = torch.arange(500, 700).to(dtype)
    probe = memo.probe(tokens)
    assert probe.digests is None
    assert memo.digests(tokens, probe=probe) == plain.digests(tokens)
    # Remembered in the form it came in and in the int32 form, like digests() alone.
    assert memo.remembered(tokens) == plain.digests(tokens)
    assert memo.remembered(tokens.to(torch.int32)) == plain.digests(tokens)
    hit = memo.probe(tokens.clone())
    assert hit.digests == plain.digests(tokens)
    assert memo.digests(tokens, probe=hit) == plain.digests(tokens)
    # Tokens that fail the checks still fail when hashed after a miss.
    bad = tokens.clone()
    bad[7] = -1
    with pytest.raises(InvalidInputError, match=">= 0"):
        memo.digests(bad, probe=memo.probe(bad))
