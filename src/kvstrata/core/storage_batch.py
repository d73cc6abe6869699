"""The batch shapes of the storage engine: what a caller passes in, what comes back, and how one
batch of units becomes backend objects (header row + payload regions, or a staging copy).

Kept apart from :mod:`kvstrata.core.storage_engine` (which re-exports every public name here) so
the engine reads as the policy -- plans, verification, failure counting -- and this file as the
mechanics of laying units out as objects.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvstrata.core.integrity import (
    HEADER_BYTES,
    ChecksumPolicy,
    Verdict,
    expected_prefixes,
    intact_rows,
    key_digests,
    prefixed_checksum,
    verify_object,
)
from kvstrata.plugins.pool_type import PoolRole, PoolSpec
from kvstrata.plugins.storage_backend import BufferRegion, StorageObject, region_views

#: Regions of one unit: one sequence of regions per object of the pool, in ObjectSpec order.
UnitRegions = Sequence[Sequence[BufferRegion]]


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per-unit outcome of one batch.

    ``error`` says why units failed at the backend -- the whole call (it raised, or answered
    nonsense) or some of its objects (not stored: disk full, read-only directory, capacity, a
    file-size limit) -- and ``failed`` counts those units, so a caller counts failures from the
    result, never from ``ok`` alone (a get's ``False`` is usually a plain miss, not a failure).
    """

    ok: list[bool]
    error: str | None = None
    skipped: bool = False  # nothing attempted (plan off / read-only): ``error`` says why
    failed: int = 0  # units the backend was asked for and failed (never a miss, never skipped)
    foreign: int = 0  # objects refused as another layout / format / key (not damage)
    #: a get's units whose objects were refused (damaged or foreign: removed where the backend
    #: can), in batch order: what left the store, unlike a miss or a failed call
    rejected: tuple[int, ...] = ()
    #: the whole call failed where a later one may not (it raised, timed out, or the open breaker
    #: refused it) -- unlike objects the backend answered "not stored" (full, read-only)
    transient: bool = False

    @property
    def prefix(self) -> int:
        return longest_present_prefix(self.ok)


@dataclass(frozen=True, slots=True)
class PoolBatch:
    """One pool's share of a multi-pool operation on the same pages."""

    page_hashes: Sequence[str]
    units: Sequence[UnitRegions] = ()


@dataclass(frozen=True, slots=True)
class ObjectBatch:
    """The objects of one put/get, unit-major, with their payload regions and header rows, and
    per object (row) what its header must say: payload length, fingerprint, key digest."""

    objects: list[StorageObject]
    payloads: list[tuple[BufferRegion, ...]]
    headers: np.ndarray  # (len(objects), HEADER_BYTES) uint8, the first region of each object
    n_obj: int  # objects per unit
    payload_nbytes: np.ndarray  # (len(objects),) int64
    fingerprints: np.ndarray  # (len(objects), 2) uint64: integrity.fingerprint_words per row
    digests: np.ndarray  # (len(objects),) uint64: integrity.key_digest per row

    @property
    def units(self) -> int:
        return len(self.objects) // self.n_obj

    def views_of_payloads(self) -> list[list[memoryview]]:
        """Per row, byte views of the payload regions, what a checksum hashes: the object's own
        views less the header's (made from the regions for an object built without views)."""
        return [
            region_views(payload) if obj.views is None else obj.views[1:]
            for obj, payload in zip(self.objects, self.payloads, strict=True)
        ]

    def per_unit(self, flags: Sequence[Any]) -> list[bool]:
        """A unit succeeds when every one of its objects does."""
        n_obj = self.n_obj
        if n_obj == 1:
            return [bool(flag) for flag in flags]
        return [all(flags[i : i + n_obj]) for i in range(0, len(flags), n_obj)]


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


def address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def checked_units(
    pool: str, page_hashes: Sequence[str], units: Sequence[UnitRegions], sizes: Sequence[int]
) -> Sequence[UnitRegions]:
    """Validate ``units`` against the payload ``sizes`` of the pool's objects; returns them in
    canonical form.

    A pool whose objects hold no payload (a bufferless pool: one header-only marker object per
    unit) accepts ``units`` empty, or one entry per page of any regions totalling 0 bytes (``[]``,
    ``[()]``...): there is nothing to read or write but the header.
    """
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


