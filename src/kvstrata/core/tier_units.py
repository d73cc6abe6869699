"""Units of a tier across every pool of a stack: all-or-nothing allocation that evicts to fit.

Load-back, the prefetcher, the writer and the lease API all need "N units of every tree pool in
this tier, or none", and when the tier is full, the same eviction step: ask the tree for the
least valuable unlocked nodes, free their units, tell the hooks. One object owns that, so no
part frees or evicts behind another's back. Sidecars share their owner's allocator, so only tree
pools appear here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from kvstrata.core.allocator import UnitAllocator
from kvstrata.core.metrics import CacheMetrics, Operation
from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.stack import NO_UNITS
from kvstrata.core.tree import EvictionResult, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import unit_tensor
from kvstrata.core.tree_eviction import TreeEvictor
from kvstrata.core.tree_node import UNIT

#: units per pool: index tensors, or (``arrays=True``) the numpy int64 arrays they would share
Allocated = dict[str, torch.Tensor] | dict[str, np.ndarray]
#: no units, as a numpy array (read-only: shared by every allocation of zero units)
NO_ARRAY = np.empty(0, dtype=np.int64)
NO_ARRAY.flags.writeable = False

#: Called before the device tier evicts, with the units per pool it is short of (write-back
#: backs nodes up there, so eviction may drop them).
BeforeDeviceEviction = Callable[[Mapping[str, int]], None]


class TierUnits:
    """Allocation and eviction of device and host units (owner thread; allocators are thread-safe)."""

    def __init__(
        self,
        pools: PoolGroup,
        tree: PrefixTree,
        *,
        delete_unbacked: bool,
        on_eviction: Callable[[str, str, int], None],
        metrics: CacheMetrics | None = None,
    ) -> None:
        """``delete_unbacked``: whether device eviction may delete a node with no host copy
        (false for write-back); ``on_eviction(tier, pool, units)`` observes every eviction;
        ``metrics`` counts out-of-window window pages per tier."""
        self.pools = pools
        self.tree = tree
        self.delete_unbacked = delete_unbacked
        self.on_eviction = on_eviction
        self.metrics = metrics
        self.before_device_eviction: BeforeDeviceEviction | None = None
        #: the nodes host eviction takes only where nothing else frees enough, and whether it may
        #: take them now (write-back: those waiting on the host for their prefix's L3 write,
        #: ``PrefixWaits``; not while an L3 write is in flight, whose sources it then frees)
        self.host_last: Callable[[], tuple[list[TreeNode], bool]] | None = None
        #: each pool's allocator per tier, looked up once (a pool keeps its allocators for life)
        self._allocators: dict[Tier, dict[str, UnitAllocator | None]] = {Tier.DEVICE: {}, Tier.HOST: {}}

    def allocator(self, pool: str, tier: Tier) -> UnitAllocator | None:
        known = self._allocators[tier]
        if pool in known:
            return known[pool]
        p = self.pools.pools[pool]
        known[pool] = found = p.device_allocator if tier is Tier.DEVICE else p.host_allocator
        return found

    def free(self, tier: Tier, units: Mapping[str, torch.Tensor]) -> None:
        for pool, value in units.items():
            if value.shape[0]:
                self.allocator(pool, tier).free(value)  # type: ignore[union-attr]

    def free_unowned(self, tier: Tier, units: Mapping[str, torch.Tensor]) -> None:
        """Free the ``units`` no node holds in ``tier``: what an insert that raised midway left
        allocated and no one's. (The tree's units are read back: an exception path only.)"""
        for pool, value in units.items():
            p = self.tree.index[pool]
            nodes = self.tree.holding(pool, tier)
            held = b"".join(n.device_raw[p] if tier is Tier.DEVICE else n.host_raw[p] for n in nodes)
            self.free(tier, {pool: value[~torch.isin(value, unit_tensor(held))] if held else value})

    def freer(self, tier: Tier) -> Callable[[str, torch.Tensor], None]:
        """A callback the tree calls with the units it dropped from ``tier``."""

        def free(pool: str, value: torch.Tensor) -> None:
            self.allocator(pool, tier).free(value)  # type: ignore[union-attr]

        return free

    def try_alloc(self, tier: Tier, needs: Mapping[str, int], *, arrays: bool = False) -> Allocated | None:
        """Every unit of ``needs`` from free units, or none (never evicts: worker threads call it).
        ``arrays``: numpy int64 arrays instead of tensors (the lease keeps units as bytes)."""
        got: dict = {}
        known = self._allocators[tier]
        for pool, count in needs.items():
            if count == 0:
                got[pool] = NO_ARRAY if arrays else NO_UNITS
                continue
            allocator = known[pool] if pool in known else self.allocator(pool, tier)
            if allocator is None:
                self.free(tier, got)
                return None
            units = allocator.take(count) if arrays else allocator.alloc(count)
            if units is None:
                self.free(tier, got)
                return None
            got[pool] = units
        return got

    def alloc(self, tier: Tier, needs: Mapping[str, int], *, arrays: bool = False) -> Allocated | None:
        """All-or-nothing allocation over pools; evicts the shortfall (LRU) once if needed
        (``arrays``: as in :meth:`try_alloc`)."""
        got = self.try_alloc(tier, needs, arrays=arrays)
        if got is not None:
            return got
        shortfall = self._shortfall(tier, needs)
        if self.tree.evictor.retention is not None:
            self.tree.evictor.retention.expire()  # a lapsed pin's lock holds nothing
        if not room_by_evicting(self.tree.evictor, tier, shortfall):
            return None  # locked units fill the tier: evicting the rest would lose it for nothing
        if tier is Tier.DEVICE:
            if self.before_device_eviction is not None:
                self.before_device_eviction(shortfall)
            result = self.tree.evict_device(
                shortfall, self.freer(Tier.DEVICE), delete_unbacked=self.delete_unbacked
            )
        else:
            result = self._evict_host(shortfall)
        self._observe(tier, result)
        got = self.try_alloc(tier, needs, arrays=arrays)
        if got is None and tier is Tier.DEVICE and not self.delete_unbacked:
            # write-back could not back up enough: a host tier smaller than a node, disabled, or
            # full of what it cannot drop. Dropping unbacked cache data beats refusing every
            # request from now on (the device tier filled with pages that could never leave)
            result = self.tree.evict_device(
                self._shortfall(tier, needs), self.freer(Tier.DEVICE), delete_unbacked=True
            )
            self._observe(tier, result)
            got = self.try_alloc(tier, needs, arrays=arrays)
        return got

    def _evict_host(self, shortfall: Mapping[str, int]) -> EvictionResult:
        """Evict ``shortfall`` from the host tier, the :attr:`host_last` nodes only where the
        others do not free enough and it may take them (a second pass). A write-back node waiting
        there for its prefix's L3 write is in no other tier: taken like any other, its pages were
        lost to every fresh cache though the prefix reached L3 soon after. Where only an L3 write
        in flight holds the room, the caller waits for it (``Writer``) or goes without."""
        last, may_take = self.host_last() if self.host_last is not None else ([], True)
        if not last:
            return self.tree.evict_host(shortfall, self.freer(Tier.HOST))
        guards = []
        try:  # (locked for the first pass: an eviction passes over locked nodes)
            guards.extend(self.tree.lock(node, Tier.HOST) for node in last)
            result = self.tree.evict_host(shortfall, self.freer(Tier.HOST))
        finally:
            for guard in guards:
                self.tree.unlock(guard)
        rest = {pool: want - result.units.get(pool, 0) for pool, want in shortfall.items()}
        if may_take and any(want > 0 for want in rest.values()):  # (their pages are lost)
            self._observe(Tier.HOST, result)
            result = self.tree.evict_host({p: w for p, w in rest.items() if w > 0}, self.freer(Tier.HOST))
        return result

    def _shortfall(self, tier: Tier, needs: Mapping[str, int]) -> dict[str, int]:
        """What ``needs`` wants beyond the free units of each pool of ``tier``."""
        shortfall = {}
        for pool, count in needs.items():
            allocator = self.allocator(pool, tier)
            available = allocator.available if allocator is not None else 0
            if count > available:
                shortfall[pool] = count - available
        return shortfall

    @contextlib.contextmanager
    def keeping_copies(self) -> Iterator[None]:
        """While write-back backs up device nodes so a device eviction can drop them: host room
        made by dropping another device node's host copy un-backs that node up, so the eviction
        frees no more than before (``allocate`` refused a request that fit; the backup waits for
        in-flight L3 writes to release host units instead)."""
        evictor = self.tree.evictor
        before, evictor.keep_copies = evictor.keep_copies, True
        try:
            yield
        finally:
            evictor.keep_copies = before

    def _observe(self, tier: Tier, result: EvictionResult) -> None:
        for pool, units in result.units.items():
            self.on_eviction(tier.value, pool, units)
        if self.metrics is not None:
            if result.units:
                self.metrics.evicted(tier.value, result.units)
            if result.out_of_window:
                self.metrics.count(Operation.out_of_window(tier.value), sum(result.out_of_window.values()))

    def alloc_spare(self, tier: Tier, wants: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Up to ``wants[pool]`` units per window pool, from free units and, where those fall
        short, from out-of-window data the tree tombstones (never from what a cached prefix
        needs). Best effort: a pool may get fewer units, or none."""
        short = {}
        for pool, count in wants.items():
            allocator = self.allocator(pool, tier)
            if allocator is not None and count > allocator.available:
                short[pool] = count - allocator.available
        if short:
            if tier is Tier.DEVICE:
                result = self.tree.evict_device(
                    short, self.freer(tier), delete_unbacked=self.delete_unbacked, out_of_window_only=True
                )
            else:
                result = self.tree.evict_host(short, self.freer(tier), out_of_window_only=True)
            self._observe(tier, result)
        got: dict[str, torch.Tensor] = {}
        for pool, count in wants.items():
            allocator = self.allocator(pool, tier)
            take = min(count, allocator.available) if allocator is not None else 0
            units = allocator.alloc(take) if take > 0 else None  # type: ignore[union-attr]
            if units is not None:
                got[pool] = units
        return got

    def alloc_protecting(
        self, node: TreeNode | None, tier: Tier, needs: Mapping[str, int]
    ) -> dict[str, torch.Tensor] | None:
        """Allocate in ``tier`` while ``node``'s path is locked there, so the eviction that
        makes room cannot take the nodes the units are for."""
        if node is None:
            return self.alloc(tier, needs)
        got = self.try_alloc(tier, needs)  # free units suffice: no eviction, no lock to take
        if got is not None:
            return got
        guard = self.tree.lock(node, tier)  # a lock walks the whole path: only when evicting
        try:
            return self.alloc(tier, needs)
        finally:
            self.tree.unlock(guard)

    def drop_everything(self) -> None:
        """Evict every unlocked node from both tiers (a late pool has no data for them). In
        rounds until one frees nothing: a device node with host-only children (write-back keeps
        a node's only copy) can leave only after the host pass took them."""
        everything = {name: 1 << 62 for name in (spec.name for spec in self.tree.pools)}
        while True:
            device = self.tree.evict_device(everything, self.freer(Tier.DEVICE))
            host = self.tree.evict_host(everything, self.freer(Tier.HOST))
            self._observe(Tier.DEVICE, device)  # evictions like any other (metrics, hooks)
            self._observe(Tier.HOST, host)
            if not any(device.units.values()) and not any(host.units.values()):
                return


