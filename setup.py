"""The package's C extensions (everything else is declared in pyproject.toml).

``lmcache_async.keys._native`` chains chunk keys with BLAKE3 and walks the CPU tier's index;
``lmcache_async.transfer._rows`` copies rows between paged KV memory and chunk payloads.
Without a C compiler the install goes on without them (``optional``): keys/hashing.py
computes the same keys with the blake3 package, and transfer plans copy with torch. A
development or test install sets ``LMCACHE_ASYNC_REQUIRE_NATIVE=1`` (the Makefile does), and
then a compile error fails the install instead of leaving an older build in place. Each
module carries the SHA-256 of its sources as ``SOURCE_HASH``, so the suite can tell a stale
build from a current one.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

SOURCES = {
    "lmcache_async.keys._native": ["lmcache_async/keys/_native.c"],
    "lmcache_async.transfer._rows": ["lmcache_async/transfer/_rows.c"],
}
"""Each extension module's C sources, relative to the repository root."""

# -pthread: the row copies spread large requests over threads of their own.
FLAGS = {"lmcache_async.transfer._rows": ["-pthread"]}


def source_hash(root: Path, sources: list[str]) -> str:
    """SHA-256 over ``sources`` in order, each as its length then its bytes."""
    digest = hashlib.sha256()
    for name in sources:
        data = (root / name).read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


ROOT = Path(__file__).resolve().parent
REQUIRED = os.environ.get("LMCACHE_ASYNC_REQUIRE_NATIVE") == "1"

setup(
    ext_modules=[
        Extension(
            name,
            sources=sources,
            define_macros=[("LMCACHE_ASYNC_SOURCE_HASH", f'"{source_hash(ROOT, sources)}"')],
            extra_compile_args=["-O3", *FLAGS.get(name, [])],
            extra_link_args=FLAGS.get(name, []),
            optional=not REQUIRED,
        )
        for name, sources in SOURCES.items()
    ]
)
