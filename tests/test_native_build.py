"""The C extensions cannot go stale: the suite runs against builds of the current sources,
a compile error fails a required build (the test install's) instead of leaving an older
``.so`` in place, and without the extensions the package still works (its pure-Python and
torch fallbacks, in a process where neither ``lmcache_async.keys._native`` nor
``lmcache_async.transfer._rows`` can be imported)."""

from __future__ import annotations

import importlib
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import setuptools

from lmcache_async.keys.chunks import NATIVE_CHAIN
from lmcache_async.transfer.native import NATIVE_ROWS

ROOT = Path(__file__).resolve().parent.parent


def run_setup(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, Any]]:
    """setup.py's names, and what it passes to ``setuptools.setup`` for the tree as it is."""
    captured: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    names = runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return names, captured


def require_compiler() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers here")


def test_each_loaded_extension_was_built_from_the_current_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extensions = run_setup(monkeypatch)[1]["ext_modules"]
    assert sorted(e.name for e in extensions) == [
        "lmcache_async.keys._native",
        "lmcache_async.transfer._rows",
    ]
    if not (NATIVE_CHAIN and NATIVE_ROWS):
        pytest.skip("the C extensions were not built (see tests/keys/test_native.py)")
    for extension in extensions:
        module = importlib.import_module(extension.name)
        macros = dict(extension.define_macros)
        assert macros["LMCACHE_ASYNC_SOURCE_HASH"] == f'"{module.SOURCE_HASH}"', (
            f"{extension.name} was built from other sources than the tree's: "
            "rebuild it with `make dev` (or `pip install -e .`)"
        )


def test_the_source_hash_changes_with_any_source_byte(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names, _ = run_setup(monkeypatch)
    for sources in names["SOURCES"].values():
        for name in sources:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, tmp_path / name)
        before = names["source_hash"](tmp_path, sources)
        assert before == names["source_hash"](ROOT, sources)
        for name in sources:
            original = (tmp_path / name).read_bytes()
            (tmp_path / name).write_bytes(original + b"\n")
            assert names["source_hash"](tmp_path, sources) != before, name
            (tmp_path / name).write_bytes(original)


def build(tree: Path, *, required: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_ASYNC_REQUIRE_NATIVE"}
    if required:
        env["LMCACHE_ASYNC_REQUIRE_NATIVE"] = "1"
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", "out"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_compile_error_fails_a_required_build_and_not_an_optional_one(tmp_path: Path) -> None:
    require_compiler()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, tmp_path / name)
    for source in ROOT.joinpath("lmcache_async").rglob("_*.c"):
        copy = tmp_path / source.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        for init in (copy.parent / "__init__.py", copy.parent.parent / "__init__.py"):
            init.touch()
        shutil.copyfile(source, copy)
    native = tmp_path / "lmcache_async" / "keys" / "_native.c"
    native.write_text(native.read_text() + "\nthis is not C;\n")

    required = build(tmp_path, required=True)
    assert required.returncode != 0, required.stdout + required.stderr
    assert "this is not C" in required.stderr or "error" in required.stderr.lower()
    assert not list((tmp_path / "out").rglob("_native*.so"))

    optional = build(tmp_path, required=False)
    assert optional.returncode == 0, optional.stdout + optional.stderr
    assert not list((tmp_path / "out").rglob("_native*.so"))
    assert list((tmp_path / "out").rglob("_rows*.so")), "the sound extension is still built"


FALLBACK_SCRIPT = """
import sys
# as if no C compiler had built them
sys.modules["lmcache_async.keys._native"] = sys.modules["lmcache_async.transfer._rows"] = None
import anyio, torch
from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.transfer import native as transfer_native
from lmcache_async.backends import lru
from lmcache_async.keys.chunks import NATIVE_CHAIN, ChunkHasher, Namespace
assert not NATIVE_CHAIN and not transfer_native.NATIVE_ROWS and lru._native is None
layout = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
)
kv = layout.allocate_kv_caches(num_blocks=40)
for cache in kv:
    cache.copy_(torch.randn(cache.shape).to(cache.dtype))
tokens = torch.arange(640) % 50000
slots = torch.arange(640)

async def main():
    config = EngineConfig(chunk_size=256, max_local_cpu_size=0.05)
    async with CacheEngine.open(config, layout, model_name="fallback") as engine:
        assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 640
        assert await engine.lookup(tokens) == 640
        out = layout.allocate_kv_caches(num_blocks=40)
        mask = await engine.retrieve(tokens, kv_caches=out, slot_mapping=slots)
        assert bool(mask.all())
        assert all(torch.equal(a, b) for a, b in zip(kv, out))  # every slot was written

anyio.run(main)
namespace = Namespace(model_name="fallback", layout_fingerprint="f")
print(" ".join(d.hex() for d in ChunkHasher(namespace, chunk_size=256).digests(tokens)))
"""


@pytest.mark.subprocess
def test_without_the_extension_the_package_stores_retrieves_and_keys_alike() -> None:
    """In a process that cannot import the extension, a store/retrieve round trip returns
    the exact KV, and the chunk keys equal this (native) process's."""
    from lmcache_async.keys.chunks import ChunkHasher, Namespace

    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    namespace = Namespace(model_name="fallback", layout_fingerprint="f")
    import torch

    expected = ChunkHasher(namespace, chunk_size=256).digests(torch.arange(640) % 50000)
    assert NATIVE_CHAIN, "this comparison needs the native chain in this process"
    assert done.stdout.split()[-len(expected) :] == [d.hex() for d in expected]
