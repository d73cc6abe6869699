"""How the controller's parts see a model stack: which pools the tree tracks, and their rules.

Every part (load-back, prefetcher, writer, the lease API) asks the same questions of a pool --
does it need every page, the last window, or one state slot; which sidecars follow its indices;
which pages does it read for a prefix -- and the answers come from the pools' declared specs
only, never from a pool type's name. This module holds those answers in one object,
:class:`StackLayout`, built at start-up and refreshed in place when a sidecar is added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from kvstrata.core.object_views import object_regions
from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.storage_engine import PoolBatch
from kvstrata.core.tree import PrefixTree
from kvstrata.plugins.pool_type import Granularity, HitRuleKind, PartialHit, PoolSpec

#: An empty unit list (a pool with nothing cached, or nothing to allocate).
NO_UNITS = torch.empty(0, dtype=torch.int64)


class PoolKind(StrEnum):
    PAGES = "pages"  # every page of the prefix
    WINDOW = "window"  # the last ``window`` pages of the prefix
    STATE = "state"  # one slot: the state after the prefix's last page


@dataclass(frozen=True)
class TreePool:
    """How the controller treats one pool the tree tracks (the anchor or a component)."""

    name: str
    kind: PoolKind
    window: int  # pages, for WINDOW pools
    followers: tuple[str, ...]  # this pool and the sidecars sharing its indices

    @classmethod
    def of(cls, spec: PoolSpec, followers: Sequence[str]) -> TreePool:
        if spec.granularity is Granularity.NODE_STATE:
            kind, window = PoolKind.STATE, 0
        elif spec.hit_rule.kind is HitRuleKind.TRAILING_PAGES:
            kind, window = PoolKind.WINDOW, int(spec.hit_rule.pages or 0)
        else:
            kind, window = PoolKind.PAGES, 0
        return cls(spec.name, kind, window, tuple(followers))

    def units_for(self, pages: int) -> int:
        """Units this pool needs to hold ``pages`` new pages."""
        if self.kind is PoolKind.STATE:
            return 1 if pages > 0 else 0
        return pages

    def slots(self, start: int, end: int) -> tuple[int, int]:
        """Pages [lo, end) this pool reads or writes for a prefix ending at ``end``; ``start``
        bounds it (a state pool needs only the last page, a window pool the last window)."""
        if self.kind is PoolKind.STATE:
            return end - 1, end
        if self.kind is PoolKind.WINDOW:
            return max(start, end - self.window), end
        return start, end


@dataclass
class StackLayout:
    """The tree pools of a stack in tree order (anchor first), and how every pool maps to them."""

    anchor: str
    tree_pools: dict[str, TreePool]
    owner_of: dict[str, str]  # every pool -> the tree pool owning its indices
    #: a partial L3 hit can be clamped only if every all-pages pool besides the anchor says so
    clampable: bool
    #: the window pools of ``tree_pools`` (most stacks have none: a chunk's allocation skips them)
    windowed: tuple[TreePool, ...] = ()
    #: every pool owns its indices (no sidecars): units per tree pool are units per pool
    self_owned: bool = False

    @classmethod
    def of(cls, pools: PoolGroup, tree: PrefixTree) -> StackLayout:
        owner_of = {name: pool.index_owner for name, pool in pools.pools.items()}
        tree_pools = {
            spec.name: TreePool.of(spec, [p.instance for p in pools.followers(spec.name)])
            for spec in tree.pools
        }
        anchor = tree.pools[0].name
        clampable = all(
            tree_pools[owner_of[name]].kind is PoolKind.PAGES and pool.spec.partial_hit is PartialHit.CLAMP
            for name, pool in pools.pools.items()
            if name != anchor
        )
        windowed = tuple(tp for tp in tree_pools.values() if tp.kind is PoolKind.WINDOW)
        self_owned = list(owner_of) == list(tree_pools) and all(k == v for k, v in owner_of.items())
        return cls(anchor, tree_pools, owner_of, clampable, windowed, self_owned)

    def refresh(self, pools: PoolGroup, tree: PrefixTree) -> None:
        """Re-read the stack after a pool was added (every part holds this same object)."""
        fresh = StackLayout.of(pools, tree)
        self.anchor, self.tree_pools = fresh.anchor, fresh.tree_pools
        self.owner_of, self.clampable, self.windowed = fresh.owner_of, fresh.clampable, fresh.windowed
        self.self_owned = fresh.self_owned

    def kind(self, pool: str) -> PoolKind:
        """How a pool's prefix units are laid out (a sidecar follows the pool owning its indices)."""
        return self.tree_pools[self.owner_of[pool]].kind

    def owner(self, pool: str) -> TreePool:
        return self.tree_pools[self.owner_of[pool]]

    def units_for(self, pages: int) -> dict[str, int]:
        """Units per tree pool to hold ``pages`` new pages."""
        return {tp.name: tp.units_for(pages) for tp in self.tree_pools.values()}

    def slot_counts(self, pages: int) -> dict[str, int]:
        """Units per tree pool to hold a stored prefix of ``pages`` pages read from L3."""
        counts = {}
        for tp in self.tree_pools.values():
            lo, hi = tp.slots(0, pages)
            counts[tp.name] = hi - lo
        return counts


def pool_batch(pools: PoolGroup, name: str, host_units: torch.Tensor, hashes: Sequence[str]) -> PoolBatch:
    """One pool's storage batch: per page hash, the host memory regions of its objects."""
    pool = pools.pools[name]
    assert pool.host is not None
    if host_units.shape[0] != len(hashes):  # paired in order: a count off is another page's bytes
        raise ValueError(f"pool {name!r}: {host_units.shape[0]} host units for {len(hashes)} page hashes")
    per_object = [object_regions(pool.host, obj.suffix, host_units) for obj in pool.spec.objects]
    if len(per_object) == 1 and len(per_object[0]) == len(hashes):  # one object per unit (most pools)
        units = [[regions] for regions in per_object[0]]
    else:
        units = [[regions[i] for regions in per_object] for i in range(len(hashes))]
    return PoolBatch(list(hashes), units)


def unit_bytes(pools: PoolGroup, tree_pool: TreePool) -> int:
    """Bytes one unit of a tree pool moves, its sidecars included."""
    return sum(pools.pools[f].device.unit_bytes for f in tree_pool.followers)  # computed at build
