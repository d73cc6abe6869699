"""The storage engine: per-pool batch exists / put / get of unit objects on one backend instance.

It is the only code that talks to a backend on the data path. It builds keys from the pool's
:class:`~kvstrata.core.keys.KeySchema`, prepends the integrity header as the first region,
follows the frozen :class:`~kvstrata.core.io_plan.IOPlan` (zero-copy regions straight from the
host pool, or a staging copy), verifies every object read back (a bad one is a miss counted in
:class:`StorageMetrics`), and turns any backend exception into a failed operation -- it never
propagates, so a broken backend cannot kill a storage thread or leak host slots.

Units and regions: one *unit* is a page (or a state slot) of a pool; it is stored as one object
per ``ObjectSpec`` of the pool. Callers pass, per unit, one sequence of :class:`BufferRegion` per
object, in ``ObjectSpec`` order, whose bytes in order are the canonical payload (see
:mod:`kvstrata.core.integrity`). A pool without buffers (a logical anchor) stores one header-only
marker object per unit; its units may be omitted (``PoolBatch(hashes)``) or be empty (``[]``,
``[()]``, what ``object_regions`` returns for it).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvstrata.core.backend_calls import BackendCalls, Notify
from kvstrata.core.breaker import CircuitBreaker
from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import (
    DAMAGE,
    FOREIGN,
    ChecksumPolicy,
    fill_headers,
    fingerprint_words,
    layout_fingerprint,
    stored_objects,
)
from kvstrata.core.io_plan import IOMode, IOPlan
from kvstrata.core.keys import KeySchema
from kvstrata.core.storage_batch import (
    BatchResult,
    ObjectBatch,
    PoolBatch,
    ReadChecks,
    UnitRegions,
    build_objects,
    checked_units,
    get_group,
    longest_present_prefix,
    put_group,
    read_order,
    stage_in,
    stage_out,
    write_order,
)
from kvstrata.core.storage_metrics import StorageMetrics, StorageOperation
from kvstrata.core.storage_reread import verify_read
from kvstrata.plugins.pool_type import PoolSpec
from kvstrata.plugins.storage_backend import BackendConfig, BreakerConfig, StorageBackend

__all__ = [
    "DAMAGE",
    "FOREIGN",
    "BatchResult",
    "PoolBatch",
    "StorageEngine",
    "StorageMetrics",
    "StorageOperation",
    "UnitRegions",
    "longest_present_prefix",
    "read_order",
    "write_order",
]

log = logging.getLogger(__name__)


class StorageEngine(BackendCalls):
    """Batch I/O of one stack's pools on one backend instance, driven only by plans and specs."""

    def __init__(
        self,
        backend: StorageBackend,
        specs: Mapping[str, PoolSpec],
        plans: Mapping[str, IOPlan],
        *,
        model_name: str,
        cache_salt: str = "",
        parallel: ParallelConfig,
        checksum: ChecksumPolicy = "xxh3",
        notify: Notify | None = None,
    ) -> None:
        """``notify``: calls the plugins' per-batch event hooks (``PluginHost.notify``, which
        never lets an observer fail the operation); optional."""
        missing = set(specs) - set(plans)
        if missing:
            raise ValueError(f"no I/O plan for pools {sorted(missing)}")
        self.backend = backend
        #: leave objects of another layout or format where they are (a read-only reader of a shared
        #: store: they are another writer's, valid for its readers); damaged ones are still removed
        self.keep_foreign = False
        self._checksum: ChecksumPolicy = checksum
        backend.set_read_verification(checksum == "xxh3")
        self.metrics = StorageMetrics()
        self._notify = notify
        self._lock = threading.Lock()
        self._key_context = {"model_name": model_name, "cache_salt": cache_salt, "parallel": parallel}
        self.specs: dict[str, PoolSpec] = {}
        self.plans: dict[str, IOPlan] = {}
        self.schemas: dict[str, KeySchema] = {}
        self._suffixes: dict[str, list[str]] = {}
        self._payload_bytes: dict[str, list[int]] = {}
        self._unit_bytes: dict[str, int] = {}
        self._fingerprints: dict[str, np.ndarray] = {}
        for name, spec in specs.items():
            self.add_pool(name, spec, plans[name])
        capabilities = backend.instance_capabilities()
        self._removable = capabilities.removable
        self._backend_checks_reads = _takes_argument(backend.get, "check")
        # Declared (not merely accepted): every object read was hashed by its I/O thread, so the
        # engine makes no second pass over the batch's bytes (a row left unchecked still gets its
        # full verdict from verify_object, which hashes that one object).
        self._reads_checked = self._backend_checks_reads and capabilities.checks_reads
        self._backend_stops_early = _takes_argument(backend.exists, "leading")
        config = getattr(backend, "config", None)
        breaker = config.circuit_breaker if isinstance(config, BackendConfig) else BreakerConfig()
        self.read_breaker = CircuitBreaker(breaker.failures, breaker.cooldown_s)
        self.write_breaker = CircuitBreaker(breaker.failures, breaker.cooldown_s)

    @property
    def checksum(self) -> ChecksumPolicy:
        return self._checksum

    @checksum.setter
    def checksum(self, policy: ChecksumPolicy) -> None:
        """Kept in step with the backend, which may rely on every read being verified."""
        self._checksum = policy
        self.backend.set_read_verification(policy == "xxh3")

    def add_pool(self, name: str, spec: PoolSpec, plan: IOPlan) -> None:
        """Start serving one more pool (e.g. a draft pool added after start) with its own plan."""
        if name in self.specs:
            raise ValueError(f"pool {name!r} is already served by this engine")
        self.specs[name] = spec
        self.plans[name] = plan
        self.schemas[name] = KeySchema.for_pool(spec, **self._key_context)
        # A bufferless pool stores one header-only marker object per unit (see stored_objects).
        objects = stored_objects(spec)
        self._suffixes[name] = [suffix for suffix, _ in objects]
        self._payload_bytes[name] = [nbytes for _, nbytes in objects]
        self._unit_bytes[name] = sum(self._payload_bytes[name])
        self._fingerprints[name] = fingerprint_words(
            [layout_fingerprint(spec, suffix) for suffix, _ in objects]
        )

    # --- keys ---------------------------------------------------------------------------------

    def object_keys(self, pool: str, page_hashes: Sequence[str]) -> list[list[str]]:
        """Keys per object spec (outer) per unit (inner) of ``pool``."""
        schema = self.schemas[pool]
        return [schema.keys(page_hashes, suffix) for suffix in self._suffixes[pool]]

    # --- exists -------------------------------------------------------------------------------

    def exists(self, pool: str, page_hashes: Sequence[str], *, leading: bool = False) -> BatchResult:
        """A unit exists when every one of its objects does.

        ``leading=True``: only the leading run of present units is asked for (its ``prefix``);
        a backend that supports it (``exists`` taking ``leading``) stops at the first missing
        object, so later units may read False although stored."""
        plan = self.plans[pool]
        count = len(page_hashes)
        if not plan.enabled:
            return BatchResult([False] * count, plan.reason, skipped=True)
        if count == 0:
            return BatchResult([])
        if self.read_breaker.refusing():  # before building keys: an outage costs the caller nothing
            return self.refused(StorageOperation.EXISTS, count)
        per_object = self.object_keys(pool, page_hashes)
        self._count(exists_calls=1)
        if leading and self._backend_stops_early:
            # unit-major, so the backend's first missing object ends the leading run of units
            flat = [key for keys in zip(*per_object, strict=True) for key in keys]
            found, error = self._call_backend(StorageOperation.EXISTS, pool, flat, leading=True)
            if found is None:
                return BatchResult([False] * count, error, failed=count, transient=True)
            n_obj = len(per_object)
            return BatchResult([all(found[i * n_obj : (i + 1) * n_obj]) for i in range(count)])
        flat = [key for keys in per_object for key in keys]
        found, error = self._call_backend(StorageOperation.EXISTS, pool, flat)
        if found is None:
            return BatchResult([False] * count, error, failed=count, transient=True)
        if len(per_object) == 1:
            return BatchResult([bool(flag) for flag in found])
        per_key = [found[j * count : (j + 1) * count] for j in range(len(per_object))]
        return BatchResult([all(flags) for flags in zip(*per_key, strict=True)])

    def exists_prefix(self, pool: str, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` the backend holds for ``pool``."""
        return self.exists(pool, page_hashes, leading=True).prefix

    def discard(self, pool: str, page_hashes: Sequence[str]) -> BatchResult:
        """Remove the units' objects no reader asks for again (a finished request's own state
        checkpoints) where the backend removes (elsewhere the store's capacity bound drops them
        like any cold object); a unit is gone when all its objects are."""
        plan, count = self.plans[pool], len(page_hashes)
        why = None if self._removable else f"backend {self.backend.instance!r} does not remove objects"
        if why or not plan.writes:
            return BatchResult([False] * count, why or plan.reason, skipped=True)
        flat = [key for keys in self.object_keys(pool, page_hashes) for key in keys]
        removed, error = self._call_backend(StorageOperation.REMOVE, pool, flat)
        if removed is None:
            return BatchResult([False] * count, error, failed=count, transient=True)
        ok = [all(removed[i::count]) for i in range(count)]  # object-major: unit i every count-th
        return BatchResult(ok, failed=ok.count(False))

    # --- put / get ----------------------------------------------------------------------------

    def _run(
        self,
        pool: str,
        page_hashes: Sequence[str],
        units: Sequence[UnitRegions],
        transfer: Callable[[str, Sequence[UnitRegions], np.ndarray | None, ObjectBatch], BatchResult],
        *,
        writing: bool,
    ) -> BatchResult:
        """Common frame of put/get: answers itself when the plan rules the operation out (off, or a
        write on a read-only rank) or there is nothing to do; else builds the objects (and the
        staging buffer of the copy path, filled for a write) and hands them to ``transfer``."""
        plan = self.plans[pool]
        count = len(page_hashes)
        if not plan.enabled:
            return BatchResult([False] * count, plan.reason, skipped=True)
        if writing and plan.read_only:
            self._count(put_skipped_read_only=count)
            return BatchResult([False] * count, plan.reason, skipped=True)
        units = checked_units(pool, page_hashes, units, self._payload_bytes[pool])
        if count == 0:
            return BatchResult([])
        if (self.write_breaker if writing else self.read_breaker).refusing():
            # Refused before staging copies and checksums: while L3 is down, a write-through
            # cache's puts and a lookup's reads cost the request path nothing (issue 15).
            return self.refused(StorageOperation.PUT if writing else StorageOperation.GET, count)
        staging: np.ndarray | None = None
        if plan.mode is IOMode.COPY:
            staging = np.empty(self._unit_bytes[pool] * count, dtype=np.uint8)
            if writing:
                stage_out(staging, units)
        keys = self.object_keys(pool, page_hashes)
        batch = build_objects(keys, self._payload_bytes[pool], units, staging, self._fingerprints[pool])
        return transfer(pool, units, staging, batch)

    def put(self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions]) -> BatchResult:
        """Store every unit (one object per ObjectSpec); a unit succeeds when all its objects do.

        A unit the backend did not store (it raised, or refused an object: disk full, read-only
        directory, capacity, a size limit) is a failure: counted in ``put_failed`` and in the
        result's ``failed``, with ``error`` saying so.
        """
        return self._run(pool, page_hashes, units, self._put_objects, writing=True)

    def _put_objects(
        self, pool: str, _units: Sequence[UnitRegions], _staging: np.ndarray | None, batch: ObjectBatch
    ) -> BatchResult:
        count = batch.units
        fill_headers(
            batch.headers,
            digests=batch.digests,
            fingerprints=batch.fingerprints,
            payload_nbytes=batch.payload_nbytes,
            payloads=batch.views_of_payloads(),
            checksum=self.checksum,
        )
        stored, error = self._call_backend(StorageOperation.PUT, pool, batch.objects)
        if stored is None:
            self._count(put_units=count, put_failed=count)
            return BatchResult([False] * count, error, failed=count, transient=True)
        ok = batch.per_unit(stored)
        failed = ok.count(False)
        written = sum(obj.nbytes for obj, flag in zip(batch.objects, stored, strict=True) if flag)
        self._count(put_units=count, put_failed=failed, bytes_written=written)
        if failed:
            error = (
                f"put on backend {self.backend.instance!r} (pool {pool!r}): {failed} of {count} units "
                "not stored (the backend refused objects: full, read-only, over a size limit?)"
            )
            log.debug(error)
        if failed < count:
            self._emit(
                "kvstrata_pages_stored",
                instance=self.backend.instance,
                pool=pool,
                pages=count - failed,
                nbytes=written,
            )
        return BatchResult(ok, error, failed=failed)

    def get(self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions]) -> BatchResult:
        """Read every unit into its regions; a missing, short or failing object makes the unit a miss.

        On a zero-copy miss the destination regions may hold partial bytes: the caller must not
        use a unit whose result is False. An object that fails verification is removed when the
        backend can remove -- a damaged one so it is not read again and again, a foreign one
        (another layout under the same key) so the key can be written again in this layout.
        """
        return self._run(pool, page_hashes, units, self._get_objects, writing=False)

    def _get_objects(
        self, pool: str, units: Sequence[UnitRegions], staging: np.ndarray | None, batch: ObjectBatch
    ) -> BatchResult:
        count = batch.units
        read, error, checks = self._read(pool, batch)
        if read is None:
            self._count(get_units=count, get_misses=count)
            return BatchResult([False] * count, error, failed=count, transient=True)
        # a rejected object is read once more before it counts or is removed (see storage_reread)
        kept = FOREIGN if self.keep_foreign else ()  # (not removed: not read again either)
        good, rejected, cleared = verify_read(
            batch, read, self.checksum, checks, lambda b: self._read(pool, b), kept
        )
        ok = batch.per_unit(good)
        if staging is not None:
            stage_in(staging, units, ok, self._unit_bytes[pool])
        delivered = np.repeat(np.asarray(ok, dtype=np.bool_), batch.n_obj)  # per object: its unit's verdict
        nbytes = int(np.asarray(read, dtype=np.int64)[delivered].sum())
        corrupt = {v.value: len(keys) for v, keys in rejected.items() if v not in FOREIGN}
        foreign = {v.value: len(keys) for v, keys in rejected.items() if v in FOREIGN}
        with self._lock:
            self.metrics.record_get(count, ok.count(True), nbytes, corrupt, foreign, cleared)
        if corrupt:
            log.warning("pool %r: rejected damaged objects %s", pool, corrupt)
        if foreign:
            log.info(
                "pool %r: objects of another layout or format under our keys, replaced: %s", pool, foreign
            )
        if not rejected:
            return BatchResult(ok)
        self._remove_rejected(pool, rejected)
        refused = {key for keys in rejected.values() for key in keys}
        per_unit = batch.n_obj
        units_refused = sorted({i // per_unit for i, obj in enumerate(batch.objects) if obj.key in refused})
        return BatchResult(ok, foreign=sum(foreign.values()), rejected=tuple(units_refused))

    def _read(self, pool: str, batch: ObjectBatch) -> tuple[list[int] | None, str | None, ReadChecks | None]:
        """Bytes read per object (None: the call failed, and why) and the checks the backend's
        I/O threads ran (verified reads)."""
        checks = ReadChecks(batch, trusted=self._reads_checked) if self.checksum == "xxh3" else None
        options = {"check": checks} if checks is not None and self._backend_checks_reads else {}
        return (*self._call_backend(StorageOperation.GET, pool, batch.objects, **options), checks)

    # --- multi-pool ---------------------------------------------------------------------------

    def put_group(self, batches: Mapping[str, PoolBatch]) -> dict[str, BatchResult]:
        """Write several pools' objects for the same pages, anchor LAST.

        An anchor page is written only if every other pool of the group that has that page stored
        it, so a visible anchor object implies its sidecars and components are there.
        """
        return put_group(self.specs, self.put, batches)

    def get_group(self, batches: Mapping[str, PoolBatch]) -> dict[str, BatchResult]:
        """Read several pools for the same pages, anchor FIRST; other pools only read the pages
        the anchor delivered (with no anchor in the group, every pool reads every page)."""
        return get_group(self.specs, self.get, batches)


def _takes_argument(method: Callable[..., Any], name: str) -> bool:
    """Whether a backend method takes an optional argument (``get``'s ``check``, ``exists``'s
    ``leading``; see ``StorageBackend``).

    Read from the signature, as pluggy reads a hook implementation's arguments: a backend written
    before the argument existed, or a subclass overriding the method without it, simply never
    gets it (its objects are verified on the engine thread; its exists answers every key).
    """
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False