def room_by_evicting(evictor: TreeEvictor, tier: Tier, shortfall: Mapping[str, int]) -> bool:
    """Whether evicting every unit of ``tier`` that no lock holds could cover ``shortfall``
    (units per pool beyond the free ones; a device window lock holds its last window only). An
    upper bound: every eviction rule (``core/tree_eviction.py``) spares a unit a lock of its pool
    holds (a request's prefix, a pin, an L3 write's source), so an allocation it rules out is
    refused before anything is evicted for it -- such an eviction only loses cached pages
    (without a host tier, for good). Stops at the first units that suffice: the oldest members,
    mostly unlocked, when the tier is simply full."""
    dev = tier is Tier.DEVICE
    for name, want in shortfall.items():
        if want <= 0:
            continue
        p, found = evictor._pool(name), 0
        for node in evictor._members[tier][p]:
            units = len((node.device_raw if dev else node.host_raw)[p]) // UNIT  # type: ignore[arg-type]
            if (node.device_lock if dev else node.host_lock)[p]:  # locked: on the device, a window
                if not (dev and evictor._window[p]):  # pool's head no lock reaches may still go
                    continue
                units -= node.depth_end - min(node.device_windows[p])
            found += max(0, units)
            if found >= want:
                break
        else:
            return False
    return True
