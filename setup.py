"""The package's one C extension (everything else is declared in pyproject.toml).

``optional``: without a C compiler the install goes on without it, and hashing.py computes
the same keys with the blake3 package.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_async._native",
            sources=["lmcache_async/_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
