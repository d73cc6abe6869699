"""The prefix tree's vocabulary: page keys, the node, the pool layout and the result types.

Every part of the tree (matching in ``tree_match``, insertion in ``tree_insert``, locks in
``tree_locks``, eviction in ``tree_eviction``, the invariant check in ``tree_check``) and the
controller speak these types. They live apart from the parts so that each part imports only
this module, never another part, and a reader finds a node's fields next to what the tree hands
back. ``kvstrata.core.tree`` re-exports every name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import NamedTuple

import torch

from kvstrata.core.tree_bytes import UNIT as UNIT  # re-exported: the parts import from here
from kvstrata.core.tree_bytes import PagedKeys as PagedKeys
from kvstrata.core.tree_bytes import PageKey as PageKey
from kvstrata.core.tree_bytes import TreeError as TreeError
from kvstrata.core.tree_bytes import Units as Units
from kvstrata.core.tree_bytes import UnitValues as UnitValues
from kvstrata.core.tree_bytes import page_keys as page_keys
from kvstrata.core.tree_bytes import paged_keys_type as paged_keys_type
from kvstrata.core.tree_bytes import unit_bytes as unit_bytes
from kvstrata.core.tree_bytes import unit_tensor as unit_tensor
from kvstrata.plugins.pool_type import Granularity, HitRuleKind, PoolRole, PoolSpec


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"


# Enum member lookups (``Tier.DEVICE``) go through a descriptor (~0.1 us each): the hot paths
# compare against these immutable aliases instead.
_DEVICE = Tier.DEVICE
_HOST = Tier.HOST


#: the children of every leaf: empty and read-only (a write to it is a bug, and fails loudly)
NO_CHILDREN: Mapping[PageKey, TreeNode] = MappingProxyType({})


class TreeNode:
    """One edge of whole pages plus per-pool data; index ``p`` follows ``PrefixTree.pools``.

    Fields are plain, untracked objects wherever possible, since a tree at 100k sequences holds
    100k nodes and Python's garbage collector visits every tracked object on each full pass: the
    edge is ``bytes`` (the pages' int64 token ids; a list for callers passing their own page
    keys), each tier's values a tuple of int64 ``bytes`` or None per pool (``device_raw``,
    ``host_raw``; a tuple of untracked items is untracked by the collector), lock counts shared
    tuples of ints. The node itself (and an inner node's children dict) are the only tracked
    objects. ``keys``, ``device`` and ``host`` read those fields as page keys and tensors.
    """

    __slots__ = (
        "children",
        "depth_end",
        "device_children",
        "device_lock",
        "device_raw",
        "device_windows",
        "edge",
        "hit_count",
        "host_children",
        "host_lock",
        "host_raw",
        "host_windows",
        "id",
        "last_access",
        "parent",
    )
    #: bytes per page of a ``bytes`` edge, and the page keys type reading it: set per page size
    #: on the subclass :func:`node_type` makes (a node holds no per-instance copy of either)
    step: int = 8
    keys_type: type[PagedKeys] = PagedKeys

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        edge: bytes | list[PageKey],
        npools: int,
        windows: bool,
        unlocked: tuple[int, ...] | None = None,
        pages: int | None = None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.edge = edge
        # a leaf shares one immutable empty mapping (half the nodes of a tree are leaves: a dict
        # each was 64 bytes and one more object for every garbage-collector pass); the tree's
        # parts give a node its own dict when its first child arrives (``add_child``)
        self.children: dict[PageKey, TreeNode] = NO_CHILDREN  # type: ignore[assignment]
        if pages is None:
            pages = len(edge) // self.step if type(edge) is bytes else len(edge)
        self.depth_end = (parent.depth_end if parent is not None else 0) + pages
        # Per-pool values, replaced whole by the tree's setter (``PrefixTree._set``) and ``split``
        self.device_raw: tuple[bytes | None, ...] = (None,) * npools
        self.host_raw: tuple[bytes | None, ...] = (None,) * npools
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
        # Children holding the anchor in each tier, kept by the tree's setter and split: eviction
        # asks "does this node still have children in the tier?" on every demotion, and a scan of
        # the siblings there made emptying a wide tier quadratic.
        self.device_children = 0
        self.host_children = 0

    def add_child(self, key: PageKey, child: TreeNode) -> None:
        """Link ``child`` under ``key`` (its first page key), giving a leaf its own dict."""
        children = self.children
        if children is NO_CHILDREN:
            self.children = {key: child}
        else:
            children[key] = child

    @property
    def keys(self) -> Sequence[PageKey]:
        """The edge's page keys (a ``PagedKeys`` copy of a ``bytes`` edge)."""
        edge = self.edge
        return self.keys_type(edge) if type(edge) is bytes else edge

    @property
    def first_key(self) -> PageKey:
        """The key the parent files this node under (its first page's key)."""
        edge = self.edge
        return edge[: self.step] if type(edge) is bytes else edge[0]

    @property
    def device(self) -> UnitValues:
        """Per-pool device unit indices as tensors (None: not held), made when read."""
        return UnitValues(self.device_raw)

    @property
    def host(self) -> UnitValues:
        """Per-pool host unit indices as tensors (None: not held), made when read."""
        return UnitValues(self.host_raw)

    @property
    def pages(self) -> int:
        edge = self.edge
        return len(edge) // self.step if type(edge) is bytes else len(edge)

    @property
    def depth_start(self) -> int:
        return self.depth_end - self.pages

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages=[{self.depth_start}, {self.depth_end}))"


