"""``lfu``: least frequently used first (requests whose prefix ran through the node), ties to
the least recently used. No aging: a prefix that was popular once stays; see ``s3fifo`` and
``arc`` for frequency with decay."""

from __future__ import annotations

from typing import Literal

from kvstrata.plugins.eviction_policy import E, EvictionPolicy, EvictionPolicyConfig, PolicyCapabilities

#: hit counts are weighted above any recency stamp the tree hands out (an int: exact at any
#: count; as a float, past 512 hits stamps a few apart tied and the older node left first)
_HITS = 1 << 44


class LfuConfig(EvictionPolicyConfig):
    type: Literal["lfu"] = "lfu"


class LfuPolicy(EvictionPolicy):
    name = "lfu"
    Config = LfuConfig
    capabilities = PolicyCapabilities(needs_frequency=True)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        return [(n.hit_count * _HITS + n.last_access, n.id, n) for n in entries]
