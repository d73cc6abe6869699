"""The prefix tree's vocabulary: page keys, the node, the pool layout and the result types.

Every part of the tree (matching in ``tree_match``, insertion in ``tree_insert``, locks in
``tree_locks``, eviction in ``tree_eviction``, the invariant check in ``tree_check``) and the
controller speak these types. They live apart from the parts so that each part imports only
this module, never another part, and a reader finds a node's fields next to what the tree hands
back. ``kvstrata.core.tree`` re-exports every name.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

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


class PagedKeys(bytes):
    """The whole-page keys of one token sequence, held as one ``bytes`` of int64 token ids.

    A sequence of page keys (``len`` counts pages, ``keys[i]`` is page ``i``'s key: its tokens'
    int64 bytes, ``keys[a:b]`` is a ``PagedKeys`` of those pages) that costs one object, not one
    per page: at page size 1 a per-page ``bytes`` made key building 75% of an insert and its
    objects most of the tree's memory. A tree edge built from it is a slice of it (one memcpy),
    and the walk compares an edge with ``bytes.startswith`` at an offset: one memcmp, no copy, no
    Python step per page or token. Equal to any sequence with the same page keys (a list of
    ``bytes`` from an older caller compares equal). One subclass per page size holds the stride
    (:func:`paged_keys_type`).
    """

    __slots__ = ()
    #: bytes per page (8 x page size); set on each page size's subclass
    step: int = 8

    def __len__(self) -> int:
        return bytes.__len__(self) // self.step

    def __getitem__(self, index):  # type: ignore[override]  # pages, not bytes
        step = self.step
        if isinstance(index, slice):
            start, stop, stride = index.indices(bytes.__len__(self) // step)
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            return type(self)(bytes.__getitem__(self, slice(start * step, max(start, stop) * step)))
        if index < 0:
            index += bytes.__len__(self) // step
        if not 0 <= index < bytes.__len__(self) // step:
            raise IndexError("page index out of range")
        at = index * step
        return bytes.__getitem__(self, slice(at, at + step))

    def __iter__(self):  # type: ignore[override]
        step = self.step
        view = bytes(self)
        return iter([view[i : i + step] for i in range(0, len(view), step)])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PagedKeys):
            return self.step == other.step and bytes.__eq__(self, other)
        if isinstance(other, list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = bytes.__hash__

    def __add__(self, other: object) -> PagedKeys:  # type: ignore[override]
        if isinstance(other, PagedKeys) and other.step == self.step:
            return type(self)(bytes(self) + bytes(other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"PagedKeys({len(self)} pages of {self.step // 8} tokens)"

    def tokens(self) -> bytes:
        """The token ids of every page, as plain int64 ``bytes``."""
        return bytes(self)

    def __reduce__(self) -> tuple[Callable[[int, bytes], PagedKeys], tuple[int, bytes]]:
        # the per-page-size subclass is made at run time: pickle by page size, not by class name
        return _rebuild_paged_keys, (self.step // 8, bytes(self))


@functools.cache
def paged_keys_type(page_size: int) -> type[PagedKeys]:
    """The ``PagedKeys`` subclass of one page size (the stride lives on the class, since a
    ``bytes`` subclass cannot carry instance attributes). Cached: one immutable type per size."""
    if page_size < 1:
        raise TreeError(f"page_size must be >= 1, got {page_size}")
    return type(f"PagedKeys{page_size}", (PagedKeys,), {"__slots__": (), "step": page_size * 8})


def _rebuild_paged_keys(page_size: int, data: bytes) -> PagedKeys:
    return paged_keys_type(page_size)(data)


def page_keys(tokens: Sequence[int] | array | torch.Tensor, page_size: int) -> PagedKeys:
    """Whole-page keys of ``tokens``: each page's token ids as int64 bytes, as one ``PagedKeys``.

    A trailing partial page is dropped (it cannot be cached). Page keys are exact (no hash
    collisions) and compare with one memcmp. Token arrays (``array('q')``, as SGLang holds them,
    or tensors) convert with one memcpy; lists pay one C-level pack.
    """
    if isinstance(tokens, array) and tokens.typecode == "q":
        flat = tokens.tobytes()
    elif isinstance(tokens, torch.Tensor):
        flat = tokens.detach().to("cpu", torch.int64).numpy().tobytes()
    else:
        flat = struct.pack(f"{len(tokens)}q", *tokens)
    step = page_size * 8
    end = len(flat) - len(flat) % step
    return paged_keys_type(page_size)(flat[:end] if end != len(flat) else flat)


#: the children of every leaf: empty and read-only (a write to it is a bug, and fails loudly)
NO_CHILDREN: Mapping[PageKey, TreeNode] = MappingProxyType({})


class TreeNode:
    """One edge of whole pages plus per-pool data; index ``p`` follows ``PrefixTree.pools``."""

    __slots__ = (
        "children",
        "depth_end",
        "device",
        "device_children",
        "device_lock",
        "device_windows",
        "hit_count",
        "host",
        "host_children",
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
        # a leaf shares one immutable empty mapping (half the nodes of a tree are leaves: a dict
        # each was 64 bytes and one more object for every garbage-collector pass); the tree's
        # parts give a node its own dict when its first child arrives (``add_child``)
        self.children: dict[PageKey, TreeNode] = NO_CHILDREN  # type: ignore[assignment]
        self.depth_end = (parent.depth_end if parent is not None else 0) + len(keys)
        # Per-pool values: an all-None tuple until the tree's setter first stores one (then a
        # list). A node never backed up to host (or host-only) then holds no list for that tier:
        # one object less for every garbage-collector pass, which at 100k sequences was half of
        # an insert's time. Only ``PrefixTree._set`` writes them (and ``split``, on lists).
        self.device: list[torch.Tensor | None] = (None,) * npools  # type: ignore[assignment]
        self.host: list[torch.Tensor | None] = (None,) * npools  # type: ignore[assignment]
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
    def pages(self) -> int:
        return len(self.keys)

    @property
    def depth_start(self) -> int:
        return self.depth_end - len(self.keys)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages=[{self.depth_start}, {self.depth_end}))"


#: per tier, per pool: the nodes holding units of that pool in that tier (no tree walk to find
#: them; eviction draws its candidates from here). Insertion-ordered dicts used as sets.
Membership = dict[Tier, list[dict[TreeNode, None]]]
#: sets (or clears, with ``None``) one pool's value of a node in a tier and keeps the membership
#: in step; the tree's owner provides it (``PrefixTree._set``), every part that edits values calls it
SetValue = Callable[[TreeNode, Tier, int, torch.Tensor | None], None]


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
    #: window-pool units tombstoned outside the last window of every prefix the tier holds
    out_of_window: dict[str, int] = field(default_factory=dict)

    def _add(self, pool: str, value: torch.Tensor) -> None:
        self.freed.setdefault(pool, []).append(value)
        self.units[pool] = self.units.get(pool, 0) + value.shape[0]


@dataclass(frozen=True)
class LockHandle:
    """What ``lock`` protected; pass it back to ``unlock`` exactly once.

    ``local`` marks a node-local lock (``PrefixTree.lock_local``): it protects only the node's
    state-pool values and its last window, not the path to the root.
    """

    node: TreeNode
    tier: Tier
    local: bool = False