@functools.cache
def node_type(page_size: int) -> type[TreeNode]:
    """The ``TreeNode`` subclass of one page size: the edge's stride lives on the class."""
    return type(
        f"TreeNode{page_size}",
        (TreeNode,),
        {"__slots__": (), "step": page_size * 8, "keys_type": paged_keys_type(page_size)},
    )


#: per tier, per pool: the nodes holding units of that pool in that tier (no tree walk to find
#: them; eviction draws its candidates from here). Insertion-ordered dicts used as sets.
Membership = dict[Tier, list[dict[TreeNode, None]]]
#: sets (or clears, with ``None``) one pool's value (int64 ``bytes``, see :func:`unit_bytes`) of a
#: node in a tier and keeps the membership in step; the tree's owner provides it
#: (``PrefixTree._set``), every part that edits values calls it
SetValue = Callable[[TreeNode, Tier, int, bytes | None], None]


class PoolLayout:
    """What the tree knows of its pools, fixed at construction and read by every part.

    Only the anchor and the components are tracked (sidecars reuse their source's indices). The
    anchor is pool 0, and index ``p`` into a node's per-pool lists follows ``pools``. The derived
    lists group pools by the hit rule the matching fold applies to them; they are plain lists and
    ints because the hot paths read them once per call.
    """

    __slots__ = (
        "all_pages",
        "anchor_only",
        "eviction_rank",
        "has_windows",
        "index",
        "names",
        "npools",
        "page_size",
        "pools",
        "state",
        "stateful",
        "unlocked",
        "window",
        "windowed",
    )

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
        self.names = [s.name for s in self.pools]
        #: node-state pools (one slot per node: the state after its last page)
        self.state = [s.granularity is Granularity.NODE_STATE for s in self.pools]
        #: trailing-window length in pages per pool (0: not a window pool)
        self.window = [
            s.hit_rule.pages if s.hit_rule.kind is HitRuleKind.TRAILING_PAGES and not self.state[i] else 0
            for i, s in enumerate(self.pools)
        ]
        #: components that need every page of the prefix, like the anchor
        self.all_pages = [
            i for i, s in enumerate(self.pools) if not self.state[i] and not self.window[i] and i != 0
        ]
        self.windowed = [i for i in range(len(self.pools)) if self.window[i]]
        #: the order pools make room in: ascending eviction_priority, a window pool after the
        #: anchor (the anchor's leaves free window units too: only the rest of its need tombstones)
        first = self.pools[0].eviction_priority
        self.eviction_rank = [
            (max(s.eviction_priority, first), 1) if self.window[i] else (s.eviction_priority, 0)
            for i, s in enumerate(self.pools)
        ]
        self.stateful = [i for i in range(len(self.pools)) if self.state[i]]
        self.anchor_only = len(self.pools) == 1
        self.npools = len(self.pools)
        self.has_windows = bool(self.windowed)
        #: the lock counts of an unlocked node, shared by every such node
        self.unlocked = (0,) * self.npools

    def pool(self, name: str) -> int:
        """Index of a tracked pool; a clear error for any other name."""
        try:
            return self.index[name]
        except KeyError:
            raise TreeError(
                f"pool {name!r} is not tracked by the tree (tracked: {list(self.index)})"
            ) from None

    def check_value(self, p: int, value: torch.Tensor, pages: int) -> torch.Tensor:
        """``value`` if it is a 1-D index tensor of the right length for pool ``p`` on ``pages``."""
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise TreeError(f"pool {self.pools[p].name!r}: values must be 1-D index tensors")
        want = 1 if self.state[p] else pages
        if value.shape[0] != want:
            raise TreeError(f"pool {self.pools[p].name!r}: expected {want} units, got {len(value)}")
        return value


