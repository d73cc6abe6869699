"""The prefix tree's parts: the names callers import stay in ``kvstrata.core.tree``, and the
per-tier eviction order is a real seam (an eviction policy will replace it)."""

from __future__ import annotations

import kvstrata.core.tree as tree_module
from kvstrata.core.tree import PrefixTree, Tier, TreeNode
from tree_stacks import Units, kv_spec, seq

# every name kvstrata.core.tree defined before it was split into parts
NAMES_BEFORE_THE_SPLIT = [
    "PageKey",
    "Tier",
    "TreeError",
    "page_keys",
    "TreeNode",
    "MatchResult",
    "InsertResult",
    "EvictionResult",
    "LockHandle",
    "PrefixTree",
]


def test_every_tree_name_is_still_importable_from_tree() -> None:
    missing = [name for name in NAMES_BEFORE_THE_SPLIT if not hasattr(tree_module, name)]
    assert not missing, missing


class MostRecentFirst:
    """An order other than LRU, for this test only: the most recently used node leaves first."""

    def ranked(self, nodes: list[TreeNode]) -> list[tuple[float, int, TreeNode]]:
        return [(-n.last_access, n.id, n) for n in nodes]


def _three_leaves() -> tuple[PrefixTree, list[TreeNode]]:
    tree, units = PrefixTree([kv_spec()]), Units()
    leaves = [tree.insert(seq(i), {"kv": units.take(1)}).node for i in (1, 2, 3)]
    tree.match(seq(2))  # leaf 2 is now the most recently used
    return tree, leaves


def test_device_eviction_follows_the_device_tier_order() -> None:
    tree, (one, two, three) = _three_leaves()
    assert tree.evict_device({"kv": 1}).deleted == 1
    assert one.parent is None and two.parent is tree.root  # LRU: the oldest leaf went
    tree.check()

    tree, (one, two, three) = _three_leaves()
    tree._evictor.orders[Tier.DEVICE] = MostRecentFirst()
    assert tree.evict_device({"kv": 1}).deleted == 1
    assert two.parent is None and one.parent is tree.root and three.parent is tree.root
    tree.check()
