"""The prefetch worker's decisions, apart from the thread and queue around them: how many pages
of a request every pool can serve from L3 (:func:`usable_length`, from existence answers), the
read into reserved host units (:func:`read_prefix`), and where a prefix ends once an object fails
verification or the ranks settle below what was read (:func:`checkpoint`: a state or window pool
ends it only where L3 holds its objects). Functions of explicit arguments: they never touch the
tree (the owner thread commits what they decided).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstrata.core.metrics import CacheMetrics, SkipReason, count_failure
from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.prefetch_op import PrefetchOp
from kvstrata.core.stack import PoolKind, StackLayout, pool_batch
from kvstrata.core.storage_engine import PoolBatch, StorageEngine, longest_present_prefix
from kvstrata.plugins.pool_type import PartialHit

#: an existence query of one pool's pages (the worker's, which notes a failed query on the op)
Exists = Callable[[str, Sequence[str]], list[bool]]


#: a read of one op's window and state objects for a prefix of ``end`` pages; returns the usable end
Reread = Callable[..., tuple[int, int]]


def lose(op: PrefetchOp, reason: SkipReason, pages: int) -> None:
    if pages > 0:
        op.lost[reason] = op.lost.get(reason, 0) + pages


def _whole_windows(present: Sequence[bool], window: int) -> list[bool]:
    """Per prefix end ``j + 1``: whether pages ``[j + 1 - window, j + 1)`` (from 0 at the start)
    are all present."""
    whole = []
    run = 0
    for j, flag in enumerate(present):
        run = run + 1 if flag else 0
        whole.append(run >= min(window, j + 1))
    return whole


def _all_of(per_pool: Sequence[Sequence[bool]]) -> list[bool]:
    return [all(column) for column in zip(*per_pool, strict=True)]


def can_truncate(pools: PoolGroup, layout: StackLayout) -> bool:
    """A verified shorter prefix is served unless an all-pages pool forbids partial hits."""
    return all(
        pools.pools[name].spec.partial_hit is PartialHit.CLAMP
        for tp in layout.tree_pools.values()
        if tp.kind is PoolKind.PAGES
        for name in tp.followers
        if name != layout.anchor
    )


def usable_length(op: PrefetchOp, pools: PoolGroup, layout: StackLayout, exists: Exists) -> int:
    """Pages after ``op.start`` that every pool can serve from L3 (0 = drop), by each pool's
    rule, from ``exists`` answers (the worker's existence queries, failures noted on ``op``)."""
    hashes = op.hashes
    anchor = layout.anchor
    end = op.found = longest_present_prefix(exists(anchor, hashes))
    op.found_known = True
    if op.exists_failed:  # L3 could not say what it holds: every page asked for is unserved
        lose(op, SkipReason.STORAGE_DOWN, len(hashes))
        return 0
    tree_pools = list(layout.tree_pools.values())
    for tp in tree_pools:  # all-pages pools (and the anchor's sidecars) clamp or drop
        if tp.kind is not PoolKind.PAGES:
            continue
        for name in tp.followers[1:] if tp.name == anchor else tp.followers:
            if end == 0:
                break
            have = longest_present_prefix(exists(name, hashes[:end]))
            if have < end:
                end = have if pools.pools[name].spec.partial_hit is PartialHit.CLAMP else 0
    # where may the prefix end? where every state pool has a state, and every window pool
    # has its whole window (the longest such prefix wins; shorter ones are fallbacks)
    can_end = [True] * end
    for tp in tree_pools:
        if tp.kind is PoolKind.PAGES or end == 0:
            continue
        flags = _all_of([exists(name, hashes[:end]) for name in tp.followers])
        if tp.kind is PoolKind.WINDOW:
            flags = _whole_windows(flags, tp.window)
        can_end = [a and b for a, b in zip(can_end, flags, strict=True)]
    op.checkpoints = [j + 1 for j, ok in enumerate(can_end) if ok]
    end = op.checkpoints[-1] if op.checkpoints else 0
    why = SkipReason.STORAGE_DOWN if op.exists_failed else SkipReason.INCOMPLETE_STACK
    lose(op, why, op.found - end)
    return end


def read_prefix(
    engine: StorageEngine,
    pools: PoolGroup,
    layout: StackLayout,
    metrics: CacheMetrics,
    op: PrefetchOp,
    end: int,
    *,
    pages_read: bool = False,
) -> tuple[int, int]:
    """Read the objects of a prefix of ``end`` pages (relative to op.start) into the reserved
    host units. Returns ``(pages, usable)``: the leading pages every all-pages pool verified,
    and the longest prefix end at or below it where the state and window pools verified too
    (``usable == end`` when everything verified). ``pages_read``: the all-pages pools verified
    ``[0, end)`` already; read only the window and state objects."""
    batches: dict[str, PoolBatch] = {}
    for tp in layout.tree_pools.values():
        if pages_read and tp.kind is PoolKind.PAGES:
            continue
        lo, hi = tp.slots(0, end)
        units = op.reserved[tp.name][: hi - lo]
        for name in tp.followers:
            if engine.plans[name].enabled:
                batches[name] = pool_batch(pools, name, units, op.hashes[lo:hi])
    results = engine.get_group(batches)
    nbytes = 0
    pages = end
    usable = end
    for name, result in results.items():
        count_failure(metrics, result)
        op.foreign += result.foreign
        op.damaged |= bool(result.rejected or result.failed or result.error is not None)
        nbytes += sum(result.ok) * pools.pools[name].spec.bytes_per_unit
        tp = layout.owner(name)
        have = longest_present_prefix(result.ok)
        if tp.kind is PoolKind.PAGES:
            pages = min(pages, have)
        elif tp.kind is PoolKind.STATE and not all(result.ok):
            usable = min(usable, end - 1)  # the state at ``end`` is bad: an earlier checkpoint
        elif tp.kind is PoolKind.WINDOW and have < len(result.ok):
            lo = end - len(result.ok)
            usable = min(usable, lo + have)  # the window may end just before the bad page
    metrics.add_bytes("storage_to_host", nbytes)
    return pages, min(usable, pages)


def checkpoint(read: Reread, op: PrefetchOp, usable: int, target: int, pages: int) -> int:
    """The longest prefix end at or below ``usable`` where the state and window objects verify
    (0: none), re-reading them there (``read(end, pages_read=True)``); ``target``: the end whose
    objects the units hold, ``pages``: the all-pages pools verified that many."""
    for _ in range(8):  # each round strictly shortens the prefix; bounded for safety
        if usable == target:
            break
        # state and window pools can only end the prefix where L3 has their objects
        target = max((c for c in op.checkpoints if c <= usable), default=0)
        if target == 0:
            break
        _, usable = read(target, pages_read=True)
        usable = min(usable, pages)
    else:
        target = 0
    return target if usable == target else 0


def read_verified(read: Reread, pools: PoolGroup, layout: StackLayout, op: PrefetchOp, end: int) -> int:
    """Read a prefix of ``end`` pages (``read(end)``); a damaged or missing object truncates it
    to the longest prefix where every pool verifies. Returns the pages usable (0 = drop)."""
    pages, usable = read(end)
    target = checkpoint(read, op, usable, end, pages)
    if target < end and not can_truncate(pools, layout):
        target = 0
    lose(op, _short_read(op), end - target)
    return target


def read_settled(read: Reread, op: PrefetchOp, end: int) -> int:
    """The ranks settled on ``end`` below what ``op`` read: the longest prefix end at most
    ``end`` whose window and state objects verify, re-read there (0: none). The pages between
    the checkpoint ``end`` reaches and that end are lost to the objects (:attr:`PrefetchOp.
    settle_lost`), not to the ranks: counted as a disagreement, a damaged state sent an
    operator looking for a rank bug."""
    settled = checkpoint(read, op, end, op.pages, op.pages)
    reached = max((c for c in op.checkpoints if c <= end), default=0)
    if reached > settled:
        lose(op, _short_read(op), reached - settled)
        op.settle_lost += reached - settled
    return settled


def _short_read(op: PrefetchOp) -> SkipReason:
    """Why a read verified less than L3 said it holds: objects of another layout under our keys
    are a layout change, not damage; objects simply gone at the read were evicted (or removed)
    after the existence answer."""
    if op.foreign:
        return SkipReason.LAYOUT_MISMATCH
    return SkipReason.DAMAGED_OBJECT if op.damaged else SkipReason.OBJECT_GONE
