"""``chain``: chain-aware LRU: never evicts a page while a later page of its prefix stays.

Every policy evicts only leaves of a tier (a node with children there stays). ``lru`` drops a
chosen leaf whole, so freeing one page can take a 200-page document tail with it; ``chain`` lets
the tree trim the leaf instead, evicting exactly the tail pages it needs and keeping the head, so
a later request sharing the head still hits it. Stacks with node-state pools (Mamba) keep whole
leaves: a trimmed head has no state at its end and could not serve a hit.
"""

from __future__ import annotations

from typing import Literal

from kvstrata.plugins.eviction_policy import E, EvictionPolicy, EvictionPolicyConfig, PolicyCapabilities


class ChainConfig(EvictionPolicyConfig):
    type: Literal["chain"] = "chain"


class ChainPolicy(EvictionPolicy):
    name = "chain"
    Config = ChainConfig
    capabilities = PolicyCapabilities(chain_aware=True)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        return [(n.last_access, n.id, n) for n in entries]
