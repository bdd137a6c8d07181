"""Encryption at rest: key files, the sealed record format, and the disk and Redis tiers
storing no plaintext, reading back exact bytes, and treating a record they cannot
authenticate as a corrupt miss.

The disk tests use real files under ``tmp_path``; the Redis tests a real ``redis-server``.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.asyncio.cluster
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lmcache_async.backends.cipher import (
    AUTH_TAG_BYTES,
    KEY_FIELD,
    PIECE_BYTES,
    RecordCipher,
    parse_key,
)
from lmcache_async.backends.codec import Codec
from lmcache_async.backends.disk import CHUNK_SUFFIX, DiskBackend
from lmcache_async.backends.record import (
    FORMAT_VERSION,
    PREFIX_SIZE,
    SEALED_FORMAT_VERSION,
    RecordHeader,
    RecordSpec,
    tensor_bytes,
)
from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX, RedisBackend
from lmcache_async.config import EngineConfig
from lmcache_async.engine.tiers import record_cipher, record_spec
from lmcache_async.errors import ConfigError, IntegrityError, InvalidInputError
from lmcache_async.keys.chunks import LINK_SIZE, ChunkKey
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES
from tests.servers import RedisCluster, RedisServer

PAGE = 4096
MASTER = bytes(range(7, 7 + 32))
OTHER = bytes(range(100, 132))
PATTERN = b"\xa5KV-PLAINTEXT-\x5a"  # 16 bytes, repeated through every payload
# A payload inside the disk tier's first read (2 KiB), one read in several pieces, and one
# decrypted from the mapped file (from 1 MiB on).
SMALL = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)
LARGE = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
)
HUGE = KVLayout.vllm_flash_attn(
    num_layers=4, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
)
TOKENS = {SMALL: 16, LARGE: 96, HUGE: 96}  # LARGE: 768 KiB chunks, HUGE: 1.5 MiB
LAYOUTS = {"small": SMALL, "large": LARGE, "huge": HUGE}


def make_spec(
    layout: KVLayout = SMALL, cipher: RecordCipher | None = None, codec: Codec = Codec.NONE
) -> RecordSpec:
    return RecordSpec(
        fingerprint=layout.fingerprint,
        fmt=str(layout.fmt),
        dtype=layout.dtype,
        max_tokens=TOKENS[layout],
        shape_of=layout.payload_shape,
        codec=codec,
        cipher=cipher,
    )


def key(i: int, tenant: int = 0) -> ChunkKey:
    """A chunk key whose tenant tag (its first TAG_BYTES bytes) is ``tenant``."""
    return ChunkKey(tenant.to_bytes(TAG_BYTES, "little") + i.to_bytes(LINK_SIZE, "little"))


def pattern_bytes(nbytes: int, i: int) -> torch.Tensor:
    """``PATTERN`` repeated over ``nbytes``, chunk ``i``'s own index in every 4 KiB."""
    data = bytearray((PATTERN * (nbytes // len(PATTERN) + 1))[:nbytes])
    data[::PAGE] = bytes([i % 256]) * len(data[::PAGE])
    return torch.frombuffer(data, dtype=torch.uint8)


def make_obj(pool: MemoryPool, layout: KVLayout, i: int, tokens: int | None = None) -> MemoryObj:
    obj = pool.allocate_nowait(layout.payload_shape(tokens or TOKENS[layout]), layout.dtype)
    assert obj is not None
    tensor_bytes(obj.tensor)[:] = pattern_bytes(obj.nbytes, i).numpy().data
    return obj


def same_bytes(obj: MemoryObj | None, expected: MemoryObj) -> bool:
    return obj is not None and bytes(tensor_bytes(obj.tensor)) == bytes(
        tensor_bytes(expected.tensor)
    )


def release(objs: list[Any]) -> None:
    for obj in objs:
        if obj is not None:
            obj.unref()


def write_key_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    pool = MemoryPool(64 << 20, page_size=PAGE, pin_memory=False)
    yield pool
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


# --------------------------------------------------------------------------- key files


@pytest.mark.parametrize(
    "data",
    [MASTER, MASTER.hex().encode(), b"  \n" + MASTER.hex().upper().encode() + b"\r\n\t"],
    ids=["raw", "hex", "hex_with_whitespace"],
)
def test_key_file_holds_raw_or_hex_key(tmp_path: Path, data: bytes) -> None:
    cipher = RecordCipher.from_key_file(write_key_file(tmp_path / "key", data))
    assert cipher.key_id == RecordCipher(MASTER).key_id
    assert cipher.key_id != RecordCipher(OTHER).key_id


BAD_KEY_FILES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "holds 0 bytes"),
    "short_raw": (MASTER[:31], "holds 31 bytes"),
    "raw_with_newline": (MASTER + b"\n", "holds 33 bytes"),
    "short_hex": (MASTER.hex()[:-1].encode(), "holds 63 bytes"),
    "long_hex": (MASTER.hex().encode() + b"a", "holds 65 bytes"),
    "not_hex": (MASTER.hex()[:-1].encode() + b"g", "not all hex digits"),
    "hex_16_byte_key": (MASTER[:16].hex().encode(), "a 16-byte key"),
    "all_zero": (bytes(32), "one byte repeated"),
    "all_zero_hex": (b"00" * 32, "one byte repeated"),
    "huge": (MASTER * 200, "larger than 4096 bytes"),
}


@pytest.mark.parametrize("case", list(BAD_KEY_FILES))
def test_bad_key_file_is_a_config_error_that_shows_no_key(tmp_path: Path, case: str) -> None:
    data, message = BAD_KEY_FILES[case]
    path = write_key_file(tmp_path / "key", data)
    with pytest.raises(ConfigError, match=message) as caught:
        RecordCipher.from_key_file(path)
    assert caught.value.field == KEY_FIELD == "encryption_key_file"
    text = str(caught.value)
    assert text.startswith("encryption_key_file: ")
    assert "openssl rand -hex 32" in text
    secrets = (data[:16].hex(), repr(data[:16])[2:-1], data[:16].decode("latin-1"))
    for secret in (*secrets, MASTER.hex()[:16]):
        assert not secret or secret not in text
    assert caught.value.__cause__ is None and caught.value.__context__ is None


def test_unreadable_key_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*missing.*No such file") as caught:
        RecordCipher.from_key_file(tmp_path / "missing")
    assert caught.value.field == KEY_FIELD
    with pytest.raises(ConfigError, match="not a regular file"):
        RecordCipher.from_key_file(tmp_path)


def test_key_file_readable_by_others_is_accepted_with_a_warning(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    path = write_key_file(tmp_path / "key", MASTER)
    path.chmod(0o644)
    with capture_logs() as logs:
        cipher = RecordCipher.from_key_file(path)
    assert cipher.key_id == RecordCipher(MASTER).key_id
    [warning] = [e for e in logs if e["event"] == "encryption_key_file_readable_by_others"]
    assert warning["mode"] == "0o644"
    assert MASTER.hex() not in repr(logs)


def test_parse_key_takes_32_raw_bytes_even_with_whitespace_at_the_ends() -> None:
    raw = b" " + MASTER[1:-1] + b"\n"
    assert parse_key(raw) == raw


def test_record_config_builds_the_cipher_from_the_key_file(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "key", MASTER.hex().encode() + b"\n")
    config = EngineConfig(encryption_key_file=str(path))
    spec = record_spec(config, SMALL, cipher=record_cipher(config))
    assert spec.cipher is not None and spec.cipher.key_id == RecordCipher(MASTER).key_id
    assert record_spec(EngineConfig(), SMALL, cipher=record_cipher(EngineConfig())).cipher is None
    with pytest.raises(ConfigError) as caught:
        record_cipher(EngineConfig(encryption_key_file=str(tmp_path / "none")))
    assert caught.value.field == "encryption_key_file"


def test_no_repr_shows_the_key_and_a_cipher_is_not_pickled() -> None:
    cipher = RecordCipher(MASTER)
    cipher.seal(bytes(key(0)), cipher.new_nonce(), b"x" * 32, b"header")  # caches a tenant key
    texts = [repr(cipher), str(cipher), repr(make_spec(cipher=cipher)), repr(cipher._keys)]
    for text in texts:
        assert MASTER.hex() not in text and repr(MASTER)[2:20] not in text
    assert cipher.key_id.hex() in repr(cipher)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(cipher)
    with pytest.raises(InvalidInputError, match="32 bytes") as caught:
        RecordCipher(MASTER[:31])
    assert MASTER[:31].hex() not in str(caught.value)


# --------------------------------------------------------------------------- the cipher


def test_each_tenant_has_its_own_hkdf_key() -> None:
    """Known answer: the format stays readable only if the derivation never changes."""
    cipher = RecordCipher(MASTER)
    nonce, payload, header = bytes(12), PATTERN * 4, b"header bytes"
    for tenant in (0, 1, 0xFFFFFFFF):
        chunk_key = bytes(key(5, tenant))
        derived = HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=None,
            info=b"lmcache_async/record-key/v1\x00" + chunk_key[:16],
        ).derive(MASTER)
        expected = AESGCM(derived).encrypt(nonce, payload, header)
        assert cipher.seal(chunk_key, nonce, payload, header) == expected
    a = cipher.seal(bytes(key(1, 1)), nonce, payload, header)
    b = cipher.seal(bytes(key(1, 2)), nonce, payload, header)
    # Tags that agree on their first 4 bytes (once the whole tag) are other tenants' keys.
    c = cipher.seal(bytes(key(1, 1 + 2**32)), nonce, payload, header)
    assert len({a, b, c}) == 3
    out = memoryview(bytearray(len(payload)))
    cipher.open_into(bytes(key(9, 1)), nonce, a, header, out)  # same tenant, any chunk
    assert bytes(out) == payload
    with pytest.raises(IntegrityError, match="does not authenticate"):
        cipher.open_into(bytes(key(1, 2)), nonce, a, header, out)
    with pytest.raises(IntegrityError, match="does not authenticate"):
        RecordCipher(OTHER).open_into(bytes(key(1, 1)), nonce, a, header, out)


def test_key_cache_is_bounded_and_rederives() -> None:
    cipher = RecordCipher(MASTER, key_cache=2)
    sealed = {t: cipher.seal(bytes(key(0, t)), bytes(12), PATTERN, b"h") for t in range(5)}
    assert len(cipher._keys) == 2
    out = memoryview(bytearray(len(PATTERN)))
    for tenant, data in sealed.items():
        cipher.open_into(bytes(key(0, tenant)), bytes(12), data, b"h", out)
        assert bytes(out) == PATTERN
    with pytest.raises(InvalidInputError):
        RecordCipher(MASTER, key_cache=0)


def test_concurrent_sealing_from_threads_is_exact() -> None:
    cipher = RecordCipher(MASTER, key_cache=3)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                chunk_key = bytes(key(rng.randrange(100), rng.randrange(8)))
                payload = rng.randbytes(rng.randrange(1, 3000))
                nonce = cipher.new_nonce()
                out = memoryview(bytearray(len(payload)))
                cipher.open_into(
                    chunk_key, nonce, cipher.seal(chunk_key, nonce, payload, b"h"), b"h", out
                )
                assert bytes(out) == payload
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_sealed_reader_takes_any_pieces_and_checks_the_tag() -> None:
    cipher = RecordCipher(MASTER)
    chunk_key, nonce, header = bytes(key(3)), cipher.new_nonce(), b"header"
    payload = bytes(pattern_bytes(100_000, 3).numpy())
    sealed = cipher.seal(chunk_key, nonce, payload, header)
    rng = random.Random(0)
    for _ in range(5):
        out = memoryview(bytearray(len(payload)))
        reader = cipher.reader(chunk_key, nonce, header, out)
        at = 0
        while at < len(sealed):
            step = rng.choice([1, 15, 16, 17, 4096, 50_000])
            reader.feed(sealed[at : at + step])
            at += step
        assert reader.needed == 0
        reader.finish()
        assert bytes(out) == payload
    out = memoryview(bytearray(len(payload)))
    reader = cipher.reader(chunk_key, nonce, header, out)
    reader.feed(sealed[:-1])
    with pytest.raises(IntegrityError, match="truncated"):
        reader.finish()
    with pytest.raises(IntegrityError, match="longer"):
        reader.feed(sealed[-2:])
    damaged = bytearray(sealed)
    damaged[-1] ^= 1
    reader = cipher.reader(chunk_key, nonce, header, out)
    reader.feed(damaged)
    with pytest.raises(IntegrityError, match="does not authenticate"):
        reader.finish()


@pytest.mark.parametrize("size", [1, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 17])
def test_sealed_writer_writes_what_seal_returns_in_small_pieces(size: int) -> None:
    cipher = RecordCipher(MASTER)
    chunk_key, nonce, header = bytes(key(4, 9)), cipher.new_nonce(), b"header"
    payload = bytes(pattern_bytes(size, 4).numpy())
    writer = cipher.writer(chunk_key, nonce, payload, header)
    assert len(writer) == size + AUTH_TAG_BYTES
    pieces: list[bytes] = []
    writer.write_to(lambda piece: pieces.append(bytes(piece)))
    assert b"".join(pieces) == cipher.seal(chunk_key, nonce, payload, header)
    assert max(len(p) for p in pieces) <= PIECE_BYTES
    with pytest.raises(InvalidInputError, match="written once"):
        writer.write_to(pieces.append)


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD, Codec.LZ4, Codec.INT8])
def test_sealed_record_format_and_round_trip(pool: MemoryPool, codec: Codec) -> None:
    spec = make_spec(cipher=RecordCipher(MASTER), codec=codec)
    obj = make_obj(pool, SMALL, 1, tokens=5)
    if codec is Codec.INT8:
        obj.tensor.copy_(torch.linspace(-3, 3, obj.tensor.numel()).reshape(obj.shape))
    try:
        head, payload = spec.encode(key(1), obj)
        assert obj.checksum is None, "a sealed record needs no checksum"
        record = head + bytes(payload)
        assert PATTERN not in record
        header, offset = RecordHeader.from_bytes(record)
        assert int.from_bytes(record[4:6], "little") == SEALED_FORMAT_VERSION
        assert (header.cipher, header.key_id, len(header.nonce)) == (
            "aes-256-gcm",
            spec.cipher.key_id if spec.cipher else b"",
            12,
        )
        assert header.raw == head and offset == len(head)
        if codec is Codec.NONE:
            assert header.length == obj.nbytes + AUTH_TAG_BYTES
        spec.check_header(header, key(1))
        spec.verify_payload(header, memoryview(record)[offset:])
        out = torch.empty(obj.shape, dtype=obj.dtype)
        spec.decode_into(header, memoryview(record)[offset:], out)
        if codec.lossless:
            assert bytes(tensor_bytes(out)) == bytes(tensor_bytes(obj.tensor))
        else:
            assert torch.allclose(out.float(), obj.tensor.float(), atol=0.05)
        again, _ = spec.encode(key(1), obj)
        assert RecordHeader.from_bytes(again)[0].nonce != header.nonce, "a nonce per record"
    finally:
        obj.unref()


