"""The free pages of a pool's arena as sorted runs: first-fit carving, and runs given back
merged with their neighbours."""

from __future__ import annotations

import bisect

__all__ = ["FreeRuns"]


class FreeRuns:
    """Free runs of ``num_pages`` pages, all free at first: each run a start page and a
    length, sorted by start, never two adjacent."""

    __slots__ = ("_lens", "_starts", "free")

    def __init__(self, num_pages: int) -> None:
        self._starts: list[int] = [0]
        self._lens: list[int] = [num_pages]
        self.free = num_pages
        """Free pages in all."""

    def largest(self) -> int:
        """Pages of the longest free run."""
        return max(self._lens, default=0)

    def carve(self, npages: int) -> int | None:
        """First fit: take ``npages`` from the lowest free run that holds them; its first
        page, or None when no run does."""
        lens = self._lens
        for i, run in enumerate(lens):
            if run >= npages:
                start = self._starts[i]
                if run == npages:
                    del self._starts[i]
                    del lens[i]
                else:
                    self._starts[i] = start + npages
                    lens[i] = run - npages
                self.free -= npages
                return start
        return None

    def give_back(self, page: int, npages: int) -> None:
        """Return the run of ``npages`` from ``page``, merging it with adjacent free runs."""
        starts, lens = self._starts, self._lens
        i = bisect.bisect_left(starts, page)
        merge_prev = i > 0 and starts[i - 1] + lens[i - 1] == page
        merge_next = i < len(starts) and page + npages == starts[i]
        if merge_prev and merge_next:
            lens[i - 1] += npages + lens[i]
            del starts[i]
            del lens[i]
        elif merge_prev:
            lens[i - 1] += npages
        elif merge_next:
            starts[i] = page
            lens[i] += npages
        else:
            starts.insert(i, page)
            lens.insert(i, npages)
        self.free += npages
