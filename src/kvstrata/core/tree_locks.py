"""Locks: what a request's prefix protects from eviction, per tier and per pool.

Kept apart from matching and eviction because the rules differ per pool kind and are easy to
get wrong: anchor and all_pages pools lock the whole path, trailing_pages (window) pools only
the nodes of the last window (each such lock also records its lower page bound on the node, so a
later split knows which half it covers), node-state pools only the node itself. Lock counts are
immutable tuples replaced on every (rare) change, so an unlocked node shares the layout's zero
tuple instead of owning lists the garbage collector must track.
"""

from __future__ import annotations

from kvstrata.core.tree_node import _DEVICE, LockHandle, PoolLayout, Tier, TreeError, TreeNode


class TreeLocks:
    """Counts and window bounds of the tree's locks; the evictor reads them from the nodes."""

    def __init__(self, layout: PoolLayout, root: TreeNode) -> None:
        self.root = root
        self._npools = layout.npools
        self._state = layout.state
        self._window = layout.window
        self._stateful = layout.stateful
        self._unlocked = layout.unlocked
        self._windowed = [p for p in range(layout.npools) if layout.window[p]]
        self._paged = [p for p in range(layout.npools) if not layout.state[p] and not layout.window[p]]
        #: what a path lock holds on its end node: the path's pools and the node-state pools
        self._end = self._paged + self._stateful
        #: the counts of an unlocked node once one path lock ends on it (a chunk's new node)
        self._one_end = tuple(int(p in self._end) for p in range(layout.npools))

    def lock(self, node: TreeNode, tier: Tier) -> LockHandle:
        """See ``PrefixTree.lock``."""
        self._change(node, tier, +1)
        return LockHandle(node, tier)

    def unlock(self, handle: LockHandle) -> None:
        if handle.local:
            self._local(handle.node, handle.tier is _DEVICE, -1)
        else:
            self._change(handle.node, handle.tier, -1)

    def lock_local(self, node: TreeNode, tier: Tier) -> LockHandle:
        """See ``PrefixTree.lock_local``."""
        self._local(node, tier is _DEVICE, +1)
        return LockHandle(node, tier, local=True)

    def _local(self, node: TreeNode, dev: bool, delta: int) -> None:
        if node is self.root:
            return
        if self._stateful:
            self._bump(node, dev, self._stateful, delta)
        for p in self._windowed:
            self._window_lock(node, dev, p, delta)

    def _change(self, node: TreeNode, tier: Tier, delta: int) -> None:
        dev = tier is _DEVICE
        if node is self.root:
            return
        end = node.depth_end
        if self._stateful:
            counts = list(node.device_lock if dev else node.host_lock)
            for p in self._stateful:
                if counts[p] + delta < 0:
                    raise TreeError(f"unlock without lock on {node!r}")
                counts[p] += delta
            self._set_locks(node, dev, counts)
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            counts = list(cur.device_lock if dev else cur.host_lock)
            for p in range(self._npools):
                if self._state[p]:
                    continue
                if self._window[p]:
                    bound = end - self._window[p]
                    if cur.depth_end <= bound:
                        continue
                    windows = cur.device_windows if dev else cur.host_windows
                    if delta > 0:
                        windows.setdefault(p, []).append(bound)
                    else:
                        try:
                            windows[p].remove(bound)
                        except (KeyError, ValueError):
                            raise TreeError(f"unlock without lock on {cur!r}") from None
                        if not windows[p]:
                            del windows[p]
                if counts[p] + delta < 0:
                    raise TreeError(f"unlock without lock on {cur!r}")
                counts[p] += delta
            self._set_locks(cur, dev, counts)
            cur = cur.parent

    def move(self, handle: LockHandle, node: TreeNode) -> LockHandle:
        """See ``PrefixTree.move_lock``: the same counts as ``unlock(handle)`` + ``lock(node)``,
        touching only the nodes below ``handle.node`` and the two windows."""
        old = handle.node
        if handle.local:
            raise TreeError("a node-local lock does not cover a path: it cannot move")
        if node is old:
            return handle
        if old is self.root:
            return self.lock(node, handle.tier)
        dev = handle.tier is _DEVICE
        if node.parent is old and not self._windowed:  # one step down: a chunk's node below the lock
            if self._stateful:
                self._bump(old, dev, self._stateful, -1)
            if (node.device_lock if dev else node.host_lock) is self._unlocked:
                self._set_locks(node, dev, self._one_end)
            else:
                self._bump(node, dev, self._end, +1)
            return LockHandle(node, handle.tier)
        fresh = []
        cur: TreeNode | None = node
        while cur is not old:
            if cur is None or cur is self.root or cur.depth_end <= old.depth_end:
                raise TreeError(f"cannot move a lock from {old!r} to {node!r}: not below it")
            fresh.append(cur)
            cur = cur.parent
        if self._stateful:
            self._bump(old, dev, self._stateful, -1)
        for p in self._windowed:
            self._window_lock(old, dev, p, -1)
            self._window_lock(node, dev, p, +1)
        self._bump(node, dev, self._end, +1)  # ``fresh[0]``: its path and state counts at once
        if self._paged:
            for cur in fresh[1:]:
                self._bump(cur, dev, self._paged, +1)
        return LockHandle(node, handle.tier)

    def _bump(self, node: TreeNode, dev: bool, pools: list[int], delta: int) -> None:
        counts = list(node.device_lock if dev else node.host_lock)
        for p in pools:
            if counts[p] + delta < 0:
                raise TreeError(f"unlock without lock on {node!r}")
            counts[p] += delta
        self._set_locks(node, dev, counts)

    def _window_lock(self, end: TreeNode, dev: bool, p: int, delta: int) -> None:
        """Add or remove one window lock of pool ``p`` ending at ``end`` (its last window's nodes)."""
        bound = end.depth_end - self._window[p]
        cur: TreeNode | None = end
        while cur is not None and cur is not self.root and cur.depth_end > bound:
            windows = cur.device_windows if dev else cur.host_windows
            if delta > 0:
                windows.setdefault(p, []).append(bound)
            else:
                try:
                    windows[p].remove(bound)
                except (KeyError, ValueError):
                    raise TreeError(f"unlock without lock on {cur!r}") from None
                if not windows[p]:
                    del windows[p]
            self._bump(cur, dev, [p], delta)
            cur = cur.parent

    def _set_locks(self, node: TreeNode, dev: bool, counts: list[int] | tuple[int, ...]) -> None:
        locks = self._unlocked if not any(counts) else tuple(counts)
        if dev:
            node.device_lock = locks
        else:
            node.host_lock = locks
