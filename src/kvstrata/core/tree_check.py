"""The tree's structural invariants, checked in one pass (tests call it after every step).

A separate module because it is long, read-only and never on a request's path: it states in one
place what every other part of the tree must preserve -- links and depths, closed device
prefixes, anchor-before-component, membership sets that match the values, lock counts that
agree with window bounds and with the parent's counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.core.tree_node import _DEVICE, _HOST, UNIT, Membership, PoolLayout, Tier, TreeNode

if TYPE_CHECKING:
    from kvstrata.core.lru_heap import LruHeaps


def check_tree(
    layout: PoolLayout, root: TreeNode, membership: Membership, heaps: LruHeaps | None = None
) -> None:
    """Assert every structural invariant of the tree under ``root`` (and the LRU order's kept
    candidates: ``heaps``)."""
    seen: set[TreeNode] = set()
    stack = [root]
    assert root.parent is None and not root.pages
    assert all(v is None for v in [*root.device_raw, *root.host_raw])
    while stack:
        node = stack.pop()
        assert node not in seen, f"{node!r} reachable twice"
        seen.add(node)
        for key, child in node.children.items():
            assert child.parent is node, f"{child!r} parent link broken"
            assert child.pages and child.first_key == key, f"{child!r} keyed wrongly"
            assert child.depth_end == node.depth_end + child.pages, f"{child!r} depth wrong"
            stack.append(child)
        children = node.children.values()
        assert node.device_children == sum(c.device_raw[0] is not None for c in children), (
            f"{node!r} device child count"
        )
        assert node.host_children == sum(c.host_raw[0] is not None for c in children), (
            f"{node!r} host child count"
        )
        if node is root:
            continue
        anchor_dev, anchor_host = node.device_raw[0] is not None, node.host_raw[0] is not None
        assert anchor_dev or anchor_host, f"{node!r} holds the anchor in no tier"
        if anchor_dev and node.parent is not root:
            assert node.parent.device_raw[0] is not None, f"{node!r} on device below a non-device parent"  # type: ignore[union-attr]
        if not anchor_dev:
            assert all(c.device_raw[0] is None for c in node.children.values()), f"{node!r}: device child"
        for p in range(layout.npools):
            for tier, vals in ((_DEVICE, node.device_raw), (_HOST, node.host_raw)):
                value = vals[p]
                member = node in membership[tier][p]
                assert member == (value is not None), f"{node!r} pool {p} {tier} LRU membership"
                if value is not None:
                    want = 1 if layout.state[p] else node.pages
                    assert type(value) is bytes and len(value) == want * UNIT, (
                        f"{node!r} pool {p} {tier} length"
                    )
                    if p != 0:
                        assert vals[0] is not None, f"{node!r} pool {p} {tier} value without anchor"
            for counts, windows in (
                (node.device_lock, node.device_windows),
                (node.host_lock, node.host_windows),
            ):
                assert counts[p] >= 0, f"{node!r} negative lock"
                if layout.window[p]:
                    assert counts[p] == len(windows.get(p, ())), f"{node!r} window lock count"
                    assert all(b < node.depth_end for b in windows.get(p, ())), f"{node!r} window bound"
            # a node holding locks for its path must have its ancestors locked too
            if not layout.state[p] and not layout.window[p] and node.parent is not root:
                assert node.parent.device_lock[p] >= node.device_lock[p], f"{node!r} device lock > parent"  # type: ignore[union-attr]
                assert node.parent.host_lock[p] >= node.host_lock[p], f"{node!r} host lock > parent"  # type: ignore[union-attr]
    for tier in Tier:
        for p in range(layout.npools):
            for node in membership[tier][p]:
                assert node in seen, f"{node!r} in {tier} LRU of pool {p} but not in the tree"
    if heaps is not None:
        heaps.check()
