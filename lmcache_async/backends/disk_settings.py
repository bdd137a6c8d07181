"""The disk tier's settings, checked when a :class:`~.disk.DiskBackend` is built."""

from __future__ import annotations

import math
import os

from ..errors import ConfigError, InvalidInputError

__all__ = ["check_disk_settings"]


def check_disk_settings(
    local_disk: object,
    max_local_disk_size: object,
    allocation_timeout: object,
    health_timeout: object,
) -> None:
    """Check :class:`~.disk.DiskBackend`'s settings (raises as its ``__init__`` says)."""
    if not isinstance(local_disk, str | os.PathLike) or not os.fspath(local_disk):
        raise ConfigError("local_disk", f"expected a directory path, got {local_disk!r}")
    if isinstance(max_local_disk_size, bool) or not isinstance(max_local_disk_size, int):
        raise ConfigError(
            "max_local_disk_size", f"expected a size in bytes, got {max_local_disk_size!r}"
        )
    if max_local_disk_size <= 0:
        raise ConfigError("max_local_disk_size", f"must be > 0 bytes, got {max_local_disk_size}")
    _check_seconds("allocation_timeout", allocation_timeout, allow_zero=True)
    _check_seconds("health_timeout", health_timeout, allow_zero=False)


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidInputError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidInputError(f"{name} must be {'>=' if allow_zero else '>'} 0, got {value}")
