"""Keeping a prefix the cache serves from its own tiers alive in a bounded L3.

A prefix hit on the device or the host is neither read from L3 nor written to it again. A store
that makes room by itself (``self_evicting``: the file backend's ``capacity_bytes`` evicts in LRU
order) would then drop the hottest prefix first -- the one every request reuses -- while the
colder pages keyed under it stay; keys are chained (a page's key stands for its whole prefix, an
L3 lookup starts at the first page L1/L2 lack), so those pages become unreachable to every other
process sharing the L3, and to this one once its own tiers let the prefix go.

A lookup that hits therefore asks L3 for the hit pages' objects, as an existence query on the
writer thread (queued ahead of the writes that follow it, off the caller's path): asking is a use
to such a store (the file backend moves them to the recent end of its LRU). A prefix that L3 lost
meanwhile is not written again here (its host copy may be gone); it is the first request that
misses it and computes it again that stores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kvstrata.core.l3_values import PageHashes
from kvstrata.core.stack import PoolKind, StackLayout
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.tree import MatchResult

log = logging.getLogger(__name__)


class HitTouch:
    """Asks L3 for a lookup's hit pages, per pool that stores an object for every page."""

    def __init__(self, engine: StorageEngine, pools: Sequence[str], submit: Callable[..., object]) -> None:
        self.engine = engine
        self.pools = tuple(pools)
        self._submit = submit

    @classmethod
    def of(cls, engine: StorageEngine | None, layout: StackLayout, executor: Executor) -> HitTouch | None:
        """For a store that evicts by itself; None where there is nothing to keep alive."""
        if engine is None or not engine.backend.instance_capabilities().self_evicting:
            return None
        pools = [
            name
            for tp in layout.tree_pools.values()
            if tp.kind is PoolKind.PAGES
            for name in tp.followers
            if name in engine.plans and engine.plans[name].writes
        ]
        return cls(engine, pools, executor.submit) if pools else None

    def after_lookup(self, match: MatchResult, hashes: PageHashes, record: bool) -> None:
        """A request's lookup (``record``: not a later chunk's, whose hits are its own pages)."""
        if record and match.host_pages:
            self._submit(self._touch, list(hashes()[: match.host_pages]))

    def _touch(self, page_hashes: list[str]) -> None:
        try:
            for pool in self.pools:  # (the leading run: a missing page ends what is reachable)
                found = self.engine.exists(pool, page_hashes, leading=True).prefix
                page_hashes = page_hashes[:found]
        except Exception:  # a bug guard: nobody waits for this answer
            log.debug("asking L3 for a hit prefix failed", exc_info=True)
