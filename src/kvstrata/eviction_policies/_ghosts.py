"""Ghost entries: recently evicted prefixes remembered by where they start, no data.

ARC and S3-FIFO learn from a miss on something they evicted recently. A tree node that left is
gone; a prefix that comes back is a new node, so a ghost is keyed by :func:`ghost_key` of the
evicted node (the tree evicts tails, so a returning prefix starts its new node there) and sized
in pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvstrata.plugins.eviction_policy import CacheEntry


def ghost_key(node: CacheEntry) -> Hashable:
    """The prefix a node holds, as a ghost remembers it: the pages above it and its first page
    key. A live page key is the page's tokens, not chained to what precedes them, so the same
    tokens starting a node under another parent are another prefix; at the same depth they
    still collide (the same page-aligned tokens at the same position), a rare false return
    that costs only a queue placement, never data."""
    return (node.depth_end - node.pages, node.keys[0])


class Ghosts:
    """Oldest-first ghost keys with their page counts (and a small tag a policy may keep with
    each, e.g. a size class), at most ``limit`` pages in all."""

    __slots__ = ("_keys", "limit", "pages")

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.pages = 0
        self._keys: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, pages: int, tag: int = 0) -> None:
        old = self._keys.pop(key, None)
        if old is not None:
            self.pages -= old[0]
        self._keys[key] = (pages, tag)
        self.pages += pages
        self.trim(self.limit)

    def take(self, key: Hashable) -> tuple[int, int] | None:
        """Forget ``key`` and return its ``(pages, tag)`` (``None`` if it is no ghost)."""
        entry = self._keys.pop(key, None)
        if entry is not None:
            self.pages -= entry[0]
        return entry

    def trim(self, limit: int) -> None:
        """Drop the oldest ghosts until at most ``limit`` pages remain."""
        while self.pages > limit and self._keys:
            self.pages -= self._keys.popitem(last=False)[1][0]
