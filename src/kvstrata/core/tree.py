"""Page-granular prefix tree with per-pool, per-tier state (the index of the device/host tiers).

Edges are lists of whole-page keys. A page key is the page's token ids packed as int64 bytes by
default (:func:`page_keys`): one C-level pack and one slice per page build it, its hash is
computed once and cached, comparison is a memcmp, equality is exact (no hash collisions to guard
against), and bytes are not tracked by the garbage collector (tuples of ints are, and a large
tree of them makes every full collection slow). Callers that already hold chained page hashes may
pass those instead: the tree only needs hashable, comparable keys. Children are keyed by their
first page key, and an edge is compared with one list-slice equality, so matching does no
per-token Python work.

Only the stack's anchor and its components live in the tree; sidecars reuse the anchor's (or
their source's) indices and are resolved by the controller. Per node and per tracked pool the
tree keeps a device value, a host value (1-D int64 unit indices: one per page for token-page
pools, one slot for node-state pools), device and host lock counts. A component value that is
missing on a node that exists for the anchor is a *tombstone*. The tree never frees memory: it
reports what it dropped and the owner frees it.
"""

from __future__ import annotations

import heapq
import struct
from array import array
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import count, pairwise

import torch

from kvstrata.plugins.pool_type import Granularity, HitRuleKind, PoolRole, PoolSpec

PageKey = Hashable


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"


# Enum member lookups (``Tier.DEVICE``) go through a descriptor (~0.1 us each): the hot paths
# compare against these immutable aliases instead.
_DEVICE = Tier.DEVICE
_HOST = Tier.HOST


class TreeError(ValueError):
    """Bad input to a tree operation (unknown pool, wrong value length, broken invariant)."""


def page_keys(tokens: Sequence[int] | array | torch.Tensor, page_size: int) -> list[bytes]:
    """Whole-page keys of ``tokens``: each page's token ids as int64 bytes.

    A trailing partial page is dropped (it cannot be cached). Bytes keys are exact (no hash
    collisions), hash once (the hash is cached on the object), compare with one memcmp and are
    invisible to the garbage collector, which matters for a tree of millions of pages. Token
    arrays (``array('q')``, as SGLang holds them, or tensors) convert with one memcpy; lists pay
    one C-level pack.
    """
    if isinstance(tokens, array) and tokens.typecode == "q":
        flat = tokens.tobytes()
    elif isinstance(tokens, torch.Tensor):
        flat = tokens.detach().to("cpu", torch.int64).numpy().tobytes()
    else:
        flat = struct.pack(f"{len(tokens)}q", *tokens)
    step = page_size * 8
    end = len(flat) - len(flat) % step
    return [flat[i : i + step] for i in range(0, end, step)]


class TreeNode:
    """One edge of whole pages plus per-pool data; index ``p`` follows ``PrefixTree.pools``."""

    __slots__ = (
        "children",
        "depth_end",
        "device",
        "device_lock",
        "device_windows",
        "hit_count",
        "host",
        "host_lock",
        "host_windows",
        "id",
        "keys",
        "last_access",
        "parent",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        keys: list[PageKey],
        npools: int,
        windows: bool,
        unlocked: tuple[int, ...] | None = None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.keys = keys
        self.children: dict[PageKey, TreeNode] = {}
        self.depth_end = (parent.depth_end if parent is not None else 0) + len(keys)
        self.device: list[torch.Tensor | None] = [None] * npools
        self.host: list[torch.Tensor | None] = [None] * npools
        # Lock counts per pool: immutable tuples, replaced on every (rare) lock change, so an
        # unlocked node shares the tree's zero tuple instead of owning two GC-tracked lists.
        zeros = unlocked if unlocked is not None else (0,) * npools
        self.device_lock: tuple[int, ...] = zeros
        self.host_lock: tuple[int, ...] = zeros
        # Window (trailing_pages) locks: the lower page bound of each lock covering this node
        # (allocated only for stacks with a window pool: fewer objects for the collector).
        self.device_windows: dict[int, list[int]] = {} if windows else None  # type: ignore[assignment]
        self.host_windows: dict[int, list[int]] = {} if windows else None  # type: ignore[assignment]
        self.hit_count = 0
        self.last_access = 0

    @property
    def pages(self) -> int:
        return len(self.keys)

    @property
    def depth_start(self) -> int:
        return self.depth_end - len(self.keys)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages=[{self.depth_start}, {self.depth_end}))"


