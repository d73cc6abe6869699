"""Keeping a prefix the cache serves from its own tiers alive in a bounded L3.

A prefix hit on the device or the host is neither read from L3 nor written to it again. A store
that makes room by itself (``self_evicting``: the file backend's ``capacity_bytes`` evicts in LRU
order) would then drop the hottest prefix first -- the one every request reuses -- while the
colder pages keyed under it stay; keys are chained (a page's key stands for its whole prefix, an
L3 lookup starts at the first page L1/L2 lack), so those pages become unreachable to every other
process sharing the L3, and to this one once its own tiers let the prefix go.

A lookup that hits therefore asks L3 for the hit pages it has host copies of, as an existence
query on the writer thread (queued at the writer's next drain, behind every write queued before
it, off the caller's path): asking is a use to such a store (the file backend moves the keys to
the recent end of its LRU). Where L3 lost some (another process evicted them: its LRU never saw
them used), the owner thread writes the hit nodes from the first lost page on again, from their
host copies, once the answer is in (:meth:`HitTouch.lost`, at a later drain).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future

from kvstrata.core.l3_values import PageHashes
from kvstrata.core.stack import PoolKind, StackLayout
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.tree import MatchResult, PrefixTree, TreeNode, tree_path

log = logging.getLogger(__name__)


class HitTouch:
    """Asks L3 for a lookup's hit pages, per pool that stores an object for every page."""

    def __init__(
        self,
        engine: StorageEngine | None,
        tree: PrefixTree,
        pools: Sequence[str],
        submit: Callable[..., Future],
    ) -> None:
        self.engine, self.tree = engine, tree
        self.pools = tuple(pools)
        self._submit = submit
        #: lookups' hits not asked for yet: (their page hashes, the hit's last node)
        self._due: list[tuple[list[str], TreeNode]] = []
        #: asks not yet drained, oldest first: (the answer, the hit's last node, the pages of
        #: its path on the host when asked: only those were written, or queued, before the ask)
        self._asked: deque[tuple[Future, TreeNode, int]] = deque()

    @classmethod
    def of(
        cls, engine: StorageEngine | None, tree: PrefixTree, layout: StackLayout, executor: Executor
    ) -> HitTouch:
        """For a store that evicts by itself; one that asks nothing where nothing may be lost."""
        if engine is None or not engine.backend.instance_capabilities().self_evicting:
            return cls(engine, tree, (), executor.submit)
        pools = [
            name
            for tp in layout.tree_pools.values()
            if tp.kind is PoolKind.PAGES
            for name in tp.followers
            if name in engine.plans and engine.plans[name].writes
        ]
        return cls(engine, tree, pools, executor.submit)

    def after_lookup(self, match: MatchResult, hashes: PageHashes, record: bool) -> None:
        """A request's lookup (``record``: not a later chunk's, whose hits are its own pages)."""
        if record and match.host_nodes and self.pools:
            self._due.append((list(hashes()[: match.host_pages]), match.host_path[-1]))

    def _ask(self) -> None:
        """Queue the due asks: at the writer's next drain, after whatever the lookup queued
        itself (a reuse's backup and L3 write), so a write still to come is not taken as lost."""
        for page_hashes, last in self._due:
            backed = _on_host(self.tree, last) if last.parent is not None else 0
            if backed:
                self._asked.append((self._submit(self._present, page_hashes[:backed]), last, backed))
        self._due.clear()

    def _present(self, page_hashes: list[str]) -> int | None:
        """Leading pages L3 holds in every pool, or None where it could not say."""
        assert self.engine is not None  # (no pools without one)
        try:
            for pool in self.pools:
                result = self.engine.exists(pool, page_hashes, leading=True)
                if result.error is not None:
                    return None
                page_hashes = page_hashes[: result.prefix]
            return len(page_hashes)
        except Exception:  # a bug guard: the answer is read by a drain that must not raise
            log.debug("asking L3 for a hit prefix failed", exc_info=True)
            return None

    def wait(self, deadline: float | None) -> bool:
        """Wait (up to ``deadline``, a ``time.monotonic`` value) for every ask's answer; whether
        there were any (``flush``: the hit pages L3 lost are written again before it returns)."""
        self._ask()
        if not self._asked:
            return False
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        futures.wait([answer for answer, _, _ in self._asked], timeout)
        return True

    def lost(self, refused: Container[TreeNode]) -> list[TreeNode]:
        """Of the answered asks, the hit nodes to write again: those on the host when asked
        with a page L3 lost, down the path while each is still on the host (its parent first:
        backups stay a contiguous prefix) and was not refused by the storage admission filter."""
        self._ask()
        nodes: dict[TreeNode, None] = {}
        while self._asked and self._asked[0][0].done():
            answer, last, backed = self._asked.popleft()
            present = None if answer.cancelled() else answer.result()
            if present is None or present == backed or last.parent is None:  # (gone: evicted)
                continue
            start = 0
            for node in tree_path(self.tree, last):  # (now: a split since moved boundaries)
                if start >= backed or node.host_raw[0] is None or node in refused:
                    break
                start += node.pages
                if start > present:
                    nodes[node] = None
        return list(nodes)


def _on_host(tree: PrefixTree, last: TreeNode) -> int:
    """Pages of the leading run of ``last``'s path with host copies."""
    pages = 0
    for node in tree_path(tree, last):
        if node.host_raw[0] is None:
            break
        pages += node.pages
    return pages
