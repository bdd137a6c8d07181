"""The package's modules and classes stay small enough to read: no module of
``lmcache_async`` over 600 lines, no class over 400."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_async

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
PACKAGE = Path(lmcache_async.__file__).parent


def oversized(root: Path) -> list[str]:
    """Every module and class under ``root`` over its limit, as ``path[:Class] lines``."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root))
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{name} {lines}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{name}:{node.name} {size}")
    return found


def test_no_module_or_class_is_over_its_limit() -> None:
    assert oversized(PACKAGE) == []


def test_the_check_finds_an_oversized_module_and_class(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "big.py").write_text("class Big:\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
    (tmp_path / "small.py").write_text("class Small:\n    pass\n")
    assert oversized(tmp_path) == [
        f"big.py {MAX_CLASS_LINES + 1 + MAX_MODULE_LINES}",
        f"big.py:Big {MAX_CLASS_LINES + 1}",
    ]
