"""Page-granular prefix tree with per-pool, per-tier state (the index of the device/host tiers).

An edge is the int64 token ids of its whole pages as one plain ``bytes`` (a slice of the
sequence's :func:`page_keys`): a child is found by its first page's bytes, and an edge compares
with one ``startswith`` (a memcmp), so matching does no per-token Python work. Page keys are
exact (no hash collisions to guard against). Callers that already hold chained page hashes may
pass lists of those instead: the tree only needs hashable, comparable keys, and such an edge is
a list. A node stores its values as int64 ``bytes`` too (``tree_bytes``): at 100k sequences the
node is then the only object per node that Python's garbage collector tracks, and a node keeps
none of the caller's value tensor alive. ``node.keys`` / ``node.device`` / ``node.host`` read
them back as page keys and tensors (copies).

Only the stack's anchor and its components live in the tree; sidecars reuse the anchor's (or
their source's) indices and are resolved by the controller. Per node and per tracked pool the
tree keeps a device value, a host value (int64 unit indices: one per page for token-page pools,
one slot for node-state pools), device and host lock counts. A component value that is
missing on a node that exists for the anchor is a *tombstone*. The tree never frees memory: it
reports what it dropped and the owner frees it.

Where each part lives. ``PrefixTree`` (here) owns the nodes, the membership sets and the setter
that keeps them in step, builds each part once and hands it that shared state; callers use only
``PrefixTree`` and the types, all importable from this module:

- ``tree_node``: page keys, ``TreeNode``, ``PoolLayout`` (the pools and their hit rules), the
  access clock and the result types (``MatchResult``, ``InsertResult``, ``EvictionResult``,
  ``LockHandle``).
- ``tree_match``: the walk, ``split`` and ``match`` with the per-tier fold of every hit rule.
- ``tree_insert``: ``insert`` / ``insert_host``.
- ``tree_locks``: lock counts and window locks.
- ``tree_eviction``: ``evict_device`` / ``evict_host``, the per-tier eviction order (LRU unless an
  eviction policy is set with ``set_eviction_order``) and the events such a policy hears.
- ``tree_check``: the structural invariants (``check``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import count

import torch

from kvstrata.core.tree_check import check_tree
from kvstrata.core.tree_eviction import EvictionOrder, LruOrder, RetentionLevels, TreeEvictor
from kvstrata.core.tree_insert import TreeInserter
from kvstrata.core.tree_locks import TreeLocks
from kvstrata.core.tree_match import TreeMatcher
from kvstrata.core.tree_node import (
    _DEVICE,
    _HOST,
    UNIT,
    AccessClock,
    EvictionResult,
    InsertResult,
    LockHandle,
    MatchResult,
    Membership,
    PagedKeys,
    PageKey,
    PoolLayout,
    SetValue,
    Tier,
    TreeError,
    TreeNode,
    Units,
    node_type,
    page_keys,
    paged_keys_type,
    unit_bytes,
    unit_tensor,
)
from kvstrata.plugins.pool_type import PoolSpec

#: called with each pool's units an eviction dropped (the owner frees them)
OnFree = Callable[[str, torch.Tensor], None]

__all__ = [
    "AccessClock",
    "EvictionOrder",
    "EvictionResult",
    "InsertResult",
    "LockHandle",
    "LruOrder",
    "MatchResult",
    "Membership",
    "PageKey",
    "PagedKeys",
    "PoolLayout",
    "PrefixTree",
    "RetentionLevels",
    "SetValue",
    "Tier",
    "TreeError",
    "TreeNode",
    "page_keys",
    "paged_keys_type",
    "tree_path",
]


class PrefixTree:
    """The page prefix tree; see the module docstring. Not thread-safe: one owner thread.

    Owns the nodes (``root``), the per-tier membership sets and the one setter that keeps them
    in step with the nodes' values; matching, insertion, locks and eviction are parts it builds
    once and hands that shared state to. Every public operation is a method here (the
    ``evictor``'s modes, such as ``keep_copies``, are set on it)."""

    def __init__(self, specs: Iterable[PoolSpec]) -> None:
        layout = PoolLayout(specs)
        self.layout = layout
        self.pools: tuple[PoolSpec, ...] = layout.pools
        self.page_size: int = layout.page_size
        self._keys_type = paged_keys_type(self.page_size)
        self.index: dict[str, int] = layout.index
        self._state = layout.state
        self._window = layout.window
        self._pool = layout.pool
        self._check_value = layout.check_value
        self._node_type = node_type(self.page_size)
        self.root = self._node_type(0, None, b"", layout.npools, layout.has_windows, layout.unlocked)
        # Per-tier, per-pool membership: the nodes holding a value of that pool in that tier,
        # the candidates of eviction (ordered then by the tier's eviction order).
        self._lru: Membership = {_DEVICE: [{} for _ in self.pools], _HOST: [{} for _ in self.pools]}
        self._device_lru, self._host_lru = self._lru[_DEVICE], self._lru[_HOST]
        ids, clock = count(1), AccessClock()
        self._matcher = TreeMatcher(layout, self.root, ids, clock, self._set, self._node_type)
        self._inserter = TreeInserter(
            layout, self.root, ids, clock, self._set, self._matcher.walk, self._matcher.split, self._node_type
        )
        self._locks = TreeLocks(layout, self.root)
        self.evictor = TreeEvictor(layout, self.root, self._lru, self._set, split=self._matcher.split)
        self.components = self.evictor.components  # (core/component_index.py)
        self._matcher.on_split = self.evictor.split

    # ------------------------------------------------------------------ helpers
    def keys_of(self, tokens: Sequence[int] | array | torch.Tensor) -> PagedKeys:
        """``page_keys`` at this tree's page size (an ``array('q')`` goes straight through)."""
        if type(tokens) is array and tokens.typecode == "q" and len(tokens) % self.page_size == 0:
            return self._keys_type(tokens.tobytes())
        return page_keys(tokens, self.page_size)

    def holding(self, name: str, tier: Tier | str) -> list[TreeNode]:
        """The nodes holding units of a pool in a tier (its LRU membership; no tree walk)."""
        return list(self._lru[Tier(tier)][self._pool(name)])

    def units(self, name: str, tier: Tier | str) -> int:
        """Units of a pool held by the tree in a tier (pages or slots)."""
        p, tier = self._pool(name), Tier(tier)
        if tier is _DEVICE:
            return sum(len(n.device_raw[p]) for n in self._lru[tier][p]) // UNIT  # type: ignore[arg-type]
        return sum(len(n.host_raw[p]) for n in self._lru[tier][p]) // UNIT  # type: ignore[arg-type]

    def nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _set(self, node: TreeNode, tier: Tier, p: int, value: bytes | None) -> None:
        """Set one pool's stored units (int64 ``bytes``) of ``node`` in ``tier``, or clear them;
        an anchor joining or leaving the tier is told to the LRU heaps once it has (and they
        keep the parent's child count)."""
        dev = tier is _DEVICE
        vals = node.device_raw if dev else node.host_raw
        new = (value,) if len(vals) == 1 else (*vals[:p], value, *vals[p + 1 :])
        if dev:
            node.device_raw, lru = new, self._device_lru[p]
        else:
            node.host_raw, lru = new, self._host_lru[p]
        if value is None:
            lru.pop(node, None)
        else:
            lru[node] = None
        if p == 0 and (vals[0] is None) is not (value is None):
            heaps = self.evictor.heaps
            (heaps.device_moved if dev else heaps.host_moved)(node, value is not None)
        if self.components.active and (p or not dev):  # components' kept candidates
            self.components.moved(node, dev, p, vals[p] is not None, value is not None)

    # ------------------------------------------------------------------ match
    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after its first ``at`` pages; returns the new upper node.

        Token-page values split by position; a node-state value stays on the deeper node (it is
        the state after the last token) and the new parent is a tombstone for that pool.
        """
        return self._matcher.split(node, at)

    def match(self, keys: Sequence[PageKey], *, split: bool = True, count_hit: bool = True) -> MatchResult:
        """Longest usable prefix of ``keys`` per tier; touches the path's LRU position.

        With ``split`` (default) a match ending inside a node splits it there, so the returned
        nodes end exactly at the matched length; without it the partial node is ignored.
        """
        result = self._matcher.match(keys, split, count_hit)
        if count_hit and self.evictor.hears:  # one access event per request, not per page
            self.evictor.accessed(result.path)
        return result

    def window_nodes(self, node: TreeNode, name: str) -> list[TreeNode]:
        """Nodes (bottom-up) covering the last window of a trailing_pages pool ending at ``node``."""
        p = self._pool(name)
        if not self._window[p]:
            raise TreeError(f"pool {name!r} has no trailing window")
        bound = node.depth_end - self._window[p]
        out = []
        while node is not self.root and node.depth_end > bound:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out

    def values(self, nodes: Sequence[TreeNode], name: str, tier: Tier | str = Tier.DEVICE) -> torch.Tensor:
        """Concatenated unit indices of ``nodes`` (root-to-leaf order) for one pool and tier."""
        p = self.index.get(name)
        if p is None:
            p = self._pool(name)
        device = tier is _DEVICE or Tier(tier) is _DEVICE
        parts = [n.device_raw[p] for n in nodes] if device else [n.host_raw[p] for n in nodes]
        if None in parts:
            attr = "device" if device else "host"
            raise TreeError(f"pool {name!r} has no {attr} value on some of the requested nodes")
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        # one copy of the stored bytes into the tensor's own buffer (no tensor per node to cat)
        return torch.frombuffer(bytearray().join(parts), dtype=torch.int64)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        keys: Sequence[PageKey],
        values: Mapping[str, Units],
        *,
        at: TreeNode | None = None,
        tell: bool = True,
    ) -> InsertResult:
        """Insert a device-resident prefix, reusing existing nodes. ``values``: per tracked pool,
        unit indices (a 1-D index tensor, or int64 bytes: a lease's pending units) of the *last*
        ``len(value)`` pages (a request's pages after its cached prefix, a window pool's last
        pages), one slot for node-state pools (the state after the last page); a pool left out
        gets tombstones, the anchor's are required. Existing nodes adopt given units they lack
        (host-only nodes come back to device, tombstones revive); the rest are returned as
        duplicates. ``at``: insert below this node (``keys``: the pages after it; a chunk pays
        for its new pages only). ``tell=False``: the caller tells the eviction order
        (``evictor.inserted``) once it holds the result (a hook interrupted then loses none)."""
        if at is not None and at is not self.root and at.parent is None:  # (the one check per chunk)
            self._require_node(at)
        result = self._inserter.insert(keys, values, _DEVICE, at)
        if tell and self.evictor.hears:
            self.evictor.inserted(_DEVICE, result)
        return result

    def insert_host(self, keys: Sequence[PageKey], values: Mapping[str, Units]) -> InsertResult:
        """Insert a host-resident prefix (a committed prefetch): new nodes exist only on host."""
        result = self._inserter.insert(keys, values, _HOST)
        if self.evictor.hears:
            self.evictor.inserted(_HOST, result)
        return result

    # ------------------------------------------------------------------ tier values
    def set_device_value(self, node: TreeNode, name: str, value: torch.Tensor) -> None:
        """Attach device units to a node (load-back); the anchor's device prefix stays closed."""
        p = self._pool(name)
        self._require_node(node)
        value = self._check_value(p, value, node.pages)
        if node.device_raw[p] is not None:
            raise TreeError(f"{node!r} already holds device units of pool {name!r}")
        if p == 0 and node.parent is not self.root and node.parent.device_raw[0] is None:  # type: ignore[union-attr]
            raise TreeError(f"load {node!r}'s parent to device first (device prefixes are closed)")
        if p != 0 and node.device_raw[0] is None:
            raise TreeError(f"load the anchor of {node!r} to device before component {name!r}")
        self._set(node, _DEVICE, p, unit_bytes(value))
        self.evictor.entered(_DEVICE, (node,) if p == 0 else ())  # a load-back: told as an insert

    def set_host_value(self, node: TreeNode, name: str, value: torch.Tensor | bytes) -> None:
        """A host copy of one pool's units (or int64 bytes) on ``node``; a backup: :meth:`set_host_values`."""
        p = self._pool(name)
        self._require_node(node)
        raw = value if isinstance(value, bytes) else unit_bytes(self._check_value(p, value, node.pages))
        self._inserter.record_host_value(node, p, raw)
        self.evictor.entered(_HOST, () if p else (node,))  # the anchor: a backup, told as an insert

    def set_host_values(self, nodes: Sequence[TreeNode], values: Mapping[str, bytes]) -> None:
        """A backup of ``nodes`` (none backed up yet) in one call: ``values[pool]`` their host
        units in node order (int64 bytes), each node taking as many as it holds on the device."""
        self._inserter.record_host(nodes, values)
        self.evictor.entered(_HOST, nodes)  # (told to the host tier's order as inserted)

    def drop_component(self, node: TreeNode, name: str, tier: Tier | str) -> torch.Tensor:
        """Tombstone one component of a node in a tier and return its units for the caller to free.

        For targeted releases (e.g. window pages a decode has moved past, a state superseded by
        a deeper checkpoint); the anchor leaves a tier only through eviction.
        """
        p, tier = self._pool(name), Tier(tier)
        self._require_node(node)
        if p == 0:
            raise TreeError(f"the anchor {name!r} leaves a tier through evict_device / evict_host only")
        dev = tier is _DEVICE
        vals, locks = (node.device_raw, node.device_lock) if dev else (node.host_raw, node.host_lock)
        value = vals[p]
        if value is None:
            raise TreeError(f"{node!r} holds no {tier} units of pool {name!r}")
        if locks[p]:
            raise TreeError(f"{node!r}: pool {name!r} is {tier}-locked")
        self._set(node, tier, p, None)
        return unit_tensor(value)

    def backed_up(self, node: TreeNode) -> bool:
        return node is self.root or node.host_raw[0] is not None

    def is_tombstone(self, node: TreeNode, name: str, tier: Tier | str) -> bool:
        """A component missing in a tier where the node's anchor is present."""
        p = self._pool(name)
        vals = node.device_raw if Tier(tier) is _DEVICE else node.host_raw
        return p != 0 and vals[0] is not None and vals[p] is None

    def _require_node(self, node: TreeNode) -> None:
        if node is self.root:
            raise TreeError("the root holds no values")
        if node.parent is None:  # eviction unlinks the nodes it deletes (and only those)
            raise TreeError(f"{node!r} is no longer in the tree")

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode, tier: Tier | str = Tier.DEVICE) -> LockHandle:
        """Protect a request's prefix ending at ``node`` from eviction in ``tier``.

        Anchor and all_pages pools lock the whole path, trailing_pages pools only the nodes of
        the last window, node-state pools only ``node`` itself.
        """
        return self._locks.lock(node, Tier(tier))

    def unlock(self, handle: LockHandle) -> None:
        self._locks.unlock(handle)

    def lock_local(self, node: TreeNode, tier: Tier | str = Tier.DEVICE) -> LockHandle:
        """Protect only ``node``'s own state-pool values and its last window in ``tier``.

        What a queued write of ``node`` needs beside a path lock that moves on: a moved lock
        leaves the state and window units of the nodes above it (``move_lock``), which a
        write still reading them must keep. Costs the window's nodes, not the path.
        """
        return self._locks.lock_local(node, Tier(tier))

    def move_lock(self, handle: LockHandle, node: TreeNode) -> LockHandle:
        """Move a lock down to ``node``, a descendant of ``handle.node`` (or the node itself):
        what a request holds after inserting its next chunk. Costs the nodes between the two
        (and the last window), not the whole path."""
        return self._locks.move(handle, node)

    # ------------------------------------------------------------------ eviction
    def set_eviction_order(self, tier: Tier | str, order: EvictionOrder) -> None:
        """Rank ``tier``'s candidates with ``order`` (an eviction policy); its declared
        capabilities decide which events it hears and whether leaves may be trimmed."""
        self.evictor.use(Tier(tier), order)

    def eviction_order(self, tier: Tier | str) -> EvictionOrder:
        return self.evictor.orders[Tier(tier)]

    def on_split(self, listener: Callable[[TreeNode, TreeNode], None]) -> None:
        """Call ``listener(upper, lower)`` whenever a node is cut in two (per-node state kept
        outside the tree follows its node)."""
        self.evictor.split_listeners.append(listener)

    def set_retention(self, retention: RetentionLevels | None) -> None:
        """Retention hints the evictor ranks above every order (see ``core.retention``)."""
        self.evictor.retention = retention

    def evict_device(
        self,
        needs: Mapping[str, int],
        on_free: OnFree | None = None,
        *,
        delete_unbacked: bool = True,
        out_of_window_only: bool = False,
    ) -> EvictionResult:
        """Free at least ``needs[pool]`` device units per pool where possible, least recent first.

        Pools go in ascending ``eviction_priority`` (a window pool after the anchor); units freed
        for one pool count for the others. The anchor evicts device leaves: a backed-up node is
        demoted to host-only, any other leaf deleted. A window pool first tombstones data outside
        the last window of every prefix the tier holds (``out_of_window_only``: nothing else). A
        component drops its value on inner nodes (tombstone); on a device leaf the whole node
        goes. Locked nodes are skipped. ``on_free`` is called per freed value (as well as
        returned). ``delete_unbacked=False`` (write-back): only backed-up nodes leave."""
        return self.evictor.evict_device(needs, on_free, delete_unbacked, out_of_window_only)

    def evict_host(
        self, needs: Mapping[str, int], on_free: OnFree | None = None, *, out_of_window_only: bool = False
    ) -> EvictionResult:
        """Free host units; only nodes whose (pool) data is not on device and not host-locked
        (window pools: out-of-window data first, as on the device)."""
        return self.evictor.evict_host(needs, on_free, out_of_window_only)

    # ------------------------------------------------------------------ sanity
    def check(self) -> None:
        """Assert every structural invariant; tests call it after each step."""
        check_tree(self.layout, self.root, self._lru, self.evictor.heaps)


def tree_path(tree: PrefixTree, node: TreeNode, since: TreeNode | None = None) -> list[TreeNode]:
    """The nodes from the root's child (or ``since``'s) down to ``node``."""
    path = []
    cur: TreeNode | None = node
    while cur is not None and cur is not tree.root and cur is not since:
        path.append(cur)
        cur = cur.parent
    path.reverse()
    return path
