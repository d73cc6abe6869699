"""The prefetcher: storage (L3) -> host (L2) for the pages after a request's host-usable prefix.

How a prefetch decides, in order:

1. **Gates** (:meth:`Prefetcher.start`, owner thread): at least ``threshold_tokens`` to fetch, and
   the pages in flight stay under ``host_fraction_limit`` of the host tier (the rate limit). A
   caller may skip the gates and wait for the whole read (:attr:`PrefetchMode.WAIT`).
2. **Length** (worker thread): the existence query runs first, so a miss never takes or evicts host
   units. The anchor's present prefix, clamped or dropped by each all-pages pool as it declares;
   a state pool ends it at the last page that has a state, a window pool at the last page whose
   whole window L3 holds (scanning down; none: the prefetch is dropped).
3. **Read** (worker thread): into free host units; when the host tier has too few free units the
   worker leaves the read to the owner, which makes room at its next call (``drain``; the read
   ``admit`` ends at once: per policy, in ``finish``). An object that fails
   verification truncates the prefix at the last page where every pool verifies (for a state
   pool: the last earlier checkpoint; for a window pool: a window that is whole), re-reading only
   the state and window objects of the shorter prefix.
4. **End** (:meth:`Prefetcher.finish`, at ``admit``): ``best_effort`` takes what is done,
   ``wait_complete`` waits, ``timeout`` waits a base plus a per-Ki-token time, capped.
5. **Commit** (:meth:`Prefetcher.commit`, owner thread): the pages every rank read become host-only
   tree nodes; every other unit is freed. A revoked prefetch frees its units once its worker ends.

Every page L3 held that a request could not use is counted by reason (:class:`SkipReason`) on the
lease and in the metrics: no miss is silent.

Worker threads never touch the tree: they fill the :class:`PrefetchOp` and set ``done``. Steps 2
and 3, and a read the ranks settle shorter (:meth:`Prefetcher.shorten`), decide in
:mod:`~kvstrata.core.prefetch_read`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import torch

from kvstrata.core.backend_calls import Notify
from kvstrata.core.metrics import Operation, SkipReason, count_failure
from kvstrata.core.part_context import PartContext
from kvstrata.core.prefetch_end import PrefetchEnd, prefetch_end
from kvstrata.core.prefetch_op import PrefetchOp, read_failed
from kvstrata.core.prefetch_read import lose, read_prefix, read_settled, read_verified, usable_length
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.tree import InsertResult, PageKey, Tier, TreeNode
from kvstrata.core.unit_digests import UnitDigests, check_span
from kvstrata.core.write_back import StoredWindowEnds

log = logging.getLogger(__name__)


class PrefetchMode(StrEnum):
    """How a lookup prefetches from L3."""

    POLICY = "policy"  # the configured gates and end policy
    WAIT = "wait"  # no gates; admit waits for the whole read (an engine that must not recompute)
    OFF = "off"  # no L3 read for this request


def _insert_host(context: PartContext, keys: list[PageKey], values: dict[str, torch.Tensor]) -> InsertResult:
    """``tree.insert_host``; where it raises (an eviction order's ``split`` / ``inserted`` hook
    interrupted, before or after the tree took them), the units no node holds are no one's."""
    try:
        return context.tree.insert_host(keys, values)
    except BaseException:
        context.units.free_unowned(Tier.HOST, values)
        raise