def test_clear_records_keep_format_version_1(pool: MemoryPool) -> None:
    obj = make_obj(pool, SMALL, 2)
    try:
        head, payload = make_spec().encode(key(2), obj)
    finally:
        obj.unref()
    assert int.from_bytes(head[4:6], "little") == FORMAT_VERSION
    header, _ = RecordHeader.from_bytes(head + bytes(payload))
    assert not header.sealed and header.checksum != 0


@pytest.mark.parametrize(
    ("writer", "reader", "reason"),
    [
        (MASTER, None, "encrypted and this tier has no key"),
        (None, MASTER, "in the clear and this tier encrypts"),
        (MASTER, OTHER, "encrypted under another key"),
    ],
)
def test_records_of_another_key_are_refused(
    pool: MemoryPool, writer: bytes | None, reader: bytes | None, reason: str
) -> None:
    written = make_spec(cipher=RecordCipher(writer) if writer else None)
    read = make_spec(cipher=RecordCipher(reader) if reader else None)
    obj = make_obj(pool, SMALL, 3)
    try:
        head, payload = written.encode(key(3), obj)
    finally:
        obj.unref()
    header, _ = RecordHeader.from_bytes(head)
    with pytest.raises(IntegrityError, match=reason):
        read.check_header(header, key(3))
    with pytest.raises(IntegrityError, match=reason):
        read.decode_into(header, payload, torch.empty(SMALL.payload_shape(16), dtype=SMALL.dtype))


