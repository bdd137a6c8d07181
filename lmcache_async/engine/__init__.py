"""The embedded cache engine: :class:`CacheEngine`, the public face over its parts."""

from __future__ import annotations

from .face import CacheEngine
from .promises import Promise

__all__ = ["CacheEngine", "Promise"]
