"""Plain-text tables and sizes, as ``lmcache-async stats`` prints them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["size_text", "text_table"]

_UNITS: Final = ("B", "KiB", "MiB", "GiB", "TiB")


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at or above 1 (``"1.5 KiB"``)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.0f} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """``rows`` under ``header`` in left-aligned columns two spaces apart, each line
    indented by ``indent``."""
    cells = [list(header), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)
