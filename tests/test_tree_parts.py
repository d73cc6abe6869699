"""The prefix tree's parts: the names callers import stay in ``kvstrata.core.tree``, and the
per-tier eviction order is a real seam (an eviction policy will replace it)."""

from __future__ import annotations

import torch

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


def test_a_short_new_part_is_copied_so_the_callers_tensor_is_not_kept_alive() -> None:
    """A new node holding a small part of the caller's value copies it (a view would keep the
    whole tensor, the units the tree did not adopt included); a node holding most of it keeps
    a view (no copy on the common path)."""
    tree, units = PrefixTree([kv_spec()]), Units()
    shared = list(range(100))
    tree.insert(seq(*shared), {"kv": units.take(100)})
    value = units.take(110)  # 100 pages already held, 10 new: 100 units would be kept for nothing
    node = tree.insert(seq(*shared, *range(500, 510)), {"kv": value}).node
    held = node.device[0]
    assert torch.equal(held, value[100:])
    assert held.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    value = units.take(120)  # 10 pages shared, 110 new: the node's view uses most of the tensor
    node = tree.insert(seq(*shared[:10], *range(600, 710)), {"kv": value}).node
    assert torch.equal(node.device[0], value[10:])
    assert node.device[0].untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    tree.check()