class AccessClock:
    """The recency clock: the last ``TreeNode.last_access`` handed out.

    Match and insert stamp their path from it, deepest node first, so an ancestor is never older
    than its descendants; the LRU eviction order ranks by those stamps. One clock is shared by
    the parts that stamp (a plain int behind one attribute: bumped inline, no call per node).
    """

    __slots__ = ("tick",)

    def __init__(self) -> None:
        self.tick = 0


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

    __slots__ = ("_duplicates", "_given", "_ranges", "new_pages", "node", "revived")

    def __init__(
        self,
        node: TreeNode,
        new_pages: int,
        given: Mapping[str, Units],
        ranges: dict[str, list[list[int]]],
        revived: Sequence[TreeNode] = (),
    ) -> None:
        self.node = node  # the node ending at the inserted length (root for an empty insert)
        self.new_pages = new_pages  # pages that did not exist in the tree before
        #: existing nodes the insert brought into its tier (their anchor adopted), root-most first
        self.revived = revived
        self._given = given
        self._ranges = ranges
        self._duplicates: dict[str, torch.Tensor] | None = None

    @property
    def duplicate_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Per pool, ``[start, end)`` unit positions of the given values the tree did not adopt."""
        return {name: [(s, e) for s, e in ranges] for name, ranges in self._ranges.items()}

    @property
    def has_duplicates(self) -> bool:
        """Whether the tree already held any of the given units (see :attr:`duplicates`)."""
        return bool(self._ranges)

    @property
    def duplicates(self) -> dict[str, torch.Tensor]:
        """Per pool, the given units the tree did not adopt (it already held them): free them."""
        if self._duplicates is None:
            out = {}
            for name, ranges in self._ranges.items():
                value = self._given[name]
                if type(value) is bytes:  # int64 bytes, as a node stores them
                    out[name] = unit_tensor(b"".join(value[s * UNIT : e * UNIT] for s, e in ranges))
                    continue
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
    #: window-pool units tombstoned outside the last window of every prefix the tier holds
    out_of_window: dict[str, int] = field(default_factory=dict)

    #: stored unit bytes dropped so far, made one tensor per pool by ``_settle`` (a tensor per
    #: node cost more than the rest of a demotion)
    _raw: dict[str, list[bytes]] = field(default_factory=dict, repr=False)

    def _add(self, pool: str, value: torch.Tensor) -> None:
        self.freed.setdefault(pool, []).append(value)
        self.units[pool] = self.units.get(pool, 0) + value.shape[0]

    def _add_raw(self, pool: str, raw: bytes) -> None:
        self._raw.setdefault(pool, []).append(raw)
        self.units[pool] = self.units.get(pool, 0) + len(raw) // UNIT

    def _settle(self) -> None:
        for pool, raws in self._raw.items():
            self.freed.setdefault(pool, []).append(unit_tensor(b"".join(raws)))
        self._raw.clear()


class LockHandle(NamedTuple):
    """What ``lock`` protected; pass it back to ``unlock`` exactly once.

    ``local`` marks a node-local lock (``PrefixTree.lock_local``): it protects only the node's
    state-pool values and its last window, not the path to the root. Immutable, and a tuple:
    a chunked request moves its lock at every chunk, and a frozen dataclass cost three times
    as much to make.
    """

    node: TreeNode
    tier: Tier
    local: bool = False