# --------------------------------------------------------------------------- tampering


def _resealed(data: bytes, **changes: Any) -> bytes:
    """The record with header fields changed and the header checksum made valid again."""
    header, offset = RecordHeader.from_bytes(data)
    head = dataclasses.replace(header, **changes).to_bytes()
    assert len(head) == offset
    return head + data[offset:]


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


def _nonce_at(data: bytes) -> int:
    header, offset = RecordHeader.from_bytes(data)
    at = data.find(header.nonce, PREFIX_SIZE, offset)
    assert at > 0
    return at


def _payload_at(data: bytes) -> int:
    return RecordHeader.from_bytes(data)[1]


# Each changes a sealed record of an uncompressed payload. The "resealed" ones also make the
# header's own checksum valid again, so only the authentication of the header can catch them.
TAMPERINGS: dict[str, Callable[[bytes], bytes]] = {
    "header_byte": lambda d: _flip(d, PREFIX_SIZE + 5),
    "nonce_byte": lambda d: _flip(d, _nonce_at(d)),
    "nonce_resealed": lambda d: _resealed(d, nonce=_flip(RecordHeader.from_bytes(d)[0].nonce, 0)),
    "codec_resealed": lambda d: _resealed(d, codec="zstd"),
    "ciphertext_first_byte": lambda d: _flip(d, _payload_at(d)),
    "ciphertext_byte": lambda d: _flip(d, (_payload_at(d) + len(d)) // 2),
    "tag_byte": lambda d: _flip(d, len(d) - 1),
    "truncated": lambda d: d[:-1],
    "tag_only": lambda d: d[: _payload_at(d)] + d[-AUTH_TAG_BYTES:],
}


# --------------------------------------------------------------------------- disk tier


async def open_disk(directory: Path, pool: MemoryPool, spec: RecordSpec) -> DiskBackend:
    """An open tier whose index is complete."""
    disk = await DiskBackend.open(
        directory, pool=pool, spec=spec, allocation_timeout=1.0, max_local_disk_size=1 << 30
    )
    with anyio.fail_after(30):
        await disk.wait_index(audited=True)
    return disk


def record_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"??/*{CHUNK_SUFFIX}"))


