"""The tier controller: one object a scheduler (or ``kvstrata replay``) drives per request.

    cache = CacheController(config, plugins)
    lease = cache.lookup(tokens)     # match L1/L2, lock the prefix, start an L3 prefetch of the rest
    cache.admit(lease)               # end the prefetch per policy, commit it, load L2 -> L1
    units = cache.allocate(lease)    # device units for the pages the engine computes now
    ...                              # the engine writes those units
    cache.insert(lease)              # index them, back up per write policy, queue the L3 write

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
after the load-back), so every rank serves the same prefix.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from kvstrata.core.collective import Collective, LocalCollective
from kvstrata.core.config import KvstrataConfig, PoolConfig
from kvstrata.core.io_plan import IOMode, IOPlan, plan_backend
from kvstrata.core.keys import hash_pages, namespace_root
from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.pool_group import Pool, PoolGroup
from kvstrata.core.storage_engine import BatchResult, PoolBatch, StorageEngine, longest_present_prefix
from kvstrata.core.transfer import object_regions
from kvstrata.core.tree import LockHandle, MatchResult, PrefixTree, Tier, TreeNode, page_keys
from kvstrata.plugins import PluginHost
from kvstrata.plugins.pool_type import Granularity, HitRuleKind, PartialHit, PoolRole, PoolSpec
from kvstrata.plugins.storage_backend import StorageBackend

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


class CacheFullError(RuntimeError):
    """The device tier cannot hold a request's new pages even after evicting everything unlocked."""


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


@dataclass(eq=False)
class _Prefetch:
    """One L3 -> L2 read. The worker fills the result fields and sets ``done``; only the owner
    thread touches the tree or frees ``reserved`` (once ``done`` is set).

    Host units are taken only after the existence query says how many pages L3 holds (a miss
    costs no allocation and never evicts host pages): the worker takes free units; when there
    are not enough it leaves ``short`` set and the owner evicts and reads at ``admit``.
    """

    start: int  # first page read (the request's host-usable prefix before it)
    hashes: list[str]  # page hashes of pages [start, start + len(hashes))
    started_s: float
    reserved: dict[str, torch.Tensor] = field(default_factory=dict)  # host units per tree pool
    short: dict[str, int] | None = None  # units the worker could not take without eviction
    found: int = 0  # leading pages whose anchor object exists
    pages: int = 0  # pages whose objects the worker read and verified, every pool included
    read_end: int = 0  # pages the worker tried to read (window/state objects sit at its end)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Write:
    """One L2 -> L3 write; host locks keep its source slots alive until the owner drains it."""

    locks: list[LockHandle]
    future: Future[dict[str, BatchResult]]


@dataclass(eq=False)
class Lease:
    """A request's hold on its cached prefix, from ``lookup`` to ``insert`` or ``release``."""

    tokens: torch.Tensor
    keys: list[bytes]
    namespace_root: str
    page_size: int
    device_pages: int = 0  # usable on device at lookup
    host_pages: int = 0  # usable on device + host at lookup
    cached_pages: int = 0  # usable on device after admit
    hit_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    record: bool = True  # count this request in the hit metrics
    admitted: bool = False
    closed: bool = False
    _hashes: list[str] | None = None
    _prefix: dict[str, torch.Tensor] = field(default_factory=dict)  # tree pool -> device units
    _first: dict[str, int] = field(default_factory=dict)
    _owner_of: dict[str, str] = field(default_factory=dict)
    _device_lock: LockHandle | None = None
    _host_lock: LockHandle | None = None
    _prefetch: _Prefetch | None = None
    _storage_pages: int = 0  # pages [host_pages, host_pages + this) came from L3
    _allocated: dict[str, torch.Tensor] | None = None

    @property
    def pages(self) -> int:
        return len(self.keys)

    @property
    def page_hashes(self) -> list[str]:
        """Chained hashes (hex) of every whole page, computed once when first needed."""
        if self._hashes is None:
            self._hashes = hash_pages(self.tokens, self.page_size, self.namespace_root)
        return self._hashes

    @property
    def cached_tokens(self) -> int:
        return self.cached_pages * self.page_size

    def prefix_units(self, pool: str) -> torch.Tensor:
        """Device units holding the cached prefix of ``pool`` (see ``prefix_first_page``)."""
        self._require_admitted()
        return self._prefix[self._owner(pool)]

    def prefix_first_page(self, pool: str) -> int:
        """The page ``prefix_units(pool)[0]`` holds (0 for all-pages pools; for a node-state pool
        the slot holds the state after page ``cached_pages - 1``)."""
        self._require_admitted()
        return self._first[self._owner(pool)]

    def _owner(self, pool: str) -> str:
        try:
            return self._owner_of[pool]
        except KeyError:
            raise KeyError(f"no pool {pool!r}; pools: {sorted(self._owner_of)}") from None

    def _require_admitted(self) -> None:
        if not self.admitted:
            raise RuntimeError("call cache.admit(lease) before reading its prefix")


