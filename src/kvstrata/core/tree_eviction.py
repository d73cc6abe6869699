"""Eviction: free a tier's units by demoting, deleting or tombstoning nodes, in a per-tier order.

Apart from matching and insertion because it is the policy side of the tree: *which* nodes may
leave a tier is fixed by the tree's invariants (closed device prefixes, locks, write-back keeping
a node's only copy, a node with children in the tier stays), while *which of those leaves first*
is an :class:`EvictionOrder`, one per tier. Today both tiers use :class:`LruOrder`; an eviction
policy replaces the order without touching the rules.

The candidates of a pool in a tier are the tree's membership set for it (the nodes holding that
pool's units there); the evictor ranks the ones that may leave and takes the lowest first. The
tree never frees memory: it reports what it dropped and the owner frees it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from kvstrata.core.tree_node import (
    _DEVICE,
    _HOST,
    EvictionResult,
    Membership,
    PoolLayout,
    SetValue,
    Tier,
    TreeError,
    TreeNode,
)


class EvictionOrder(Protocol):
    """Which node leaves a tier first, among those the tree's rules allow to leave.

    The evictor collects the nodes that may leave and asks ``ranked`` for one entry per node,
    ``(rank, node.id, node)``; it sorts (or heaps) the entries and the lowest leaves first. The
    id breaks ties (the older node first), so the order never depends on how candidates were
    collected. A node is ranked when it becomes a candidate: at the start of an eviction, or when
    its last child in the tier has just left. One call ranks a whole batch: every candidate of
    every eviction is ranked, and a Python call per node measurably slowed eviction.
    """

    def ranked(self, nodes: list[TreeNode]) -> list[tuple[float, int, TreeNode]]: ...


class LruOrder:
    """Least recently used first: ``last_access`` is stamped by every match and insert, deepest
    node first, so a parent is never older than its children."""

    __slots__ = ()

    def ranked(self, nodes: list[TreeNode]) -> list[tuple[float, int, TreeNode]]:
        return [(n.last_access, n.id, n) for n in nodes]


class TreeEvictor:
    """Applies the eviction rules over the tree's membership sets, in each tier's order."""

    def __init__(
        self,
        layout: PoolLayout,
        root: TreeNode,
        membership: Membership,
        set_value: SetValue,
        orders: Mapping[Tier, EvictionOrder] | None = None,
    ) -> None:
        self.root = root
        self.pools = layout.pools
        self._pool = layout.pool
        self._members = membership
        self._set = set_value  # sets a node's value and its tier membership (PrefixTree._set)
        self.orders: dict[Tier, EvictionOrder] = (
            dict(orders) if orders is not None else {_DEVICE: LruOrder(), _HOST: LruOrder()}
        )
        self._delete_unbacked = True  # see evict_device

    def evict_device(
        self,
        needs: Mapping[str, int],
        on_free: Callable[[str, torch.Tensor], None] | None,
        delete_unbacked: bool,
    ) -> EvictionResult:
        """See ``PrefixTree.evict_device``."""
        self._delete_unbacked = delete_unbacked
        try:
            return self._evict(_DEVICE, needs, on_free)
        finally:
            self._delete_unbacked = True

    def evict_host(
        self, needs: Mapping[str, int], on_free: Callable[[str, torch.Tensor], None] | None
    ) -> EvictionResult:
        """See ``PrefixTree.evict_host``."""
        return self._evict(_HOST, needs, on_free)

    def _evict(
        self, tier: Tier, needs: Mapping[str, int], on_free: Callable[[str, torch.Tensor], None] | None
    ) -> EvictionResult:
        result = EvictionResult()
        order = sorted((self._pool(name) for name in needs), key=lambda p: self.pools[p].eviction_priority)
        for p in order:
            want = needs[self.pools[p].name]
            if want < 0:
                raise TreeError(f"cannot evict a negative amount ({want}) of pool {self.pools[p].name!r}")
            if result.units.get(self.pools[p].name, 0) >= want:
                continue
            if p == 0:
                self._evict_anchor(tier, want, result)
            else:
                self._evict_component(tier, p, want, result)
        if on_free is not None:
            for name, parts in result.freed.items():
                for value in parts:
                    on_free(name, value)
        return result

    # ------------------------------------------------------------------ rules
    def _has_tier_children(self, node: TreeNode, tier: Tier) -> bool:
        if tier is _DEVICE:
            return any(c.device[0] is not None for c in node.children.values())
        return bool(node.children)

    def _node_evictable(self, node: TreeNode, tier: Tier) -> bool:
        """Whether ``node`` as a whole can leave ``tier`` now."""
        if node is self.root or self._has_tier_children(node, tier):
            return False
        if tier is _DEVICE:
            if node.device[0] is None or any(node.device_lock):
                return False
            # a non-backed-up node is deleted, which it cannot be while it has (host) children
            return node.host[0] is not None or (self._delete_unbacked and not node.children)
        return node.device[0] is None and node.host[0] is not None and not any(node.host_lock)

    def _copy_droppable(self, node: TreeNode) -> bool:
        """Whether the host copy of a device-resident node may go (the second host pass): not
        locked (an L3 write reads it), and no child holds a host copy (backups stay a prefix)."""
        return (
            node.device[0] is not None
            and node.host[0] is not None
            and not any(node.host_lock)
            and not any(c.host[0] is not None for c in node.children.values())
        )

    def _drop_copy(self, node: TreeNode, result: EvictionResult) -> None:
        """Drop the host copy of a node that stays on the device (it is no longer backed up)."""
        for p, value in enumerate(node.host):
            if value is not None:
                result._add(self.pools[p].name, value)
                self._set(node, _HOST, p, None)

    def _drop_node(self, node: TreeNode, tier: Tier, result: EvictionResult) -> TreeNode:
        """Evict a whole node from ``tier`` (demote or delete); returns its parent."""
        parent = node.parent
        assert parent is not None
        if tier is _DEVICE:
            for p, value in enumerate(node.device):
                if value is not None:
                    result._add(self.pools[p].name, value)
                    self._set(node, _DEVICE, p, None)
            if node.host[0] is not None:
                result.demoted.append(node)
                return parent
        for p, value in enumerate(node.host):
            if value is not None:
                result._add(self.pools[p].name, value)
                self._set(node, _HOST, p, None)
        del parent.children[node.keys[0]]
        node.parent = None
        result.deleted += 1
        return parent

    # ------------------------------------------------------------------ per pool kind
    def _evict_anchor(self, tier: Tier, want: int, result: EvictionResult) -> None:
        """Drop whole leaves of the tier, lowest rank first; a parent left without children in
        the tier becomes a candidate in turn."""
        name = self.pools[0].name
        ranked = self.orders[tier].ranked
        heap = ranked([n for n in self._members[tier][0] if self._node_evictable(n, tier)])
        heapq.heapify(heap)
        while heap and result.units.get(name, 0) < want:
            _, _, node = heapq.heappop(heap)
            if not self._node_evictable(node, tier):
                continue
            parent = self._drop_node(node, tier, result)
            if self._node_evictable(parent, tier):
                heapq.heappush(heap, ranked([parent])[0])
        if tier is _HOST and result.units.get(name, 0) < want:
            self._drop_copies(want, result)

    def _drop_copies(self, want: int, result: EvictionResult) -> None:
        """Second host pass: host copies of pages that stay on the device go, deepest first in
        the order (their pages are still served from L1; the host tier needs the room)."""
        name = self.pools[0].name
        ranked = self.orders[_HOST].ranked
        heap = ranked([n for n in self._members[_HOST][0] if self._copy_droppable(n)])
        heapq.heapify(heap)
        while heap and result.units.get(name, 0) < want:
            _, _, node = heapq.heappop(heap)
            if not self._copy_droppable(node):
                continue
            self._drop_copy(node, result)
            parent = node.parent
            if parent is not None and parent is not self.root and self._copy_droppable(parent):
                heapq.heappush(heap, ranked([parent])[0])

    def _evict_component(self, tier: Tier, p: int, want: int, result: EvictionResult) -> None:
        """Drop one component's units, lowest rank first: a whole node where it may leave the
        tier (its pages are useless without the component), else a tombstone."""
        name = self.pools[p].name
        dev = tier is _DEVICE
        members = self._members[tier][p]
        if dev:
            # not locked; and write-back (keep_unbacked) keeps a node without a backup whole
            keep_unbacked = not self._delete_unbacked
            nodes = [n for n in members if not n.device_lock[p] and not (keep_unbacked and n.host[0] is None)]
        else:
            # not locked, and not also on device (the device copy goes first)
            nodes = [n for n in members if not n.host_lock[p] and n.device[p] is None]
        candidates = self.orders[tier].ranked(nodes)
        candidates.sort()
        for _, _, node in candidates:
            if result.units.get(name, 0) >= want:
                break
            if (node.device if dev else node.host)[p] is None:
                continue  # already dropped with a cascaded node
            if self._node_evictable(node, tier):
                parent = self._drop_node(node, tier, result)
                # the parent's own component value is considered in its own turn
                del parent
            else:
                value = (node.device if dev else node.host)[p]
                assert value is not None
                result._add(name, value)
                self._set(node, tier, p, None)
                result.tombstoned += 1