async def put_chunks(
    tier: DiskBackend | RedisBackend,
    pool: MemoryPool,
    layout: KVLayout,
    keys: list[ChunkKey],
    *,
    partial_last: bool = True,
) -> list[MemoryObj]:
    """Put chunk ``i`` of ``keys`` (the last one partial, unless not ``partial_last``);
    returns the objects, still held."""
    full = TOKENS[layout]
    last = full // 2 + 1 if partial_last else full
    objs = [
        make_obj(pool, layout, i, full if i < len(keys) - 1 else last) for i in range(len(keys))
    ]
    assert await tier.put(keys, objs) == len(keys)
    return objs


async def assert_served(
    tier: DiskBackend | RedisBackend, keys: list[ChunkKey], objs: list[MemoryObj]
) -> None:
    got = await tier.get(keys)
    try:
        assert all(same_bytes(g, o) for g, o in zip(got, objs, strict=True))
    finally:
        release(got)


MIXED_KEYS = [key(0), key(1, tenant=7), key(2, tenant=0xABCDEF01)]


@pytest.mark.anyio
@pytest.mark.parametrize("size", list(LAYOUTS))
@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD])
async def test_disk_files_hold_no_plaintext_and_read_back_exact(
    tmp_path: Path, pool: MemoryPool, size: str, codec: Codec
) -> None:
    layout = LAYOUTS[size]
    clear, sealed = make_spec(layout, codec=codec), make_spec(layout, RecordCipher(MASTER), codec)
    with anyio.fail_after(60):
        plain = await open_disk(tmp_path / "clear", pool, clear)
        disk = await open_disk(tmp_path / "sealed", pool, sealed)
        objs = await put_chunks(disk, pool, layout, MIXED_KEYS)
        release(await put_chunks(plain, pool, layout, MIXED_KEYS))
        try:
            await plain.aclose()
            if codec is Codec.NONE:  # the search would find the plaintext
                assert all(PATTERN in p.read_bytes() for p in record_files(tmp_path / "clear"))
            files = record_files(tmp_path / "sealed")
            assert len(files) == len(MIXED_KEYS)
            for path in files:
                assert PATTERN not in path.read_bytes()
            await assert_served(disk, MIXED_KEYS, objs)
            await disk.aclose()
            disk = await open_disk(tmp_path / "sealed", pool, sealed)  # the scan takes them
            assert (disk.stats().chunks, disk.stats().corrupt) == (len(MIXED_KEYS), 0)
            await assert_served(disk, MIXED_KEYS, objs)
        finally:
            release(objs)
            await disk.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("writer", "reader"), [(MASTER, OTHER), (MASTER, None), (None, MASTER)])
