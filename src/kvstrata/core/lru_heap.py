"""The LRU order's eviction candidates, kept in a heap across evictions.

The evictor takes the lowest-ranked node that may leave a tier, then the next, a parent joining
the candidates once its last child in the tier has left. Ranking every member of the tier at
every eviction cost O(tier) per allocation once the tier was full: 79 ms per request with
10,000 device nodes, every request evicting. Under the built-in LRU order a node's rank is its
``last_access``, a stamp that only grows, so the tree keeps the candidates in a heap instead:

- an entry is pushed when a node may have become a candidate: its anchor joins the tier (on the
  host: a node with no device copy), it leaves the device with a host copy (demoted), or its
  last child in the tier leaves (device: the last device child; host: the last child);
- an entry may be stale: its node left the tier (dropped), or was stamped since (pushed again
  with its stamp: the old stamp is a lower bound, so the node surfaces no later than its rank);
- a node that surfaces and may not leave is dropped from the heap where only a child leaving
  can change that (the child's leaving pushes it again), else (locked, no backup under
  write-back) set aside and pushed back after the eviction.

So the node that surfaces is the one the scan ranked lowest: an eviction costs the nodes it
looks at, not the tier. Dropped and stale entries are compacted away once the heap holds twice
the tier. Plugin orders and retention levels (a rank that is not the stamp) rank by a scan,
unless an order declares ``recency_order`` (:func:`ranks_by_recency`: the ``lru`` plugin).
Nothing is kept until the first eviction asks (then built from the members): a cache that never
evicts pays no push per insert (~3 us per sequence of a 30,000-sequence tree).
The host copies of device nodes the second host pass may drop are kept the same way
(:class:`CopyHeap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from heapq import heapify, heappop, heappush

from kvstrata.core.tree_node import _DEVICE, EvictionResult, Membership, Tier, TreeNode

#: entries beyond twice the tier's members before the heap is rebuilt from them
_SLACK = 64


Entry = tuple[int, int, TreeNode]  # (the stamp it was pushed with, the node's id, the node)


def overgrown(heap: list[Entry], members: Sized) -> bool:
    """Whether a heap holds more than twice its members' entries (stale ones, dropped nodes'):
    time to rebuild it from them."""
    return len(heap) > 2 * len(members) + _SLACK


def pop_live(heap: list[Entry], members: dict[TreeNode, None]) -> Entry | None:
    """Pop the lowest entry whose node is still a member and carries the stamp it was pushed
    with, or None once the heap is empty: entries of nodes that left are dropped, those of nodes
    stamped since pushed again with their stamp (a stamp only grows: the old one ranked early)."""
    while heap:
        entry = heappop(heap)
        rank, _, node = entry
        if node not in members:
            continue
        if node.last_access == rank:
            return entry
        heappush(heap, (node.last_access, node.id, node))
    return None


class LruHeap:
    """One tier's candidates for the anchor's LRU eviction (see the module docstring)."""

    __slots__ = ("_evicting", "active", "heap", "host", "members", "ranks")

    def __init__(self, members: dict[TreeNode, None], host: bool) -> None:
        self.members = members  # the tier's anchor membership (the tree keeps it)
        self.host = host
        self.heap: list[Entry] = []
        self.ranks = True  # false while a plugin order ranks the tier
        #: entries kept (pushed by the setter): from the first eviction that asks while ``ranks``,
        #: so a cache that never evicts pays no push per insert
        self.active = False
        self._evicting = False

    def push(self, node: TreeNode) -> None:
        if self.active:
            heap = self.heap
            heappush(heap, (node.last_access, node.id, node))
            if overgrown(heap, self.members) and not self._evicting:
                self.rebuild()

    def rebuild(self) -> None:
        """An entry for every member (on the host: every one without a device copy)."""
        host = self.host
        heap = [(n.last_access, n.id, n) for n in self.members if not (host and n.device_raw[0] is not None)]
        heapify(heap)
        self.heap = heap

    def enable(self, on: bool) -> None:
        """The LRU order ranks the tier (the heap is built at the next eviction) or a plugin
        order does (nothing is kept)."""
        self.ranks = on
        if not on:
            self.heap, self.active = [], False

    def _keep(self) -> None:
        """Built from the members at the first ask, kept from then on."""
        if not self.active:
            self.rebuild()
            self.active = True

    def evict(
        self,
        evictable: Callable[[TreeNode, Tier], bool],
        drop: Callable[[TreeNode, Tier, EvictionResult], object],
        name: str,
        tier: Tier,
        want: int,
        result: EvictionResult,
    ) -> None:
        """``drop`` the least recently used nodes that are ``evictable`` from ``tier`` until
        ``want`` units of the anchor ``name`` left (or none may): what the evictor's ranked scan
        drops, in the same order."""
        self._keep()
        if overgrown(self.heap, self.members):
            self.rebuild()
        heap, members = self.heap, self.members
        deferred = []
        self._evicting = True
        try:
            while result.units.get(name, 0) < want and (entry := pop_live(heap, members)) is not None:
                node = entry[2]
                if evictable(node, tier):
                    drop(node, tier, result)  # (the setter pushes its parent, where it may go now)
                elif self._may_wait(node):
                    deferred.append(entry)  # locked, or no backup: may go at a later eviction
        finally:
            self._evicting = False
            for entry in deferred:
                heappush(heap, entry)

    def _may_wait(self, node: TreeNode) -> bool:
        """Whether ``node``, surfacing but not evictable, may go at a later eviction without the
        setter pushing it again (it is locked, or has no backup): then it is put back."""
        if self.host:
            return not (node.device_raw[0] is not None or node.children)
        return not node.device_children

    def leaves_first(self, leaves: Callable[[TreeNode], bool], enough: Callable[[], bool]) -> None:
        """Offer device members to ``leaves`` in the order an eviction takes them, until
        ``enough``: least recently used first, each once it has no device child or every one
        was offered and ``leaves`` said it goes (then its parent is offered in turn). Nothing
        leaves: write-back asks what to back up so that an eviction can free the shortfall
        (``core/write_back.py``). Costs the nodes it offers, not the tier; the heap is left as
        it was (stale entries refreshed, nodes with device children dropped, as in ``evict``)."""
        self._keep()
        heap, members = self.heap, self.members
        taken: list[Entry] = []  # live candidates popped: pushed back after
        ready: list[Entry] = []  # parents whose every device child was offered
        gone: dict[TreeNode, int] = {}  # per parent: its device children offered and leaving
        offered: set[TreeNode] = set()  # (a node may have two entries of one stamp: join, last child)
        try:
            while not enough():
                while heap:  # the global heap's lowest live candidate on top
                    rank, _, node = heap[0]
                    if node not in members:
                        heappop(heap)
                    elif node.last_access != rank:
                        heappush(heap, (node.last_access, node.id, heappop(heap)[2]))
                    elif node.device_children:
                        heappop(heap)  # pushed again when its last device child leaves
                    else:
                        break
                if ready and (not heap or ready[0] < heap[0]):
                    node = heappop(ready)[2]
                elif heap:
                    entry = heappop(heap)
                    taken.append(entry)
                    node = entry[2]
                else:
                    return
                if node in offered:
                    continue
                offered.add(node)
                if leaves(node):
                    parent: TreeNode = node.parent  # type: ignore[assignment]
                    if parent.parent is not None:  # (not the root)
                        count = gone[parent] = gone.get(parent, 0) + 1
                        if count == parent.device_children:
                            heappush(ready, (parent.last_access, parent.id, parent))
        finally:
            for entry in taken:
                heappush(heap, entry)


class CopyHeap(LruHeap):
    """The host copies of device nodes, for the second host pass (``_drop_copies`` in
    ``core/tree_eviction.py``): a copy may go once no child has one (backups stay a prefix),
    lowest stamp first. An entry is pushed when a node holds both copies (its host copy joins
    while it is on the device, or it comes back to the device) and when its last host child
    leaves; one surfacing with host children or no device copy is dropped (pushed again then),
    a locked one put back after."""

    __slots__ = ()

    def rebuild(self) -> None:
        heap = [(n.last_access, n.id, n) for n in self.members if n.device_raw[0] is not None]
        heapify(heap)
        self.heap = heap

    def _may_wait(self, node: TreeNode) -> bool:
        return node.device_raw[0] is not None and not node.host_children


class LruHeaps:
    """The device and host heaps, told by the tree's setter whenever a node's anchor joins or
    leaves a tier (it also keeps the parents' child counts here)."""

    __slots__ = ("copies", "device", "host")

    def __init__(self, membership: Membership) -> None:
        self.device = LruHeap(membership[_DEVICE][0], host=False)
        self.host = LruHeap(membership[Tier.HOST][0], host=True)
        self.copies = CopyHeap(membership[Tier.HOST][0], host=True)

    def enable(self, tier: Tier, on: bool) -> None:
        (self.device if tier is _DEVICE else self.host).enable(on)
        if tier is not _DEVICE:
            self.copies.enable(on)

    def of(self, tier: Tier) -> LruHeap | None:
        """The tier's heap, while the LRU order ranks it."""
        heap = self.device if tier is _DEVICE else self.host
        return heap if heap.ranks else None

    def check(self) -> None:
        """Assert what makes the kept candidates the scan's: every member that may be a candidate
        (device: no device child; host: no device copy, no child; a host copy the second pass
        may drop: on the device, no host child) has an entry ranked no later than its stamp
        (``PrefixTree.check``; tests call it after every step)."""
        kinds = {
            "device": (self.device, lambda n: not n.device_children),
            "host": (self.host, lambda n: n.device_raw[0] is None and not n.children),
            "host copy": (self.copies, lambda n: n.device_raw[0] is not None and not n.host_children),
        }
        for kind, (heap, candidate) in kinds.items():
            if not heap.active:
                continue
            ranks: dict[TreeNode, int] = {}
            for rank, _, node in heap.heap:
                ranks[node] = min(rank, ranks.get(node, rank))
            for node in heap.members:
                rank = ranks.get(node)
                assert not candidate(node) or (rank is not None and rank <= node.last_access), (
                    f"{node!r} may be a {kind} candidate but has no LRU entry"
                )

    def device_moved(self, node: TreeNode, joined: bool) -> None:
        parent: TreeNode = node.parent  # type: ignore[assignment]
        if joined:  # (every chunk's node: ``active`` read here, a push call only where kept)
            parent.device_children += 1
            if self.device.active:
                self.device.push(node)
            if node.host_raw[0] is not None and self.copies.active:  # back: its host copy may go
                self.copies.push(node)
            return
        parent.device_children -= 1
        if parent.device_children == 0 and parent.parent is not None:  # (not the root)
            self.device.push(parent)
        if node.host_raw[0] is not None:  # demoted: a host candidate now
            self.host.push(node)

    def host_moved(self, node: TreeNode, joined: bool) -> None:
        parent: TreeNode = node.parent  # type: ignore[assignment]
        if joined:  # (a backup's every node)
            parent.host_children += 1
            if (heap := self.host if node.device_raw[0] is None else self.copies).active:
                heap.push(node)
            return
        parent.host_children -= 1
        if not parent.host_children and parent.device_raw[0] is not None and parent.host_raw[0] is not None:
            self.copies.push(parent)  # its copy is the last of its path now
        # its last child may be leaving the tree (a host eviction deletes it after this)
        if parent.parent is not None and parent.device_raw[0] is None and len(parent.children) <= 1:
            self.host.push(parent)


def ranks_by_recency(order: object) -> bool:
    """Whether the heaps may rank for ``order``: it declares ``recency_order`` (and trims no leaf),
    and its ``ranked`` is the one declared with that (a subclass that re-ranks is ranked by its own
    ``ranked``). ``policy.eviction: lru`` spelled out scanned the tier at every eviction: 10 ms
    per request at 5,000 device nodes against 0.3 ms left unset."""
    caps = getattr(order, "capabilities", None)
    if not getattr(caps, "recency_order", False) or getattr(caps, "chain_aware", False):
        return False
    mro = type(order).__mro__
    declared = next(c for c in mro if "capabilities" in vars(c))
    ranking = next((c for c in mro if "ranked" in vars(c)), object)
    return issubclass(declared, ranking)
