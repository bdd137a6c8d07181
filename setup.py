"""The package's one C extension (everything else is declared in pyproject.toml).

``optional``: without a C compiler the install goes on without it: hashing.py computes
the same keys with the blake3 package, and transfer plans copy with torch.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_async._native",
            sources=["lmcache_async/_native.c", "lmcache_async/_rows.c"],
            # -pthread: the row copies spread large requests over threads of their own.
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
