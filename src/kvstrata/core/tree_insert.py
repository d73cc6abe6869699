"""Insertion: add a prefix's pages and per-pool values to the tree, adopting what exists.

The write side of the hot path (``benchmarks/tree.py`` times it with matching), apart from the
tree's owner (``tree.PrefixTree``) so the one long procedure -- validate the values, walk,
split where a value starts inside a node, adopt into existing nodes, grow new ones, place
node-state slots, stamp recency -- reads top to bottom. It reuses the matcher's ``walk`` and
``split`` (passed in as callables) and works per node, never per page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import count, pairwise

import torch

from kvstrata.core.tree_node import (
    _DEVICE,
    _HOST,
    UNIT,
    AccessClock,
    InsertResult,
    PagedKeys,
    PageKey,
    PoolLayout,
    SetValue,
    Tier,
    TreeError,
    TreeNode,
    Units,
    unit_bytes,
)

Walk = Callable[[Sequence[PageKey], bool, TreeNode | None], tuple[list[TreeNode], int]]
Split = Callable[[TreeNode, int], TreeNode]


class TreeInserter:
    """Inserts device- or host-resident prefixes; holds only references to the tree's shared parts."""

    def __init__(
        self,
        layout: PoolLayout,
        root: TreeNode,
        ids: count[int],
        clock: AccessClock,
        set_value: SetValue,
        walk: Walk,
        split: Split,
        node_class: type[TreeNode] = TreeNode,
    ) -> None:
        self.root = root
        self._node = node_class  # the tree's node type (its page size's edge stride)
        self._step = layout.page_size * 8
        self._index = layout.index
        self._pool = layout.pool
        self._check_value = layout.check_value
        self._anchor_name = layout.pools[0].name
        self._names = layout.names
        self._npools = layout.npools
        self._state = layout.state
        self._stateful = layout.stateful
        self._anchor_only = layout.anchor_only
        self._paged = [p for p in range(layout.npools) if not layout.state[p]]  # token-page pools
        self._has_windows = layout.has_windows
        self._unlocked = layout.unlocked
        self._ids = ids  # node ids, shared with the matcher's split
        self._clock = clock
        self._set = set_value  # sets a node's value and its tier membership (PrefixTree._set)
        self._walk = walk
        self._split = split

    def insert(
        self,
        keys: Sequence[PageKey],
        values: Mapping[str, Units],
        tier: Tier,
        at: TreeNode | None = None,
    ) -> InsertResult:
        """See ``PrefixTree.insert`` (``tier`` device) and ``PrefixTree.insert_host`` (host).
        ``at``: insert below this node (``keys`` are the pages after it), so a request that
        keeps its place in the tree pays for its new pages only."""
        top = at or self.root
        base = top.depth_end  # page positions below are relative to ``top``
        n = len(keys)
        npools = self._npools
        state = self._state
        names = self._names
        given: list[Units | None] = [None] * npools
        start = [0] * npools  # first page each token-page pool's value covers
        for name, value in values.items():
            p = self._index.get(name)
            if p is None:
                p = self._pool(name)
            if type(value) is bytes:  # int64 bytes, as a node stores them (a lease's units)
                count = -1 if len(value) % UNIT else len(value) // UNIT
            else:  # shape, not len(): Tensor.__len__ is a Python-level call, this is the hot path
                shape = value.shape if isinstance(value, torch.Tensor) else None
                count = shape[0] if shape is not None and len(shape) == 1 else -1
            if state[p]:  # one slot (check_value raises the error for anything else)
                given[p] = value if count == 1 else self._check_value(p, value, n)  # type: ignore[arg-type]
                continue
            if not 0 <= count <= n:
                raise TreeError(
                    f"pool {name!r}: values must be 1-D index tensors (or int64 bytes) of at most {n} units"
                )
            given[p] = value
            start[p] = n - count
        if given[0] is None:
            raise TreeError(f"insert needs values for the anchor pool {self._anchor_name!r}")
        suffix = any(start)  # some value covers only the last pages (only paged pools start > 0)
        if not suffix and type(keys) is list and n and keys[0] not in top.children:
            return self._grow(top, keys, given, values, tier)
        if self._anchor_only:
            paged = [0]
        elif len(values) == npools:  # every pool given (a chunk's insert): the layout's paged pools
            paged = self._paged
        else:
            paged = [p for p in range(npools) if given[p] is not None and not state[p]]
        dev = tier is _DEVICE
        # duplicate unit ranges per pool, merged while contiguous so each becomes one slice
        dup_ranges: dict[str, list[list[int]]] = {}
        path, i = self._walk(keys, True, top)
        if start[0] > i:
            raise TreeError(
                f"anchor values cover pages [{start[0]}, {n}) but the tree holds only the first {i}"
            )
        if suffix:
            # a value starting inside a matched node: split there, so each node is covered whole or not
            for cut in sorted({start[p] for p in paged if 0 < start[p] < i}):
                for j, node in enumerate(path):
                    if node.depth_start - base < cut < node.depth_end - base:
                        path.insert(j, self._split(node, cut - node.depth_start + base))
                        break
        # each given value as int64 bytes, made when a node first stores part of it: a node keeps
        # its own slice (33 bytes beside the units, untracked), never a view of the caller's tensor
        raw: list[bytes | None] = [None] * npools
        revived: list[TreeNode] = []  # existing nodes whose anchor the insert brought into the tier
        # adopt into existing nodes: revive host-only nodes / tombstones, the rest is duplicate
        e = 0  # the path runs contiguously below ``top``: each node starts where the last ended
        for node in path:
            vals = node.device_raw if dev else node.host_raw
            s, e = e, node.depth_end - base
            for p in paged:  # the anchor (p == 0) is adopted first, so components may follow
                first = start[p]
                if e <= first:
                    continue  # pages before this pool's value: not given
                lo, hi = s - first, e - first
                if vals[p] is None:
                    if raw[p] is None:
                        raw[p] = unit_bytes(given[p])  # type: ignore[arg-type]
                    self._set(node, tier, p, raw[p][lo * UNIT : hi * UNIT])  # type: ignore[index]
                    if not p:
                        revived.append(node)
                    continue
                ranges = dup_ranges.get(names[p])
                if ranges is None:
                    dup_ranges[names[p]] = [[lo, hi]]
                elif ranges[-1][1] == lo:
                    ranges[-1][1] = hi
                else:
                    ranges.append([lo, hi])
        node = path[-1] if path else top
        if i < n:
            # new pages; one node per stretch where the same pools have values
            cuts = sorted({i, n} | {start[p] for p in paged if i < start[p] < n}) if suffix else (i, n)
            step = self._step
            flat = bytes.__getitem__ if isinstance(keys, PagedKeys) else None  # plain bytes slices
            for s, e in pairwise(cuts):
                parent = node
                if flat is not None:
                    edge = flat(keys, slice(s * step, e * step))
                    first_key = edge[:step]
                else:
                    edge = keys[s:e] if isinstance(keys, list) else list(keys[s:e])
                    first_key = edge[0]
                node = self._node(
                    next(self._ids), parent, edge, npools, self._has_windows, self._unlocked, e - s
                )
                parent.add_child(first_key, node)
                for p in paged:
                    first = start[p]
                    if first <= s:
                        value = raw[p]
                        if value is None:
                            raw[p] = value = unit_bytes(given[p])  # type: ignore[arg-type]
                        if s != first or e != n:
                            value = value[(s - first) * UNIT : (e - first) * UNIT]
                        self._set(node, tier, p, value)
                path.append(node)
        for p in self._stateful:
            value = given[p]
            if value is None:
                continue
            vals = node.device_raw if dev else node.host_raw
            if node is top or vals[p] is not None or vals[0] is None:
                dup_ranges[names[p]] = [[0, 1]]
            else:
                self._set(node, tier, p, unit_bytes(value))
        clock = self._clock
        tick = clock.tick  # stamped deepest first, as in match
        for node_ in reversed(path):
            tick += 1
            node_.last_access = tick
        clock.tick = tick
        return InsertResult(node, n - i, values, dup_ranges, revived)

    def _grow(
        self,
        top: TreeNode,
        keys: list[PageKey],
        given: list[Units | None],
        values: Mapping[str, Units],
        tier: Tier,
    ) -> InsertResult:
        """``insert`` where nothing below ``top`` starts with ``keys`` and every value covers
        every page (a chunk of a request extending its own node): one new node holding every
        given value (the anchor first, as ``insert`` sets them), nothing to walk or adopt."""
        n = len(keys)
        node = self._node(next(self._ids), top, keys[:], self._npools, self._has_windows, self._unlocked, n)
        top.add_child(keys[0], node)
        for p, value in enumerate(given):
            if value is not None:
                self._set(node, tier, p, value if type(value) is bytes else unit_bytes(value))
        clock = self._clock
        clock.tick += 1
        node.last_access = clock.tick
        return InsertResult(node, n, values, {})

    def record_host_value(self, node: TreeNode, p: int, raw: bytes) -> None:
        """See ``PrefixTree.set_host_value`` (``node`` is in the tree): one pool's host units."""
        name = self._names[p]
        if len(raw) != (1 if self._state[p] else node.pages) * UNIT:
            raise TreeError(f"pool {name!r}: {len(raw) // UNIT} units for {node.pages} page(s)")
        if node.host_raw[p] is not None:
            raise TreeError(f"{node!r} already holds host units of pool {name!r}")
        if p and node.host_raw[0] is None:
            raise TreeError(f"back up the anchor of {node!r} before component {name!r}")
        self._set(node, _HOST, p, raw)

    def record_host(self, nodes: Sequence[TreeNode], values: Mapping[str, bytes]) -> None:
        """See ``PrefixTree.set_host_values``: a backup of ``nodes``, each taking per pool the next
        units of ``values[pool]``, as many as it holds device units (what the backup copied).
        Checked whole before any node changes."""
        root, index, names = self.root, self._index, self._names
        for name in values:
            if name not in index:
                self._pool(name)  # raises the tree's error
        if nodes and names[0] not in values:
            raise TreeError(f"a backup needs units of the anchor {names[0]!r}")
        slots = [(index[name], value) for name, value in values.items()]
        totals = [0] * len(slots)
        for node in nodes:
            if node is root or node.parent is None:  # eviction unlinks the nodes it deletes
                raise TreeError(
                    "the root holds no values" if node is root else f"{node!r} is no longer in the tree"
                )
            if node.host_raw[0] is not None:
                raise TreeError(f"{node!r} already holds host units of pool {names[0]!r}")
            device = node.device_raw
            if device[0] is None:
                raise TreeError(f"{node!r} holds no device units to back up")
            for k, (p, _) in enumerate(slots):
                units = device[p]
                if units is not None:
                    totals[k] += len(units)
        for k, (p, value) in enumerate(slots):
            if totals[k] != len(value):
                more = "more" if len(value) > totals[k] else "fewer"
                raise TreeError(f"pool {names[p]!r}: {more} units given than the nodes hold on the device")
        offsets = [0] * len(slots)
        for node in nodes:  # the anchor first: it marks the node backed up
            device = node.device_raw
            for k, (p, value) in enumerate(slots):
                units = device[p]
                if units is not None:
                    start = offsets[k]
                    end = offsets[k] = start + len(units)
                    self._set(node, _HOST, p, value[start:end])
