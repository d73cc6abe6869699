"""Matching: walk page keys down the tree, split a node where a match ends inside it, and fold
every pool's hit rule into one usable prefix per tier.

This is the read side of the hot path (``benchmarks/tree.py`` times it with insertion), kept
apart from the owner of the tree (``tree.PrefixTree``) so a reader sees the whole walk-and-fold
on one screen. The walk does one dict lookup and one list-slice comparison per node, never a
Python step per page or token; the pool layout's lists are copied onto the matcher once so each
use is a single attribute lookup. ``split`` lives here because a match is what splits nodes
(insertion reuses it for values that start inside a node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import count

from kvstrata.core.tree_node import (
    _DEVICE,
    _HOST,
    UNIT,
    AccessClock,
    MatchResult,
    PagedKeys,
    PageKey,
    PoolLayout,
    SetValue,
    Tier,
    TreeError,
    TreeNode,
    unit_tensor,
)


class TreeMatcher:
    """Walks, splits and matches; owns no state beyond references to the tree's shared parts."""

    def __init__(
        self,
        layout: PoolLayout,
        root: TreeNode,
        ids: count[int],
        clock: AccessClock,
        set_value: SetValue,
        node_class: type[TreeNode] = TreeNode,
    ) -> None:
        self.root = root
        self._node = node_class  # the tree's node type (its page size's edge stride)
        self._step = layout.page_size * 8
        self.page_size = layout.page_size
        self.pools = layout.pools
        self._npools = layout.npools
        self._state = layout.state
        self._window = layout.window
        self._all_pages = layout.all_pages
        self._windowed = layout.windowed
        self._stateful = layout.stateful
        self._anchor_only = layout.anchor_only
        self._has_windows = layout.has_windows
        self._unlocked = layout.unlocked
        self._ids = ids  # node ids, shared with insertion
        self._clock = clock
        self._set = set_value  # sets a node's value and its tier membership (PrefixTree._set)
        #: told of every split (upper, lower): eviction policies and hints carry state over
        self.on_split: Callable[[TreeNode, TreeNode], None] | None = None

    # ------------------------------------------------------------------ split
    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after its first ``at`` pages; returns the new upper node.

        Token-page values split by position; a node-state value stays on the deeper node (it is
        the state after the last token) and the new parent is a tombstone for that pool.
        """
        if node is self.root or not 0 < at < node.pages:
            raise TreeError(f"cannot split {node!r} at page {at}")
        parent = node.parent
        assert parent is not None
        edge = node.edge
        cut = at * self._step if type(edge) is bytes else at
        upper = self._node(
            next(self._ids), parent, edge[:cut], self._npools, self._has_windows, self._unlocked, at
        )
        node.edge = edge[cut:]
        parent.children[upper.first_key] = upper  # replaces ``node`` under the same first key
        upper.children = {node.first_key: node}
        node.parent = upper
        # ``node`` leaves ``parent`` for ``upper``; setting upper's anchor below counts it back
        if node.device_raw[0] is not None:
            parent.device_children -= 1
            upper.device_children = 1
        if node.host_raw[0] is not None:
            parent.host_children -= 1
            upper.host_children = 1
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        device_lock, host_lock = list(upper.device_lock), list(upper.host_lock)
        units = at * UNIT
        for p in range(self._npools):
            if self._state[p]:
                continue  # the state (and its lock) stays on the node that holds it
            value = node.device_raw[p]
            if value is not None:
                self._set(upper, _DEVICE, p, value[:units])
                node.device_raw = (*node.device_raw[:p], value[units:], *node.device_raw[p + 1 :])
            value = node.host_raw[p]
            if value is not None:
                self._set(upper, _HOST, p, value[:units])
                node.host_raw = (*node.host_raw[:p], value[units:], *node.host_raw[p + 1 :])
            if self._window[p]:
                for locks, up_locks in (
                    (node.device_windows, upper.device_windows),
                    (node.host_windows, upper.host_windows),
                ):
                    bounds = [b for b in locks.get(p, ()) if b < upper.depth_end]
                    if bounds:
                        up_locks[p] = bounds
                device_lock[p] = len(upper.device_windows.get(p, ()))
                host_lock[p] = len(upper.host_windows.get(p, ()))
            else:
                device_lock[p] = node.device_lock[p]
                host_lock[p] = node.host_lock[p]
        upper.device_lock, upper.host_lock = tuple(device_lock), tuple(host_lock)
        if self.on_split is not None:
            self.on_split(upper, node)
        return upper

    # ------------------------------------------------------------------ match
    def walk(
        self, keys: Sequence[PageKey], split: bool, start: TreeNode | None = None
    ) -> tuple[list[TreeNode], int]:
        """The nodes ``keys`` run through and how many pages matched (splitting the last one
        where the match ends inside it when ``split``, else leaving it out). ``start``: walk
        below this node, ``keys`` being the pages after it (the root by default)."""
        if isinstance(keys, PagedKeys):
            return self._walk_paged(keys, split, start)
        node, i, n, path = start or self.root, 0, len(keys), []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.keys  # a ``PagedKeys`` copy of a bytes edge compares with a list of keys
            width = len(ck)
            if keys[i : i + width] == ck:
                path.append(child)
                node = child
                i += width
                continue
            m, lim = 1, min(width, n - i)
            while m < lim and ck[m] == keys[i + m]:
                m += 1
            if split:
                path.append(self.split(child, m))
                i += m
            break
        return path, i

    def _walk_paged(self, keys: PagedKeys, split: bool, start: TreeNode | None) -> tuple[list[TreeNode], int]:
        """``walk`` for keys from ``page_keys``: over the plain bytes of the tokens, in byte
        offsets. An edge of the same kind compares with one ``startswith`` at the offset (a
        memcmp, no slice); where it differs, a binary search of such compares finds the page.
        No Python step per page or token, and no Python-level ``PagedKeys`` method call."""
        step = keys.step
        raw = bytes(keys)  # slicing plain bytes is C-level (``PagedKeys.__getitem__`` is not)
        total = len(raw)
        node, at, path = start or self.root, 0, []
        while at < total:
            child = node.children.get(raw[at : at + step])
            if child is None:
                break
            ck = child.edge
            pages = child.depth_end - node.depth_end
            fit = (total - at) // step
            if type(ck) is bytes:  # edges of one tree share its page size
                if raw.startswith(ck, at):
                    path.append(child)
                    node = child
                    at += pages * step
                    continue
                # the first page matched (the child's key): the equal run is in [lo, hi)
                view, lo, hi = memoryview(ck), 1, (pages if pages <= fit else fit + 1)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if raw.startswith(view[: mid * step], at):
                        lo = mid
                    else:
                        hi = mid
                m = lo
            else:  # an edge inserted from a list of page keys: page by page
                m, lim = 1, min(pages, fit)
                while m < lim and ck[m] == raw[at + m * step : at + (m + 1) * step]:
                    m += 1
                if m == pages:
                    path.append(child)
                    node = child
                    at += pages * step
                    continue
            if split:
                path.append(self.split(child, m))
                at += m * step
            break
        return path, at // step

    def match(self, keys: Sequence[PageKey], split: bool, count_hit: bool) -> MatchResult:
        """See ``PrefixTree.match``."""
        path = (
            self._walk_paged(keys, split, None) if isinstance(keys, PagedKeys) else self.walk(keys, split)
        )[0]
        clock = self._clock
        tick = clock.tick  # deepest first, so an ancestor is never older
        if count_hit:
            for node in reversed(path):
                tick += 1
                node.last_access = tick
                node.hit_count += 1
        else:
            for node in reversed(path):
                tick += 1
                node.last_access = tick
        clock.tick = tick
        root = self.root
        last = path[-1] if path else root
        ps = self.page_size
        if self._anchor_only:
            jd = 0
            for node in path:
                if node.device_raw[0] is None:
                    break
                jd += 1
            jh = jd
            for node in path[jd:]:
                if node.host_raw[0] is None:
                    break
                jh += 1
        else:
            jd = self._fold(path, _DEVICE)
            jh = self._fold(path, _HOST)
        dnode = path[jd - 1] if jd else root
        hnode = path[jh - 1] if jh else root
        result = MatchResult(
            ps, last.depth_end, dnode.depth_end, hnode.depth_end, path, last, dnode, hnode, jd, jh
        )
        for p in self._stateful:
            name = self.pools[p].name
            if jd and dnode.device_raw[p] is not None:
                result.device_state[name] = unit_tensor(dnode.device_raw[p])  # type: ignore[arg-type]
            if jh:
                if hnode.device_raw[p] is not None:
                    result.host_state[name] = (_DEVICE, unit_tensor(hnode.device_raw[p]))  # type: ignore[arg-type]
                elif hnode.host_raw[p] is not None:
                    result.host_state[name] = (_HOST, unit_tensor(hnode.host_raw[p]))  # type: ignore[arg-type]
        return result

    # ------------------------------------------------------------------ fold
    def _present(self, node: TreeNode, p: int, tier: Tier) -> bool:
        if node.device_raw[p] is not None:
            return True
        return tier is _HOST and node.host_raw[p] is not None

    def _fold(self, path: list[TreeNode], tier: Tier) -> int:
        """Number of path nodes usable in ``tier``: the deepest end where every pool's rule holds."""
        present = self._present
        limit = 0
        for node in path:
            if not present(node, 0, tier) or any(not present(node, p, tier) for p in self._all_pages):
                break
            limit += 1
        for j in range(limit, 0, -1):
            end = path[j - 1]
            if any(not present(end, p, tier) for p in self._stateful):
                continue
            if all(self._window_ok(path, j, p, tier) for p in self._windowed):
                return j
        return 0

    def _window_ok(self, path: list[TreeNode], j: int, p: int, tier: Tier) -> bool:
        bound = path[j - 1].depth_end - self._window[p]
        for i in range(j - 1, -1, -1):
            node = path[i]
            if not self._present(node, p, tier):
                return False
            if node.depth_start <= bound:
                return True
        return True  # the window reaches the root: a short prefix needs every page it has
