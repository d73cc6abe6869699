"""Component (state, window) eviction choices, kept across evictions.

Three questions about a component pool once ranked every holder of it at every eviction,
O(tier) per allocation once the tier was full. Write-back, before every device eviction: which
unbacked, unlocked device holders to back up, least recently used first, until the shortfall
is covered (:func:`~kvstrata.core.write_back.eviction_backups`: 5 ms per request with 3,000
device nodes on a window stack), and which backed-up holders gained a component after their
backup (:func:`~kvstrata.core.write_back.gained_components`). The evictor, under the LRU order
without retention levels: which holders may lose the units in a tier, lowest stamp first
(``TreeEvictor._component_candidates``: with one state slot per node, 8 ms per request with
4,000 device nodes, every request evicting a state). The tree's setter tells this index
whenever a component joins or leaves a tier, or a node's backup (host anchor) comes or goes,
so each answer costs what it looks at:

- per pool, a heap of ``(last_access, id, node)`` entries of its unbacked device holders:
  pushed when the node joins the pool's device holders and when it loses its backup; an entry
  is stale when its node left, was stamped since (pushed again with its stamp: stamps only
  grow) or is backed up (dropped: pushed again when the backup goes); a locked or already
  chosen node is put back after;
- per pool, the holders that are backed up without a host copy of the component (gained), and
  each holder's position among the pool's holders (the order the scan met them in);
- per tier and pool, the evictor's :class:`ComponentHeap`.

Nothing is kept until the first question (a write-through cache never asks write-back's):
then built from the membership. The answers are the scans' own, node for node and in order
(tests/test_component_index.py checks every one against the scan).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from heapq import heappush
from itertools import count

from kvstrata.core.lru_heap import Entry, overgrown, pop_live
from kvstrata.core.tree_node import _DEVICE, _HOST, UNIT, Membership, TreeNode


class ComponentIndex:
    """Write-back's per component pool backup candidates and gained components, and the
    evictor's heaps (see the module docstring); the tree's setter calls :meth:`moved`."""

    __slots__ = (
        "_backing",
        "_count",
        "_evicting",
        "_gained",
        "_heaps",
        "_members",
        "_seq",
        "_tiers",
        "active",
        "pools",
    )

    def __init__(self, membership: Membership, npools: int) -> None:
        self._members = membership[_DEVICE]
        self._tiers = (membership[_HOST], membership[_DEVICE])  # (indexed by ``dev``)
        self.pools = tuple(range(1, npools))  # the components (pool 0 is the anchor)
        self.active = False  # whether the setter tells this index anything (once asked)
        self._backing = False  # write-back's choices kept (once asked)
        self._evicting: dict[tuple[bool, int], ComponentHeap] = {}  # (device?, pool): the evictor's
        self._heaps: list[list[Entry]] = [[] for _ in range(npools)]
        self._gained: list[dict[TreeNode, None]] = [{} for _ in range(npools)]
        self._seq: list[dict[TreeNode, int]] = [{} for _ in range(npools)]
        self._count = count()

    def evicting(self, dev: bool, p: int) -> ComponentHeap:
        """The LRU order's candidates to lose component ``p``'s units in the device (``dev``) or
        host tier (kept from the first eviction that asks)."""
        heap = self._evicting.get((dev, p))
        if heap is None:
            heap = self._evicting[dev, p] = ComponentHeap(self._tiers[dev][p], p, not dev)
            self.active = True
        return heap

    def _activate(self) -> None:
        self.active = self._backing = True
        for p in self.pools:
            seq = self._seq[p]
            for node in self._members[p]:  # (insertion ordered: the order holders joined)
                seq[node] = next(self._count)
                self._check(node, p)
            self._rebuild(p)

    def _rebuild(self, p: int) -> None:
        heap = [(n.last_access, n.id, n) for n in self._members[p] if n.host_raw[0] is None]
        heap.sort()  # (a sorted list is a heap)
        self._heaps[p] = heap

    def _push(self, p: int, node: TreeNode) -> None:
        heap = self._heaps[p]
        heappush(heap, (node.last_access, node.id, node))
        if overgrown(heap, self._members[p]):
            self._rebuild(p)

    def _check(self, node: TreeNode, p: int) -> None:
        """Whether ``node`` holds pool ``p`` on the device, is backed up and has no host copy of it."""
        if node.device_raw[p] is not None and node.host_raw[0] is not None and node.host_raw[p] is None:
            self._gained[p][node] = None
        else:
            self._gained[p].pop(node, None)

    def moved(self, node: TreeNode, dev: bool, p: int, was: bool, now: bool) -> None:
        """``node``'s value of pool ``p`` in the device (``dev``) or host tier was set (``was``:
        held before, ``now``: held after); called while active for a component or a host anchor."""
        if self._evicting and was is not now:
            self._evicting_moved(node, dev, p, now)
        if not self._backing:
            return
        if dev:
            if was is now:
                return
            if now:  # joined the pool's device holders
                self._seq[p][node] = next(self._count)
                if node.host_raw[0] is None:
                    self._push(p, node)
                self._check(node, p)
            else:
                self._seq[p].pop(node, None)
                self._gained[p].pop(node, None)
        elif p == 0:
            if was is now:
                return
            for q in self.pools:
                if not now and node.device_raw[q] is not None:  # lost its backup: a candidate again
                    self._push(q, node)
                self._check(node, q)
        else:
            self._check(node, p)

    def _evicting_moved(self, node: TreeNode, dev: bool, p: int, now: bool) -> None:
        """The evictor's heaps: a holder joined (pushed), a device node was backed up (pushed:
        write-back's evictions skip unbacked ones) or a component left the device (its host copy
        may lose it now)."""
        heaps = self._evicting
        if not dev and not p:
            for q in self.pools if now else ():
                heap = heaps.get((True, q))
                if heap is not None and node.device_raw[q] is not None:
                    heap.push(node)
            return
        heap = heaps.get((dev, p))
        if heap is not None and now:
            heap.push(node)
        heap = heaps.get((False, p)) if dev and not now else None
        if heap is not None and node.host_raw[p] is not None:
            heap.push(node)

    def backups(self, p: int, chosen: dict[TreeNode, None], have: int, want: int) -> None:
        """Add to ``chosen`` the unbacked device holders of pool ``p`` whose units are not locked,
        least recently used first, until ``have`` plus their units reach ``want``: what ranking
        every holder chose, in its order."""
        if not self._backing:  # (the evictor's heaps may have been kept first)
            self._activate()
        members = self._members[p]
        if overgrown(self._heaps[p], members):
            self._rebuild(p)
        heap = self._heaps[p]
        taken: list[Entry] = []  # live candidates popped: pushed back after
        seen: set[TreeNode] = set()  # (a node may have two entries of one stamp)
        try:
            while have < want and (entry := pop_live(heap, members)) is not None:
                node = entry[2]
                if node.host_raw[0] is not None or node in seen:
                    continue  # backed up: pushed again when its host copy goes
                seen.add(node)
                taken.append(entry)
                if node in chosen or node.device_lock[p]:
                    continue
                chosen[node] = None
                have += len(node.device_raw[p]) // UNIT  # type: ignore[arg-type]
        finally:
            for entry in taken:
                heappush(heap, entry)

    def gained(self, pools: Sequence[int]) -> list[TreeNode]:
        """The device holders of ``pools``' components that are backed up without a host copy
        of one and whose units are not locked, root first (ties: in ``pools``' order, each
        pool's holders in the order they joined): what scanning every holder found."""
        if not self._backing:  # (the evictor's heaps may have been kept first)
            self._activate()
        found: dict[TreeNode, tuple[int, int, int]] = {}
        for rank, p in enumerate(pools):
            seq = self._seq[p]
            for node in self._gained[p]:
                if node not in found and not node.device_lock[p]:
                    found[node] = (node.depth_end, rank, seq[node])
        return sorted(found, key=found.__getitem__)


class ComponentHeap:
    """One tier's candidates to lose a component pool's units under the LRU order (the evictor's
    ``_component_candidates``), kept as :class:`~kvstrata.core.lru_heap.LruHeap` keeps the
    anchor's: an entry per holder, stale once the holder left or was stamped since. A holder
    that may not lose the units now is put back after the eviction where a lock holds them, and
    dropped where only an event the setter reports can change that: on the host a device copy
    (pushed when it leaves), on the device under write-back no backup (pushed when backed up;
    an eviction that may delete unbacked nodes rebuilds the heap first)."""

    __slots__ = ("_iterating", "_taken", "heap", "host", "lossy", "members", "p")

    def __init__(self, members: dict[TreeNode, None], p: int, host: bool) -> None:
        self.members, self.p, self.host = members, p, host
        self._iterating = False
        self._taken: list[Entry] = []  # live entries popped: pushed back after
        self.rebuild()

    def rebuild(self) -> None:
        p, host = self.p, self.host
        heap = [(n.last_access, n.id, n) for n in self.members if not (host and n.device_raw[p] is not None)]
        heap.sort()  # (a sorted list is a heap)
        self.heap, self.lossy = heap, False  # lossy: unbacked device holders dropped

    def push(self, node: TreeNode) -> None:
        heap = self.heap
        heappush(heap, (node.last_access, node.id, node))
        if overgrown(heap, self.members) and not self._iterating:
            self.rebuild()

    def ordered(self, may_lose: Callable[[TreeNode], bool], keep: bool) -> Iterator[TreeNode]:
        """The holders that ``may_lose`` the units, least recently used first; ``keep``: on the
        device, unbacked holders may not (write-back). What ranking every holder yields, in its
        order, while the eviction that walks it only drops and tombstones."""
        self._restore()
        if (self.lossy and not keep) or overgrown(self.heap, self.members):
            self.rebuild()
        return self._walk(may_lose, keep)

    def _restore(self) -> None:
        self._iterating = False
        taken, self._taken = self._taken, []
        heap, members = self.heap, self.members
        for entry in taken:
            if entry[2] in members:
                heappush(heap, entry)

    def _walk(self, may_lose: Callable[[TreeNode], bool], keep: bool) -> Iterator[TreeNode]:
        heap, members, p, host = self.heap, self.members, self.p, self.host
        seen: set[TreeNode] = set()  # (a node may have two entries of one stamp)
        self._iterating = True
        try:
            while (entry := pop_live(heap, members)) is not None:
                node = entry[2]
                if node in seen:
                    continue
                if host:
                    if node.device_raw[p] is not None:
                        continue  # pushed again when its device copy goes
                elif keep and node.host_raw[0] is None:
                    self.lossy = True  # pushed again when backed up
                    continue
                seen.add(node)
                self._taken.append(entry)
                if may_lose(node):
                    yield node
        finally:
            self._restore()
