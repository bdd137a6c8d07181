"""``python -m lmcache_async.cli``: the ``lmcache-async`` command line."""

from __future__ import annotations

import sys

from lmcache_async.cli import main

sys.exit(main())
