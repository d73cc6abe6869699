"""The prefix tree's parts: the names callers import stay in ``kvstrata.core.tree``, and the
per-tier eviction order is a real seam (an eviction policy will replace it)."""

from __future__ import annotations

import gc
import weakref

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
    tree.set_eviction_order(Tier.DEVICE, MostRecentFirst())
    assert tree.evict_device({"kv": 1}).deleted == 1
    assert two.parent is None and one.parent is tree.root and three.parent is tree.root
    tree.check()


def test_nodes_keep_their_own_units_and_none_of_the_callers_tensor() -> None:
    """A node stores its own copy of its part of the value (int64 bytes, not a view): the
    caller's tensor is not kept alive, the units the tree did not adopt included, whether the
    new part is short or most of it; a later write to that tensor, or to a value read back,
    leaves the tree's units as they were."""
    tree, units = PrefixTree([kv_spec()]), Units()
    shared = list(range(100))
    tree.insert(seq(*shared), {"kv": units.take(100)})
    for tail, length in ((range(500, 510), 110), (range(600, 710), 120)):
        value = units.take(length)
        keys = seq(*shared[: len(value) - len(tail)], *tail)
        expected = value[len(value) - len(tail) :].clone()
        node = tree.insert(keys, {"kv": value}).node
        alive = weakref.ref(value)
        value.fill_(-1)  # the caller reuses its tensor
        del value
        gc.collect()
        assert alive() is None, "the tree kept the caller's tensor alive"
        held = node.device[0]
        assert torch.equal(held, expected) and held.dtype == torch.int64
        held.fill_(-2)  # a value read back is the caller's copy
        assert torch.equal(node.device[0], expected)
        assert torch.equal(tree.values(tree.match(keys).device_path, "kv")[-len(tail) :], expected)
    tree.check()
