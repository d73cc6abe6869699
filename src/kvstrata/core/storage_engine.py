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

import ctypes
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import (
    HEADER_BYTES,
    ChecksumPolicy,
    Verdict,
    build_header,
    layout_fingerprint,
    stored_objects,
    verify_object,
)
from kvstrata.core.io_plan import IOMode, IOPlan
from kvstrata.core.keys import KeySchema
from kvstrata.plugins.pool_type import PoolRole, PoolSpec
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject

log = logging.getLogger(__name__)

#: Regions of one unit: one sequence of regions per object of the pool, in ObjectSpec order.
UnitRegions = Sequence[Sequence[BufferRegion]]


@dataclass
class StorageMetrics:
    """Counters of one engine (one backend instance); read by metrics exporters."""

    exists_calls: int = 0
    put_units: int = 0
    put_failed: int = 0
    put_skipped_read_only: int = 0
    get_units: int = 0
    get_hits: int = 0
    get_misses: int = 0
    corrupt_detected: int = 0
    corrupt_reasons: dict[str, int] = field(default_factory=dict)
    corrupt_removed: int = 0  # damaged objects deleted so they are not read again
    corrupt_remove_failed: int = 0
    backend_errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per-unit outcome of one batch; ``error`` is set when the whole operation failed."""

    ok: list[bool]
    error: str | None = None
    skipped: bool = False  # nothing attempted (plan off / read-only): ``error`` says why

    @property
    def prefix(self) -> int:
        return longest_present_prefix(self.ok)


#: Verdicts that mean the stored bytes are damaged (not merely another writer's layout or format
#: version, which a deployment sharing the store may still read): such objects are removed.
DAMAGE = frozenset(
    {Verdict.SHORT_READ, Verdict.BAD_MAGIC, Verdict.LENGTH_MISMATCH, Verdict.CHECKSUM_MISMATCH}
)


@dataclass(frozen=True, slots=True)
class _Batch:
    """The objects of one put/get, unit-major, with their payload regions and header rows."""

    objects: list[StorageObject]
    payloads: list[tuple[BufferRegion, ...]]
    headers: np.ndarray  # (len(objects), HEADER_BYTES) uint8, the first region of each object
    n_obj: int  # objects per unit

    @property
    def units(self) -> int:
        return len(self.objects) // self.n_obj

    def per_unit(self, flags: Sequence[Any]) -> list[bool]:
        """A unit succeeds when every one of its objects does."""
        n_obj = self.n_obj
        if n_obj == 1:
            return [bool(flag) for flag in flags]
        return [all(flags[i : i + n_obj]) for i in range(0, len(flags), n_obj)]


@dataclass(frozen=True, slots=True)
class PoolBatch:
    """One pool's share of a multi-pool operation on the same pages."""

    page_hashes: Sequence[str]
    units: Sequence[UnitRegions] = ()


def longest_present_prefix(flags: Sequence[bool]) -> int:
    """Length of the leading run of ``True``: how many pages from the start are usable."""
    for index, flag in enumerate(flags):
        if not flag:
            return index
    return len(flags)


def write_order(specs: Sequence[PoolSpec]) -> list[PoolSpec]:
    """Sidecars, then components, then the anchor LAST: the anchor object is the commit marker."""
    rank = {PoolRole.SIDECAR: 0, PoolRole.COMPONENT: 1, PoolRole.ANCHOR: 2}
    return sorted(specs, key=lambda spec: rank[spec.role])


def read_order(specs: Sequence[PoolSpec]) -> list[PoolSpec]:
    """Anchor first: no anchor, no point reading the rest."""
    return list(reversed(write_order(specs)))


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


