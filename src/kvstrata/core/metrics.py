"""Counters of one cache: hits per tier, bytes per direction, operations, failures, latencies.

Updated by the owner thread and the storage workers (hence the lock), read by ``snapshot()``,
the replay report and the optional Prometheus exporter (:mod:`kvstrata.prometheus`). Updates
happen per request or per batch, never per page.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.core.storage_batch import BatchResult

from kvstrata.core.storage_metrics import StorageMetrics

#: Latency samples kept per kind (the newest; enough for stable percentiles).
LATENCY_SAMPLES = 100_000

TIERS = ("device", "host", "storage")
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host")


class Operation(StrEnum):
    """What the controller and its parts count (``snapshot()["operations"]``, the
    ``kvstrata_operations`` Prometheus family's ``operation`` label): the values are those names."""

    BACKUPS = "backups"
    BACKUPS_WAITED = "backups_waited"  # backups that waited for in-flight L3 writes to free host units
    BACKUPS_SKIPPED = "backups_skipped"  # backups not made: the host tier stayed full (not failures)
    LOAD_BACKS = "load_backs"
    STORAGE_WRITES = "storage_writes"
    STORAGE_WRITES_ABANDONED = "storage_writes_abandoned"  # unfinished at close()'s deadline: cancelled
    PREFETCHES_STARTED = "prefetches_started"
    PREFETCHES_COMMITTED = "prefetches_committed"
    PREFETCHES_DROPPED = "prefetches_dropped"
    PREFETCHES_REVOKED = "prefetches_revoked"
    PREFETCHES_SKIPPED = "prefetches_skipped"
    # pages offered to a tier by admission (policy.admission) and taken / refused, pins refused
    HOST_ADMITTED = "host_admitted"
    HOST_REJECTED = "host_rejected"
    STORAGE_ADMITTED = "storage_admitted"
    STORAGE_REJECTED = "storage_rejected"
    PINS_REFUSED = "pins_refused"
    # window-pool pages tombstoned per tier as out-of-window data (outside the last window of
    # every prefix the tier holds): they leave before anything a cached prefix needs
    OUT_OF_WINDOW_DEVICE = "out_of_window_device"
    OUT_OF_WINDOW_HOST = "out_of_window_host"

    @classmethod
    def out_of_window(cls, tier: str) -> Operation:
        """The out-of-window count of ``tier`` (``"device"`` or ``"host"``)."""
        return cls(f"out_of_window_{tier}")


#: every operation name, in snapshot order
OPERATIONS = tuple(Operation)
LATENCIES = ("match", "load_back", "prefetch")


class SkipReason(StrEnum):
    """Why pages the host tier or L3 could have served were not used (no miss goes unexplained).

    Counted per lease (``Lease.skipped``) and in :attr:`CacheMetrics.skipped_pages`. For the
    gates (threshold, host fraction, rate limit, disabled) and ``storage_down`` the pages are the
    ones asked for (L3 was not asked, or could not say what it holds); for the others, pages L3
    or the host tier held (a read revoked before L3 answered is counted when it ends).
    """

    BELOW_THRESHOLD = "below_threshold"  # fewer tokens to fetch than policy.prefetch.threshold_tokens
    HOST_FRACTION = "host_fraction"  # the read alone exceeds host_fraction_limit of the host tier
    RATE_LIMIT = "rate_limit"  # reads in flight plus this one exceed host_fraction_limit
    DISABLED = "disabled"  # the caller asked for no prefetch
    STORAGE_DOWN = "storage_down"  # L3's breaker is open (not asked), or its existence query failed
    TIMEOUT = "timeout"  # the read had not finished at admit (timeout / best_effort policies)
    HOST_FULL = "host_full"  # no room in the host tier even after eviction
    DAMAGED_OBJECT = "damaged_object"  # an object failed verification or could not be read
    OBJECT_GONE = "object_gone"  # an object L3 said it held was gone at the read (evicted meanwhile)
    LAYOUT_MISMATCH = "layout_mismatch"  # an object of another layout / format under our key
    INCOMPLETE_STACK = "incomplete_stack"  # a pool of the stack lacks objects (window, state, sidecar)
    RANK_DISAGREEMENT = "rank_disagreement"  # another rank holds less
    UNBACKED_PARENT = "unbacked_parent"  # the refill would sit below a device page with no host copy
    DEVICE_FULL = "device_full"  # host pages could not be loaded back: no room on the device
    BELOW_LOAD_BACK_THRESHOLD = "below_load_back_threshold"  # policy.load_back_threshold_tokens
    RELEASED = "released"  # the request was released (aborted) before its prefetch was used


@dataclass
class CacheMetrics:
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    operations: dict[Operation, int] = field(default_factory=lambda: dict.fromkeys(Operation, 0))
    #: failed operations: one per storage call that failed (whole or in part; the units are the
    #: storage counters' `put_failed`), backup, load-back or allocation that could not complete
    failures: int = 0
    #: pages that could have been served but were not, by :class:`SkipReason`
    skipped_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SkipReason, 0))
    latency_s: dict[str, deque[float]] = field(
        default_factory=lambda: {kind: deque(maxlen=LATENCY_SAMPLES) for kind in LATENCIES}
    )
    #: samples ever recorded per kind (the deques keep only the newest LATENCY_SAMPLES)
    latency_count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LATENCIES, 0))
    #: seconds ever recorded per kind: with ``latency_count``, a summary that only grows
    latency_sum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LATENCIES, 0.0))
    #: units that left a tier by eviction, per tier and pool (also what ``kvstrata_eviction``
    #: hears): how hard each tier's capacity is pressed
    evicted_units: dict[str, dict[str, int]] = field(default_factory=lambda: {"device": {}, "host": {}})
    #: the storage engine's counters, attached at start-up when the cache has L3 (:meth:`attach`)
    storage: StorageMetrics | None = None
    #: the controller's count of open leases (a gauge, set at start-up): an engine that drops
    #: leases without insert or release holds their units until close, and this shows it first
    lease_count: Callable[[], int] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def attach(self, storage: StorageMetrics) -> None:
        """Report ``storage`` (the engine's counters) with this cache's: ``corrupt_detected`` and
        ``snapshot()["storage"]`` read it."""
        self.storage = storage

    def count(self, operation: Operation, n: int = 1) -> None:
        with self._lock:
            self.operations[operation] += n

    def add_bytes(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[direction] += nbytes

    def fail(self, n: int = 1) -> None:
        with self._lock:
            self.failures += n

    def skip(self, reason: SkipReason, pages: int, into: dict[str, int] | None = None) -> None:
        """Count ``pages`` not served for ``reason`` (also into a lease's ``skipped``)."""
        if pages <= 0:
            return
        with self._lock:
            self.skipped_pages[reason] += pages
        if into is not None:
            into[reason] = into.get(reason, 0) + pages

    def evicted(self, tier: str, units: Mapping[str, int]) -> None:
        with self._lock:
            per_pool = self.evicted_units[tier]
            for pool, n in units.items():
                per_pool[pool] = per_pool.get(pool, 0) + n

    def latency(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.latency_s[kind].append(seconds)
            self.latency_count[kind] += 1
            self.latency_sum[kind] += seconds

    def request(self, tokens: int, hits: dict[str, int]) -> None:
        with self._lock:
            self.requests += 1
            self.lookup_tokens += tokens
            for tier, n in hits.items():
                self.hit_tokens[tier] += n

    @property
    def corrupt_detected(self) -> int:
        return self.storage.corrupt_detected if self.storage is not None else 0

    def snapshot(self, *, samples: bool = True) -> dict[str, Any]:
        """A plain-data copy (JSON-serialisable) of every counter; without ``samples`` the
        latency windows (up to 100k floats each) are left out and ``latency_s`` is empty: a
        scrape reads counts and sums only, and copying the windows held the lock the data path
        counts under for about a millisecond."""
        with self._lock:
            hits = dict(self.hit_tokens)
            hits["total"] = sum(hits.values())
            return {
                "requests": self.requests,
                "lookup_tokens": self.lookup_tokens,
                "hit_tokens": hits,
                "bytes": dict(self.bytes),
                "operations": {str(operation): n for operation, n in self.operations.items()},
                "failures": self.failures,
                "skipped_pages": {str(reason): n for reason, n in self.skipped_pages.items()},
                "evicted_units": {tier: dict(pools) for tier, pools in self.evicted_units.items()},
                "corrupt_detected": self.corrupt_detected,
                "open_leases": self.lease_count() if self.lease_count is not None else 0,
                "storage": self.storage.counters() if self.storage is not None else {},
                "latency_s": {kind: list(kept) for kind, kept in self.latency_s.items()} if samples else {},
                "latency_count": dict(self.latency_count),
                "latency_sum_s": dict(self.latency_sum),
            }


def count_failure(metrics: CacheMetrics, result: BatchResult) -> None:
    """One failure for a storage call that failed, whole or in part (the units it did not store
    are the storage counters' ``put_failed``; a skipped call is a plan, not a failure; a get's
    miss is not a failure)."""
    if not result.skipped and (result.failed or result.error is not None):
        metrics.fail()
