"""Encryption at rest of the slow tiers' records: AES-256-GCM under a key per tenant.

One 32-byte *master key*, read from the file the config's ``encryption_key_file`` names
(:meth:`RecordCipher.from_key_file`), is never used to encrypt anything itself. Each tenant
gets its own key, HKDF-SHA256 of the master key with the tenant's 16-byte tag (the first
bytes of every chunk key, :func:`~lmcache_async.tenancy.tenants.tag_of`) in the ``info``; a short
*key id*, derived the same way, lets a reader tell a record sealed under another master
key from a damaged one without trying to decrypt it.

Each record is sealed with a fresh random 12-byte nonce; the record's header, chunk key
included, is the associated data, so a record moved under another key, or one whose
header was edited, fails to open like one whose payload was. The 16-byte GCM tag trails
the ciphertext. With random nonces a key should seal fewer than 2**32 records: that is
per tenant, and a cache that writes more should change its master key from time to time.

Key bytes never appear in a repr, a log line or an error message. Nothing here does I/O
but :meth:`RecordCipher.from_key_file`; sealing and opening large payloads belong in
worker threads, as the record's other work does.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lmcache_async.logging import get_logger
from lmcache_async.tenancy.tenants import TAG_BYTES, tag_of

from ..errors import ConfigError, IntegrityError, InvalidInputError

__all__ = [
    "AUTH_TAG_BYTES",
    "CIPHER_NAME",
    "KEY_BYTES",
    "KEY_FIELD",
    "KEY_ID_BYTES",
    "NONCE_BYTES",
    "PIECE_BYTES",
    "RecordCipher",
    "SealedReader",
    "SealedWriter",
    "parse_key",
]

log = get_logger(__name__)

CIPHER_NAME: Final = "aes-256-gcm"
"""What a sealed record's header names as its cipher."""

KEY_BYTES: Final = 32
"""Size of the master key and of each tenant's key."""

NONCE_BYTES: Final = 12
"""Size of a record's random nonce."""

AUTH_TAG_BYTES: Final = 16
"""Size of the GCM tag that trails a sealed payload."""

KEY_ID_BYTES: Final = 8
"""Size of the key id a sealed record's header carries."""

KEY_FIELD: Final = "encryption_key_file"
"""The config field that names the key file (and every ConfigError raised here)."""

PIECE_BYTES: Final = 256 * 1024
"""Bytes a :class:`SealedWriter` encrypts at a time (and the size of its buffer): small
enough to stay in the CPU cache between the cipher and the write."""

DEFAULT_KEY_CACHE: Final = 4096
"""Tenants whose derived key a cipher keeps at most (the oldest is derived again)."""

_TENANT_KEY_INFO: Final = b"lmcache_async/record-key/v1\x00"
_KEY_ID_INFO: Final = b"lmcache_async/record-key-id/v1\x00"
_MAX_KEY_FILE_BYTES: Final = 4096
_HEX_DIGITS: Final = frozenset(b"0123456789abcdefABCDEF")
_KEY_HELP: Final = "make one with: openssl rand -hex 32 > FILE"
# decrypt_into (newer cryptography releases) writes the plaintext where it belongs, with no
# copy; older ones return new bytes.
_HAS_DECRYPT_INTO: Final = hasattr(AESGCM, "decrypt_into")