class CacheController:
    """Device (L1), host (L2) and storage (L3) tiers of one model stack; see the module docstring."""

    def __init__(
        self, config: KvstrataConfig, plugins: PluginHost, *, collective: Collective | None = None
    ) -> None:
        self.config = config
        self.plugins = plugins
        self.collective: Collective = collective or LocalCollective()
        self.metrics = CacheMetrics()
        self.page_size = config.model.page_size
        self.namespace_root = namespace_root(config.model.name, config.model.cache_salt)
        self.policy = config.policy
        self._closed = False
        self._leases: set[int] = set()
        self.backend: StorageBackend | None = None
        self.engine: StorageEngine | None = None
        plugins.hook.kvstrata_configure.call_historic(kwargs={"config": config})
        backend, host_allocator = self._open_backend()
        try:
            self.pools = PoolGroup(config, plugins, host_allocator=host_allocator)
            self.tree = PrefixTree(pool.spec for pool in self.pools.pools.values())
            self.anchor = self.tree.pools[0].name
            self._describe_pools()
            if backend is not None:
                self._attach_storage(backend)
        except BaseException:
            if backend is not None:
                backend.close()
            raise
        self._writes: list[_Write] = []
        self._orphans: list[_Prefetch] = []  # revoked prefetches whose worker has not finished
        self._reserved_pages = 0  # pages in flight in prefetches (the rate limit counts them)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-l3-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-l3-prefetch")

    # --- construction ---------------------------------------------------------------------------

    def _open_backend(self) -> tuple[StorageBackend | None, Any]:
        storage = self.config.tiers.storage
        if not storage:
            return None, None
        if len(storage) > 1:
            raise ValueError(
                f"tiers.storage: one storage instance per cache is supported, got {sorted(storage)}"
            )
        if self.config.tiers.host.capacity_tokens <= 0:
            raise ValueError(
                "tiers.storage needs a host tier (L3 reads and writes go through L2): "
                "set tiers.host.capacity_tokens > 0"
            )
        ((instance, backend_config),) = storage.items()
        backend = self.plugins.storage_backends.require(backend_config.type)(instance, backend_config)
        backend.open()
        caps = backend.instance_capabilities()
        return backend, (backend.allocate_host_memory if caps.host_allocator else None)

    def _describe_pools(self) -> None:
        self._owner_of = {name: pool.index_owner for name, pool in self.pools.pools.items()}
        # sidecars of sidecars resolve to the tree pool owning the indices
        self.tree_pools: dict[str, TreePool] = {}
        for spec in self.tree.pools:
            followers = [p.instance for p in self.pools.followers(spec.name)]
            self.tree_pools[spec.name] = TreePool.of(spec, followers)
        #: a partial L3 hit can be clamped only if every all-pages pool besides the anchor says so
        self._clampable = all(
            self.pool_kind(name) is PoolKind.PAGES and pool.spec.partial_hit is PartialHit.CLAMP
            for name, pool in self.pools.pools.items()
            if name != self.anchor
        )

    def _attach_storage(self, backend: StorageBackend) -> None:
        caps = backend.instance_capabilities()
        specs = {name: pool.spec for name, pool in self.pools.pools.items()}
        self.backend = backend
        self.engine = StorageEngine(
            backend,
            specs,
            self._plan(backend, specs.values()),
            model_name=self.config.model.name,
            cache_salt=self.config.model.cache_salt,
            parallel=self.config.parallel,
            checksum=self.policy.checksum,
            hook=self.plugins.hook,
        )
        self.metrics.corrupt_detected_fn = lambda: self.engine.metrics.corrupt_detected if self.engine else 0
        self.plugins.hook.kvstrata_backend_opened(
            instance=backend.instance, backend=backend, capabilities=caps
        )

    def _plan(self, backend: StorageBackend, specs: Iterable[PoolSpec]) -> dict[str, IOPlan]:
        """Plan each (backend, pool) I/O path, register zero-copy host memory, log the plans."""
        caps = backend.instance_capabilities()
        host_from_backend = bool(caps.host_allocator)
        plans = plan_backend(
            backend.instance,
            caps,
            specs,
            parallel=self.config.parallel,
            host_memory_from_backend=host_from_backend,
        )
        self._register_zero_copy(backend, plans, host_from_backend)
        for name, plan in plans.items():
            log.info("I/O plan %s/%s: %s (%s)", backend.instance, name, plan.mode.value, plan.reason)
        return plans

    def _register_zero_copy(
        self, backend: StorageBackend, plans: Mapping[str, IOPlan], host_from_backend: bool
    ) -> None:
        """Register the host memory of zero-copy pools (backend-allocated memory already is)."""
        if host_from_backend:
            return
        seen: set[int] = set()
        for name, plan in plans.items():
            host = self.pools.pools[name].host
            if plan.mode is not IOMode.ZERO_COPY or host is None:
                continue
            region = host.region()
            if region is not None and region.ptr not in seen:
                seen.add(region.ptr)
                backend.register_host_memory(region)

    @property
    def storage_enabled(self) -> bool:
        return self.engine is not None

    def pool_kind(self, pool: str) -> PoolKind:
        """How a pool's prefix units are laid out (a sidecar follows the pool owning its indices)."""
        return self.tree_pools[self._owner_of[pool]].kind

    # --- allocation ---------------------------------------------------------------------------

    def _allocator(self, pool: str, tier: Tier):
        p = self.pools.pools[pool]
        return p.device_allocator if tier is Tier.DEVICE else p.host_allocator

    def _free(self, tier: Tier, units: Mapping[str, torch.Tensor]) -> None:
        for pool, value in units.items():
            if len(value):
                self._allocator(pool, tier).free(value)

    def _free_evicted(self, tier: Tier):
        def free(pool: str, value: torch.Tensor) -> None:
            self._allocator(pool, tier).free(value)

        return free

    def _try_alloc(self, tier: Tier, needs: Mapping[str, int]) -> dict[str, torch.Tensor] | None:
        got: dict[str, torch.Tensor] = {}
        for pool, count in needs.items():
            if count == 0:
                got[pool] = _EMPTY
                continue
            allocator = self._allocator(pool, tier)
            units = allocator.alloc(count) if allocator is not None else None
            if units is None:
                self._free(tier, got)
                return None
            got[pool] = units
        return got

    def _alloc(self, tier: Tier, needs: Mapping[str, int]) -> dict[str, torch.Tensor] | None:
        """All-or-nothing allocation over pools; evicts the shortfall (LRU) once if needed."""
        got = self._try_alloc(tier, needs)
        if got is not None:
            return got
        shortfall = {}
        for pool, count in needs.items():
            allocator = self._allocator(pool, tier)
            available = allocator.available if allocator is not None else 0
            if count > available:
                shortfall[pool] = count - available
        if tier is Tier.DEVICE:
            write_back = self.policy.write == "write_back"
            if write_back:
                self._back_up_for_eviction(shortfall)
            result = self.tree.evict_device(
                shortfall, self._free_evicted(Tier.DEVICE), delete_unbacked=not write_back
            )
        else:
            result = self.tree.evict_host(shortfall, self._free_evicted(Tier.HOST))
        for pool, units in result.units.items():
            self.plugins.hook.kvstrata_eviction(tier=tier.value, pool=pool, units=units)
        return self._try_alloc(tier, needs)

    def _alloc_protecting(
        self, node: TreeNode, tier: Tier, needs: Mapping[str, int]
    ) -> dict[str, torch.Tensor] | None:
        """Allocate in ``tier`` while ``node``'s path is locked there, so the eviction that
        makes room cannot take the nodes the units are for."""
        guard = self.tree.lock(node, tier)
        try:
            return self._alloc(tier, needs)
        finally:
            self.tree.unlock(guard)

    # --- lookup ---------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | torch.Tensor, *, record: bool = True) -> Lease:
        """Match ``tokens`` against the device and host tiers, lock the usable prefix, and start
        an L3 prefetch of the pages after it when the prefetch policy allows.

        ``record=False`` keeps the request out of the hit counters: for the later chunks of a
        chunked prefill, whose "hits" are the request's own earlier chunks."""
        self._check_open()
        self.poll()
        started = time.perf_counter()
        tokens = torch.as_tensor(tokens, dtype=torch.int64).flatten().cpu()
        keys = page_keys(tokens, self.page_size)
        lease = Lease(tokens, keys, self.namespace_root, self.page_size, record=record)
        lease._owner_of = self._owner_of
        match = self.tree.match(keys)
        lease.device_pages, lease.host_pages = match.device_pages, match.host_pages
        if match.device_pages:
            lease._device_lock = self.tree.lock(match.device_node, Tier.DEVICE)
        if match.host_pages > match.device_pages:
            lease._host_lock = self.tree.lock(match.host_node, Tier.HOST)
        self._leases.add(id(lease))
        self.metrics.latency("match", time.perf_counter() - started)
        if self.policy.write == "write_through_selective":
            hot = [n for n in match.device_path if n.hit_count >= self.policy.write_through_threshold]
            self._back_up(hot, hashes=lease.page_hashes)
        if self.engine is not None:
            lease._prefetch = self._start_prefetch(lease)
        return lease

    # --- prefetch (L3 -> L2) ------------------------------------------------------------------

    def _prefetch_budget(self) -> int:
        anchor_host = self.pools.pools[self.anchor].host_allocator
        return int(anchor_host.units * self.policy.prefetch.host_fraction_limit) if anchor_host else 0

    def _start_prefetch(self, lease: Lease) -> _Prefetch | None:
        start = lease.host_pages
        count = lease.pages - start
        threshold = max(self.policy.prefetch.threshold_tokens, self.page_size)
        if count <= 0 or count * self.page_size < threshold:
            return None
        if self._reserved_pages + count > self._prefetch_budget():
            self.metrics.count("prefetches_skipped")
            return None
        op = _Prefetch(start, lease.page_hashes[start:], time.perf_counter())
        self._reserved_pages += count
        self.metrics.count("prefetches_started")
        self._reader.submit(self._run_prefetch, op)
        return op

    def _run_prefetch(self, op: _Prefetch) -> None:
        """Worker thread: existence per pool, the usable length by each pool's rule, then the read.
        Never touches the tree; ``done`` is always set."""
        try:
            end = self._prefetch_length(op)
            op.read_end = end
            if end > 0 and not op.cancelled:
                needs = self._prefetch_needs(end)
                got = self._try_alloc(Tier.HOST, needs)  # allocators are thread-safe; no eviction
                if got is None:
                    op.short = needs
                else:
                    op.reserved = got
                    op.pages = self._prefetch_read(op, end)
        except Exception:  # an engine bug must not kill the worker or leak the slots
            log.exception("prefetch failed")
            op.pages = 0
        finally:
            self.metrics.latency("prefetch", time.perf_counter() - op.started_s)
            op.done.set()

    def _prefetch_needs(self, end: int) -> dict[str, int]:
        """Host units per tree pool to hold an L3 prefix of ``end`` pages."""
        needs = {}
        for tp in self.tree_pools.values():
            lo, hi = self._slots(tp, 0, end)
            needs[tp.name] = hi - lo
        return needs

    def _exists(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        assert self.engine is not None
        result = self.engine.exists(pool, hashes)
        self._count_failure(result)
        return result.ok

    def _count_failure(self, result: BatchResult) -> None:
        """A storage call that was attempted and failed (a skipped one is a plan, not a failure)."""
        if result.error is not None and not result.skipped:
            self.metrics.fail()

    def _prefetch_length(self, op: _Prefetch) -> int:
        """Pages after ``op.start`` that every pool can serve from L3 (0 = drop)."""
        hashes = op.hashes
        end = op.found = longest_present_prefix(self._exists(self.anchor, hashes))
        pools = list(self.tree_pools.values())
        for tp in pools:  # all-pages pools (and the anchor's sidecars) clamp or drop
            names = tp.followers[1:] if tp.name == self.anchor else tp.followers
            if tp.kind is not PoolKind.PAGES:
                continue
            for name in names:
                if end == 0:
                    return 0
                have = longest_present_prefix(self._exists(name, hashes[:end]))
                if have < end:
                    clamp = self.pools.pools[name].spec.partial_hit is PartialHit.CLAMP
                    end = have if clamp else 0
        for tp in pools:  # a prefix ends where a state exists
            if tp.kind is PoolKind.STATE and end > 0:
                flags = self._all_of([self._exists(name, hashes[:end]) for name in tp.followers])
                end = max((j + 1 for j, ok in enumerate(flags) if ok), default=0)
        for tp in pools:  # the last window must be whole
            if tp.kind is PoolKind.WINDOW and end > 0:
                lo = max(0, end - tp.window)
                flags = self._all_of([self._exists(name, hashes[lo:end]) for name in tp.followers])
                if not all(flags):
                    return 0
        return end

    @staticmethod
    def _all_of(per_pool: Sequence[Sequence[bool]]) -> list[bool]:
        return [all(column) for column in zip(*per_pool, strict=True)]

    def _slots(self, tp: TreePool, start: int, end: int) -> tuple[int, int]:
        """Pages [lo, end) a pool reads or writes for a prefix ending at ``end``; ``start`` bounds it."""
        if tp.kind is PoolKind.STATE:
            return end - 1, end
        if tp.kind is PoolKind.WINDOW:
            return max(start, end - tp.window), end
        return start, end

    def _batch(self, name: str, tier_units: torch.Tensor, hashes: Sequence[str]) -> PoolBatch:
        pool = self.pools.pools[name]
        assert pool.host is not None
        per_object = [object_regions(pool.host, obj.suffix, tier_units) for obj in pool.spec.objects]
        units = [[regions[i] for regions in per_object] for i in range(len(hashes))]
        return PoolBatch(list(hashes), units)

    def _prefetch_read(self, op: _Prefetch, end: int) -> int:
        """Read pages [0, end) (relative to op.start) into the reserved host units; returns how many
        pages every pool delivered (0 if a window or state pool is incomplete)."""
        assert self.engine is not None
        batches: dict[str, PoolBatch] = {}
        for tp in self.tree_pools.values():
            lo, hi = self._slots(tp, 0, end)
            units = op.reserved[tp.name][: hi - lo]
            for name in tp.followers:
                if self.engine.plans[name].enabled:
                    batches[name] = self._batch(name, units, op.hashes[lo:hi])
        results = self.engine.get_group(batches)
        nbytes = 0
        done = end
        for name, result in results.items():
            self._count_failure(result)
            tp = self.tree_pools[self._owner_of[name]]
            have = longest_present_prefix(result.ok)
            nbytes += sum(result.ok) * self.pools.pools[name].spec.bytes_per_unit
            if tp.kind is PoolKind.PAGES:
                done = min(done, have)
            elif have < len(result.ok):
                done = 0
        if done < end and not self._clampable:
            done = 0
        self.metrics.add_bytes("storage_to_host", nbytes)
        return done

    def _end_prefetch(self, lease: Lease) -> int:
        """Terminate the lease's prefetch per policy; returns the pages this rank can commit."""
        op = lease._prefetch
        if op is None:
            return 0
        policy = self.policy.prefetch
        if policy.policy == "wait_complete":
            op.done.wait()
        elif policy.policy == "timeout":
            tokens = len(op.hashes) * self.page_size
            limit = policy.timeout_base_s + policy.timeout_per_ki_token_s * tokens / 1024
            if policy.timeout_max_s is not None:
                limit = min(limit, policy.timeout_max_s)
            op.done.wait(limit)
        if not op.done.is_set():
            return 0
        if op.short is not None and policy.policy != "best_effort":
            # L3 has the pages but the host tier is full: make room (owner thread) and read now
            protect = lease._host_lock or lease._device_lock
            got = (
                self._alloc_protecting(protect.node, Tier.HOST, op.short)
                if protect is not None
                else self._alloc(Tier.HOST, op.short)
            )
            op.short = None
            if got is not None:
                op.reserved = got
                op.pages = self._prefetch_read(op, op.read_end)
        return op.pages

    def _commit_prefetch(self, lease: Lease, pages: int) -> None:
        """Insert the first ``pages`` prefetched pages as host-only nodes; free every other slot."""
        op = lease._prefetch
        assert op is not None
        lease._prefetch = None
        if not op.done.is_set():  # still reading into the slots: free them when it finishes
            op.cancelled = True
            self._orphans.append(op)
            self.metrics.count("prefetches_revoked")
            return
        self._reserved_pages -= len(op.hashes)
        usable = pages > 0 and (pages == op.pages or self._clampable)
        if not usable:
            if op.found:
                self.metrics.count("prefetches_dropped")
            self._free(Tier.HOST, op.reserved)
            return
        values: dict[str, torch.Tensor] = {}
        spare: dict[str, torch.Tensor] = {}
        for tp in self.tree_pools.values():
            lo, hi = self._slots(tp, 0, pages)
            have = op.reserved[tp.name]
            values[tp.name] = have[: hi - lo]
            spare[tp.name] = have[hi - lo :]
        result = self.tree.insert_host(lease.keys[: op.start + pages], values)
        self._free(Tier.HOST, spare)
        self._free(Tier.HOST, result.duplicates)
        lease._storage_pages = pages
        self.metrics.count("prefetches_committed")
        self.plugins.hook.kvstrata_prefetch_committed(
            request_id=str(id(lease)), tokens=pages * self.page_size, pools=list(self.pools.pools)
        )

    # --- admit (commit + load-back) -----------------------------------------------------------

    def admit(self, lease: Lease) -> Lease:
        """End the prefetch per policy, commit what every rank read, load host pages back to the
        device (all pools or none), and settle ``lease.cached_pages`` and its prefix units."""
        self._check_lease(lease)
        if lease.admitted:
            raise RuntimeError("lease already admitted")
        self.poll()
        local = self._end_prefetch(lease)
        (agreed,) = self.collective.all_min([local])
        if lease._prefetch is not None:
            self._commit_prefetch(lease, agreed)
        started = time.perf_counter()
        match = self.tree.match(lease.keys, count_hit=False)
        if (match.host_pages - match.device_pages) * self.page_size >= max(
            1, self.policy.load_back_threshold_tokens
        ):
            if self._load_back(match):
                match = self.tree.match(lease.keys, count_hit=False)
            self.metrics.latency("load_back", time.perf_counter() - started)
        (cached,) = self.collective.all_min([match.device_pages])
        if cached < match.device_pages:
            match = self.tree.match(lease.keys[:cached], count_hit=False)
        self._settle(lease, match)
        return lease

    def _load_back(self, match: MatchResult) -> bool:
        """Host -> device for the host part of ``match``: every needed unit or none."""
        nodes = match.path[match.device_nodes : match.host_nodes]
        end = match.host_node
        wanted: dict[str, list[TreeNode]] = {}
        for tp in self.tree_pools.values():
            p = self.tree.index[tp.name]
            if tp.kind is PoolKind.STATE:
                candidates = [end]
            elif tp.kind is PoolKind.WINDOW:
                candidates = list(reversed(self.tree.window_nodes(end, tp.name)))
            else:
                candidates = list(match.path[: match.host_nodes]) if p else nodes
            wanted[tp.name] = [n for n in candidates if n.device[p] is None and n.host[p] is not None]
        needs = {name: sum(len(n.host[self.tree.index[name]]) for n in ns) for name, ns in wanted.items()}
        if not any(needs.values()):
            return False
        got = self._alloc_protecting(end, Tier.DEVICE, needs)  # the nodes being loaded stay
        if got is None:
            self.metrics.fail()
            return False
        handles = []
        nbytes = 0
        for name, ns in wanted.items():
            if not ns:
                continue
            p = self.tree.index[name]
            host = torch.cat([n.host[p] for n in ns])  # type: ignore[misc]
            handles += self.pools.host_to_device(name, host, got[name])
            nbytes += len(host) * sum(
                self.pools.pools[f].spec.bytes_per_unit for f in self.tree_pools[name].followers
            )
        for handle in handles:
            handle.wait()
        # anchor first, root to leaf (device prefixes stay closed), then the components
        for name, ns in wanted.items():
            p = self.tree.index[name]
            offset = 0
            for node in ns:
                width = len(node.host[p])  # type: ignore[arg-type]
                self.tree.set_device_value(node, name, got[name][offset : offset + width])
                offset += width
        self.metrics.count("load_backs")
        self.metrics.add_bytes("host_to_device", nbytes)
        return True

    def _settle(self, lease: Lease, match: MatchResult) -> None:
        """Fix the lease's prefix at the device-usable length of ``match``; move its lock there."""
        if lease._host_lock is not None:
            self.tree.unlock(lease._host_lock)
            lease._host_lock = None
        if lease._device_lock is not None:
            self.tree.unlock(lease._device_lock)
            lease._device_lock = None
        cached = match.device_pages
        if cached:
            lease._device_lock = self.tree.lock(match.device_node, Tier.DEVICE)
        lease.cached_pages = cached
        for tp in self.tree_pools.values():
            if cached == 0:
                lease._prefix[tp.name], lease._first[tp.name] = _EMPTY, 0
            elif tp.kind is PoolKind.STATE:
                lease._prefix[tp.name] = match.device_state[tp.name]
                lease._first[tp.name] = cached - 1
            elif tp.kind is PoolKind.WINDOW:
                nodes = list(reversed(self.tree.window_nodes(match.device_node, tp.name)))
                lease._prefix[tp.name] = self.tree.values(nodes, tp.name)
                lease._first[tp.name] = nodes[0].depth_start
            else:
                lease._prefix[tp.name] = self.tree.values(match.device_path, tp.name)
                lease._first[tp.name] = 0
        device = min(lease.device_pages, cached)
        storage = max(0, min(cached, lease.host_pages + lease._storage_pages) - max(lease.host_pages, device))
        lease.hit_pages = {"device": device, "host": cached - device - storage, "storage": storage}
        lease.admitted = True
        if lease.record:
            self.metrics.request(
                lease.pages * self.page_size, {t: n * self.page_size for t, n in lease.hit_pages.items()}
            )

    # --- allocate / insert / release ----------------------------------------------------------

    def allocate(self, lease: Lease) -> dict[str, torch.Tensor]:
        """Device units for pages [cached_pages, pages) of every pool (sidecars share their
        owner's units; node-state pools get one slot). Raises :class:`CacheFullError`."""
        self._check_lease(lease)
        if not lease.admitted:
            self.admit(lease)
        if lease._allocated is not None:
            raise RuntimeError("units already allocated for this lease")
        new = lease.pages - lease.cached_pages
        needs = {tp.name: tp.units_for(new) for tp in self.tree_pools.values()}
        got = self._alloc(Tier.DEVICE, needs)
        if got is None:
            self.metrics.fail()
            raise CacheFullError(
                f"device tier cannot hold {new} new pages ({needs}) even after evicting every "
                "unlocked page: raise tiers.device.capacity_tokens or admit fewer requests at once"
            )
        lease._allocated = got
        return {name: got[owner] for name, owner in self._owner_of.items()}

    def insert(self, lease: Lease) -> None:
        """Index the pages the engine computed, back them up per write policy, close the lease."""
        self._check_lease(lease)
        self.poll()
        got = lease._allocated
        if got is None:
            raise RuntimeError("insert needs the units from cache.allocate(lease)")
        node: TreeNode | None = None
        if lease.pages > lease.cached_pages:
            result = self.tree.insert(lease.keys, got)
            self._free(Tier.DEVICE, result.duplicates)
            node = result.node
        lease._allocated = None
        self._close_lease(lease)
        if node is not None and self.policy.write == "write_through":
            path = []
            while node is not None and node is not self.tree.root:
                path.append(node)
                node = node.parent
            self._back_up(list(reversed(path)), hashes=lease.page_hashes)

    def release(self, lease: Lease) -> None:
        """Abort a request: free its unused units, end its prefetch, unlock its prefix."""
        if lease.closed:
            return
        if lease._allocated is not None:
            self._free(Tier.DEVICE, lease._allocated)
            lease._allocated = None
        if lease._prefetch is not None:
            self._commit_prefetch(lease, 0)
        self._close_lease(lease)

    def _close_lease(self, lease: Lease) -> None:
        for attr in ("_device_lock", "_host_lock"):
            handle = getattr(lease, attr)
            if handle is not None:
                self.tree.unlock(handle)
                setattr(lease, attr, None)
        lease.closed = True
        self._leases.discard(id(lease))

    def _check_lease(self, lease: Lease) -> None:
        self._check_open()
        if lease.closed:
            raise RuntimeError("lease is closed (inserted or released)")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("cache is closed")

    # --- backups (L1 -> L2 -> L3) -------------------------------------------------------------

    def _back_up(self, nodes: Iterable[TreeNode], *, hashes: Sequence[str] | None = None) -> None:
        """Copy device-only nodes to host, root first, stopping at the first that does not fit or
        whose parent has no backup (backups stay a contiguous prefix); queue their L3 write."""
        if not self.pools.host_enabled:
            return
        todo: list[TreeNode] = []
        allocated: list[dict[str, torch.Tensor]] = []
        contiguous = self.policy.write != "write_back"
        for node in nodes:
            if self.tree.backed_up(node) or node.device[0] is None:
                continue
            parent = node.parent
            if contiguous and parent is not self.tree.root and not self.tree.backed_up(parent):  # type: ignore[arg-type]
                break
            needs = {}
            for name in self.tree_pools:
                value = node.device[self.tree.index[name]]
                needs[name] = 0 if value is None else len(value)
            got = self._alloc_protecting(node, Tier.HOST, needs)
            if got is None:
                self.metrics.fail()
                break
            todo.append(node)
            allocated.append(got)
        if not todo:
            return
        handles = []
        nbytes = 0
        for name, tp in self.tree_pools.items():
            p = self.tree.index[name]
            pairs = [(n.device[p], a[name]) for n, a in zip(todo, allocated, strict=True) if len(a[name])]
            if not pairs:
                continue
            device = torch.cat([d for d, _ in pairs])  # type: ignore[misc]
            host = torch.cat([h for _, h in pairs])
            handles += self.pools.device_to_host(name, device, host)
            nbytes += len(host) * sum(self.pools.pools[f].spec.bytes_per_unit for f in tp.followers)
        for handle in handles:
            handle.wait()
        for node, got in zip(todo, allocated, strict=True):
            for name in self.tree_pools:  # anchor first: it marks the node backed up
                if len(got[name]):
                    self.tree.set_host_value(node, name, got[name])
        self.metrics.count("backups", len(todo))
        self.metrics.add_bytes("device_to_host", nbytes)
        if self.engine is not None:
            self._queue_write(todo, hashes)

    def _back_up_for_eviction(self, shortfall: Mapping[str, int]) -> None:
        """Write-back: back up least recently used device nodes before evicting them."""
        want = shortfall.get(self.anchor, 0) or max(shortfall.values(), default=0)
        candidates = [
            n
            for n in self.tree.holding(self.anchor, Tier.DEVICE)
            if not self.tree.backed_up(n) and not any(n.device_lock)
        ]
        candidates.sort(key=lambda n: (n.last_access, n.id))
        chosen, units = [], 0
        for node in candidates:
            if units >= want:
                break
            chosen.append(node)
            units += node.pages
        chosen.sort(key=lambda n: n.depth_end)
        self._back_up(chosen)

    def _node_hashes(self, node: TreeNode) -> list[str]:
        """Page hashes of ``node``'s pages, rebuilt from the keys of its path (token pages)."""
        path = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.tree.root:
            path.append(cur)
            cur = cur.parent
        keys = [k for n in reversed(path) for k in n.keys]
        tokens = np.frombuffer(b"".join(keys), dtype=np.int64)
        return hash_pages(tokens, self.page_size, self.namespace_root)[node.depth_start :]

    def _queue_write(self, nodes: Sequence[TreeNode], hashes: Sequence[str] | None) -> None:
        """L2 -> L3 for freshly backed-up nodes: batches built here, written on the worker."""
        assert self.engine is not None
        per_pool: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
        for node in nodes:
            if hashes is not None:
                node_hashes = list(hashes[node.depth_start : node.depth_end])
            else:
                node_hashes = self._node_hashes(node)
            for name, tp in self.tree_pools.items():
                value = node.host[self.tree.index[name]]
                if value is None:
                    continue
                page_hashes = node_hashes[-1:] if tp.kind is PoolKind.STATE else node_hashes
                for follower in tp.followers:
                    entry = per_pool.setdefault(follower, ([], []))
                    entry[0].extend(page_hashes)
                    entry[1].append(value)
        batches = {}
        for name, (page_hashes, values) in per_pool.items():
            if self.engine.plans[name].writes:
                batches[name] = self._batch(name, torch.cat(values), page_hashes)
        if not batches:
            return
        locks = [self.tree.lock(n, Tier.HOST) for n in nodes]
        self._writes.append(_Write(locks, self._writer.submit(self.engine.put_group, batches)))
        self.metrics.count("storage_writes")

    # --- owner-thread commit points -----------------------------------------------------------

    def poll(self) -> None:
        """Drain finished storage work: unlock written nodes, count failures, free revoked
        prefetch slots. Called at the start of every public call; cheap when nothing finished."""
        if self._writes:
            pending = []
            for write in self._writes:
                if write.future.done():
                    self._finish_write(write)
                else:
                    pending.append(write)
            self._writes = pending
        if self._orphans:
            alive = []
            for op in self._orphans:
                if op.done.is_set():
                    self._reserved_pages -= len(op.hashes)
                    self._free(Tier.HOST, op.reserved)
                else:
                    alive.append(op)
            self._orphans = alive

    def _finish_write(self, write: _Write) -> None:
        try:
            results = write.future.result()
        except Exception:  # the engine does not raise on backend errors; this is a bug guard
            log.exception("L3 write failed")
            self.metrics.fail()
            results = {}
        nbytes = 0
        for name, result in results.items():
            self._count_failure(result)
            nbytes += sum(result.ok) * self.pools.pools[name].spec.bytes_per_unit
        self.metrics.add_bytes("host_to_storage", nbytes)
        for handle in write.locks:
            self.tree.unlock(handle)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every queued L3 write and revoked prefetch, then commit their results."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for write in list(self._writes):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                write.future.exception(remaining)
            except TimeoutError:
                break
        for op in list(self._orphans):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            op.done.wait(remaining)
        self.poll()

    # --- late pools -----------------------------------------------------------------------------

    def add_pool(self, name: str, config: PoolConfig | Mapping[str, Any]) -> Pool:
        """Add a sidecar pool at runtime (e.g. a speculative draft pool) with its own I/O plan.

        Pages cached before it existed hold no data for it, so they are dropped from both tiers
        (no request may hold a lease meanwhile); L3 entries without its objects miss by rule.
        """
        self._check_open()
        if self._leases:
            raise RuntimeError(f"add_pool({name!r}) needs no open leases ({len(self._leases)} open)")
        self.flush()
        pool = self.pools.add_pool(name, config)
        if pool.role is not PoolRole.SIDECAR:
            raise ValueError(
                f"pool {name!r} is a {pool.role.value}: only sidecars (pools with an index_source) "
                "can be added after start"
            )
        everything = {tp: 1 << 62 for tp in self.tree_pools}
        self.tree.evict_device(everything, self._free_evicted(Tier.DEVICE))
        self.tree.evict_host(everything, self._free_evicted(Tier.HOST))
        self._describe_pools()
        if self.engine is not None and self.backend is not None:
            (plan,) = self._plan(self.backend, [pool.spec]).values()
            self.engine.add_pool(name, pool.spec, plan)
        return pool

    # --- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self._reader.shutdown(wait=True, cancel_futures=True)
            if self.backend is not None:
                hook = self.plugins.hook
                hook.kvstrata_backend_closing(instance=self.backend.instance, backend=self.backend)
                self.backend.close()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
