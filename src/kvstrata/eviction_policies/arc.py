"""``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over prefix-tree nodes.

T1 holds prefixes seen once since they entered the tier, T2 those reused; B1 / B2 remember what
each evicted (ghosts, by first page key). A prefix returning from B1 says T1 was too small and
grows its target ``p``; one returning from B2 shrinks it. An eviction takes the least recently
used leaf of T1 while T1 exceeds ``p``, else of T2. Sizes are pages (nodes differ in length),
and the list to evict from is fixed for the length of one eviction (ranks must compare). The
directory stays within the paper's bounds (|T1| + |B1| <= c, all four <= 2c) after every
eviction and insert. A missed prefix is heard of only at its insert, after the eviction that
made room for it: that eviction runs on the ``p`` before the prefix's ghost adapts it (and
without the paper's "x in B2 and |T1| == p" case).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvstrata.eviction_policies._ghosts import Ghosts, ghost_key
from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)

_LIST = float(1 << 52)  # the second list ranks after every stamp of the first


class ArcConfig(EvictionPolicyConfig):
    type: Literal["arc"] = "arc"


class ArcPolicy(EvictionPolicy):
    name = "arc"
    Config = ArcConfig
    capabilities = PolicyCapabilities(events=True, needs_frequency=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        self.capacity = max(1, context.capacity_pages)
        self.target = 0.0  # p: pages T1 should hold
        self._list: dict[object, int] = {}  # node -> 1 (T1) or 2 (T2)
        self._stamp: dict[object, int] = {}
        self._size: dict[object, int] = {}
        self.sizes = [0, 0, 0]  # pages in T1, T2 (index 1, 2)
        self.b1 = Ghosts(self.capacity)
        self.b2 = Ghosts(2 * self.capacity)
        self._tick = 0

    def _place(self, node: E, which: int) -> None:
        self._tick += 1
        self._list[node] = which
        self._stamp[node] = self._tick
        self._size[node] = node.pages
        self.sizes[which] += node.pages

    def _move(self, node: object, which: int) -> None:
        self.sizes[self._list[node]] -= self._size[node]
        self.sizes[which] += self._size[node]
        self._list[node] = which

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        for node in entries:  # unheard of (an insert revived a host-only node): new, placed
            if node not in self._list:  # before the lists' order is read from their sizes,
                self._place(node, 1)  # else a node ranked alone next ranked otherwise
        t1, t2 = self.sizes[1], self.sizes[2]
        first = 1 if (t1 > self.target and t1 > 0) or t2 == 0 else 2
        out = []
        for node in entries:
            which = self._list[node]
            out.append(((which != first) * _LIST + self._stamp[node], node.id, node))
        return out

    def inserted(self, entries: Sequence[E]) -> None:
        for node in entries:
            if node in self._list:
                continue
            key = ghost_key(node)
            if key in self.b1:  # the paper's delta counts x in its ghost list
                grow = max(self.b2.pages / max(self.b1.pages, 1), 1.0) * node.pages
                self.b1.take(key)
                self.target = min(float(self.capacity), self.target + grow)
                self._place(node, 2)
            elif key in self.b2:
                shrink = max(self.b1.pages / max(self.b2.pages, 1), 1.0) * node.pages
                self.b2.take(key)
                self.target = max(0.0, self.target - shrink)
                self._place(node, 2)
            else:
                self._place(node, 1)
        self._bound()

    def accessed(self, entries: Sequence[E]) -> None:
        for node in entries:  # deepest first: a parent ends up more recent than its child
            which = self._list.get(node)
            if which is None:
                continue
            if which == 1:
                self._move(node, 2)
            self._tick += 1
            self._stamp[node] = self._tick

    def split(self, upper: E, lower: E) -> None:
        which = self._list.get(lower)
        if which is None:
            return
        self._list[upper] = which
        self._stamp[upper] = self._stamp[lower]
        self._size[upper] = upper.pages
        self._size[lower] = lower.pages  # the two halves together hold what ``lower`` held

    def removed(self, entries: Sequence[E]) -> None:
        for node in entries:
            which = self._list.pop(node, None)
            if which is None:
                continue
            del self._stamp[node]
            pages = self._size.pop(node)
            self.sizes[which] -= pages
            (self.b1 if which == 1 else self.b2).add(ghost_key(node), pages)
        self._bound()

    def _bound(self) -> None:
        # |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, as ARC keeps its directory
        self.b1.trim(max(0, self.capacity - self.sizes[1]))
        self.b2.trim(max(0, 2 * self.capacity - self.sizes[1] - self.sizes[2] - self.b1.pages))