async def test_disk_records_under_another_key_are_misses_left_in_place(
    tmp_path: Path, pool: MemoryPool, writer: bytes | None, reader: bytes | None
) -> None:
    """At open (the scan) and when a file is swapped under an open tier: a miss, counted
    when read, and the file stays for the engines that hold its key."""
    written = make_spec(cipher=RecordCipher(writer) if writer else None)
    spec = make_spec(cipher=RecordCipher(reader) if reader else None)
    with anyio.fail_after(60):
        first = await open_disk(tmp_path / "a", pool, written)
        release(await put_chunks(first, pool, SMALL, MIXED_KEYS))
        await first.aclose()
        disk = await open_disk(tmp_path / "a", pool, spec)
        try:
            assert (disk.stats().chunks, disk.stats().corrupt) == (0, 0)
            assert len(record_files(tmp_path / "a")) == len(MIXED_KEYS)
            assert await disk.get(MIXED_KEYS) == [None] * len(MIXED_KEYS)
        finally:
            await disk.aclose()
        disk = await open_disk(tmp_path / "c", pool, spec)
        try:
            release(await put_chunks(disk, pool, SMALL, MIXED_KEYS[:1]))
            other = await open_disk(tmp_path / "b", pool, written)
            release(await put_chunks(other, pool, SMALL, MIXED_KEYS[:1]))
            await other.aclose()
            [mine], [theirs] = record_files(tmp_path / "c"), record_files(tmp_path / "b")
            mine.write_bytes(theirs.read_bytes())
            assert await disk.get(MIXED_KEYS[:1]) == [None]
            assert disk.stats().corrupt == 1
            assert mine.read_bytes() == theirs.read_bytes(), "another key's record is kept"
        finally:
            await disk.aclose()
        again = await open_disk(tmp_path / "a", pool, written)  # its own key reads them all
        try:
            objs = await again.get(MIXED_KEYS)
            assert None not in objs
            release([obj for obj in objs if obj is not None])
        finally:
            await again.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("size", list(LAYOUTS))
