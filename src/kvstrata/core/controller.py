"""The tier controller: one object a scheduler (or ``kvstrata replay``) drives per request.

    cache = CacheController(config, plugins)
    lease = cache.lookup(tokens)     # match L1/L2, lock the prefix, start an L3 prefetch of the rest
    cache.admit(lease)               # end the prefetch per policy, commit it, load L2 -> L1
    units = cache.allocate(lease)    # device units for the pages the engine computes now
    ...                              # the engine writes those units
    cache.insert(lease)              # index them, back up per write policy, queue the L3 write

Parts. The controller is the lease API and a coordinator; each concern lives in its own module
and talks in explicit objects: start-up wiring (:mod:`~kvstrata.core.builder`), unit allocation
and eviction (:mod:`~kvstrata.core.tier_units`), load-back L2 -> L1
(:mod:`~kvstrata.core.load_back`), the L3 prefetcher (:mod:`~kvstrata.core.prefetcher`), backups
and L3 writes (:mod:`~kvstrata.core.writer`), rank agreement
(:class:`~kvstrata.core.collective.RankAgreement`). ``docs/architecture.md`` draws them.

Threads. Every tree mutation and every allocation happens on the caller's (owner) thread. Storage
work runs on two worker threads (one writing L2 -> L3, one prefetching L3 -> L2) that only read
host memory they were handed and report results; the owner commits those results at fixed points
(the start of every public call, and ``admit`` for a request's own prefetch). A backend exception
fails that operation only (the storage engine turns it into a failed result), and every host slot
an operation staged is released when its result is drained.

Hybrid stacks. The controller reads each tree pool's declared rule, never its type: ``all_pages``
pools need every page, trailing-window pools the last window, node-state pools one slot at the
end of the prefix; sidecars follow the pool whose indices they share. L3 writes go sidecars and
components first, the anchor last (the anchor object commits a page); prefetch reads the anchor
first and commits only when every pool finished. A prefetch that some pool cannot complete is
clamped where every such pool declares ``clamp`` and dropped whole otherwise.

Ranks. Lengths that decide what a request reuses are agreed with a MIN through the
:class:`~kvstrata.core.collective.Collective` at two fixed points of ``admit`` (after the prefetch,
after the load-back), so every rank serves the same prefix. A rank raising inside ``admit``
still meets the points it owes (the others then reuse nothing of that request): alone in the
collective, the others waited there until the group's timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvstrata.core.boundary import ClosingApi, caller_origin, exclusive
from kvstrata.core.builder import (
    CacheParts,
    DeviceTensors,
    EngineTensors,
    PoolSpecs,
    add_late_pool,
    build_cache,
)
from kvstrata.core.collective import Collective, agreement_for
from kvstrata.core.config import KvstrataConfig
from kvstrata.core.lease import CacheFullError, Lease, found_pages, require_lease
from kvstrata.core.lease_units import (
    allocate_units,
    device_full,
    hand_to_tree,
    page_number,
    take_for_insert,
)
from kvstrata.core.metrics import SkipReason
from kvstrata.core.pool_group import Pool
from kvstrata.core.prefetch_op import PrefetchOp
from kvstrata.core.prefetcher import Prefetcher, PrefetchMode
from kvstrata.core.retention import RetentionHint
from kvstrata.core.stack import PoolKind, TreePool
from kvstrata.core.tokens import token_ids
from kvstrata.core.tree import MatchResult, Tier, page_keys
from kvstrata.core.unit_memory import UnitMemory
from kvstrata.core.writer import back_up_prefix
from kvstrata.plugins import PluginHost

#: ``Tier.DEVICE`` without the enum's descriptor lookup (~0.1 us): the per-chunk calls read it
_DEVICE = Tier.DEVICE

__all__ = ["CacheController", "CacheFullError", "Lease", "PoolKind", "PrefetchMode", "SkipReason", "TreePool"]


class CacheController(UnitMemory, ClosingApi):
    """Device (L1), host (L2) and storage (L3) tiers of one model stack; see the module docstring."""

    def __init__(
        self,
        config: KvstrataConfig,
        plugins: PluginHost,
        *,
        collective: Collective | None = None,
        device_tensors: DeviceTensors | None = None,
    ) -> None:
        self.config, self.plugins, self.policy = config, plugins, config.policy
        self.ranks = agreement_for(collective, config.parallel)  # refused before anything opens
        self._closed, self._leases = False, dict[int, Lease]()  # open leases, oldest first
        self._guard, self._inside = threading.RLock(), ""  # one thread at a time (boundary.exclusive)
        self._slot_index, self._forks = {}, None  # fork_state's source slots and plan (UnitMemory)
        self.parts: CacheParts = build_cache(config, plugins, device_tensors=device_tensors)
        parts = self.parts
        self.page_size, self.namespace_root = parts.page_size, parts.namespace_root
        self.metrics, self.pools, self.tree = parts.metrics, parts.pools, parts.tree
        self.metrics.lease_count = self._leases.__len__  # (the dict only: no cycle through the cache)
        self.layout, self.backend, self.engine = parts.layout, parts.backend, parts.engine
        self.units, self.load_back, self.writer = parts.units, parts.load_back, parts.writer
        self.prefetcher: Prefetcher | None = parts.prefetcher
        #: the anchor's device units: every request must fit them whole (late pools are sidecars)
        self._device_pages = parts.pools.anchor.device_allocator.units

    # --- what the parts hold, under the names callers use -------------------------------------

    @property
    def collective(self) -> Collective:
        return self.ranks.collective

    @property
    def storage_enabled(self) -> bool:
        return self.parts.engine is not None

    @property
    def tree_pools(self) -> dict[str, TreePool]:
        return self.layout.tree_pools

    def pool_kind(self, pool: str) -> PoolKind:
        """How a pool's prefix units are laid out (a sidecar follows the pool owning its indices)."""
        return self.layout.kind(pool)

    # --- lookup ---------------------------------------------------------------------------------

    @exclusive
    def lookup(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        record: bool = True,
        prefetch: PrefetchMode | str = PrefetchMode.POLICY,
        retention: RetentionHint | None = None,
    ) -> Lease:
        """Match ``tokens`` against the device and host tiers, lock the usable prefix, and start
        an L3 prefetch of the pages after it when the prefetch policy allows.

        ``record=False`` keeps the request out of the hit counters: for the later chunks of a
        chunked prefill, whose "hits" are the request's own earlier chunks. ``prefetch="wait"``
        skips the prefetch gates and makes ``admit`` wait for the whole read (at most
        ``policy.prefetch.timeout_max_s``); ``"off"`` reads
        nothing from L3. ``retention``: priority / pin / TTL of the prefix once inserted."""
        self._check_open()
        tokens = token_ids(tokens)  # before anything is matched or locked
        mode = PrefetchMode(prefetch)
        if retention is not None and not isinstance(retention, RetentionHint):
            raise TypeError(f"retention must be a kvstrata.RetentionHint or None, got {retention!r}")
        self.poll()
        started = time.perf_counter()
        # the lease grows its keys page by page (chunked prefill, decode): a list of page keys
        keys = list(page_keys(tokens, self.page_size))
        tail = tokens[len(keys) * self.page_size :].numpy().tobytes()
        lease = Lease(keys, tail, self.namespace_root, self.page_size, record=record, retention=retention)
        lease.bind_issuer(self, self.layout.owner_of, caller_origin(3))
        match = self.tree.match(keys, count_hit=record)  # one access per request, not per chunk
        self._leases[id(lease)] = lease
        try:
            lease.hold_match(self.tree, match)
            self.metrics.latency("match", time.perf_counter() - started)
            self.writer.on_lookup(match, lease.hashes_source, record)
            if self.prefetcher is not None and lease.pages > lease.host_pages:
                at, hashes, node = lease.host_pages, lease.page_hashes[lease.host_pages :], lease.locked_node
                lease.attach_prefetch(self.prefetcher.start(at, hashes, lease.skipped, mode, node))
        except BaseException:
            self.release(lease)  # a failed lookup holds nothing
            raise
        return lease

    # --- admit (prefetch end + commit, load-back) -----------------------------------------------

    @exclusive
    def admit(self, lease: Lease) -> Lease:
        """End the prefetch per policy, commit what every rank read, load host pages back to the
        device (all pools or none), and settle ``lease.cached_pages`` and its prefix units."""
        self._check_lease(lease)
        if lease.admitted:
            raise RuntimeError("lease already admitted")
        with self.ranks:  # raising in here, a rank still meets the others' agreement points
            op = lease.prefetch
            self._drain(ending=op)  # (``poll``; room for ``op``'s read is ``finish``'s to make, per policy)
            local = self.prefetcher.finish(op, lease.locked_node) if op else 0  # type: ignore[union-attr]
            cut = None if op is None else self.prefetcher.shorter(op)  # type: ignore[union-attr]
            pages = self.ranks.prefetch_pages(lease.host_pages if op is None else op.start, local, cut)
            if op is not None:
                self._commit_prefetch(lease, pages)
            started = time.perf_counter()
            match = self.tree.match(lease.keys, count_hit=False)
            host_only = match.host_pages - match.device_pages
            if host_only * self.page_size >= max(1, self.policy.load_back_threshold_tokens):
                result = self.load_back.run(self.load_back.plan(match))
                # matched again whatever it did: making room for a load-back that then failed may
                # have evicted device pages the first match counted (a window pool's tail)
                match = self.tree.match(lease.keys, count_hit=False)
                if result.device_full:
                    self.metrics.skip(SkipReason.DEVICE_FULL, host_only, lease.skipped)
                self.metrics.latency("load_back", time.perf_counter() - started)
            else:
                self.metrics.skip(SkipReason.BELOW_LOAD_BACK_THRESHOLD, host_only, lease.skipped)
            local = match.device_pages
            match = self.ranks.cached_match(match, lambda n: self.tree.match(lease.keys[:n], count_hit=False))
            if match.device_pages < local:
                self.metrics.skip(SkipReason.RANK_DISAGREEMENT, local - match.device_pages, lease.skipped)
            self._settle(lease, match)
        return lease

    def _commit_prefetch(self, lease: Lease, pages: int, unused: SkipReason | None = None) -> None:
        op = lease.detach_prefetch()
        assert op is not None and self.prefetcher is not None
        backed = pages <= 0 or op.start <= 0
        try:  # (the op is detached: dropped in ``finally`` also when the backup raised)
            backed = backed or back_up_prefix(self.writer, lease.keys[: op.start], lease.hashes_source)
            if backed:
                request = str(id(lease))
                committed = self.prefetcher.commit(op, lease.keys, pages, request, lease.skipped, unused)
                lease.prefetched(committed)
        finally:  # what a raise (KeyboardInterrupt) left the op holding is freed; else a no-op
            self.prefetcher.release(op)
            if not backed:  # host-only pages below a device-only page would break "backups form
                # a contiguous prefix from the root" and pin that page on the device: drop the refill
                self.prefetcher.drop(op, SkipReason.UNBACKED_PARENT, lease.skipped)

    def _settle(self, lease: Lease, match: MatchResult) -> None:
        lease.settle(self.tree, self.layout, match)
        if lease.record:
            page = self.page_size
            self.metrics.request(lease.pages * page, {t: n * page for t, n in lease.hit_pages.items()})

    # --- allocate / insert / release ----------------------------------------------------------

    @exclusive
    def allocate(
        self,
        lease: Lease,
        *,
        end_page: int | None = None,
        partial_page: bool = False,
        window_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Device units per pool for the pages of ``lease`` neither cached nor allocated, through
        ``end_page`` (default: every whole page; ``partial_page`` adds the one being filled).
        Sidecars share their owner's units; a window pool every new page where it has room, else
        (or ``window_only``) the last ones down to its window; a state pool one slot per insert."""
        self._check_lease(lease)
        pages = lease.pages  # (``end_page`` is checked before the admit: refused, it admits nothing)
        end = pages if end_page is None else page_number(end_page, "end_page")
        if not 0 <= end <= pages:
            raise ValueError(f"end_page {end} outside [0, {pages}] (the lease's whole pages)")
        if not lease.admitted:
            self.admit(lease)
        end = max(end + int(partial_page and end == pages), lease.allocated_pages)
        # the whole request sits locked in the anchor's device tier: one longer than the tier is
        # refused before anything is evicted for it (an eviction that cannot make room)
        fits = end <= self._device_pages
        got = allocate_units(self.units, self.layout, lease, end, window_only) if fits else None
        if got is None and fits and self._drain():  # (not per chunk) finished L3 work held units
            got = allocate_units(self.units, self.layout, lease, end, window_only)
        if got is None:
            self.metrics.fail()
            pinned = self.parts.retention.pinned_pages
            raise device_full(self.layout, lease, end, self.units, pinned, too_long=not fits)
        if self.layout.self_owned:  # the tensors are the caller's: the lease keeps bytes of its own
            return got
        return {name: got[owner] for name, owner in self.layout.owner_of.items()}

    @exclusive
    def insert(self, lease: Lease, *, close: bool = True) -> None:
        """Index the pages the engine computed (through the last whole page), back them up per
        write policy and queue their L3 write; then close the lease, or with ``close=False``
        keep it (and its place in the tree) for the next chunk. A state pool's slot must hold
        the state after the last inserted page: each insert is a checkpoint -- where the last
        ``allocate`` ended there; one that ran on into a partial page records none (its slot
        holds a later state: see :func:`~kvstrata.core.lease_units.take_for_insert`)."""
        self._check_lease(lease)
        self._drain()
        end = lease.pages
        if lease.allocated_pages < end:
            raise RuntimeError(
                f"insert needs units for pages [{lease.allocated_pages}, {end}): call cache.allocate(lease)"
            )
        if end > lease.committed_pages:
            values, rest = take_for_insert(self.layout, lease, end)
            above = lease.node
            result = self.tree.insert(lease.keys[lease.committed_pages : end], values, at=above, tell=False)
            hand_to_tree(self.units, self.layout, self.tree, lease, result, end, rest, close)
            writer = self.writer
            if self.policy.write == "write_through" or writer.digests is not None or writer.hears_inserts:
                hashes, cached = lease.hashes_source, lease.cached_pages
                writer.on_insert(result.node, hashes, above, cached, owner=lease, keep_open=not close)
        if lease.retention is not None:  # (read here: no call per chunk of a request without a hint)
            self._retain(lease)  # also a request whose whole prefix was cached: its hint holds there
        if close:
            self._free_pending(lease)
            self._close_lease(lease)

    @exclusive
    def release(self, lease: Lease) -> None:
        """Abort a request: free its unused units, end its prefetch, unlock its prefix; pages it
        inserted stay, and what write-through batched of them (an open lease's) is backed up."""
        require_lease(lease, self)
        if lease.closed:
            return
        self._free_pending(lease)
        if lease.prefetch is not None:
            self._commit_prefetch(lease, 0, SkipReason.RELEASED)
        self._close_lease(lease)

    def _free_pending(self, lease: Lease) -> None:
        for units in lease.take_pending():
            self.units.free(Tier.DEVICE, units)

    def _close_lease(self, lease: Lease) -> None:
        self.writer.end_open(lease)  # what write-through batched, backed up while still locked
        lease.mark_closed(self.tree)
        self._leases.pop(id(lease), None)

    # --- retention (the lookup's hint on the inserted prefix) ---------------------------------

    def _retain(self, lease: Lease) -> None:
        if (hint := lease.retention) is not None and lease.node is not None:
            lease.hold_pin(self.parts.retention.apply(lease.node, hint, lease.pin, found_pages(lease)))

    @exclusive
    def unpin(self, lease: Lease) -> None:
        """Release the pin a lease's ``RetentionHint(pin=True)`` took (a no-op without one).
        Works on closed leases: a pin outlives the request that set it."""
        require_lease(lease, self)
        pin = lease.take_pin()
        if pin is not None:
            self.parts.retention.release(pin)

    def _check_lease(self, lease: Lease) -> None:
        if self._closed:  # (``_check_open`` inline: every call of a chunk checks a lease)
            raise RuntimeError("cache is closed")
        if type(lease) is not Lease or lease._issuer is not self:  # (require_lease's one test)
            require_lease(lease, self)
        if lease.closed:
            raise RuntimeError("lease is closed (inserted or released)")

    # --- owner-thread commit points -----------------------------------------------------------

    @exclusive
    def poll(self) -> None:
        """Drain finished storage work: unlock written nodes, count failures, free revoked
        prefetch slots. Called at the start of every public call; cheap when nothing finished."""
        self._drain()

    def _drain(self, ending: PrefetchOp | None = None) -> bool:
        """``poll`` for calls already inside the guard (no second trip through it per chunk);
        whether any L3 write or revoked read had finished (their units and locks freed now).
        ``ending``: the read ``admit`` ends next (no room is made for it here)."""
        took = self.writer.drain()
        return (self.prefetcher is not None and self.prefetcher.drain(ending)) or took

    @exclusive
    def flush(self, timeout: float | None = None) -> None:
        """Back up what write-through batched for open leases, then wait (at most ``timeout`` s)
        for every queued L3 write and revoked prefetch, and commit their results."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.writer.wait(deadline)
        if self.prefetcher is not None:
            self.prefetcher.wait(deadline)
        self.poll()

    # --- late pools -----------------------------------------------------------------------------

    @exclusive
    def add_pool(self, name: str, config: PoolSpecs, *, device_tensors: EngineTensors | None = None) -> Pool:
        """Add a sidecar pool at runtime (e.g. a speculative draft pool) with its own I/O plan, in
        the engine's own ``device_tensors`` (``{buffer: tensor}``, as ``open`` takes them) if given.
        Pages cached before it hold no data for it: dropped from both tiers (no lease may be open),
        pinned ones too (every pin is released: a pinned page would be served with the new pool's
        units, which no one wrote)."""
        self._check_open()
        if self._leases:
            raise RuntimeError(f"add_pool({name!r}) needs no open leases ({len(self._leases)} open)")
        self.flush()
        return add_late_pool(self.parts, name, config, device_tensors)
