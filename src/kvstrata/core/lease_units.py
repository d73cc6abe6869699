"""The units a lease holds between ``allocate`` and ``insert``: what an allocation needs per
tree pool, taking it (evicting to fit), the error when the device tier cannot hold it, and
which pending units an insert hands the tree. Arithmetic over a :class:`~kvstrata.core.lease.Lease`'s
pending units, apart from the lease so that class stays its state and its transitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstrata.core.lease import CacheFullError, Lease, unit_arrays
from kvstrata.core.stack import NO_UNITS, PoolKind, StackLayout
from kvstrata.core.tokens import integer
from kvstrata.core.tree import Tier
from kvstrata.core.tree_bytes import UNIT

if TYPE_CHECKING:
    from kvstrata.core.tier_units import TierUnits
    from kvstrata.core.tree import PrefixTree
    from kvstrata.core.tree_node import InsertResult

#: enum members without the descriptor lookup (~0.1 us each): every chunk reads a few
_PAGES, _WINDOW, _STATE = PoolKind.PAGES, PoolKind.WINDOW, PoolKind.STATE
_DEVICE = Tier.DEVICE


def page_number(value: object, name: str) -> int:
    """A page count or position an engine passed (an int, or a NumPy / 0-d tensor integer, as a
    length read from a tensor is): as a Python int, or a clear error. Kept as given, a tensor
    would become the lease's ``allocated_pages`` and the allocator's counts (a bool: refused)."""
    number = integer(value)
    if number is None:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return number


def allocation_needs(layout: StackLayout, lease: Lease, end: int) -> dict[str, int]:
    """Units per tree pool that pages ``[lease.allocated_pages, end)`` must have: every page for
    all-pages pools, the pages of the trailing window for window pools (the rest of their pages
    are :func:`window_extras`, taken only where room is spare), one slot per insert for state
    pools."""
    new = end - lease.allocated_pages
    pending = lease._allocated or {}
    needs = {}
    for tp in layout.tree_pools.values():
        if tp.kind is _PAGES:
            needs[tp.name] = new
        elif tp.kind is _WINDOW:
            needs[tp.name] = min(tp.window, new)
        else:
            needs[tp.name] = 1 if new > 0 and not pending.get(tp.name) else 0
    return needs


def device_full(
    layout: StackLayout, lease: Lease, end: int, units: TierUnits, pinned: int = 0, too_long: bool = False
) -> CacheFullError:
    """The error of an ``allocate`` the device tier cannot hold even after evicting: what was
    asked per pool, what each pool has, what pins hold, and what to change."""
    needs = allocation_needs(layout, lease, end)
    allocators = {pool: units.pools.pools[pool].device_allocator for pool in needs}
    sizes = {pool: allocator.units for pool, allocator in allocators.items()}
    short = {p: n - allocators[p].available for p, n in needs.items() if n > allocators[p].available}
    pins = (
        f"; {pinned} device pages are pinned (RetentionHint(pin=True): cache.unpin(lease) releases "
        "them, policy.retention.max_pinned_fraction caps them)"
        if pinned
        else ""
    )
    kept: dict[str, int] = {}
    for units in lease._duplicates or ():  # (read only: see free_duplicates)
        for pool, value in units.items():
            kept[pool] = kept.get(pool, 0) + len(value)
    copies = (
        f"; the request holds {kept} units its engine still reads outside the tree, freed at its "
        "close: its own copies of pages another request inserted first (look up the whole prompt, "
        "not its first chunk, to skip computing pages the tree holds) or the window an earlier "
        "allocate handed out (insert between allocates)"
        if kept
        else ""
    )
    return CacheFullError(
        f"device tier cannot hold {end - lease.allocated_pages} new pages ({needs}) even after "
        f"evicting every unlocked page (device units per pool: {sizes}; the request's own "
        f"prefix stays locked{pins}{copies}): raise tiers.device.capacity_tokens (or the pool's "
        "device_units) or admit fewer requests at once",
        short,
        too_long,
    )


def window_extras(layout: StackLayout, lease: Lease, end: int) -> dict[str, int]:
    """Per window pool, the new pages of ``[lease.allocated_pages, end)`` before its trailing
    window: a prefill computes their window data, and keeping it lets a later request reuse any
    prefix of this one (not only one ending where this allocation ends). Best effort: these units
    come from free units and out-of-window data only, never from what a cached prefix needs."""
    new = end - lease.allocated_pages
    return {tp.name: new - tp.window for tp in layout.windowed if new > tp.window}


def allocate_units(
    units: TierUnits, layout: StackLayout, lease: Lease, end: int, window_only: bool = False
) -> dict[str, torch.Tensor] | None:
    """Device units for pages ``[lease.allocated_pages, end)`` per tree pool (evicting what it
    must for :func:`allocation_needs`, then, unless ``window_only``, :func:`window_extras` where
    room is spare), recorded in the lease (window units it no longer needs freed), or None: the
    engine's tensors (one call per chunk: the lease's record is here, not a helper's)."""
    needs = allocation_needs(layout, lease, end)
    got = units.try_alloc(_DEVICE, needs, arrays=True)  # free units suffice (every chunk): no eviction
    if got is None:
        got = units.alloc(_DEVICE, needs, arrays=True)
    if got is None:
        return None
    extras = window_extras(layout, lease, end) if layout.windowed and not window_only else None
    if extras:
        try:  # the spare units evict out-of-window data: anything raising there frees ``got``
            spares = units.alloc_spare(_DEVICE, extras)
        except BaseException:
            units.free(_DEVICE, got)  # type: ignore[arg-type]
            raise
        for name, spare in spares.items():
            got[name] = np.concatenate([spare.numpy(), got[name]])
    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, bytes] = {}
    for name, array in got.items():
        tensors[name] = torch.from_numpy(array) if array.shape[0] else NO_UNITS
        raw[name] = array.tobytes()
    try:  # handed to the lease: interrupted before it recorded them (a Ctrl-C), they are freed
        dropped = lease.add_allocation(layout, (tensors, raw), end)
    except BaseException:  # (units no one holds were never freed again)
        units.free(_DEVICE, unit_arrays(raw))
        raise
    if dropped:  # a window pool's stale units
        units.free(_DEVICE, dropped)
    return tensors