def _derive(master: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(master)


def parse_key(data: bytes) -> bytes:
    """The 32-byte master key held by a key file's contents ``data``: exactly 32 raw bytes,
    or 64 hex digits with any whitespace around them.

    Raises:
        ConfigError: anything else (the message says what is wrong, never the bytes).
    """
    text = data.strip()
    if len(data) == KEY_BYTES and not (len(text) == len(data) and set(text) <= _HEX_DIGITS):
        key = bytes(data)
    elif len(text) == 2 * KEY_BYTES and set(text) <= _HEX_DIGITS:
        key = bytes.fromhex(text.decode("ascii"))
    elif len(text) == 2 * KEY_BYTES:
        raise ConfigError(
            KEY_FIELD,
            f"the key file holds {len(text)} characters, not all hex "
            f"digits; expected 64 hex digits or 32 raw bytes ({_KEY_HELP})",
        )
    elif len(data) == KEY_BYTES:
        # 32 hex digits are more likely a 16-byte key written as hex than a random key.
        raise ConfigError(
            KEY_FIELD,
            f"the key file holds 32 hex digits, a 16-byte key; "
            f"expected a 32-byte key: 64 hex digits or 32 raw bytes ({_KEY_HELP})",
        )
    else:
        raise ConfigError(
            KEY_FIELD,
            f"the key file holds {len(data)} bytes; expected a "
            f"32-byte key: 64 hex digits or 32 raw bytes ({_KEY_HELP})",
        )
    if len(set(key)) == 1:
        raise ConfigError(KEY_FIELD, f"the key is one byte repeated, not a secret ({_KEY_HELP})")
    return key


class _TenantKey:
    """One tenant's derived key and its AEAD object (the repr shows neither)."""

    __slots__ = ("aead", "key")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.aead = AESGCM(key)

    def __repr__(self) -> str:
        return "<tenant key>"


class RecordCipher:
    """Seals and opens record payloads: AES-256-GCM under a key per tenant, derived from
    one master key (see the module docstring).

    Safe to share between threads: the derived keys are cached (at most ``key_cache``
    tenants) under a lock, and each operation uses its own cipher context.

    Raises:
        InvalidInputError: ``master_key`` is not 32 bytes, or ``key_cache`` is not a
            positive int.
    """

    __slots__ = ("_capacity", "_key_id", "_keys", "_lock", "_master")

    def __init__(self, master_key: bytes, *, key_cache: int = DEFAULT_KEY_CACHE) -> None:
        if not isinstance(master_key, bytes) or len(master_key) != KEY_BYTES:
            raise InvalidInputError(f"master_key must be {KEY_BYTES} bytes")
        if isinstance(key_cache, bool) or not isinstance(key_cache, int) or key_cache <= 0:
            raise InvalidInputError(f"key_cache must be a positive int, got {key_cache!r}")
        self._master = master_key
        self._key_id = _derive(master_key, _KEY_ID_INFO, KEY_ID_BYTES)
        self._capacity = key_cache
        self._keys: dict[bytes, _TenantKey] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str]) -> RecordCipher:
        """The cipher of the master key in the file at ``path`` (32 raw bytes, or 64 hex
        digits with whitespace around them allowed). A file others may read is accepted,
        with a warning in the log.

        Raises:
            ConfigError: the file cannot be read or does not hold such a key
                (``field="encryption_key_file"``; the message never shows its bytes).
        """
        file = Path(os.fspath(path))
        try:
            # Checked before opening: opening a FIFO would wait for a writer.
            if not stat.S_ISREG(os.stat(file).st_mode):
                raise ConfigError(KEY_FIELD, f"{str(file)!r} is not a regular file")
            with open(file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(_MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(KEY_FIELD, f"cannot read {str(file)!r}: {reason}") from None
        if len(data) > _MAX_KEY_FILE_BYTES:
            raise ConfigError(
                KEY_FIELD,
                f"{str(file)!r} is larger than {_MAX_KEY_FILE_BYTES} bytes, not a key "
                f"({_KEY_HELP})",
            )
        cipher = cls(parse_key(data))
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "encryption_key_file_readable_by_others", path=str(file), mode=oct(mode & 0o777)
            )
        return cipher

    @property
    def name(self) -> str:
        """The cipher's name, as sealed records' headers give it."""
        return CIPHER_NAME

    @property
    def key_id(self) -> bytes:
        """A short id of the master key (derived from it; it reveals nothing of the key)."""
        return self._key_id

    def __repr__(self) -> str:
        return f"RecordCipher({CIPHER_NAME}, key_id={self._key_id.hex()})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a RecordCipher holds a key and cannot be pickled")

    @staticmethod
    def new_nonce() -> bytes:
        """A fresh random nonce for one record."""
        return os.urandom(NONCE_BYTES)

    def _tenant(self, chunk_key: bytes) -> _TenantKey:
        tag = tag_of(chunk_key)
        if len(tag) != TAG_BYTES:
            raise InvalidInputError(f"a chunk key has at least {TAG_BYTES} bytes")
        with self._lock:
            found = self._keys.get(tag)
            if found is not None:
                return found
        derived = _TenantKey(_derive(self._master, _TENANT_KEY_INFO + tag, KEY_BYTES))
        with self._lock:
            keys = self._keys
            if tag not in keys:
                while len(keys) >= self._capacity:
                    del keys[next(iter(keys))]
                keys[tag] = derived
            return keys[tag]

    def seal(
        self, chunk_key: bytes, nonce: bytes, payload: bytes | memoryview, header: bytes
    ) -> bytes:
        """``ciphertext ‖ tag`` of ``payload`` under the tenant of ``chunk_key``, with
        ``header`` (the record's header bytes) authenticated beside it."""
        return self._tenant(chunk_key).aead.encrypt(nonce, payload, header)

    def open_into(
        self,
        chunk_key: bytes,
        nonce: bytes,
        sealed: bytes | memoryview,
        header: bytes,
        out: memoryview,
    ) -> None:
        """Check and decrypt ``sealed`` (``ciphertext ‖ tag``) into ``out``, which must be
        exactly the ciphertext's size. On failure ``out`` holds unspecified bytes.

        Raises:
            IntegrityError: the sizes do not match, or the record does not authenticate
                (another key, or its header or payload was changed).
        """
        if len(sealed) != len(out) + AUTH_TAG_BYTES:
            raise IntegrityError(
                f"sealed payload is {len(sealed)} bytes, expected {len(out) + AUTH_TAG_BYTES}"
            )
        aead = self._tenant(chunk_key).aead
        try:
            if _HAS_DECRYPT_INTO:
                aead.decrypt_into(nonce, sealed, header, out)
            else:  # pragma: no cover (older cryptography)
                out[:] = aead.decrypt(nonce, sealed, header)
        except InvalidTag:
            raise IntegrityError(_NOT_AUTHENTIC) from None

    def writer(
        self, chunk_key: bytes, nonce: bytes, payload: bytes | memoryview, header: bytes
    ) -> SealedWriter:
        """A :class:`SealedWriter` that produces what :meth:`seal` returns, a piece at a
        time as it is written (``payload`` must stay unchanged until then)."""
        context = Cipher(algorithms.AES(self._tenant(chunk_key).key), modes.GCM(nonce))
        encryptor = context.encryptor()
        encryptor.authenticate_additional_data(header)
        return SealedWriter(encryptor, memoryview(payload).cast("B"))

    def reader(
        self, chunk_key: bytes, nonce: bytes, header: bytes, out: memoryview
    ) -> SealedReader:
        """A :class:`SealedReader` that decrypts a sealed payload into ``out`` piece by
        piece, as it is read (``out`` is exactly the ciphertext's size)."""
        context = Cipher(algorithms.AES(self._tenant(chunk_key).key), modes.GCM(nonce))
        decryptor = context.decryptor()
        decryptor.authenticate_additional_data(header)
        return SealedReader(decryptor, out)