def build_objects(
    keys: Sequence[Sequence[str]],
    sizes: Sequence[int],
    units: Sequence[UnitRegions],
    staging: np.ndarray | None,
    fingerprints: np.ndarray,
) -> ObjectBatch:
    """One object per (unit, ObjectSpec), unit-major: a header region, then the payload regions
    (the caller's, or consecutive slices of ``staging`` on the copy path). ``keys`` are per object
    spec (outer) per unit (inner); ``fingerprints``: one row of words per object spec. Each object
    carries its byte views (:attr:`StorageObject.views`), made here once for the backend's I/O
    and the checksum both: the header's and the staging's as slices of one view each."""
    n_obj = len(sizes)
    headers = np.zeros((len(units) * n_obj, HEADER_BYTES), dtype=np.uint8)
    header_ptr = address(headers)
    header_view = memoryview(headers.reshape(-1))
    cursor = address(staging) if staging is not None else 0
    staging_view = memoryview(staging) if staging is not None else None
    objects: list[StorageObject] = []
    payloads: list[tuple[BufferRegion, ...]] = []
    at = offset = 0  # where the next header starts in ``headers``, the next payload in ``staging``
    for i, unit in enumerate(units):
        for j, nbytes in enumerate(sizes):
            views: list[memoryview]
            if not nbytes:
                payload: tuple[BufferRegion, ...] = ()
                views = []
            elif staging_view is not None:
                payload = (BufferRegion(cursor, nbytes),)
                views = [staging_view[offset : offset + nbytes]]
                cursor += nbytes
                offset += nbytes
            else:
                payload = tuple(unit[j])
                views = region_views(payload)
            header = BufferRegion(header_ptr, HEADER_BYTES)
            objects.append(
                StorageObject(keys[j][i], (header, *payload), [header_view[at : at + HEADER_BYTES], *views])
            )
            payloads.append(payload)
            header_ptr += HEADER_BYTES
            at += HEADER_BYTES
    count = len(units)
    return ObjectBatch(
        objects,
        payloads,
        headers,
        n_obj,
        payload_nbytes=_stacked(np.asarray(sizes, dtype=np.int64), count),
        fingerprints=_stacked(fingerprints, count),
        digests=key_digests([obj.key for obj in objects]),
    )


def _stacked(block: np.ndarray, count: int) -> np.ndarray:
    """``count`` copies of ``block`` one after another along its first axis (``np.tile`` of the
    rows: the same array at a third to a half of its cost for the few units of a chunked get)."""
    out = np.empty((count, *block.shape), dtype=block.dtype)
    out[...] = block
    return out.reshape(count * block.shape[0], *block.shape[1:])


def stage_out(staging: np.ndarray, units: Sequence[UnitRegions]) -> None:
    """Gather every unit's regions into the contiguous ``staging`` buffer (one memmove per region)."""
    cursor = address(staging)
    for unit in units:
        for regions in unit:
            for region in regions:
                ctypes.memmove(cursor, region.ptr, region.nbytes)
                cursor += region.nbytes


def stage_in(staging: np.ndarray, units: Sequence[UnitRegions], ok: Sequence[bool], unit_bytes: int) -> None:
    """Scatter verified units (``unit_bytes`` each in ``staging``) into their destination regions."""
    cursor = address(staging)
    for unit, hit in zip(units, ok, strict=True):
        if hit:
            position = cursor
            for regions in unit:
                for region in regions:
                    ctypes.memmove(region.ptr, position, region.nbytes)
                    position += region.nbytes
        cursor += unit_bytes


