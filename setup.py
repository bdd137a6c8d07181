"""The package's one C extension (everything else is declared in pyproject.toml).

Without a C compiler the install goes on without it (``optional``): hashing.py computes the
same keys with the blake3 package, and transfer plans copy with torch. A development or test
install sets ``LMCACHE_ASYNC_REQUIRE_NATIVE=1`` (the Makefile does), and then a compile error
fails the install instead of leaving an older build in place. The SHA-256 of the sources is
compiled in as ``_native.SOURCE_HASH`` so the suite can tell a stale build from a current one.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

SOURCES = ["lmcache_async/_native.c", "lmcache_async/_rows.c"]


def source_hash(root: Path) -> str:
    """SHA-256 over the sources in order, each as its length then its bytes."""
    digest = hashlib.sha256()
    for name in SOURCES:
        data = (root / name).read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


setup(
    ext_modules=[
        Extension(
            "lmcache_async._native",
            sources=SOURCES,
            define_macros=[
                ("LMCACHE_ASYNC_SOURCE_HASH", f'"{source_hash(Path(__file__).resolve().parent)}"')
            ],
            # -pthread: the row copies spread large requests over threads of their own.
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=os.environ.get("LMCACHE_ASYNC_REQUIRE_NATIVE") != "1",
        )
    ]
)