@dataclass(slots=True)
class MatchResult:
    """Per-tier usable prefix lengths (pages) of one lookup, after folding every pool's hit rule.

    ``host_pages`` is what device and host together can serve (>= ``device_pages``); the
    difference is what a load-back would bring to the device. ``pages`` is how far the keys
    matched the tree at all. Every length ends at a node boundary (the match splits a node
    when it ends inside it), so ``device_node`` / ``host_node`` / ``last_node`` end exactly there.
    """

    page_size: int
    pages: int
    device_pages: int
    host_pages: int
    path: list[TreeNode]  # matched nodes from the root's child down to ``last_node``
    last_node: TreeNode
    device_node: TreeNode
    host_node: TreeNode
    device_nodes: int = 0  # ``path[:device_nodes]`` is the device-usable part of the path
    host_nodes: int = 0  # ``path[:host_nodes]`` is the host-usable part
    #: node-state pools: the device slot the request would copy its state from (device tier)
    device_state: dict[str, torch.Tensor] = field(default_factory=dict)
    #: node-state pools: where the host-tier prefix's state lives, and in which tier
    host_state: dict[str, tuple[Tier, torch.Tensor]] = field(default_factory=dict)

    @property
    def device_path(self) -> list[TreeNode]:
        return self.path[: self.device_nodes]

    @property
    def host_path(self) -> list[TreeNode]:
        return self.path[: self.host_nodes]

    @property
    def device_tokens(self) -> int:
        return self.device_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