@pytest.mark.parametrize("tampering", [*TAMPERINGS, "moved_key", "moved_tenant"])
async def test_disk_tampered_record_is_a_corrupt_miss(
    tmp_path: Path, pool: MemoryPool, size: str, tampering: str
) -> None:
    layout = LAYOUTS[size]
    disk = await open_disk(tmp_path / "c", pool, make_spec(layout, RecordCipher(MASTER)))
    with anyio.fail_after(60):
        try:
            target = key(1, tenant=3)
            keys = [key(0, tenant=3), target]
            release(await put_chunks(disk, pool, layout, keys, partial_last=False))
            files = {p.name.split(".")[0]: p for p in record_files(tmp_path / "c")}
            source = files[key(0, tenant=3).to_str()].read_bytes()
            if tampering == "moved_key":  # same tenant: the key is in the authenticated header
                data = _resealed(source, key=bytes(target))
            elif tampering == "moved_tenant":
                data = _resealed(source, key=bytes(key(1, tenant=4)))
                target = key(1, tenant=4)
                release(await put_chunks(disk, pool, layout, [target], partial_last=False))
                files = {p.name.split(".")[0]: p for p in record_files(tmp_path / "c")}
            else:  # the target's own record, changed
                data = TAMPERINGS[tampering](files[target.to_str()].read_bytes())
            assert data != source
            path = files[target.to_str()]
            path.write_bytes(data)
            corrupt = disk.stats().corrupt
            assert await disk.get([target]) == [None]
            assert disk.stats().corrupt == corrupt + 1
            assert not path.exists()
        finally:
            await disk.aclose()


# --------------------------------------------------------------------------- Redis tier


async def open_redis(url: str, pool: MemoryPool, spec: RecordSpec, **options: Any) -> RedisBackend:
    return await RedisBackend.open(url, pool=pool, spec=spec, allocation_timeout=1.0, **options)