_NOT_AUTHENTIC: Final = "record does not authenticate (another key, or damaged)"


class SealedReader:
    """Decrypts one sealed payload into ``out`` as its bytes arrive, in pieces of any size
    (:meth:`feed`), then checks its tag (:meth:`finish`). A file is read through a small
    buffer this way, straight into the tensor's memory: no copy of the whole payload.
    ``out`` holds unverified bytes until :meth:`finish` returns."""

    __slots__ = ("_at", "_decryptor", "_out", "_tag")

    def __init__(self, decryptor: AEADDecryptionContext, out: memoryview) -> None:
        self._decryptor = decryptor
        self._out = out
        self._at = 0
        self._tag = bytearray()

    @property
    def needed(self) -> int:
        """Bytes of the sealed payload not fed yet."""
        return len(self._out) - self._at + AUTH_TAG_BYTES - len(self._tag)

    def feed(self, data: bytes | memoryview) -> None:
        """The next bytes of the sealed payload.

        Raises:
            IntegrityError: more bytes than the payload has.
        """
        view = memoryview(data).cast("B")
        if len(view) > self.needed:
            raise IntegrityError("sealed payload is longer than its header says")
        body = min(len(view), len(self._out) - self._at)
        if body:
            end = self._at + body
            # update_into(src, dst) with disjoint buffers: GCM writes as many bytes as it reads.
            self._decryptor.update_into(view[:body], self._out[self._at : end])
            self._at = end
        self._tag += view[body:]

    def finish(self) -> None:
        """Check the tag once every byte was fed.

        Raises:
            IntegrityError: bytes are missing, or the record does not authenticate.
        """
        if self.needed:
            raise IntegrityError(f"sealed payload is truncated ({self.needed} bytes missing)")
        try:
            self._decryptor.finalize_with_tag(bytes(self._tag))
        except InvalidTag:
            raise IntegrityError(_NOT_AUTHENTIC) from None


class SealedWriter:
    """A payload sealed as it is written: :meth:`write_to` hands ``ciphertext ‖ tag`` to a
    writer :data:`PIECE_BYTES` at a time, encrypted into one small buffer, so a large
    payload is never held encrypted in full (no large allocation, no extra pass over
    memory). ``len()`` is the sealed size. It can be written once."""

    __slots__ = ("_encryptor", "_plain", "_written")

    def __init__(self, encryptor: AEADEncryptionContext, plain: memoryview) -> None:
        self._encryptor = encryptor
        self._plain = plain
        self._written = False

    def __len__(self) -> int:
        return len(self._plain) + AUTH_TAG_BYTES

    def write_to(self, write: Callable[[memoryview], None]) -> None:
        """Call ``write`` with each piece of the sealed payload, in order (each piece is
        valid only during its call).

        Raises:
            InvalidInputError: the payload was already written.
        """
        if self._written:
            raise InvalidInputError("a sealed payload is written once")
        self._written = True
        plain = self._plain
        piece = memoryview(bytearray(min(PIECE_BYTES, len(plain))))
        for at in range(0, len(plain), PIECE_BYTES):
            out = piece[: min(PIECE_BYTES, len(plain) - at)]
            self._encryptor.update_into(plain[at : at + len(out)], out)
            write(out)
        self._encryptor.finalize()
        write(memoryview(self._encryptor.tag))