class InsertResult:
    """Outcome of an insert; the duplicate tensors are sliced only when asked for."""

    __slots__ = ("_duplicates", "_given", "_ranges", "new_pages", "node")

    def __init__(
        self,
        node: TreeNode,
        new_pages: int,
        given: dict[str, torch.Tensor],
        ranges: dict[str, list[list[int]]],
    ) -> None:
        self.node = node  # the node ending at the inserted length (root for an empty insert)
        self.new_pages = new_pages  # pages that did not exist in the tree before
        self._given = given
        self._ranges = ranges
        self._duplicates: dict[str, torch.Tensor] | None = None

    @property
    def duplicate_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Per pool, ``[start, end)`` unit positions of the given values the tree did not adopt."""
        return {name: [(s, e) for s, e in ranges] for name, ranges in self._ranges.items()}

    @property
    def duplicates(self) -> dict[str, torch.Tensor]:
        """Per pool, the given units the tree did not adopt (it already held them): free them."""
        if self._duplicates is None:
            out = {}
            for name, ranges in self._ranges.items():
                value = self._given[name]
                parts = [value[s:e] for s, e in ranges]
                out[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
            self._duplicates = out
        return self._duplicates


@dataclass
class EvictionResult:
    #: dropped unit indices per pool (the caller frees them in that tier's allocator)
    freed: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    demoted: list[TreeNode] = field(default_factory=list)  # device dropped, node kept on host
    deleted: int = 0  # nodes removed from the tree
    tombstoned: int = 0  # component values dropped on nodes that stay

    def _add(self, pool: str, value: torch.Tensor) -> None:
        self.freed.setdefault(pool, []).append(value)
        self.units[pool] = self.units.get(pool, 0) + value.shape[0]


@dataclass(frozen=True)
class LockHandle:
    """What ``lock`` protected; pass it back to ``unlock`` exactly once."""

    node: TreeNode
    tier: Tier


class PrefixTree:
    """The page prefix tree; see the module docstring. Not thread-safe: one owner thread."""

    def __init__(self, specs: Iterable[PoolSpec]) -> None:
        tracked = [s for s in specs if s.role is not PoolRole.SIDECAR]
        anchors = [s for s in tracked if s.role is PoolRole.ANCHOR]
        if len(anchors) != 1:
            raise TreeError(f"a stack needs exactly one anchor pool, got {[s.name for s in anchors]}")
        if anchors[0].granularity is not Granularity.TOKEN_PAGES:
            raise TreeError(f"anchor pool {anchors[0].name!r} must have token_pages granularity")
        page_sizes = {s.page_size for s in tracked}
        if len(page_sizes) != 1:
            raise TreeError(f"all tree pools must share one page_size, got {sorted(page_sizes)}")
        # the anchor is always pool 0
        self.pools: tuple[PoolSpec, ...] = (anchors[0], *[s for s in tracked if s is not anchors[0]])
        self.page_size: int = page_sizes.pop()
        self.index: dict[str, int] = {s.name: i for i, s in enumerate(self.pools)}
        self._names = [s.name for s in self.pools]
        self._state = [s.granularity is Granularity.NODE_STATE for s in self.pools]
        self._window = [
            s.hit_rule.pages if s.hit_rule.kind is HitRuleKind.TRAILING_PAGES and not self._state[i] else 0
            for i, s in enumerate(self.pools)
        ]
        self._all_pages = [
            i for i, s in enumerate(self.pools) if not self._state[i] and not self._window[i] and i != 0
        ]
        self._windowed = [i for i in range(len(self.pools)) if self._window[i]]
        self._stateful = [i for i in range(len(self.pools)) if self._state[i]]
        self._anchor_only = len(self.pools) == 1
        self._npools = len(self.pools)
        self._has_windows = bool(self._windowed)
        self._delete_unbacked = True  # see evict_device
        self._ids = count(1)
        # LRU clock: the last ``last_access`` handed out (a plain int: bumped inline per node)
        self._tick = 0
        self._unlocked = (0,) * self._npools
        self.root = TreeNode(0, None, [], self._npools, self._has_windows, self._unlocked)
        # Per-tier, per-pool LRU membership: the nodes holding a value of that pool in that tier,
        # ordered for eviction by ``last_access`` (touched bottom-up on every match and insert).
        self._lru: dict[Tier, list[dict[TreeNode, None]]] = {
            _DEVICE: [{} for _ in self.pools],
            _HOST: [{} for _ in self.pools],
        }
        self._device_lru = self._lru[_DEVICE]
        self._host_lru = self._lru[_HOST]

    # ------------------------------------------------------------------ helpers
    def keys_of(self, tokens: Sequence[int] | array | torch.Tensor) -> list[bytes]:
        return page_keys(tokens, self.page_size)

    def _pool(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise TreeError(
                f"pool {name!r} is not tracked by the tree (tracked: {list(self.index)})"
            ) from None

    def holding(self, name: str, tier: Tier | str) -> list[TreeNode]:
        """The nodes holding units of a pool in a tier (its LRU membership; no tree walk)."""
        return list(self._lru[Tier(tier)][self._pool(name)])

    def units(self, name: str, tier: Tier | str) -> int:
        """Units of a pool held by the tree in a tier (pages or slots)."""
        p = self._pool(name)
        return sum(len(getattr(n, Tier(tier).value)[p]) for n in self._lru[Tier(tier)][p])

    def nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _touch(self, path: list[TreeNode]) -> None:
        # deepest first, so an ancestor is never older than its descendants
        tick = self._tick
        for node in reversed(path):
            tick += 1
            node.last_access = tick
        self._tick = tick

    def _set(self, node: TreeNode, tier: Tier, p: int, value: torch.Tensor | None) -> None:
        if tier is _DEVICE:
            node.device[p] = value
            lru = self._device_lru[p]
        else:
            node.host[p] = value
            lru = self._host_lru[p]
        if value is None:
            lru.pop(node, None)
        else:
            lru[node] = None

    def _check_value(self, p: int, value: torch.Tensor, pages: int) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise TreeError(f"pool {self.pools[p].name!r}: values must be 1-D index tensors")
        want = 1 if self._state[p] else pages
        if value.shape[0] != want:
            raise TreeError(f"pool {self.pools[p].name!r}: expected {want} units, got {len(value)}")
        return value

    # ------------------------------------------------------------------ split
    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after its first ``at`` pages; returns the new upper node.

        Token-page values split by position; a node-state value stays on the deeper node (it is
        the state after the last token) and the new parent is a tombstone for that pool.
        """
        if node is self.root or not 0 < at < len(node.keys):
            raise TreeError(f"cannot split {node!r} at page {at}")
        parent = node.parent
        assert parent is not None
        upper = TreeNode(
            next(self._ids), parent, node.keys[:at], self._npools, self._has_windows, self._unlocked
        )
        node.keys = node.keys[at:]
        parent.children[upper.keys[0]] = upper
        upper.children[node.keys[0]] = node
        node.parent = upper
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        device_lock, host_lock = list(upper.device_lock), list(upper.host_lock)
        for p in range(self._npools):
            if self._state[p]:
                continue  # the state (and its lock) stays on the node that holds it
            value = node.device[p]
            if value is not None:
                self._set(upper, _DEVICE, p, value[:at])
                node.device[p] = value[at:]
            value = node.host[p]
            if value is not None:
                self._set(upper, _HOST, p, value[:at])
                node.host[p] = value[at:]
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
        return upper

    # ------------------------------------------------------------------ match
    def _walk(self, keys: Sequence[PageKey], split: bool) -> tuple[list[TreeNode], int]:
        node, i, n, path = self.root, 0, len(keys), []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.keys
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

    def match(self, keys: Sequence[PageKey], *, split: bool = True, count_hit: bool = True) -> MatchResult:
        """Longest usable prefix of ``keys`` per tier; touches the path's LRU position.

        With ``split`` (default) a match ending inside a node splits it there, so the returned
        nodes end exactly at the matched length; without it the partial node is ignored.
        """
        path, _ = self._walk(keys, split)
        tick = self._tick  # _touch inlined: deepest first, so an ancestor is never older
        if count_hit:
            for node in reversed(path):
                tick += 1
                node.last_access = tick
                node.hit_count += 1
        else:
            for node in reversed(path):
                tick += 1
                node.last_access = tick
        self._tick = tick
        root = self.root
        last = path[-1] if path else root
        ps = self.page_size
        if self._anchor_only:
            jd = 0
            for node in path:
                if node.device[0] is None:
                    break
                jd += 1
            jh = jd
            for node in path[jd:]:
                if node.host[0] is None:
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
            if jd and dnode.device[p] is not None:
                result.device_state[name] = dnode.device[p]  # type: ignore[assignment]
            if jh:
                if hnode.device[p] is not None:
                    result.host_state[name] = (_DEVICE, hnode.device[p])  # type: ignore[arg-type]
                elif hnode.host[p] is not None:
                    result.host_state[name] = (_HOST, hnode.host[p])  # type: ignore[arg-type]
        return result

    def _present(self, node: TreeNode, p: int, tier: Tier) -> bool:
        if node.device[p] is not None:
            return True
        return tier is _HOST and node.host[p] is not None

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
        parts = [n.device[p] for n in nodes] if device else [n.host[p] for n in nodes]
        for v in parts:
            if v is None:
                attr = "device" if device else "host"
                raise TreeError(f"pool {name!r} has no {attr} value on some of the requested nodes")
        if len(parts) == 1:
            return parts[0]  # type: ignore[return-value]
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(parts)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ insert
    def insert(self, keys: Sequence[PageKey], values: Mapping[str, torch.Tensor]) -> InsertResult:
        """Insert a device-resident prefix; existing nodes are reused.

        ``values`` maps a tracked pool to its unit indices for the *last* ``len(value)`` pages of
        the sequence (usually all of them; a shorter value leaves the earlier pages untouched:
        a request inserting what it computed after its cached prefix, or a window pool that
        only holds its last pages) -- one slot for node-state pools: the state after the last
        page. A pool left out gets tombstones on the new nodes. Existing nodes adopt given units
        where they lack them (host-only nodes come back to device, tombstones are revived); the
        rest are returned as duplicates. The anchor's values are required.
        """
        return self._insert(keys, values, _DEVICE)

    def insert_host(self, keys: Sequence[PageKey], values: Mapping[str, torch.Tensor]) -> InsertResult:
        """Insert a host-resident prefix (a committed prefetch): new nodes exist only on host."""
        return self._insert(keys, values, _HOST)

    def _insert(
        self, keys: Sequence[PageKey], values: Mapping[str, torch.Tensor], tier: Tier
    ) -> InsertResult:
        n = len(keys)
        npools = self._npools
        state = self._state
        names = self._names
        given: list[torch.Tensor | None] = [None] * npools
        start = [0] * npools  # first page each token-page pool's value covers
        for name, value in values.items():
            p = self.index.get(name)
            if p is None:
                p = self._pool(name)
            if state[p]:
                given[p] = self._check_value(p, value, n)
                continue
            # shape, not len(): Tensor.__len__ is a Python-level call, this is the hot path
            shape = value.shape if isinstance(value, torch.Tensor) else None
            if shape is None or len(shape) != 1 or shape[0] > n:
                raise TreeError(f"pool {name!r}: values must be 1-D index tensors of at most {n} units")
            given[p] = value
            start[p] = n - shape[0]
        if given[0] is None:
            raise TreeError(f"insert needs values for the anchor pool {self.pools[0].name!r}")
        paged = (
            [0] if self._anchor_only else [p for p in range(npools) if given[p] is not None and not state[p]]
        )
        suffix = any(start)  # some value covers only the last pages (only paged pools start > 0)
        dev = tier is _DEVICE
        # duplicate unit ranges per pool, merged while contiguous so each becomes one slice
        dup_ranges: dict[str, list[list[int]]] = {}
        path, i = self._walk(keys, split=True)
        if start[0] > i:
            raise TreeError(
                f"anchor values cover pages [{start[0]}, {n}) but the tree holds only the first {i}"
            )
        if suffix:
            # a value starting inside a matched node: split there, so each node is covered whole or not
            for cut in sorted({start[p] for p in paged if 0 < start[p] < i}):
                for j, node in enumerate(path):
                    if node.depth_start < cut < node.depth_end:
                        path.insert(j, self.split(node, cut - node.depth_start))
                        break
        # adopt into existing nodes: revive host-only nodes / tombstones, the rest is duplicate
        for node in path:
            vals = node.device if dev else node.host
            e = node.depth_end
            s = e - len(node.keys)
            for p in paged:  # the anchor (p == 0) is adopted first, so components may follow
                first = start[p]
                if e <= first:
                    continue  # pages before this pool's value: not given
                lo, hi = s - first, e - first
                if vals[p] is None:
                    self._set(node, tier, p, given[p][lo:hi])  # type: ignore[index]
                    continue
                ranges = dup_ranges.get(names[p])
                if ranges is None:
                    dup_ranges[names[p]] = [[lo, hi]]
                elif ranges[-1][1] == lo:
                    ranges[-1][1] = hi
                else:
                    ranges.append([lo, hi])
        node = path[-1] if path else self.root
        if i < n:
            # new pages; one node per stretch where the same pools have values
            cuts = sorted({i, n} | {start[p] for p in paged if i < start[p] < n}) if suffix else (i, n)
            for s, e in pairwise(cuts):
                parent = node
                rest = keys[s:e] if isinstance(keys, list) else list(keys[s:e])
                node = TreeNode(next(self._ids), parent, rest, npools, self._has_windows, self._unlocked)
                parent.children[rest[0]] = node
                for p in paged:
                    first = start[p]
                    if first <= s:
                        value = given[p]
                        if s != first or e != n:
                            value = value[s - first : e - first]  # type: ignore[index]
                        self._set(node, tier, p, value)
                path.append(node)
        for p in self._stateful:
            value = given[p]
            if value is None:
                continue
            vals = node.device if dev else node.host
            if node is self.root or vals[p] is not None or vals[0] is None:
                dup_ranges[names[p]] = [[0, 1]]
            else:
                self._set(node, tier, p, value)
        tick = self._tick  # _touch inlined
        for node_ in reversed(path):
            tick += 1
            node_.last_access = tick
        self._tick = tick
        return InsertResult(node, n - i, values, dup_ranges)

    # ------------------------------------------------------------------ tier values
    def set_device_value(self, node: TreeNode, name: str, value: torch.Tensor) -> None:
        """Attach device units to a node (load-back); the anchor's device prefix stays closed."""
        p = self._pool(name)
        self._require_node(node)
        value = self._check_value(p, value, node.pages)
        if node.device[p] is not None:
            raise TreeError(f"{node!r} already holds device units of pool {name!r}")
        if p == 0 and node.parent is not self.root and node.parent.device[0] is None:  # type: ignore[union-attr]
            raise TreeError(f"load {node!r}'s parent to device first (device prefixes are closed)")
        if p != 0 and node.device[0] is None:
            raise TreeError(f"load the anchor of {node!r} to device before component {name!r}")
        self._set(node, _DEVICE, p, value)

    def set_host_value(self, node: TreeNode, name: str, value: torch.Tensor) -> None:
        """Record a host copy (a finished backup); the anchor's host value marks the node backed up."""
        p = self._pool(name)
        self._require_node(node)
        value = self._check_value(p, value, node.pages)
        if node.host[p] is not None:
            raise TreeError(f"{node!r} already holds host units of pool {name!r}")
        if p != 0 and node.host[0] is None:
            raise TreeError(f"back up the anchor of {node!r} before component {name!r}")
        self._set(node, _HOST, p, value)

    def drop_component(self, node: TreeNode, name: str, tier: Tier | str) -> torch.Tensor:
        """Tombstone one component of a node in a tier and return its units for the caller to free.

        For targeted releases (e.g. window pages a decode has moved past, a state superseded by
        a deeper checkpoint); the anchor leaves a tier only through eviction.
        """
        p, tier = self._pool(name), Tier(tier)
        self._require_node(node)
        if p == 0:
            raise TreeError(f"the anchor {name!r} leaves a tier through evict_device / evict_host only")
        vals, locks = (node.device, node.device_lock) if tier is _DEVICE else (node.host, node.host_lock)
        value = vals[p]
        if value is None:
            raise TreeError(f"{node!r} holds no {tier} units of pool {name!r}")
        if locks[p]:
            raise TreeError(f"{node!r}: pool {name!r} is {tier}-locked")
        self._set(node, tier, p, None)
        return value

    def backed_up(self, node: TreeNode) -> bool:
        return node is self.root or node.host[0] is not None

    def is_tombstone(self, node: TreeNode, name: str, tier: Tier | str) -> bool:
        """A component missing in a tier where the node's anchor is present."""
        p = self._pool(name)
        vals = node.device if Tier(tier) is _DEVICE else node.host
        return p != 0 and vals[0] is not None and vals[p] is None

    def _require_node(self, node: TreeNode) -> None:
        if node is self.root:
            raise TreeError("the root holds no values")
        if node.parent is None or node.parent.children.get(node.keys[0]) is not node:
            raise TreeError(f"{node!r} is no longer in the tree")

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode, tier: Tier | str = Tier.DEVICE) -> LockHandle:
        """Protect a request's prefix ending at ``node`` from eviction in ``tier``.

        Anchor and all_pages pools lock the whole path, trailing_pages pools only the nodes of
        the last window, node-state pools only ``node`` itself.
        """
        tier = Tier(tier)
        self._lock(node, tier, +1)
        return LockHandle(node, tier)

    def unlock(self, handle: LockHandle) -> None:
        self._lock(handle.node, handle.tier, -1)

    def _lock(self, node: TreeNode, tier: Tier, delta: int) -> None:
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
            for p in range(len(self.pools)):
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

    def _set_locks(self, node: TreeNode, dev: bool, counts: list[int]) -> None:
        locks = self._unlocked if not any(counts) else tuple(counts)
        if dev:
            node.device_lock = locks
        else:
            node.host_lock = locks

    # ------------------------------------------------------------------ eviction
    def evict_device(
        self,
        needs: Mapping[str, int],
        on_free: Callable[[str, torch.Tensor], None] | None = None,
        *,
        delete_unbacked: bool = True,
    ) -> EvictionResult:
        """Free at least ``needs[pool]`` device units per pool where possible, least recent first.

        Pools are served in ascending ``eviction_priority``; units freed for one pool count for
        the others. The anchor evicts device leaves: a backed-up node is demoted to host-only,
        any other leaf is deleted. A component drops its value on inner nodes (tombstone); on a
        device leaf the whole node goes, since its pages are useless without that component.
        Locked nodes are skipped. ``on_free`` is called per freed value (as well as returned).
        With ``delete_unbacked=False`` (write-back: a node whose backup failed must not lose its
        only copy) only backed-up nodes leave the device or lose components there.
        """
        self._delete_unbacked = delete_unbacked
        try:
            return self._evict(_DEVICE, needs, on_free)
        finally:
            self._delete_unbacked = True

    def evict_host(
        self, needs: Mapping[str, int], on_free: Callable[[str, torch.Tensor], None] | None = None
    ) -> EvictionResult:
        """Free host units; only nodes whose (pool) data is not on device and not host-locked."""
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

    def _evict_anchor(self, tier: Tier, want: int, result: EvictionResult) -> None:
        name = self.pools[0].name
        heap = [(n.last_access, n.id, n) for n in self._lru[tier][0] if self._node_evictable(n, tier)]
        heapq.heapify(heap)
        while heap and result.units.get(name, 0) < want:
            _, _, node = heapq.heappop(heap)
            if not self._node_evictable(node, tier):
                continue
            parent = self._drop_node(node, tier, result)
            if self._node_evictable(parent, tier):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _evict_component(self, tier: Tier, p: int, want: int, result: EvictionResult) -> None:
        name = self.pools[p].name
        dev = tier is _DEVICE
        candidates = []
        for node in self._lru[tier][p]:
            if dev and (node.device_lock[p] or (not self._delete_unbacked and node.host[0] is None)):
                continue  # locked, or write-back keeps a node without backup whole
            if not dev and (node.host_lock[p] or node.device[p] is not None):
                continue
            candidates.append((node.last_access, node.id, node))
        candidates.sort()
        for _, _, node in candidates:
            if result.units.get(name, 0) >= want:
                break
            if (node.device if dev else node.host)[p] is None:
                continue  # already dropped with a cascaded node
            if self._node_evictable(node, tier):
                parent = self._drop_node(node, tier, result)
                # the parent's own component value is considered in its LRU turn
                del parent
            else:
                value = (node.device if dev else node.host)[p]
                assert value is not None
                result._add(name, value)
                self._set(node, tier, p, None)
                result.tombstoned += 1

    # ------------------------------------------------------------------ sanity
    def check(self) -> None:
        """Assert every structural invariant; tests call it after each step."""
        seen: set[TreeNode] = set()
        stack = [self.root]
        assert self.root.parent is None and not self.root.keys
        assert all(v is None for v in self.root.device + self.root.host)
        while stack:
            node = stack.pop()
            assert node not in seen, f"{node!r} reachable twice"
            seen.add(node)
            for key, child in node.children.items():
                assert child.parent is node, f"{child!r} parent link broken"
                assert child.keys and child.keys[0] == key, f"{child!r} keyed wrongly"
                assert child.depth_end == node.depth_end + len(child.keys), f"{child!r} depth wrong"
                stack.append(child)
            if node is self.root:
                continue
            anchor_dev, anchor_host = node.device[0] is not None, node.host[0] is not None
            assert anchor_dev or anchor_host, f"{node!r} holds the anchor in no tier"
            if anchor_dev and node.parent is not self.root:
                assert node.parent.device[0] is not None, f"{node!r} on device below a non-device parent"  # type: ignore[union-attr]
            if not anchor_dev:
                assert all(c.device[0] is None for c in node.children.values()), f"{node!r}: device child"
            for p in range(len(self.pools)):
                for tier, vals in ((_DEVICE, node.device), (_HOST, node.host)):
                    value = vals[p]
                    member = node in self._lru[tier][p]
                    assert member == (value is not None), f"{node!r} pool {p} {tier} LRU membership"
                    if value is not None:
                        want = 1 if self._state[p] else len(node.keys)
                        assert value.dim() == 1 and len(value) == want, f"{node!r} pool {p} {tier} length"
                        if p != 0:
                            assert vals[0] is not None, f"{node!r} pool {p} {tier} value without anchor"
                for counts, windows in (
                    (node.device_lock, node.device_windows),
                    (node.host_lock, node.host_windows),
                ):
                    assert counts[p] >= 0, f"{node!r} negative lock"
                    if self._window[p]:
                        assert counts[p] == len(windows.get(p, ())), f"{node!r} window lock count"
                        assert all(b < node.depth_end for b in windows.get(p, ())), f"{node!r} window bound"
                # a node holding locks for its path must have its ancestors locked too
                if not self._state[p] and not self._window[p] and node.parent is not self.root:
                    assert node.parent.device_lock[p] >= node.device_lock[p], f"{node!r} device lock > parent"  # type: ignore[union-attr]
                    assert node.parent.host_lock[p] >= node.host_lock[p], f"{node!r} host lock > parent"  # type: ignore[union-attr]
        for tier in Tier:
            for p in range(len(self.pools)):
                for node in self._lru[tier][p]:
                    assert node in seen, f"{node!r} in {tier} LRU of pool {p} but not in the tree"