def rkey(k: ChunkKey) -> bytes:
    return (DEFAULT_KEY_PREFIX + k.to_str()).encode()


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.parametrize("size", list(LAYOUTS))
async def test_redis_values_hold_no_plaintext_and_read_back_exact(
    redis_server: RedisServer, pool: MemoryPool, size: str
) -> None:
    layout = LAYOUTS[size]
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    with anyio.fail_after(60):
        clear = await open_redis(redis_server.url, pool, make_spec(layout), key_prefix="clear:")
        tier = await open_redis(redis_server.url, pool, make_spec(layout, RecordCipher(MASTER)))
        objs = await put_chunks(tier, pool, layout, MIXED_KEYS)
        try:
            release(await put_chunks(clear, pool, layout, MIXED_KEYS))
            names = await raw.keys("*")
            assert len(names) == 2 * len(MIXED_KEYS)
            values = {name: await raw.get(name) for name in names}
            assert all(PATTERN in v for n, v in values.items() if n.startswith(b"clear:"))
            sealed = [v for n, v in values.items() if not n.startswith(b"clear:")]
            assert len(sealed) == len(MIXED_KEYS)
            assert not any(PATTERN in value for value in sealed)
            await assert_served(tier, MIXED_KEYS, objs)
            assert tier.stats().corrupt == 0
        finally:
            release(objs)
            await clear.aclose()
            await tier.aclose()
            await raw.aclose()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_redis_cluster_values_hold_no_plaintext(
    redis_cluster: RedisCluster, pool: MemoryPool
) -> None:
    raw: Any = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    with anyio.fail_after(60):
        tier = await open_redis(redis_cluster.url, pool, make_spec(LARGE, RecordCipher(MASTER)))
        objs = await put_chunks(tier, pool, LARGE, MIXED_KEYS)
        try:
            for k in MIXED_KEYS:
                value = await raw.get(rkey(k))
                assert value is not None and PATTERN not in value
            await assert_served(tier, MIXED_KEYS, objs)
        finally:
            release(objs)
            await tier.aclose()
            await raw.aclose()


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.parametrize(("writer", "reader"), [(MASTER, OTHER), (MASTER, None), (None, MASTER)])
async def test_redis_values_under_another_key_are_misses_left_in_place(
    redis_server: RedisServer, pool: MemoryPool, writer: bytes | None, reader: bytes | None
) -> None:
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    with anyio.fail_after(60):
        first = await open_redis(
            redis_server.url, pool, make_spec(cipher=RecordCipher(writer) if writer else None)
        )
        second = await open_redis(
            redis_server.url, pool, make_spec(cipher=RecordCipher(reader) if reader else None)
        )
        try:
            release(await put_chunks(first, pool, SMALL, MIXED_KEYS))
            assert await second.get(MIXED_KEYS) == [None] * len(MIXED_KEYS)
            assert second.stats().corrupt == len(MIXED_KEYS)
            # A shared server: the hosts holding the key still read every record.
            assert [await raw.exists(rkey(k)) for k in MIXED_KEYS] == [1] * len(MIXED_KEYS)
            objs = await first.get(MIXED_KEYS)
            assert None not in objs
            release([obj for obj in objs if obj is not None])
        finally:
            await first.aclose()
            await second.aclose()
            await raw.aclose()


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.parametrize("tampering", [*TAMPERINGS, "moved_key"])
async def test_redis_tampered_value_is_a_corrupt_miss(
    redis_server: RedisServer, pool: MemoryPool, tampering: str
) -> None:
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    with anyio.fail_after(60):
        tier = await open_redis(redis_server.url, pool, make_spec(LARGE, RecordCipher(MASTER)))
        try:
            release(await put_chunks(tier, pool, LARGE, [key(0), key(1)]))
            source = await raw.get(rkey(key(0)))
            if tampering == "moved_key":
                data = _resealed(source, key=bytes(key(1)))
            else:  # the target's own record, changed
                data = TAMPERINGS[tampering](await raw.get(rkey(key(1))))
            assert data != source
            await raw.set(rkey(key(1)), data)
            assert await tier.get([key(1)]) == [None]
            assert tier.stats().corrupt == 1
            assert await raw.exists(rkey(key(1))) == 0
            # The untouched record still opens.
            got = await tier.get([key(0)])
            assert got[0] is not None
            release(got)
        finally:
            await tier.aclose()
            await raw.aclose()


def test_payload_sizes_are_what_the_tests_assume() -> None:
    assert math.prod(SMALL.payload_shape(16)) * 2 == 2048
    assert math.prod(LARGE.payload_shape(96)) * 2 > 2 * 256 * 1024