def on_subset(
    operation: Callable[[str, Sequence[str], Sequence[UnitRegions]], BatchResult],
    pool: str,
    batch: PoolBatch,
    keep: Sequence[int],
) -> BatchResult:
    """Run ``operation`` on the pages at ``keep`` only; the others report False (not failed)."""
    units = [batch.units[i] for i in keep] if batch.units else ()  # () for a bufferless pool
    sub = operation(pool, [batch.page_hashes[i] for i in keep], units)
    ok = [False] * len(batch.page_hashes)
    for position, index in enumerate(keep):
        ok[index] = sub.ok[position]
    rejected = tuple(keep[position] for position in sub.rejected)
    return BatchResult(ok, sub.error, sub.skipped, sub.failed, sub.foreign, rejected, sub.transient)


#: the checksum's hasher (:func:`~kvstrata.core.integrity.prefixed_checksum`), read once
_xxh3_64 = xxhash.xxh3_64


class ReadChecks:
    """The ``check`` the engine hands a backend's ``get``: the checksum of each object, computed by
    the I/O thread that just read it.

    Why there: the bytes are still in that core's cache (hashing a 256 KiB page right after its
    read took a third of the time it takes once the whole batch is in, measured here), the objects
    of a batch hash in parallel (xxhash releases the GIL for buffers this large), and the engine
    thread is left with one vectorised pass over the headers (:func:`verify_batch`). Rows a
    backend did not check are hashed in that pass. Each hash starts from the header this reader
    expects (:func:`~kvstrata.core.integrity.expected_prefixes`), not the one read: two hash
    updates and no header patching per object, the little Python an I/O thread runs between its
    system calls being what two threads contend for (the GIL).
    """

    __slots__ = ("_computed", "_full", "_payloads", "_prefixes", "_trusted", "expected")

    def __init__(self, batch: ObjectBatch, *, trusted: bool = False) -> None:
        """``trusted``: the backend declared that it checks every object it reads
        (``checks_reads``), so :meth:`all_computed` hashes nothing itself."""
        rows = len(batch.objects)
        self._full = (batch.payload_nbytes + HEADER_BYTES).tolist()
        #: per row, the checksum an I/O thread computed (None: none). A list, not an array: each
        #: thread writes one item per object, and a list item costs a tenth of a numpy one
        self._computed: list[int | None] = [None] * rows
        prefixes = expected_prefixes(batch.digests, batch.fingerprints, batch.payload_nbytes)
        self._prefixes = memoryview(prefixes)
        #: the same headers as words, for :func:`~kvstrata.core.integrity.intact_rows`
        self.expected = np.frombuffer(prefixes, dtype="<u8")
        #: per row, the views of the engine's own payload regions (the ones the backend read
        #: into when it used the objects' views; never views a backend hands back)
        self._payloads = batch.views_of_payloads()
        self._trusted = trusted

    def checksum(self, row: int) -> int:
        start = row * HEADER_BYTES
        return prefixed_checksum(self._prefixes[start : start + HEADER_BYTES], self._payloads[row])

    def __call__(self, row: int, nbytes: int) -> None:
        """Called by an I/O thread once object ``row`` is read (``nbytes``; negative: not found).
        Only a complete object has a checksum worth computing. (The body is :meth:`checksum`
        inlined, the function call saved: this runs between two threads' system calls.)"""
        if nbytes == self._full[row]:
            start = row * HEADER_BYTES
            hasher = _xxh3_64(self._prefixes[start : start + HEADER_BYTES])
            for view in self._payloads[row]:
                hasher.update(view)
            self._computed[row] = hasher.intdigest()

    def all_computed(self, read: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every complete object's checksum as uint64 (0 elsewhere) and which rows have one.

        Untrusted (a backend whose ``get`` takes no ``check``, or does not declare
        ``checks_reads``): what no I/O thread hashed is hashed here, a second pass over those
        bytes. Trusted: nothing is hashed here; a row left unchecked is reported as such and
        must not pass the fast path (:func:`verify_object` then decides it, hashing that row)."""
        computed = self._computed
        if not self._trusted:
            complete = read == np.asarray(self._full, dtype=np.int64)
            for row in np.flatnonzero(complete).tolist():
                if computed[row] is None:
                    computed[row] = self.checksum(row)
        known = np.fromiter((value is not None for value in computed), dtype=np.bool_, count=len(computed))
        sums = np.fromiter((value or 0 for value in computed), dtype=np.uint64, count=len(computed))
        return sums, known


def verify_batch(
    batch: ObjectBatch, read: Sequence[int], checksum: ChecksumPolicy, checks: ReadChecks | None = None
) -> tuple[list[bool], dict[Verdict, list[str]]]:
    """Verify every object read back (``read``: bytes per object, negative = a plain miss):
    per object whether it is good, and the keys of the rejected ones by verdict.

    Objects whose header is exactly what this reader writes pass in one vectorised pass
    (:func:`~kvstrata.core.integrity.intact_rows`); every other object found gets its verdict from
    :func:`~kvstrata.core.integrity.verify_object`, so the verdicts are that function's.
    """
    rows = len(batch.objects)
    got = np.fromiter(read, dtype=np.int64, count=rows)
    known: np.ndarray | None = None
    expected: np.ndarray | None = None
    if checksum == "xxh3":
        checks = checks or ReadChecks(batch)
        computed, known = checks.all_computed(got)
        expected = checks.expected
    else:
        computed = np.zeros(rows, dtype=np.uint64)
    good = intact_rows(
        batch.headers,
        got,
        payload_nbytes=batch.payload_nbytes,
        fingerprints=batch.fingerprints,
        digests=batch.digests,
        checksum=checksum,
        computed=computed,
        expected=expected,
    )
    if known is not None:
        good &= known  # a checksum nobody computed proves nothing
    rejected: dict[Verdict, list[str]] = {}
    for row in np.flatnonzero(~good & (got >= 0)).tolist():
        obj = batch.objects[row]
        verdict = verify_object(
            batch.headers[row].data,
            key=obj.key,
            fingerprint=batch.fingerprints[row].tobytes(),
            payload=batch.payloads[row],
            bytes_read=int(got[row]),
            checksum=checksum,
        )
        if verdict is Verdict.OK:
            good[row] = True
        else:
            rejected.setdefault(verdict, []).append(obj.key)
    return good.tolist(), rejected


Operation = Callable[[str, Sequence[str], Sequence[UnitRegions]], BatchResult]


def put_group(
    specs: Mapping[str, PoolSpec], put: Operation, batches: Mapping[str, PoolBatch]
) -> dict[str, BatchResult]:
    """``StorageEngine.put_group``: sidecars and components first, then the anchor over the pages
    every other pool of the group stored."""
    results: dict[str, BatchResult] = {}
    failed_pages: set[str] = set()
    for spec in write_order([specs[name] for name in batches]):
        batch = batches[spec.name]
        if spec.role is not PoolRole.ANCHOR:
            result = put(spec.name, batch.page_hashes, batch.units)
            results[spec.name] = result
            if not result.skipped:
                failed_pages.update(h for h, ok in zip(batch.page_hashes, result.ok, strict=True) if not ok)
            continue
        keep = [i for i, page_hash in enumerate(batch.page_hashes) if page_hash not in failed_pages]
        results[spec.name] = on_subset(put, spec.name, batch, keep)
    return results


def get_group(
    specs: Mapping[str, PoolSpec], get: Operation, batches: Mapping[str, PoolBatch]
) -> dict[str, BatchResult]:
    """``StorageEngine.get_group``: the anchor first, the other pools over the pages it delivered."""
    results: dict[str, BatchResult] = {}
    anchor_hits: set[str] | None = None
    for spec in read_order([specs[name] for name in batches]):
        batch = batches[spec.name]
        if spec.role is PoolRole.ANCHOR or anchor_hits is None:
            result = get(spec.name, batch.page_hashes, batch.units)
            results[spec.name] = result
            if spec.role is PoolRole.ANCHOR:
                anchor_hits = {h for h, ok in zip(batch.page_hashes, result.ok, strict=True) if ok}
            continue
        keep = [i for i, page_hash in enumerate(batch.page_hashes) if page_hash in anchor_hits]
        results[spec.name] = on_subset(get, spec.name, batch, keep)
    return results
