"""``lru``: least recently used first, by the tree's own recency stamps (the default).

The tree stamps every node of a request's matched path and of an insert, deepest first, so a
parent is never older than its children: ranking by the stamp needs no events and no state.
"""

from __future__ import annotations

from typing import Literal

from kvstrata.plugins.eviction_policy import E, EvictionPolicy, EvictionPolicyConfig, PolicyCapabilities


class LruConfig(EvictionPolicyConfig):
    type: Literal["lru"] = "lru"


class LruPolicy(EvictionPolicy):
    name = "lru"
    Config = LruConfig
    capabilities = PolicyCapabilities(recency_order=True)  # the tree's kept heaps rank it: O(log n)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        return [(n.last_access, n.id, n) for n in entries]
