"""Eviction: free a tier's units by demoting, deleting or tombstoning nodes, in a per-tier order.

Apart from matching and insertion because it is the policy side of the tree: *which* nodes may
leave a tier is fixed by the tree's invariants (closed device prefixes, locks and pins, write-back
keeping a node's only copy, a node with children in the tier stays), while *which of those leaves
first* is an :class:`EvictionOrder`, one per tier: an eviction-policy plugin
(:class:`~kvstrata.plugins.eviction_policy.EvictionPolicy`) or the built-in :class:`LruOrder`. A
policy replaces the order without touching the rules.

The candidates of a pool in a tier are the tree's membership set for it (the nodes holding that
pool's units there); the evictor ranks the ones that may leave and takes the lowest first. What
else an order declares (``capabilities``) the evictor honours here, off the per-page path:

- ``events``: the order hears ``accessed`` (one call per matched request path), ``inserted`` (the nodes an
  insert created in its tier, or a load-back or backup brought there), ``split``, ``removed`` (per eviction);
- ``chain_aware``: a chosen leaf longer than what is still needed is trimmed -- its tail pages go, its head
  stays -- on stacks without node-state pools (a trimmed head has no state).

Window (trailing_pages) pools have a class of their own that leaves first: window data outside the last window
of every prefix the tier holds (:func:`window_tail`), tombstoned before anything a cached prefix needs; a
window pool makes room after the anchor, whose leaves free its units too. On the device a window lock (a
request's, a pin's) holds only its last window: the older part of a node it reaches into is such data too (the
node is split where the lock's window starts); one an unlocked end still needs goes after every unlocked node,
so what :func:`room_by_evicting` counts is freed. A host lock may be an L3 write's source (it reads the whole
node): it holds the node whole. Host copies of what stays on the device go last (:func:`_drop_copies`,
:mod:`kvstrata.core.state_copies`).

Retention hints (:mod:`kvstrata.core.retention`) rank above the order: a node with a higher retention level
leaves only after every node of a lower one. The tree never frees memory: the owner frees what it dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from kvstrata.core.component_index import ComponentIndex
from kvstrata.core.lru_heap import LruHeaps, ranks_by_recency
from kvstrata.core.policy_events import GuardedEvents
from kvstrata.core.state_copies import drop_state_copies
from kvstrata.core.tree_node import (
    _DEVICE,
    _HOST,
    EvictionResult,
    InsertResult,
    Membership,
    PoolLayout,
    SetValue,
    Tier,
    TreeError,
    TreeNode,
    unit_tensor,
)
from kvstrata.plugins.eviction_policy import PolicyCapabilities

Split = Callable[[TreeNode, int], TreeNode]


class RetentionLevels(Protocol):
    """Retention hints as the evictor reads them (``kvstrata.core.retention.Retention``)."""

    def levels(self) -> Callable[[TreeNode], int] | None:
        """Each node's level for the eviction starting now, or None when no node has one."""
        ...

    def expire(self) -> None:
        """Release the pins whose TTL passed (before asking whether evicting can make room)."""
        ...

    def split(self, upper: TreeNode, lower: TreeNode) -> None: ...

    def forget(self, node: TreeNode) -> None: ...


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

    capabilities = PolicyCapabilities(recency_order=True)  # (the heaps rank it: see use)

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
        split: Split | None = None,
    ) -> None:
        self.root = root
        self.pools = layout.pools
        self._pool = layout.pool
        self._members = membership
        self._set = set_value  # sets a node's value and its tier membership (PrefixTree._set)
        self._split = split  # the matcher's split (trims a leaf for chain-aware orders)
        self._can_trim = not layout.stateful and split is not None
        self._window, self._stateful = layout.window, layout.stateful  # window pages per pool; states
        self._eviction_rank = layout.eviction_rank
        self.orders: dict[Tier, EvictionOrder] = {_DEVICE: LruOrder(), _HOST: LruOrder()}
        self._hearing: dict[Tier, Any] = {}  # tiers whose order hears events
        self._trims: dict[Tier, bool] = {_DEVICE: False, _HOST: False}
        #: whether any order hears events: the one check match and insert pay
        self.hears = False
        #: retention hints (priority, TTL), or None; pins are locks and need nothing here
        self.retention: RetentionLevels | None = None
        #: other owners of per-node state told of splits and of deleted nodes (the writer's sets)
        self.split_listeners: list[Callable[[TreeNode, TreeNode], None]] = []
        self.delete_listeners: list[Callable[[TreeNode], None]] = []
        self._gone: list[TreeNode] | None = None  # nodes leaving the tier in this eviction
        self._level: Callable[[TreeNode], int] | None = None  # retention levels of this eviction
        self._delete_unbacked = True  # see evict_device
        #: host eviction leaves device pages their host copies (``TierUnits.keeping_copies``)
        self.keep_copies = False
        self.heaps = LruHeaps(membership)  # the LRU order's candidates (core/lru_heap.py)
        self.components = ComponentIndex(membership, len(layout.pools))  # (core/component_index.py)
        for tier, order in (orders or {}).items():
            self.use(tier, order)

    def use(self, tier: Tier, order: EvictionOrder) -> None:
        """Make ``order`` rank ``tier``'s candidates, honouring its declared capabilities."""
        self.orders[tier] = order
        self.heaps.enable(tier, ranks_by_recency(order))
        caps = getattr(order, "capabilities", None)
        self._trims[tier] = bool(getattr(caps, "chain_aware", False)) and self._can_trim
        if getattr(caps, "events", False):
            self._hearing[tier] = GuardedEvents(order, tier.value)  # (a policy's bug fails nothing)
        else:
            self._hearing.pop(tier, None)
        self.hears = bool(self._hearing)

    # ------------------------------------------------------------------ events
    def accessed(self, path: Sequence[TreeNode]) -> None:
        """One request's matched path (root first): every hearing order gets it deepest first
        (an empty one too: a request that matched nothing still moves a policy's clock)."""
        deepest_first = path[::-1]
        for order in self._hearing.values():
            order.accessed(deepest_first)

    def inserted(self, tier: Tier, result: InsertResult) -> None:
        """An insert into ``tier``: what it brought there, root-most first -- the existing nodes it
        adopted (``result.revived``: else a policy heard of them only ranking them) above those it created."""
        order = self._hearing.get(tier)
        node, first = result.node, result.node.depth_end - result.new_pages
        if order is None or (result.new_pages <= 0 and not result.revived):
            return
        created = []
        while result.new_pages > 0 and node is not self.root and node.depth_start >= first:
            created.append(node)
            node = node.parent  # type: ignore[assignment]
        order.inserted([*result.revived, *created[::-1]])

    def entered(self, tier: Tier, nodes: Sequence[TreeNode]) -> None:
        """``nodes`` joined ``tier`` from the other tier (a load-back, a backup): inserted into it,
        one at a time, so a policy's ghosts see a prefix it evicted come back."""
        order = self._hearing.get(tier)
        for node in nodes if order is not None else ():  # (one check when no order hears)
            order.inserted([node])  # type: ignore[union-attr]

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` was cut off the top of ``lower``: orders and hints carry their state over."""
        for order in self._hearing.values():
            order.split(upper, lower)
        if self.retention is not None:
            self.retention.split(upper, lower)
        for listener in self.split_listeners:
            listener(upper, lower)

    # ------------------------------------------------------------------ entry points
    def evict_device(
        self,
        needs: Mapping[str, int],
        on_free: Callable[[str, torch.Tensor], None] | None,
        delete_unbacked: bool,
        out_of_window_only: bool = False,
    ) -> EvictionResult:
        """See ``PrefixTree.evict_device``."""
        self._delete_unbacked = delete_unbacked
        try:
            return self._evict(_DEVICE, needs, on_free, out_of_window_only)
        finally:
            self._delete_unbacked = True

    def evict_host(
        self,
        needs: Mapping[str, int],
        on_free: Callable[[str, torch.Tensor], None] | None,
        out_of_window_only: bool = False,
    ) -> EvictionResult:
        """See ``PrefixTree.evict_host``."""
        return self._evict(_HOST, needs, on_free, out_of_window_only)

    def _evict(
        self,
        tier: Tier,
        needs: Mapping[str, int],
        on_free: Callable[[str, torch.Tensor], None] | None,
        out_of_window_only: bool,
    ) -> EvictionResult:
        result = EvictionResult()
        hearing = self._hearing.get(tier)
        self._gone = [] if hearing is not None else None
        # fixed for the whole eviction: every rank of one heap must have the same shape
        self._level = self.retention.levels() if self.retention is not None else None
        try:
            pools = sorted((self._pool(name) for name in needs), key=self._eviction_rank.__getitem__)
            for p in pools:
                want = needs[self.pools[p].name]
                if want < 0:
                    raise TreeError(f"cannot evict a negative amount ({want}) of pool {self.pools[p].name!r}")
                if result.units.get(self.pools[p].name, 0) >= want:
                    continue
                if self._window[p]:  # out-of-window data first: no cached prefix needs it
                    self._evict_out_of_window(tier, p, want, result)
                if out_of_window_only or result.units.get(self.pools[p].name, 0) >= want:
                    continue
                if p == 0:
                    self._evict_anchor(tier, want, result)
                else:
                    self._evict_component(tier, p, want, result)
        finally:
            result._settle()
            if on_free is not None:  # what left the tree is freed, also when a policy raised
                for name, parts in result.freed.items():
                    for value in parts:
                        on_free(name, value)
            gone, self._gone = self._gone, None
            if gone:
                hearing.removed(gone)  # type: ignore[union-attr]
        return result

    def _ranked(self, tier: Tier, nodes: list[TreeNode]) -> list[tuple[Any, int, TreeNode]]:
        """The tier order's entries; under retention hints keyed by ``(level, rank)``."""
        entries = self.orders[tier].ranked(nodes)
        level = self._level
        if level is not None:
            return [((level(n), rank), i, n) for rank, i, n in entries]
        return entries

    # ------------------------------------------------------------------ rules
    def _node_evictable(self, node: TreeNode, tier: Tier) -> bool:
        """Whether ``node`` as a whole can leave ``tier`` now."""
        if node is self.root or _has_tier_children(node, tier):
            return False
        if tier is _DEVICE:
            if node.device_raw[0] is None or any(node.device_lock):
                return False
            # a non-backed-up node is deleted, which it cannot be while it has (host) children
            return node.host_raw[0] is not None or (self._delete_unbacked and not node.children)
        return node.device_raw[0] is None and node.host_raw[0] is not None and not any(node.host_lock)

    def _drop_copy(self, node: TreeNode, result: EvictionResult) -> None:
        """Drop the host copy of a node that stays on the device (it is no longer backed up)."""
        for p, value in enumerate(node.host_raw):
            if value is not None:
                result._add_raw(self.pools[p].name, value)
                self._set(node, _HOST, p, None)
        if self._gone is not None:
            self._gone.append(node)

    def _drop_node(self, node: TreeNode, tier: Tier, result: EvictionResult) -> TreeNode:
        """Evict a whole node from ``tier`` (demote or delete); returns its parent."""
        parent = node.parent
        assert parent is not None
        if self._gone is not None:
            self._gone.append(node)
        if tier is _DEVICE:
            for p, value in enumerate(node.device_raw):
                if value is not None:
                    result._add_raw(self.pools[p].name, value)
                    self._set(node, _DEVICE, p, None)
            if node.host_raw[0] is not None:
                result.demoted.append(node)
                return parent
        for p, value in enumerate(node.host_raw):
            if value is not None:
                result._add_raw(self.pools[p].name, value)
                self._set(node, _HOST, p, None)
        del parent.children[node.first_key]
        node.parent = None
        result.deleted += 1
        if self.retention is not None:
            self.retention.forget(node)
        for forget in self.delete_listeners:
            forget(node)
        return parent

    # ------------------------------------------------------------------ per pool kind
    def _evict_anchor(self, tier: Tier, want: int, result: EvictionResult) -> None:
        """Drop whole leaves of the tier, lowest rank first; a parent left without children in the tier
        becomes a candidate in turn. A chain-aware order trims the last leaf it needs to the pages still
        wanted. The LRU order's candidates are kept (``core/lru_heap.py``): ranking them all cost O(tier)."""
        name = self.pools[0].name
        kept = self.heaps.of(tier) if self._level is None else None
        if kept is not None:
            kept.evict(self._node_evictable, self._drop_node, name, tier, want, result)
        else:
            self._evict_ranked(tier, name, want, result)
        if tier is _HOST and not self.keep_copies and result.units.get(name, 0) < want:
            _drop_copies(self, want, result)

    def _evict_ranked(self, tier: Tier, name: str, want: int, result: EvictionResult) -> None:
        """:meth:`_evict_anchor` by the tier's order (a plugin's) or retention levels: all ranked."""
        trims = self._trims[tier]
        heap = self._ranked(tier, [n for n in self._members[tier][0] if self._node_evictable(n, tier)])
        heapq.heapify(heap)
        while heap and result.units.get(name, 0) < want:
            _, _, node = heapq.heappop(heap)
            if not self._node_evictable(node, tier):
                continue
            rest = want - result.units.get(name, 0)
            if trims and node.pages > rest:
                self._split(node, node.pages - rest)  # type: ignore[misc]  # node keeps the tail
                self._drop_node(node, tier, result)
                break
            parent = self._drop_node(node, tier, result)
            if self._node_evictable(parent, tier):
                heapq.heappush(heap, self._ranked(tier, [parent])[0])

    def _component_candidates(self, tier: Tier, p: int, heads: bool = False) -> Iterator[TreeNode]:
        """Nodes that may lose pool ``p``'s units in ``tier``, lowest rank first: see
        :func:`_may_lose` (with ``heads``, on the device, also a node whose window locks start
        after its first page: its head may go). The LRU order's are kept across evictions
        (``core/component_index.py``): ranking every holder cost O(tier) per eviction."""
        dev = tier is _DEVICE  # (a host lock may be an L3 write's, reading the whole node)
        free = _head_free if heads and dev else _unlocked
        keep = dev and not self._delete_unbacked  # write-back: a node without a backup stays
        if p and self.heaps.of(tier) is not None and self._level is None:
            return self.components.evicting(dev, p).ordered(lambda n: _may_lose(n, p, dev, keep, free), keep)
        nodes = [n for n in self._members[tier][p] if _may_lose(n, p, dev, keep, free)]
        return iter([n for *_, n in sorted(self._ranked(tier, nodes))])

    def _evict_out_of_window(self, tier: Tier, p: int, want: int, result: EvictionResult) -> None:
        """Tombstone window data outside the last window of every prefix the tier holds, lowest
        rank first, before any window data a prefix needs (and before the anchor's pages). A
        node whose last pages a prefix needs is split there and loses only its head."""
        name = self.pools[p].name
        for node in self._component_candidates(tier, p, heads=True):
            if result.units.get(name, 0) >= want:
                break
            tail = window_tail(node, tier, self._window[p], p, self._stateful)
            locks = node.device_windows.get(p) if tier is _DEVICE else None
            if locks:  # a request's window reaches into the node: its head is no one's
                tail = max(tail, node.depth_end - min(locks))
            if tail >= node.pages:
                continue
            if tail:  # the head is out of every window
                node = self._split(node, node.pages - tail)  # type: ignore[misc]
            value = unit_tensor((node.device_raw if tier is _DEVICE else node.host_raw)[p])  # type: ignore[arg-type]
            result._add(name, value)
            self._set(node, tier, p, None)
            result.tombstoned += 1
            result.out_of_window[name] = result.out_of_window.get(name, 0) + value.shape[0]

    def _evict_component(self, tier: Tier, p: int, want: int, result: EvictionResult) -> None:
        """Drop one component's units, lowest rank first: a whole node where it may leave the tier (its
        pages are useless without the component), else a tombstone. Then a device window pool tombstones
        locked nodes' heads above every lock window (no lock needs them; ``room_by_evicting`` counts them)"""
        name = self.pools[p].name
        dev = tier is _DEVICE
        for heads in (False, True) if dev and self._window[p] else (False,):
            for node in self._component_candidates(tier, p, heads=heads):
                if result.units.get(name, 0) >= want:
                    return
                if (node.device_raw if dev else node.host_raw)[p] is None:
                    continue  # already dropped with a cascaded node
                if self._node_evictable(node, tier):
                    self._drop_node(node, tier, result)  # its parent's value: in the parent's turn
                    continue
                if heads:  # (the second pass: every unlocked candidate has gone)
                    node = _unheld_head(node, p, self._split)  # type: ignore[arg-type]
                value = (node.device_raw if dev else node.host_raw)[p]
                assert value is not None
                result._add_raw(name, value)
                self._set(node, tier, p, None)
                result.tombstoned += 1
        if not dev and not self.keep_copies and p in self._stateful:  # then host copies of device states
            drop_state_copies(self._members[_HOST][p], self._set, p, name, want, result)


def _drop_copies(evictor: TreeEvictor, want: int, result: EvictionResult) -> None:
    """Second host pass: host copies of pages that stay on the device go, deepest first in
    the order (their pages are still served from L1; the host tier needs the room)."""
    name = evictor.pools[0].name
    if evictor.heaps.of(_HOST) is not None and evictor._level is None:  # kept: core/lru_heap.py
        drop = lambda node, tier, result: evictor._drop_copy(node, result)  # noqa: E731
        evictor.heaps.copies.evict(lambda node, tier: _copy_droppable(node), drop, name, _HOST, want, result)
        return
    heap = evictor._ranked(_HOST, [n for n in evictor._members[_HOST][0] if _copy_droppable(n)])
    heapq.heapify(heap)
    while heap and result.units.get(name, 0) < want:
        _, _, node = heapq.heappop(heap)
        if not _copy_droppable(node):
            continue
        evictor._drop_copy(node, result)
        parent = node.parent
        if parent is not None and parent is not evictor.root and _copy_droppable(parent):
            heapq.heappush(heap, evictor._ranked(_HOST, [parent])[0])


def _has_tier_children(node: TreeNode, tier: Tier) -> bool:
    if tier is _DEVICE:
        return node.device_children > 0  # counted by the tree: O(1), not a sibling scan
    return bool(node.children)


def _in_tier(node: TreeNode, tier: Tier, p: int = 0) -> bool:
    """Whether ``node``'s pages (pool ``p``'s units; the anchor's by default) can be served from
    ``tier`` (host: from device or host)."""
    return node.device_raw[p] is not None or (tier is _HOST and node.host_raw[p] is not None)


def window_tail(node: TreeNode, tier: Tier, window: int, p: int, stateful: Sequence[int] = ()) -> int:
    """How many of ``node``'s last pages lie in the last window (``window`` pages of pool ``p``)
    of a prefix the tier holds; the pages before them are out-of-window data. A held prefix ends
    at ``node`` or below it where the tier's paths end or branch (a request's end, a shared
    prompt) or at a node holding every state pool's (``stateful``) state in the tier (a chunk's
    checkpoint); an end within the window below a node without its window data is unusable: the
    path's usable part ends above that node. Walks the nodes ending within the window below."""
    limit = node.depth_end + window
    nearest = window  # distance from node's end to the nearest prefix end within the window
    stack: list[tuple[TreeNode, TreeNode | None]] = [(node, None)]  # (node, where usable data ends)
    while stack:
        cur, cut = stack.pop()
        below = [c for c in cur.children.values() if _in_tier(c, tier)]
        # a leaf of the tier, a branch point or a checkpoint: no nearer end below it
        if len(below) != 1 or (stateful and all(_in_tier(cur, tier, q) for q in stateful)):
            nearest = min(nearest, (cut or cur).depth_end - node.depth_end)
        elif below[0].depth_end < limit:
            stack.append((below[0], cut or (None if _in_tier(below[0], tier, p) else cur)))
    return min(node.pages, window - nearest)


def _may_lose(node: TreeNode, p: int, dev: bool, keep: bool, free: Callable[..., bool]) -> bool:
    """Whether ``node`` may lose pool ``p``'s units in a tier: ``free`` of its locks; on the
    device not without a backup where ``keep`` (write-back); on the host not also on the device."""
    if dev:
        return free(node, p, node.device_lock, node.device_windows) and not (
            keep and node.host_raw[0] is None
        )
    return free(node, p, node.host_lock, node.host_windows) and node.device_raw[p] is None


def _unheld_head(node: TreeNode, p: int, split: Split) -> TreeNode:
    """The part of a device ``node`` no window lock of pool ``p`` holds: itself when unlocked,
    else its head above every lock's window (``_head_free``), split off there; locks record
    their lower bound, so all stay on the lower half with every page their windows read."""
    if not node.device_lock[p]:
        return node
    return split(node, min(node.device_windows[p]) - node.depth_start)


def _unlocked(node: TreeNode, p: int, locks: tuple[int, ...], windows: dict[int, list[int]]) -> bool:
    return not locks[p]


def _head_free(node: TreeNode, p: int, locks: tuple[int, ...], windows: dict[int, list[int]]) -> bool:
    """Unlocked for window pool ``p``, or every lock's window starts after the node's first page
    (window locks record their lower page bound: :mod:`~kvstrata.core.tree_locks`)."""
    return not locks[p] or min(windows[p]) > node.depth_end - node.pages


def _copy_droppable(node: TreeNode) -> bool:
    """Whether the host copy of a device-resident node may go (the second host pass): not
    locked (an L3 write reads it), and no child holds a host copy (backups stay a prefix)."""
    return (
        node.device_raw[0] is not None
        and node.host_raw[0] is not None
        and not any(node.host_lock)
        and not node.host_children
    )


def event_errors(evictor: TreeEvictor) -> list[str]:
    """The first error of each tier's policy whose events raised (a cache logs and ignores them;
    the policy conformance kit fails them)."""
    return [f"{h.tier} tier: {h.first_error}" for h in evictor._hearing.values() if h.first_error]