class Prefetcher:
    """L3 -> L2 reads for leases (see the module docstring for the decision steps)."""

    def __init__(
        self, context: PartContext, engine: StorageEngine, notify: Notify, window_ends: StoredWindowEnds
    ) -> None:
        self.context, self.window_ends = context, window_ends  # (the writer's: what L3 holds)
        self.pools, self.tree, self.layout = context.pools, context.tree, context.layout
        self.units, self.metrics = context.units, context.metrics
        self.engine = engine
        self.policy = context.policy.prefetch
        self.notify = notify  # an event hook's call that never raises (PluginHost.notify)
        self.page_size = context.page_size
        self.orphans: list[PrefetchOp] = []  # revoked prefetches whose worker has not finished
        self.reserved_pages = 0  # pages in flight (the rate limit counts them)
        #: reads a lease holds, with the node making room for them must keep (``_make_room``)
        self._held: dict[PrefetchOp, TreeNode | None] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-l3-prefetch")
        self.digests: UnitDigests | None = None  # debug.unit_digests

    # --- gates (owner thread) -------------------------------------------------------------------

    def _budget(self) -> int:
        anchor_host = self.pools.pools[self.layout.anchor].host_allocator
        return int(anchor_host.units * self.policy.host_fraction_limit) if anchor_host else 0

    def start(
        self,
        start: int,
        hashes: Sequence[str],
        skipped: dict[str, int],
        mode: PrefetchMode = PrefetchMode.POLICY,
        protect: TreeNode | None = None,
    ) -> PrefetchOp | None:
        """Start reading pages ``[start, start + len(hashes))`` if the gates allow; a gate that
        refuses counts the pages in ``skipped`` (the lease's) and in the metrics. ``protect``:
        the lease's locked node, kept when room is made for the read."""
        count = len(hashes)
        if count <= 0:
            return None
        reason = None
        if mode is PrefetchMode.OFF:
            reason = SkipReason.DISABLED
        elif self.engine.read_breaker.refusing():  # no worker hop for a read that would be refused
            reason = SkipReason.STORAGE_DOWN
        elif mode is PrefetchMode.POLICY:
            budget = self._budget()
            if count * self.page_size < max(self.policy.threshold_tokens, self.page_size):
                reason = SkipReason.BELOW_THRESHOLD
            elif count > budget:
                reason = SkipReason.HOST_FRACTION
            elif self.reserved_pages + count > budget:
                reason = SkipReason.RATE_LIMIT
        if reason is not None:
            self.metrics.skip(reason, count, skipped)
            if reason is not SkipReason.BELOW_THRESHOLD and reason is not SkipReason.DISABLED:
                self.metrics.count(Operation.PREFETCHES_SKIPPED)
            return None
        op = PrefetchOp(start, list(hashes), time.perf_counter(), blocking=mode is PrefetchMode.WAIT)
        self.reserved_pages += count
        self.metrics.count(Operation.PREFETCHES_STARTED)
        self._held[op] = protect
        self._thread.submit(self._run, op)
        return op

    # --- length and read (worker thread) --------------------------------------------------------

    def _run(self, op: PrefetchOp, late: bool = False, settle: int = 0) -> None:
        """Existence per pool, the usable length by each pool's rule, then the read (``late``:
        only the read, into the units ``finish`` made room for; ``settle``: a shorter end's
        window and state objects, for ``shorten``). Never touches the tree; ``done`` is always set."""
        late = late or settle > 0
        asked = late  # L3 said what it holds: a failure from here on fails the read
        try:
            if settle:
                op.settled = read_settled(functools.partial(self._read, op), op, settle)
                return
            if late:
                op.pages = self._read_verified(op, op.read_end)
                return
            end = usable_length(op, self.pools, self.layout, functools.partial(self._exists, op))
            op.read_end, asked = end, True
            if end > 0 and not op.cancelled:
                needs = self.layout.slot_counts(end)
                got = self.units.try_alloc(Tier.HOST, needs)  # allocators are thread-safe
                if got is None:
                    op.short = needs
                else:
                    op.reserved = got
                    op.pages = self._read_verified(op, end)
        except BaseException:  # an engine bug, or a plugin's BaseException (asyncio.CancelledError,
            log.exception("prefetch failed")  # an interrupt): the read fails, counted; not re-raised,
            read_failed(op, self.metrics, asked)  # a worker's future is no one's to read
        finally:
            if not late:  # (one sample per prefetch)
                self.metrics.latency("prefetch", time.perf_counter() - op.started_s)
            op.done.set()

    def _exists(self, op: PrefetchOp, pool: str, hashes: Sequence[str]) -> list[bool]:
        result = self.engine.exists(pool, hashes)
        count_failure(self.metrics, result)
        if result.error is not None and not result.skipped:
            op.exists_failed = True  # what it answered False for is unknown, not absent
        return result.ok

    def _read(self, op: PrefetchOp, end: int, *, pages_read: bool = False) -> tuple[int, int]:
        return read_prefix(self.engine, self.pools, self.layout, self.metrics, op, end, pages_read=pages_read)

    def _read_verified(self, op: PrefetchOp, end: int) -> int:
        return read_verified(functools.partial(self._read, op), self.pools, self.layout, op, end)

    # --- end and commit (owner thread) ----------------------------------------------------------

    @functools.cached_property
    def end(self) -> PrefetchEnd:
        """The end policy (``policy.prefetch.policy``), chosen once."""
        return prefetch_end(self.policy)

    def finish(self, op: PrefetchOp, protect: TreeNode | None) -> int:
        """End ``op`` per policy; returns the pages this rank can commit. ``protect`` is the
        lease's locked node, kept while the owner makes room for a read the worker left to it.
        Every wait is bounded (``wait_complete`` and ``prefetch="wait"`` by ``timeout_max_s``):
        a backend call that never returns costs the request its L3 pages, not the scheduler
        thread; the read goes on as an orphan whose units are freed when it ends."""
        self._held.pop(op, None)
        wait = self.policy.timeout_max_s if op.blocking else self.end.wait_s(len(op.hashes) * self.page_size)
        if not op.done.wait(wait):
            op.timed_out = True
            return 0
        if op.short is not None:
            # L3 has the pages but the host tier is full: make room (owner thread), read on the
            # worker (a read on this thread would have no deadline), wait as long again
            got = None
            if op.blocking or self.end.makes_room:
                got = self.units.alloc_protecting(protect, Tier.HOST, op.short)
            op.short = None
            if got is None:
                lose(op, SkipReason.HOST_FULL, op.read_end)
            else:
                op.reserved = got
                op.done.clear()
                self._thread.submit(self._run, op, late=True)
                if not op.done.wait(wait):
                    op.timed_out = True
                    return 0
        return op.pages

    def shorter(self, op: PrefetchOp) -> Callable[[int], int] | None:
        """How the rank agreement shortens ``op`` below what it read (``shorten``), or None where
        it clamps at any page (every pool but the anchor an all-pages one that clamps)."""
        return None if self.layout.clampable else functools.partial(self.shorten, op)

    def shorten(self, op: PrefetchOp, end: int) -> int:
        """Pages of ``op`` (as ``finish`` ended it) ending at most at ``end`` that every pool
        can serve: the longest checkpoint there, its window and state objects re-read on the
        worker (they sat at the end read); 0 if none, or the read did not end within
        ``timeout_max_s`` (the other ranks wait for this one: a bounded wait, not the policy's)."""
        held = op.settled or op.pages
        if end >= held or end <= 0:
            return min(held, max(0, end))
        op.settled = 0  # (until the read verifies)
        op.done.clear()
        self._thread.submit(self._run, op, settle=end)
        if not op.done.wait(self.policy.timeout_max_s):
            op.timed_out = True
            return 0
        return op.settled

    def commit(
        self,
        op: PrefetchOp,
        keys: Sequence[PageKey],
        pages: int,
        request_id: str,
        skipped: dict[str, int],
        unused: SkipReason | None = None,
    ) -> int:
        """Insert the first ``pages`` prefetched pages as host-only nodes under ``keys[:op.start]``;
        free every other unit. Returns the pages committed (0 when dropped or still reading).
        Pages found but not committed are counted in ``skipped`` by reason: ``unused`` (the
        request was released), else a timeout where ``finish`` gave up waiting, else another
        rank holding less (what a settle read lost to its objects is theirs: ``read_settled``)."""
        if not op.done.is_set():  # still reading into the slots: free them when it finishes
            self.release(op)
            self.metrics.count(Operation.PREFETCHES_REVOKED)
            why = unused or SkipReason.TIMEOUT
            if op.found_known:
                self.metrics.skip(*op.revoked_loss(why), skipped)
            else:  # still asking L3 what it holds: counted when the worker ends (``drain``)
                op.revoked = (why, skipped)
            return 0
        if op.short is not None:  # released before ``finish`` made room for the pages L3 holds
            op.short = None
            lose(op, unused or SkipReason.HOST_FULL, op.read_end)
        for reason, lost in op.lost.items():
            self.metrics.skip(reason, lost, skipped)
        partial = pages > 0 and (self.layout.clampable or pages == op.settled)
        if pages < op.pages:
            why = unused or (SkipReason.TIMEOUT if op.timed_out else SkipReason.RANK_DISAGREEMENT)
            self.metrics.skip(why, (op.pages - pages if partial else op.pages) - op.settle_lost, skipped)
        if not (pages > 0 and (pages == op.pages or partial)):
            if op.found:
                self.metrics.count(Operation.PREFETCHES_DROPPED)
            self.release(op)
            return 0
        values: dict[str, torch.Tensor] = {}
        spare: dict[str, torch.Tensor] = {}
        for tp in self.layout.tree_pools.values():
            lo, hi = tp.slots(0, pages)
            have = op.reserved[tp.name]
            values[tp.name] = have[: hi - lo]
            spare[tp.name] = have[hi - lo :]
        if self.digests and not check_span(self.digests, "l3_restore", values, op.hashes[:pages], Tier.HOST):
            self.release(op)  # not the bytes committed for them: a miss
            return 0
        op.reserved = spare  # the tree's from here
        result = _insert_host(self.context, list(keys[: op.start + pages]), values)
        try:
            if self.layout.windowed:  # its last window was just read from L3: no write puts it back
                self.window_ends.add(result.node)
            self.release(op)
        finally:
            self.units.free(Tier.HOST, result.duplicates)
        self.metrics.count(Operation.PREFETCHES_COMMITTED)
        self.notify(
            "kvstrata_prefetch_committed",
            request_id=request_id,
            tokens=pages * self.page_size,
            pools=list(self.pools.pools),
        )
        return pages

    def drop(self, op: PrefetchOp, reason: SkipReason, skipped: dict[str, int]) -> None:
        """Give up a finished (or still running) prefetch whose pages cannot be placed."""
        if op.done.is_set():
            self.metrics.skip(reason, op.pages, skipped)
            op.pages = 0
        self.commit(op, [], 0, request_id="", skipped=skipped)

    def release(self, op: PrefetchOp) -> None:
        """Give back, once, what a detached ``op`` holds: its pages in flight and its host units
        (not those ``commit`` gave the tree); a read still running is revoked, freed by ``drain``."""
        self._held.pop(op, None)
        if not op.done.is_set():
            if op not in self.orphans:  # (its units are the worker's until it ends)
                op.cancelled = True
                self.orphans.append(op)
            return
        if op.counted:
            op.counted = False
            self.reserved_pages -= len(op.hashes)
        units, op.reserved = op.reserved, {}
        self.units.free(Tier.HOST, units)

    def _make_room(self, ending: PrefetchOp | None) -> None:
        """Make room now for the reads whose worker found the host tier full, and read on the
        worker while their requests wait for ``admit``. A full host tier is every host tier once
        warm: made room for only at ``admit``, no such read overlapped the request's wait, and
        ``best_effort`` (no wait there) never restored from L3 at all. Not for ``ending``: room
        for the read ``admit`` ends is ``finish``'s to make, per policy (``best_effort`` would
        evict for a read it does not wait for)."""
        for op, protect in list(self._held.items()):
            if op is ending or not op.done.is_set():
                continue
            del self._held[op]  # (once: a read still short at ``admit`` is tried there again)
            if op.short is None or op.cancelled:
                continue
            got = self.units.alloc_protecting(protect, Tier.HOST, op.short)
            if got is not None:
                op.short, op.reserved = None, got
                op.done.clear()
                self._thread.submit(self._run, op, late=True)

    def drain(self, ending: PrefetchOp | None = None) -> bool:
        """Make room for reads that found the host tier full (``ending``'s aside); free the units
        of revoked prefetches whose worker has finished (returns whether any had)."""
        if self._held:
            self._make_room(ending)
        if not self.orphans:
            return False
        alive = []
        for op in self.orphans:
            if op.done.is_set():
                self.release(op)
                if op.revoked is not None:
                    self.metrics.skip(*op.revoked_loss(op.revoked[0]), op.revoked[1])
            else:
                alive.append(op)
        took, self.orphans = len(alive) < len(self.orphans), alive
        return took

    def wait(self, deadline: float | None) -> None:
        """Wait (up to ``deadline``, a ``time.monotonic`` value) for revoked prefetches to end."""
        for op in list(self.orphans):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            op.done.wait(remaining)

    def shutdown(self, wait: bool = True) -> None:
        self._thread.shutdown(wait=wait, cancel_futures=True)
