"""Keeping a prefix the cache serves from its own tiers alive in a bounded L3.

A prefix hit on the device or the host is neither read from L3 nor written to it again. A store
that makes room by itself (``self_evicting``: the file backend's ``capacity_bytes`` evicts in LRU
order) would then drop the hottest prefix first -- the one every request reuses -- while the
colder pages keyed under it stay; keys are chained (a page's key stands for its whole prefix, an
L3 lookup starts at the first page L1/L2 lack), so those pages become unreachable to every other
process sharing the L3, and to this one once its own tiers let the prefix go. The same holds for
what a restore ending at a node end needs besides pages: a state pool's slot there, a window
pool's last window.

A lookup that hits therefore asks L3 for the objects of the hit it has host copies of -- every
page of the all-pages pools, the state and last window at every node end -- as existence
queries on the writer thread (queued at the writer's next drain, behind every write queued
before it, off the caller's path): asking is a use to such a store (the file backend moves the
keys to the recent end of its LRU). Where L3 lost some (another process evicted them: its LRU
never saw them used) after an earlier answer found them, the owner thread writes those nodes
again from their host copies once the answer is in (:meth:`HitTouch.lost`, at a later drain).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Container
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from kvstrata.core.l3_values import PageHashes
from kvstrata.core.metrics import CacheMetrics, count_failure
from kvstrata.core.node_set import NodeSet
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import PoolKind, TreePool
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.tree import MatchResult, TreeNode, tree_path
from kvstrata.core.write_back import StoredWindowEnds

log = logging.getLogger(__name__)

#: asks waiting for their answer at most: past it (the writer thread hangs in L3, or is far
#: behind) a hit is not asked about -- a later one is -- instead of one more ask per lookup
#: held without bound and run, stale, ahead of every write queued after it
_ASKS_MAX = 256


@dataclass
class _Ask:
    """One hit's question to L3, built on the owner thread, answered on the writer thread."""

    last: TreeNode  # the hit's last node
    backed: int  # pages of its path on the host when asked: only those were written before
    pages: list[str]  # their page hashes, asked of every all-pages pool
    ends: list[TreeNode] = field(default_factory=list)  # nodes whose end objects are asked
    end_keys: list[dict[str, list[str]]] = field(default_factory=list)  # per end: pool -> keys
    #: ends whose last window this cache's write had stored or queued (ahead of the ask) by then
    stored: set[TreeNode] = field(default_factory=set)
    answer: Future | None = None  # (leading pages present, indices of ends missing an object)