def take_for_insert(layout: StackLayout, lease: Lease, end: int) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Split the pending units into the values of pages ``[committed_pages, end)`` (what the tree
    gets) and the rest (units of pages at or after ``end``, kept for the next insert).

    A state pool's working slot becomes the checkpoint at ``end`` only where the allocation ends
    there too: once a partial page is allocated beyond ``end`` the engine runs its state on into
    that page (in place: it has no other slot), so the slot no longer holds the state after
    ``end`` -- committed there, it would serve a later request the state of tokens it never
    had. It stays pending instead (freed at close): the node at ``end`` has no checkpoint, and a
    match never ends there (insert before allocating a partial page to keep one)."""
    new = end - lease.committed_pages
    after = lease.allocated_pages - end  # pages allocated beyond ``end`` (a partial page)
    pending_all = lease._allocated or {}
    if not after and not layout.windowed:  # every pending unit is of pages up to ``end`` (a chunk)
        # (every pool's units, as a chunk's are: the dict itself, the lease drops it for ``rest``)
        taken = pending_all if all(pending_all.values()) else {n: v for n, v in pending_all.items() if v}
        return taken, dict.fromkeys(pending_all, b"")
    values: dict[str, bytes] = {}
    rest: dict[str, bytes] = {}
    for tp in layout.tree_pools.values():
        pending = pending_all.get(tp.name, b"")
        if tp.kind is _PAGES:
            cut = new * UNIT
            values[tp.name], rest[tp.name] = pending[:cut], pending[cut:]
        elif tp.kind is _WINDOW:
            keep = max(len(pending) - after * UNIT, 0)
            values[tp.name], rest[tp.name] = pending[:keep], pending[keep:]
        elif after:  # the working slot runs past ``end`` (see above): not a checkpoint of it
            values[tp.name], rest[tp.name] = b"", pending
        else:
            values[tp.name], rest[tp.name] = pending, b""
    return {name: v for name, v in values.items() if v}, rest


def free_duplicates(
    units: TierUnits, layout: StackLayout, result: InsertResult, close: bool
) -> dict[str, torch.Tensor]:
    """Free the units of inserted pages the tree already held (another request computed and
    inserted them first), except, when the lease stays open (``close=False``), the page units
    (all-pages and window pools) its engine still attends over: the engine reads the units
    ``allocate`` gave it, not the tree's, so freed now they went to the next request and its
    writes became this one's KV. Returned: the lease frees them at close. A state pool's slot is
    freed at once: the next chunk forks the tree's checkpoint into a new one."""
    duplicates = result.duplicates
    if close:
        units.free(_DEVICE, duplicates)
        return {}
    kept = {name: value for name, value in duplicates.items() if layout.tree_pools[name].kind is not _STATE}
    if len(kept) < len(duplicates):
        units.free(_DEVICE, {name: value for name, value in duplicates.items() if name not in kept})
    return kept


def hand_to_tree(
    units: TierUnits,
    layout: StackLayout,
    tree: PrefixTree,
    lease: Lease,
    result: InsertResult,
    end: int,
    rest: dict[str, bytes],
    close: bool,
) -> None:
    """``insert``, once the tree holds the lease's values: free the duplicates and mark the lease
    inserted, that also when something raises between (a Ctrl-C; the duplicates not freed then
    are the lease's, freed at its close): left pending, the values were freed by the lease's
    release while the tree served them, and the next request's writes became their bytes. Then
    tell the device eviction order (``tree.insert(..., tell=False)``): a hook of it interrupted
    before the lease was marked left the tree's units the lease's too."""
    kept = result.duplicates if result.has_duplicates else None  # the lease's to free, unless freed now
    try:
        kept = free_duplicates(units, layout, result, close) if kept else None
    finally:
        lease.mark_inserted(tree, result.node, end, rest, kept or None)
    if tree.evictor.hears:
        tree.evictor.inserted(_DEVICE, result)
