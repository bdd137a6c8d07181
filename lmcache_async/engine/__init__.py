"""The embedded cache engine: :class:`CacheEngine`, the public face over its parts."""

from __future__ import annotations

from ..promise import Promise
from .face import CacheEngine

__all__ = ["CacheEngine", "Promise"]
