"""``policy.eviction: lru`` spelled out ranks by the tree's kept LRU heaps, as leaving it unset
does: the ``lru`` plugin declares ``recency_order`` (it ranks exactly by the tree's stamps), and
before that the core ranked every member of the tier at every eviction through the plugin's
``ranked`` (10 ms per request at 5,000 device nodes, against 0.3 ms unset). A policy whose own
``ranked`` overrides the one the declaration came with is ranked by it."""

from __future__ import annotations

from typing import Any

from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.eviction_policies.lru import LruPolicy
from kvstrata.plugins import PluginHost, PolicyContext
from tree_stacks import PAGE, Units, kv_spec, seq

HOST = PluginHost()


def _tree(policy: Any) -> PrefixTree:
    tree = PrefixTree([kv_spec()])
    tree.set_eviction_order(Tier.DEVICE, policy)
    return tree


def _lru() -> LruPolicy:
    context = PolicyContext(tier="device", capacity_pages=64, page_size=PAGE, page_bytes=64)
    return make_policy(HOST, policy_config(HOST, "lru"), context)  # type: ignore[return-value]


class _Counting(LruPolicy):
    """Counts ``ranked`` calls: the heaps rank for the plugin, so it is never called."""

    calls = 0

    def ranked(self, entries: list[Any]) -> list[tuple[float, int, Any]]:
        type(self).calls += 1
        return [(-n.last_access, n.id, n) for n in entries]  # most recent first: re-ranks


def _evict_after_three_prefixes(tree: PrefixTree) -> list[int]:
    units = Units()
    leaves = [tree.insert(seq(first, first + 1), {"kv": units.take(2)}).node for first in (10, 20, 30)]
    tree.match(seq(10, 11))  # the first prefix is used again: the second is the oldest now
    tree.evict_device({"kv": 2})
    tree.check()
    return [i for i, leaf in enumerate(leaves) if leaf.device_raw[0] is None]


def test_the_lru_plugin_is_ranked_by_the_trees_kept_heaps_and_evicts_as_unset_does() -> None:
    spelled_out, unset = _tree(_lru()), PrefixTree([kv_spec()])
    assert spelled_out.evictor.heaps.of(Tier.DEVICE) is not None, "the plugin's tier keeps heaps"
    assert _evict_after_three_prefixes(spelled_out) == _evict_after_three_prefixes(unset) == [1]


def test_a_subclass_that_re_ranks_is_ranked_by_its_own_ranked() -> None:
    context = PolicyContext(tier="device", capacity_pages=64, page_size=PAGE, page_bytes=64)
    tree = _tree(_Counting(_lru().config, context))
    assert tree.evictor.heaps.of(Tier.DEVICE) is None, "its ranked is not the declared one"
    assert _evict_after_three_prefixes(tree) == [0], "most recent first (the match): its own order"
    assert _Counting.calls > 0