class HitTouch:
    """Asks L3 for a lookup's hit: the all-pages pools' pages, state and window objects at each
    node end."""

    def __init__(
        self,
        engine: StorageEngine | None,
        context: PartContext,
        executor: Executor | None,
        window_ends: StoredWindowEnds,
    ) -> None:
        self.engine, self.tree, self.window_ends = engine, context.tree, window_ends
        self.layout, self.metrics = context.layout, context.metrics
        self._submit = executor.submit if executor is not None else None
        self.paged: list[str] = []  # all-pages pools, by the names they are stored under
        #: state and window pools: (tree pool index, the pool's rule, the names it is stored under)
        self.at_ends: list[tuple[int, TreePool, list[str]]] = []
        self._read: object = None  # the layout's tree pools ``paged`` and ``at_ends`` were read from
        self._read_pools()
        #: lookups' hits not asked for yet, and asks not drained yet (oldest first): the writer
        #: reads both before calling :meth:`lost` (every drain, so every chunk; mostly both empty)
        self.due: list[tuple[list[str], TreeNode]] = []
        self.asked: deque[_Ask] = deque()
        #: nodes an answer found whole in L3: only what L3 is known to have held is written
        #: again when lost (a write that failed -- a full or read-only disk -- is not retried at
        #: every hit: the failures of a run would depend on when answers came)
        self._confirmed = NodeSet(tree=context.tree)
        #: confirmed upper halves of a split: their pages were found, their end objects never
        #: were (the end is new: a branch there writes its window after the ask answered)
        self._new_end = NodeSet(tree=context.tree)
        if self._submit is not None:
            context.tree.on_split(self._split)

    @classmethod
    def of(
        cls, engine: StorageEngine | None, context: PartContext, executor: Executor, ends: StoredWindowEnds
    ) -> HitTouch:
        """For a store that evicts by itself; one that asks nothing where nothing may be lost."""
        evicts = engine is not None and engine.backend.instance_capabilities().self_evicting
        return cls(engine, context, executor if evicts else None, ends)

    def _read_pools(self) -> None:
        """Which pools are asked, read again when the layout changed: a sidecar added at runtime
        (``add_pool``: a draft pool) was never asked, and its objects of a hot prefix were LRU-
        evicted first, so no fresh cache restored the prefix."""
        tree_pools = self.layout.tree_pools
        if tree_pools is self._read:
            return
        writes = self.engine.plans if self.engine is not None else {}
        stored = [
            (tp, [n for n in tp.followers if n in writes and writes[n].writes]) for tp in tree_pools.values()
        ]
        self.paged = [name for tp, names in stored if tp.kind is PoolKind.PAGES for name in names]
        self.at_ends = [
            (self.tree.index[tp.name], tp, names)
            for tp, names in stored
            if names and tp.kind is not PoolKind.PAGES
        ]
        self._read = tree_pools

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        """A confirmed node's new upper half holds pages that answer found (else its loss was
        never repaired: only the lower half, below it, was written again)."""
        if lower in self._confirmed:
            self._confirmed.add(upper)
            self._new_end.add(upper)

    def after_lookup(self, match: MatchResult, hashes: PageHashes, record: bool) -> None:
        """A request's lookup (``record``: not a later chunk's, whose hits are its own pages)."""
        if not (record and match.host_nodes and self._submit is not None):
            return
        self._read_pools()
        if self.paged:
            self.due.append((list(hashes()[: match.host_pages]), match.host_path[-1]))

    def _ask(self, refused: Container[TreeNode]) -> None:
        """Queue the due asks: at the writer's next drain, after whatever the lookup queued
        itself (a reuse's backup and L3 write), so a write still to come is not taken as lost;
        only of the path's leading run on the host that the storage admission filter has not
        refused (nothing below a refused node was written either)."""
        for page_hashes, last in self.due:
            if last.parent is None or len(self.asked) >= _ASKS_MAX:  # (evicted since; too many)
                continue
            ask = _Ask(last, 0, page_hashes)
            for node in tree_path(self.tree, last):
                if node.host_raw[0] is None or node in refused:
                    break
                ask.backed += node.pages
                self._ask_end(ask, node)
            if ask.backed:
                ask.pages = page_hashes[: ask.backed]
                ask.answer = self._submit(self._present, ask)  # type: ignore[misc]
                self.asked.append(ask)
        self.due.clear()

    def _ask_end(self, ask: _Ask, node: TreeNode) -> None:
        """The state and window objects a restore ending at ``node`` needs, where it has them."""
        keys: dict[str, list[str]] = {}
        for p, tp, names in self.at_ends:
            if node.host_raw[p] is not None:
                lo, hi = tp.slots(0, node.depth_end)
                keys.update((name, ask.pages[lo:hi]) for name in names)
        if keys:
            ask.ends.append(node)
            ask.end_keys.append(keys)
            if node in self.window_ends:
                ask.stored.add(node)

    def _present(self, ask: _Ask) -> tuple[int, set[int]] | None:
        """Leading pages L3 holds in every all-pages pool, and the ends missing an object; None
        where L3 could not say."""
        assert self.engine is not None  # (asks need one)
        try:
            pages = ask.pages
            for pool in self.paged:
                result = self.engine.exists(pool, pages, leading=True)
                count_failure(self.metrics, result)  # a failed ask is a failed storage call too
                if result.error is not None:
                    return None
                pages = pages[: result.prefix]
            missing: set[int] = set()
            for pool in {name for keys in ask.end_keys for name in keys}:  # one query per pool
                asked = [(i, keys[pool]) for i, keys in enumerate(ask.end_keys) if pool in keys]
                result = self.engine.exists(pool, [key for _, keys in asked for key in keys])
                count_failure(self.metrics, result)
                if result.error is not None:
                    return None
                found = iter(result.ok)
                missing.update(i for i, keys in asked if not all([next(found) for _ in keys]))
            return len(pages), missing
        except Exception:  # a bug guard: the answer is read by a drain that must not raise
            log.debug("asking L3 for a hit prefix failed", exc_info=True)
            return None

    def wait(self, deadline: float | None, refused: Container[TreeNode]) -> bool:
        """Wait (up to ``deadline``, a ``time.monotonic`` value) for every ask's answer; whether
        there were any (``flush``: what L3 lost of a hit is written again before it returns)."""
        self._ask(refused)
        if not self.asked:
            return False
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        futures.wait([ask.answer for ask in self.asked if ask.answer is not None], timeout)
        return True

    def lost(self, refused: Container[TreeNode]) -> list[TreeNode]:
        """Of the answered asks, the hit nodes to write again -- those with a page, state or
        window L3 lost, that an earlier answer found whole (a split's upper half: its pages; its
        end is new) or, for a prefix end's window, that this cache's own write queued before the
        ask stored (lost before any ask saw it) -- while each is still on
        the host with its parents (backups stay a contiguous prefix) and was not refused by the
        storage admission filter (never in L3). Their windows are forgotten as stored, so the
        writes carry them whole."""
        if not (self.due or self.asked):  # (every drain, so every chunk: nothing due or asked)
            return []
        self._ask(refused)
        nodes: dict[TreeNode, None] = {}
        ends = self.window_ends
        while self.asked and self.asked[0].answer is not None and self.asked[0].answer.done():
            ask = self.asked.popleft()
            answer = _answer(ask.answer, self.metrics)  # type: ignore[arg-type]
            if answer is None or ask.last.parent is None:
                continue
            present, missing = answer
            lost_ends = {ask.ends[i] for i in missing if ask.ends[i].parent is not None}
            start = 0
            for node in tree_path(self.tree, ask.last):  # (now: a split since moved boundaries)
                if start >= ask.backed or node.host_raw[0] is None or node in refused:
                    break
                start += node.pages
                held = start <= present
                if held and node not in lost_ends:
                    self._confirmed.add(node)
                    self._new_end.discard(node)
                elif (node in self._confirmed and not (held and node in self._new_end)) or (
                    node in lost_ends and node in ask.stored and node in ends
                ):
                    # held before: lost since (a stored window end's write, queued before the ask
                    # and not failed, held it too; one queued after it -- the insert that follows
                    # the lookup asking writes the window at its branch point -- had not run)
                    self._confirmed.discard(node)
                    nodes[node] = None
        if nodes:
            ends.difference_update(nodes)
        return list(nodes)


def _answer(answer: Future, metrics: CacheMetrics) -> tuple[int, set[int]] | None:
    """An ask's answer; None where it was cancelled (``close``) or raised past ``_present``'s
    guard (a plugin's ``asyncio.CancelledError`` / ``SystemExit`` on the writer thread: it fails
    that ask, counted, not the owner thread's next call, as a write's does in ``Writer._finish``)."""
    if answer.cancelled():
        return None
    error = answer.exception()
    if error is not None:
        log.warning("asking L3 for a hit prefix failed", exc_info=error)
        metrics.fail()
        return None
    return answer.result()
