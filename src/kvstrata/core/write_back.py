"""Which host locks a queued L3 write takes, which nodes write-back backs up to evict, and
which pages of an open lease write-through has still to back up; and a queued write itself
(:class:`PendingWrite`, waited for in order by :func:`wait_writes`).

The first two rules are about what eviction may take from under the writer, and both went wrong
once (issue 29): a path lock covers the pages of its whole path but the state slot and window of
its own node only, and device eviction drops leaves, so a backup is worth making only where it
lets a leaf (or a component) go. The third batches write-through's backups of a lease that stays
open (chunked prefill): its inserted pages hold the lease's device lock, so no eviction can drop
them meanwhile, and one backup of many chunks costs what one of a single chunk did.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.core.metrics import CacheMetrics, count_failure
from kvstrata.core.node_set import NodeSet, SplitFollowingSet, on_host
from kvstrata.core.stack import PoolKind, StackLayout
from kvstrata.core.storage_metrics import StorageOperation
from kvstrata.core.tree import LockHandle, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT

if TYPE_CHECKING:
    from kvstrata.core.l3_values import PerPool
    from kvstrata.core.storage_engine import BatchResult, StorageEngine


@dataclass(eq=False)
class SharedLock:
    """A host lock several queued writes rely on. A lock's paged pools cover the node's whole
    path, so the writes of a chunked request (each below the previous) share one lock moved down
    the path instead of each walking the path from the root. Its state and window pools cover
    only the node it sits on (and that node's last window), so every write also keeps node-local
    locks of its own (:func:`host_locks`). Unlocked when its last write is drained."""

    handle: LockHandle
    refs: int = 1


class StoredWindowEnds(NodeSet):
    """Nodes whose last window (every window pool's objects of the pages ending at the node's
    end) is queued or written to L3: a request branching at a prefix end writes that window only
    where it is not (each branch at one system prompt, each turn of a conversation, wrote it
    again). A split's upper half is a new node, so it is never taken for its lower's. Nodes that
    left the tree are swept out as the set grows; a failed write takes its nodes out again, and
    a window L3 lost later is written again when a hit's ask finds it missing (``l3_touch``)."""

    def settled(self, ends: Sequence[TreeNode], results: Mapping[str, Any]) -> None:
        """A write of ``ends``' windows finished: if any unit of it failed, they are not stored."""
        if ends and (not results or not all(all(r.ok) for r in results.values())):
            self.difference_update(ends)


def host_locks(
    tree: PrefixTree, layout: StackLayout, last: SharedLock | None, nodes: Sequence[TreeNode]
) -> list[SharedLock]:
    """Host locks keeping ``nodes``' units alive while they are written; the last one is
    the write's path lock. A path just below ``last`` (the last queued write's path lock)
    moves that lock down (O(new nodes)); any other path (a node below the one before it) takes
    one path lock on its deepest node, which covers the others' pages (one walk to the root per
    write, not one per node: a chunked request's batch is a chain as deep as the request);
    nodes that are no path each get a lock of their own.

    A moved lock keeps the path's paged units but leaves the state units of the node it
    came from and that node's window (a state lock covers its own node only), which the
    earlier write still reads on the writer thread. So with state or window pools, a node
    whose path lock may move holds a node-local lock too, released with its write. Without
    it host eviction freed a queued checkpoint's slot, the next backup reused it, and L3
    stored another page's state under this page's key (issue 29)."""
    chained = last is not None and last.refs > 0 and _is_chain(nodes, last.handle.node)
    path = chained or (len(nodes) > 1 and _is_chain(nodes[1:], nodes[0]))  # one lock covers all pages
    local: list[SharedLock] = []
    if any(tp.kind is not PoolKind.PAGES for tp in layout.tree_pools.values()):
        local = [SharedLock(tree.lock_local(n, Tier.HOST)) for n in (nodes if path else nodes[-1:])]
    if chained:
        assert last is not None
        last.handle = tree.move_lock(last.handle, nodes[-1])
        last.refs += 1
        return [*local, last]
    if path:
        return [*local, SharedLock(tree.lock(nodes[-1], Tier.HOST))]
    own = [SharedLock(tree.lock(node, Tier.HOST)) for node in nodes]
    return [*own[:-1], *local, own[-1]]


def _is_chain(nodes: Sequence[TreeNode], top: TreeNode) -> bool:
    """Whether ``nodes`` are a path going straight down from ``top``'s child."""
    parent = top
    for node in nodes:
        if node.parent is not parent:
            return False
        parent = node
    return bool(nodes)


def eviction_backups(tree: PrefixTree, layout: StackLayout, shortfall: Mapping[str, int]) -> list[TreeNode]:
    """Write-back: the device nodes to back up so that eviction can free ``shortfall``.

    Only what the eviction can then drop is worth a backup. The anchor leaves the device
    from leaves, so its candidates are reached from the leaves up, least recently used
    first, as eviction will (a leaf first, then its parent); a component (state,
    window) is tombstoned on inner nodes too, so any unbacked node whose component is not
    locked will do, the path of a running request included. Picking by stamp alone chose
    inner nodes above unbacked leaves and nodes whose units were locked, freed nothing, and
    raised ``CacheFullError`` on a tier of evictable pages (issue 29); a window pool, evicted
    after the anchor, counts the units of the backed-up leaves leaving too. The components'
    candidates are kept across evictions (``core/component_index.py``): ranking every holder
    cost O(tier) per eviction (5 ms per request with 3,000 device nodes). Retention levels (and
    a plugin's order) rank them as the eviction does: by recency alone a prioritised prefix's
    state checkpoint was backed up, the only one the eviction could then drop."""
    anchor, rank = layout.anchor, tree.evictor._eviction_rank
    leaving = _evictable_leaves(tree, layout, shortfall[anchor]) if shortfall.get(anchor, 0) else []
    chosen: dict[TreeNode, None] = {n: None for n in leaving if n.host_raw[0] is None}
    ranked, level = None, None  # (read once a component needs backups)
    for name, want in shortfall.items():
        if name == anchor or want <= 0:
            continue
        p = tree.index[name]  # a pool evicted after the anchor: its leaves, backed up or not, free it
        freed = [*chosen, *(n for n in leaving if n.host_raw[0] is not None)] if rank[p] > rank[0] else chosen
        have = sum(len(n.device[p]) for n in freed if n.device[p] is not None)
        if have >= want:  # (the anchor's backups may cover it)
            continue
        if ranked is None:
            retention = tree.evictor.retention
            level = retention.levels() if retention is not None else None
            ranked = level is not None or tree.evictor.heaps.of(Tier.DEVICE) is None
        if ranked:
            _component_backups_ranked(tree, name, chosen, have, want, level)
        else:
            tree.components.backups(p, chosen, have, want)
    return sorted(chosen, key=lambda n: n.depth_end)


def _component_backups_ranked(
    tree: PrefixTree,
    name: str,
    chosen: dict[TreeNode, None],
    have: int,
    want: int,
    level: Callable[[TreeNode], int] | None,
) -> None:
    """:meth:`~kvstrata.core.component_index.ComponentIndex.backups` by the ranks of the device
    tier's order under the retention ``level`` of each node, as the eviction's
    ``_component_candidates`` takes them: O(holders), only while a level is live or a plugin
    ranks the tier (whose anchor eviction ranks every node then too)."""
    p = tree.index[name]
    holders = [n for n in tree.holding(name, Tier.DEVICE) if n.host_raw[0] is None]
    entries: list[tuple[Any, int, TreeNode]]
    entries = tree.eviction_order(Tier.DEVICE).ranked([n for n in holders if not n.device_lock[p]])
    if level is not None:
        entries = [((level(n), rank), i, n) for rank, i, n in entries]
    for *_, node in sorted(entries):
        if have >= want:
            return
        if node not in chosen:
            chosen[node] = None
            have += len(node.device_raw[p]) // UNIT  # type: ignore[arg-type]


def gained_components(tree: PrefixTree, layout: StackLayout) -> list[TreeNode]:
    """Write-back: device nodes already backed up holding a component (a checkpoint a later
    request left where it split the node, window data) that is not, unlocked, root first. Their
    backup predates it, so :func:`eviction_backups` skips them, and eviction dropped the only
    copy: a prefix ending there was lost to the host tier and L3. Kept by the tree's setter
    (``core/component_index.py``): scanning every holder cost O(tier) per eviction."""
    return tree.components.gained([tree.index[name] for name in list(layout.tree_pools)[1:]])


def device_only_ancestors(tree: PrefixTree, nodes: Sequence[TreeNode]) -> list[TreeNode]:
    """The ancestors of ``nodes`` with no host copy, root first: write-back backs them up with
    the nodes it evicts, so what reaches L3 has its prefix there too (one walk per path, each
    node once)."""
    seen: set[TreeNode] = set(nodes)
    found: list[TreeNode] = []
    for node in nodes:
        parent = node.parent
        while parent is not None and parent is not tree.root and parent not in seen:
            seen.add(parent)
            if parent.host_raw[0] is None and parent.device_raw[0] is not None:
                found.append(parent)
            parent = parent.parent
    return sorted(found, key=lambda n: n.depth_end)


def unbacked_above(tree: PrefixTree, path: Sequence[TreeNode]) -> list[TreeNode]:
    """The ancestors of ``path[0]`` with a device copy and no host copy, root first, up to the
    first backed-up one (write-through backups are a contiguous prefix: those above it are too).
    Empty, after one check, in the common case."""
    found: list[TreeNode] = []
    parent = path[0].parent if path else None
    while parent is not None and parent is not tree.root and parent.host_raw[0] is None:
        if parent.device_raw[0] is not None:
            found.append(parent)
        parent = parent.parent
    found.reverse()
    return found


def with_backed_up_prefix(
    tree: PrefixTree, nodes: Iterable[TreeNode], waiting: Container[TreeNode] = ()
) -> list[TreeNode]:
    """Those of ``nodes`` whose every ancestor has a host copy and is not ``waiting`` (for its
    own L3 write) unless kept here, root first: what write-back may write to L3 (an object
    below a page L3 never gets is found by no later cache)."""
    kept: dict[TreeNode, None] = {}
    for node in sorted(nodes, key=lambda n: n.depth_end):
        parent = node.parent
        while (
            parent is not None
            and parent is not tree.root
            and parent.host_raw[0] is not None
            and (parent not in waiting or parent in kept)
        ):
            parent = parent.parent
        if parent is None or parent is tree.root:
            kept[node] = None
    return list(kept)


def _evictable_leaves(tree: PrefixTree, layout: StackLayout, want: int) -> list[TreeNode]:
    """The device nodes that leave so that ``want`` pages can (the unbacked ones to back up).

    Walks the device part of the tree from its leaves up, least recently used first, as
    eviction will: a node is reached once every device child below it can leave; a
    backed-up node can leave as it is, an unbacked one once backed up, a locked one never
    (nor can its ancestors). Under the LRU order the walk takes the evictor's kept
    candidates (``core/lru_heap.py``): ranking every device node cost O(tier) per eviction
    (4 ms per request with 5,000 device nodes). Retention levels rank above the order, as the
    eviction ranks them: by recency alone a prioritised prefix was backed up, the only node the
    eviction could then drop, and it left the device before ordinary pages."""
    retention = tree.evictor.retention
    level = retention.levels() if retention is not None else None
    heap = tree.evictor.heaps.of(Tier.DEVICE)
    if heap is None or level is not None:
        return _evictable_leaves_ranked(tree, layout, want, level)
    chosen: list[TreeNode] = []
    pages = 0

    def leaves(node: TreeNode) -> bool:
        nonlocal pages
        if any(node.device_lock):
            return False
        chosen.append(node)
        pages += node.pages
        return True

    heap.leaves_first(leaves, lambda: pages >= want)
    return chosen


def _evictable_leaves_ranked(
    tree: PrefixTree, layout: StackLayout, want: int, level: Callable[[TreeNode], int] | None = None
) -> list[TreeNode]:
    """:func:`_evictable_leaves` by the ranks of the device tier's order (a plugin's) under the
    retention ``level`` of each node, as its eviction takes them (by recency, the backups let a
    write-back eviction drop only what LRU would have: ``fifo`` kept its first prefix and
    dropped a later one)."""
    order = tree.eviction_order(Tier.DEVICE).ranked

    def ranked(nodes: list[TreeNode]) -> list[tuple[Any, int, TreeNode]]:
        entries = order(nodes)
        return entries if level is None else [((level(n), rank), i, n) for rank, i, n in entries]

    nodes = tree.holding(layout.anchor, Tier.DEVICE)
    below = {n: n.device_children for n in nodes}
    ready = ranked([n for n, count in below.items() if count == 0])
    heapq.heapify(ready)
    chosen, pages = [], 0
    while ready and pages < want:
        *_, node = heapq.heappop(ready)
        if any(node.device_lock):
            continue
        chosen.append(node)
        pages += node.pages
        parent = node.parent
        if parent in below:
            below[parent] -= 1
            if below[parent] == 0:
                heapq.heappush(ready, ranked([parent])[0])
    return chosen


@dataclass(eq=False)
class OpenChain:
    """What write-through has not backed up yet of one lease: the nodes below ``since`` (None:
    the root) down to ``node``; ``cached`` is the lease's cached prefix, ``hashes`` its page
    hashes (the writer's arguments of the insert that started the chain)."""

    since: TreeNode | None
    node: TreeNode
    cached: int
    hashes: Callable[[], Sequence[str]]


class OpenBackups:
    """Write-through's backups of leases that stay open, batched by ``batch_pages``.

    An insert that keeps its lease open adds its nodes to the lease's chain; the chain is backed
    up once it holds ``batch_pages`` pages, when the lease closes or is released, and at every
    flush. Until then its pages are locked on the device by the lease (no eviction drops them)
    and a lookup finds them there; ``batch_pages=1`` backs up at every insert."""

    def __init__(self, batch_pages: int) -> None:
        self.batch_pages = batch_pages
        self._open: dict[object, OpenChain] = {}

    def insert(
        self,
        owner: object,
        node: TreeNode,
        since: TreeNode | None,
        cached: int,
        hashes: Callable[[], Sequence[str]],
        keep_open: bool,
    ) -> OpenChain | None:
        """The chain to back up now (ending at the freshly inserted ``node``), or None while it
        waits for more pages (``keep_open``: the lease stays open)."""
        chain = self._open.pop(owner, None) if owner is not None else None
        if chain is None:
            chain = OpenChain(since, node, cached, hashes)
        chain.node = node
        start = chain.since.depth_end if chain.since is not None else 0
        if keep_open and owner is not None and node.depth_end - start < self.batch_pages:
            self._open[owner] = chain
            return None
        return chain

    def end(self, owner: object) -> OpenChain | None:
        """The chain ``owner``'s lease left un-backed-up (it closes or is released)."""
        return self._open.pop(owner, None)

    def take_all(self) -> list[OpenChain]:
        """Every open lease's chain (a flush backs them up; their leases start new chains)."""
        chains = list(self._open.values())
        self._open.clear()
        return chains


# --- queued L3 writes ---------------------------------------------------------------------------


@dataclass(eq=False)
class PendingWrite:
    """One queued L2 -> L3 write; host locks keep its source slots alive until it is drained."""

    locks: list[SharedLock]
    future: Future[dict[str, BatchResult]]
    #: nodes whose last window this write stores (window stacks): unmarked if it fails
    ends: Sequence[TreeNode] = ()
    #: the nodes written: offered again at a reuse if a transient failure lost the write
    nodes: Sequence[TreeNode] = ()
    #: set by the future's done callback (or by whoever waited on the future): ``drain`` runs at
    #: every call and reads this plain flag instead of ``future.done()``, which takes the
    #: future's lock (contended by the writer thread)
    finished: bool = False

    def mark_finished(self, _future: Future[dict[str, BatchResult]]) -> None:
        self.finished = True


def wait_writes(pending: Iterable[PendingWrite], deadline: float | None) -> None:
    """Wait for each of ``pending`` in order, up to ``deadline`` (``time.monotonic``; None: no limit)."""
    for write in list(pending):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            write.future.exception(remaining)
        except TimeoutError:
            return
        except CancelledError:  # by ``close`` (counted abandoned there): done all the same
            pass
        write.finished = True  # done: its callback may not have run yet (the next poll drains it)


def count_refused_writes(engine: StorageEngine, metrics: CacheMetrics, per_pool: PerPool) -> None:
    """L3 is down: count the refused write without the batch copies, host locks and worker hop
    it would cost (a dead L3 must not slow L1/L2; benchmarks/faults.py)."""
    for name, (page_hashes, _values) in per_pool.items():
        if engine.plans[name].writes:
            count_failure(metrics, engine.refused(StorageOperation.PUT, len(page_hashes)))


class RetryWrites:
    """Nodes whose L3 write a transient failure lost -- the put raised or timed out, or the open
    breaker refused it -- offered again at their next reuse once the breaker lets writes
    through. Nothing else writes them again while they stay in L1/L2 (a hit reads no L3), and
    every key below them chains through their pages: one timed-out put of a hot prompt left
    every later page written under it unreachable to a fresh cache. A write the backend
    answered "not stored" (full, read-only, over a size limit) is not retried: the failures of
    a run would then depend on when answers came."""

    def __init__(self, tree: PrefixTree) -> None:
        self._nodes = SplitFollowingSet(tree, on_host)

    def __bool__(self) -> bool:
        return bool(len(self._nodes))

    def lost(self, nodes: Iterable[TreeNode]) -> None:
        """A transient failure lost ``nodes``' write (or some of it: what was stored is skipped)."""
        self._nodes.update(nodes)

    def due(self, path: Sequence[TreeNode], engine: StorageEngine | None) -> list[TreeNode]:
        """Of a reused ``path`` (root first), the nodes to write again, each once (a later
        failure brings it back) and still on the host; none while the breaker refuses writes."""
        if engine is None or engine.write_breaker.refusing():
            return []
        due = [node for node in path if node in self._nodes]
        self._nodes.difference_update(due)
        return [node for node in due if node.host[0] is not None]


class PrefixWaits:
    """Write-back: nodes on the host whose L3 write waits for their prefix's. An eviction backs
    a leaf up with its device-only ancestors; where the host tier could not take an ancestor (in-
    flight writes, leases, pins hold it), the leaf went to L2 only (:func:`with_backed_up_prefix`)
    and nothing wrote it later: not the ancestor's own write once it left the device, not host
    eviction. Its pages were lost to every fresh cache, though L3 came to hold their whole prefix.
    They wait here and go with the first write that completes their prefix; a split's halves
    both wait. Their host copy is their only one, so host eviction takes them last
    (:meth:`exposed`): taken like any other node, a leaf waiting below a prefix a lease kept on
    the device was lost for good. Scanned at each eviction's write while any wait: O(waiting x
    depth), none mostly."""

    def __init__(self, tree: PrefixTree) -> None:
        self.tree = tree
        self._nodes = SplitFollowingSet(tree, on_host)

    def __bool__(self) -> bool:
        return bool(len(self._nodes))

    def exposed(self) -> list[TreeNode]:
        """The waiting nodes in the host tier only: host eviction takes them last
        (``TierUnits.host_last``), as their pages would be in no tier."""
        return [node for node in self._nodes if on_host(node) and node.device_raw[0] is None] if self else []

    def prefixes(self) -> list[TreeNode]:
        """The device-only ancestors the waiting nodes still on the host wait for, root first."""
        held = [node for node in self._nodes if on_host(node)] if self else []
        return device_only_ancestors(self.tree, held) if held else []

    def ready(self, fresh: Sequence[TreeNode]) -> list[TreeNode]:
        """Of ``fresh`` host copies and the waiting nodes still on the host, those to write now,
        root first (:func:`with_backed_up_prefix`); the others with a host copy wait."""
        held = [node for node in self._nodes if on_host(node)]
        candidates = [*fresh, *held] if held else fresh
        kept = with_backed_up_prefix(self.tree, candidates, self._nodes)
        if len(kept) < len(candidates):
            taken = set(kept)
            self._nodes.update(n for n in candidates if n not in taken and n.host_raw[0] is not None)
        self._nodes.difference_update(kept)
        return kept


class Unqueued:
    """Host copies a writer :meth:`call` made and has not queued the L3 write of yet. An
    interrupt (an observer hook's) between a backup's copies and its write's queueing left them
    on the host with no write to come: later backups pass over a node on the host, so L3 never
    got their pages, reused or not. They are :attr:`lost`, for the writer's next drain to queue."""

    def __init__(self, tree: PrefixTree) -> None:
        self.lost, self.interrupted = SplitFollowingSet(tree, on_host), False  # (a drain reads the flag)
        self._copied, self._depth = dict[TreeNode, None](), 0

    def copied(self, nodes: Iterable[TreeNode]) -> None:
        if self._depth:
            self._copied.update(dict.fromkeys(nodes))

    def queued(self, nodes: Iterable[TreeNode]) -> None:
        for node in nodes if self._copied else ():
            self._copied.pop(node, None)

    def call(self) -> Unqueued:
        """A writer call that copies and queues (``with unqueued.call():``; a generator's cost ~1-2 us)."""
        return self

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:  # (a nested call's: the outer one's too, the same nodes)
            self.interrupted = True
            self.lost.update(node for node in self._copied if on_host(node))
        self._depth -= 1
        if not self._depth:
            self._copied.clear()

    def take(self) -> list[TreeNode]:
        """The lost nodes still on the host, root first (and forgets them all)."""
        nodes = sorted((node for node in self.lost if on_host(node)), key=lambda n: n.depth_end)
        self.lost.difference_update(list(self.lost))
        self.interrupted = False
        return nodes