class StorageEngine:
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
        hook: Any | None = None,
    ) -> None:
        """``hook``: a pluggy hook relay (``PluginHost.hook``) for per-batch events; optional."""
        missing = set(specs) - set(plans)
        if missing:
            raise ValueError(f"no I/O plan for pools {sorted(missing)}")
        self.backend = backend
        self.checksum: ChecksumPolicy = checksum
        self.metrics = StorageMetrics()
        self._hook = hook
        self._lock = threading.Lock()
        self._key_context = {"model_name": model_name, "cache_salt": cache_salt, "parallel": parallel}
        self.specs: dict[str, PoolSpec] = {}
        self.plans: dict[str, IOPlan] = {}
        self.schemas: dict[str, KeySchema] = {}
        self._suffixes: dict[str, list[str]] = {}
        self._payload_bytes: dict[str, list[int]] = {}
        self._unit_bytes: dict[str, int] = {}
        self._fingerprints: dict[str, list[bytes]] = {}
        for name, spec in specs.items():
            self.add_pool(name, spec, plans[name])
        self._removable = backend.instance_capabilities().removable

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
        self._fingerprints[name] = [layout_fingerprint(spec, suffix) for suffix, _ in objects]

    # --- keys ---------------------------------------------------------------------------------

    def object_keys(self, pool: str, page_hashes: Sequence[str]) -> list[list[str]]:
        """Keys per object spec (outer) per unit (inner) of ``pool``."""
        schema = self.schemas[pool]
        return [schema.keys(page_hashes, suffix) for suffix in self._suffixes[pool]]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.metrics, name, getattr(self.metrics, name) + delta)

    def _emit(self, name: str, **kwargs: Any) -> None:
        """Call a per-batch hook; an observer's failure must never fail the operation."""
        if self._hook is None:
            return
        try:
            getattr(self._hook, name)(**kwargs)
        except Exception:
            log.exception("hook %s raised; ignored", name)

    def _backend_failed(self, operation: str, pool: str, exc: BaseException) -> str:
        self._count(backend_errors=1)
        message = f"{operation} on backend {self.backend.instance!r} (pool {pool!r}) failed: {exc!r}"
        log.warning(message)
        self._emit(
            "kvstrata_operation_failed", operation=operation, instance=self.backend.instance, error=exc
        )
        return message

    # --- exists -------------------------------------------------------------------------------

    def exists(self, pool: str, page_hashes: Sequence[str]) -> BatchResult:
        """A unit exists when every one of its objects does."""
        plan = self.plans[pool]
        count = len(page_hashes)
        if not plan.enabled:
            return BatchResult([False] * count, plan.reason, skipped=True)
        if count == 0:
            return BatchResult([])
        per_object = self.object_keys(pool, page_hashes)
        flat = [key for keys in per_object for key in keys]
        self._count(exists_calls=1)
        try:
            found = self.backend.exists(flat)
            if len(found) != len(flat):
                raise RuntimeError(f"backend returned {len(found)} results for {len(flat)} keys")
        except Exception as exc:  # a backend failure fails this call only
            return BatchResult([False] * count, self._backend_failed("exists", pool, exc))
        ok = [all(found[j * count + i] for j in range(len(per_object))) for i in range(count)]
        return BatchResult(ok)

    def exists_prefix(self, pool: str, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` the backend holds for ``pool``."""
        return self.exists(pool, page_hashes).prefix

    # --- put / get ----------------------------------------------------------------------------

    def _checked_units(
        self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions]
    ) -> Sequence[UnitRegions]:
        """Validate ``units`` against the pool's objects; returns them in canonical form.

        A pool whose objects hold no payload (a bufferless pool: one header-only marker object
        per unit) accepts ``units`` empty, or one entry per page of any regions totalling 0 bytes
        (``[]``, ``[()]``...): there is nothing to read or write but the header.
        """
        sizes = self._payload_bytes[pool]
        if not any(sizes):
            if units and len(units) != len(page_hashes):
                raise ValueError(f"pool {pool!r}: {len(units)} units of regions for {len(page_hashes)} pages")
            stray = sum(region.nbytes for unit in units for regions in unit for region in regions)
            if stray:
                raise ValueError(f"pool {pool!r} stores no payload; its units' regions hold {stray} bytes")
            return [[() for _ in sizes]] * len(page_hashes)
        if len(units) != len(page_hashes):
            raise ValueError(f"pool {pool!r}: {len(units)} units of regions for {len(page_hashes)} pages")
        for index, unit in enumerate(units):
            if len(unit) != len(sizes):
                raise ValueError(f"pool {pool!r} unit {index}: {len(unit)} objects, spec has {len(sizes)}")
            for obj_index, regions in enumerate(unit):
                nbytes = sum(region.nbytes for region in regions)
                if nbytes != sizes[obj_index]:
                    raise ValueError(
                        f"pool {pool!r} unit {index} object {obj_index}: regions hold {nbytes} bytes, "
                        f"the spec says {sizes[obj_index]}"
                    )
        return units

    def _run(
        self,
        pool: str,
        page_hashes: Sequence[str],
        units: Sequence[UnitRegions],
        transfer: Callable[[str, Sequence[UnitRegions], np.ndarray | None, _Batch], BatchResult],
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
        units = self._checked_units(pool, page_hashes, units)
        if count == 0:
            return BatchResult([])
        staging: np.ndarray | None = None
        if plan.mode is IOMode.COPY:
            staging = np.empty(self._unit_bytes[pool] * count, dtype=np.uint8)
            if writing:
                self._stage_out(staging, units)
        return transfer(pool, units, staging, self._build_objects(pool, page_hashes, units, staging))

    def _build_objects(
        self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions], staging: np.ndarray | None
    ) -> _Batch:
        """One object per (unit, ObjectSpec), unit-major: a header region, then the payload regions
        (the caller's, or consecutive slices of ``staging`` on the copy path)."""
        sizes = self._payload_bytes[pool]
        n_obj = len(sizes)
        keys = self.object_keys(pool, page_hashes)
        headers = np.zeros((len(page_hashes) * n_obj, HEADER_BYTES), dtype=np.uint8)
        header_ptr = _address(headers)
        cursor = _address(staging) if staging is not None else 0
        objects: list[StorageObject] = []
        payloads: list[tuple[BufferRegion, ...]] = []
        for i, unit in enumerate(units):
            for j, nbytes in enumerate(sizes):
                if not nbytes:
                    payload: tuple[BufferRegion, ...] = ()
                elif staging is not None:
                    payload = (BufferRegion(cursor, nbytes),)
                    cursor += nbytes
                else:
                    payload = tuple(unit[j])
                objects.append(StorageObject(keys[j][i], (BufferRegion(header_ptr, HEADER_BYTES), *payload)))
                payloads.append(payload)
                header_ptr += HEADER_BYTES
        return _Batch(objects, payloads, headers, n_obj)

    def _call_backend(
        self, operation: str, pool: str, objects: Sequence[StorageObject]
    ) -> tuple[list[Any] | None, str | None]:
        """Run ``backend.put/get``; a raise or a wrong-length answer fails the whole call."""
        try:
            answer = list(getattr(self.backend, operation)(objects))
            if len(answer) != len(objects):
                raise RuntimeError(f"backend returned {len(answer)} results for {len(objects)} objects")
        except Exception as exc:
            return None, self._backend_failed(operation, pool, exc)
        return answer, None

    def put(self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions]) -> BatchResult:
        """Store every unit (one object per ObjectSpec); a unit succeeds when all its objects do."""
        return self._run(pool, page_hashes, units, self._put_objects, writing=True)

    def _put_objects(
        self, pool: str, _units: Sequence[UnitRegions], _staging: np.ndarray | None, batch: _Batch
    ) -> BatchResult:
        count = batch.units
        fingerprints = self._fingerprints[pool]
        header_bytes = batch.headers.reshape(-1).data
        for row, (obj, payload) in enumerate(zip(batch.objects, batch.payloads, strict=True)):
            start = row * HEADER_BYTES
            header_bytes[start : start + HEADER_BYTES] = build_header(
                obj.key, fingerprints[row % batch.n_obj], payload, self.checksum
            )
        stored, error = self._call_backend("put", pool, batch.objects)
        if stored is None:
            self._count(put_units=count, put_failed=count)
            return BatchResult([False] * count, error)
        ok = batch.per_unit(stored)
        written = sum(obj.nbytes for obj, flag in zip(batch.objects, stored, strict=True) if flag)
        self._count(put_units=count, put_failed=ok.count(False), bytes_written=written)
        if any(ok):
            self._emit(
                "kvstrata_pages_stored",
                instance=self.backend.instance,
                pool=pool,
                pages=ok.count(True),
                nbytes=written,
            )
        return BatchResult(ok)

    def get(self, pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions]) -> BatchResult:
        """Read every unit into its regions; a missing, short or failing object makes the unit a miss.

        On a zero-copy miss the destination regions may hold partial bytes: the caller must not
        use a unit whose result is False. A damaged object (truncated, bit flip, not ours) is
        removed when the backend can remove, so it is not read again and again.
        """
        return self._run(pool, page_hashes, units, self._get_objects, writing=False)

    def _get_objects(
        self, pool: str, units: Sequence[UnitRegions], staging: np.ndarray | None, batch: _Batch
    ) -> BatchResult:
        count = batch.units
        read, _error = self._call_backend("get", pool, batch.objects)
        if read is None:
            self._count(get_units=count, get_misses=count)
            return BatchResult([False] * count, _error)
        good = [False] * len(batch.objects)
        corrupt: dict[str, int] = {}
        damaged: list[str] = []
        fingerprints = self._fingerprints[pool]
        for row, obj in enumerate(batch.objects):
            if read[row] < 0:
                continue  # a plain miss
            verdict = verify_object(
                batch.headers[row].data,
                key=obj.key,
                fingerprint=fingerprints[row % batch.n_obj],
                payload=batch.payloads[row],
                bytes_read=read[row],
                checksum=self.checksum,
            )
            if verdict is Verdict.OK:
                good[row] = True
                continue
            corrupt[verdict.value] = corrupt.get(verdict.value, 0) + 1
            if verdict in DAMAGE:
                damaged.append(obj.key)
        ok = batch.per_unit(good)
        if staging is not None:
            self._stage_in(staging, units, ok, self._unit_bytes[pool])
        hits = ok.count(True)
        nbytes = sum(read[row] for row in range(len(batch.objects)) if ok[row // batch.n_obj])
        with self._lock:
            self.metrics.get_units += count
            self.metrics.get_hits += hits
            self.metrics.get_misses += count - hits
            self.metrics.bytes_read += nbytes
            self.metrics.corrupt_detected += sum(corrupt.values())
            for reason, n in corrupt.items():
                self.metrics.corrupt_reasons[reason] = self.metrics.corrupt_reasons.get(reason, 0) + n
        if corrupt:
            log.warning("pool %r: rejected corrupt or foreign objects %s", pool, corrupt)
        if damaged:
            self._remove_damaged(pool, damaged)
        return BatchResult(ok)

    def _remove_damaged(self, pool: str, keys: Sequence[str]) -> None:
        """Drop objects that failed verification as damaged, where the backend can remove."""
        if not self._removable:
            return
        try:
            removed = list(self.backend.remove(keys))
            if len(removed) != len(keys):
                raise RuntimeError(f"backend returned {len(removed)} results for {len(keys)} keys")
        except Exception as exc:
            self._backend_failed("remove", pool, exc)
            self._count(corrupt_remove_failed=len(keys))
            return
        self._count(corrupt_removed=removed.count(True), corrupt_remove_failed=removed.count(False))

    @staticmethod
    def _stage_out(staging: np.ndarray, units: Sequence[UnitRegions]) -> None:
        """Gather every unit's regions into the contiguous ``staging`` buffer (one memmove per region)."""
        cursor = _address(staging)
        for unit in units:
            for regions in unit:
                for region in regions:
                    ctypes.memmove(cursor, region.ptr, region.nbytes)
                    cursor += region.nbytes

    @staticmethod
    def _stage_in(
        staging: np.ndarray, units: Sequence[UnitRegions], ok: Sequence[bool], unit_bytes: int
    ) -> None:
        """Scatter verified units (``unit_bytes`` each in ``staging``) into their destination regions."""
        cursor = _address(staging)
        for unit, hit in zip(units, ok, strict=True):
            if hit:
                position = cursor
                for regions in unit:
                    for region in regions:
                        ctypes.memmove(region.ptr, position, region.nbytes)
                        position += region.nbytes
            cursor += unit_bytes

    # --- multi-pool ---------------------------------------------------------------------------

    def put_group(self, batches: Mapping[str, PoolBatch]) -> dict[str, BatchResult]:
        """Write several pools' objects for the same pages, anchor LAST.

        An anchor page is written only if every other pool of the group that has that page stored
        it, so a visible anchor object implies its sidecars and components are there.
        """
        specs = write_order([self.specs[name] for name in batches])
        results: dict[str, BatchResult] = {}
        failed_pages: set[str] = set()
        for spec in specs:
            batch = batches[spec.name]
            if spec.role is not PoolRole.ANCHOR:
                result = self.put(spec.name, batch.page_hashes, batch.units)
                results[spec.name] = result
                if not result.skipped:
                    failed_pages.update(
                        h for h, ok in zip(batch.page_hashes, result.ok, strict=True) if not ok
                    )
                continue
            keep = [i for i, page_hash in enumerate(batch.page_hashes) if page_hash not in failed_pages]
            results[spec.name] = self._on_subset(self.put, spec.name, batch, keep)
        return results

    def get_group(self, batches: Mapping[str, PoolBatch]) -> dict[str, BatchResult]:
        """Read several pools for the same pages, anchor FIRST; other pools only read the pages
        the anchor delivered (with no anchor in the group, every pool reads every page)."""
        specs = read_order([self.specs[name] for name in batches])
        results: dict[str, BatchResult] = {}
        anchor_hits: set[str] | None = None
        for spec in specs:
            batch = batches[spec.name]
            if spec.role is PoolRole.ANCHOR or anchor_hits is None:
                result = self.get(spec.name, batch.page_hashes, batch.units)
                results[spec.name] = result
                if spec.role is PoolRole.ANCHOR:
                    anchor_hits = {h for h, ok in zip(batch.page_hashes, result.ok, strict=True) if ok}
                continue
            keep = [i for i, page_hash in enumerate(batch.page_hashes) if page_hash in anchor_hits]
            results[spec.name] = self._on_subset(self.get, spec.name, batch, keep)
        return results

    @staticmethod
    def _on_subset(
        operation: Callable[[str, Sequence[str], Sequence[UnitRegions]], BatchResult],
        pool: str,
        batch: PoolBatch,
        keep: Sequence[int],
    ) -> BatchResult:
        """Run ``operation`` on the pages at ``keep`` only; the others report False."""
        units = [batch.units[i] for i in keep] if batch.units else ()  # () for a bufferless pool
        sub = operation(pool, [batch.page_hashes[i] for i in keep], units)
        ok = [False] * len(batch.page_hashes)
        for position, index in enumerate(keep):
            ok[index] = sub.ok[position]
        return BatchResult(ok, sub.error, sub.skipped)
