"""Batch verification: the vectorised header checks give verify_object's verdicts, checksums are
computed in the backend's I/O threads, and a bad object is still a counted miss either way."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvstrata.core import storage_batch
from kvstrata.core.integrity import (
    HEADER_BYTES,
    Verdict,
    build_header,
    fill_headers,
    fingerprint_words,
    key_digests,
    layout_fingerprint,
    object_checksum,
    verify_object,
)
from kvstrata.core.storage_batch import ObjectBatch, ReadChecks, build_objects, verify_batch
from kvstrata.plugins.storage_backend import (
    BufferRegion,
    ReadCheck,
    StorageObject,
    object_views,
    region_views,
)
from kvstrata.storage_backends import file as file_backend
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes

KIT = BackendConformance()


def regions(*arrays: np.ndarray) -> tuple[BufferRegion, ...]:
    return tuple(BufferRegion(int(a.ctypes.data), a.nbytes) for a in arrays)


def test_fill_headers_writes_what_build_header_builds() -> None:
    spec = conformance_specs()["attn"]
    fps = [layout_fingerprint(spec, "k"), layout_fingerprint(spec, "v")]
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (64, 64, 64, 64, 0, 64)]
    keys = [f"key-{i}" for i in range(len(payloads))]
    for checksum in ("xxh3", "none"):
        headers = np.zeros((len(payloads), HEADER_BYTES), dtype=np.uint8)
        fill_headers(
            headers,
            digests=key_digests(keys),
            fingerprints=np.tile(fingerprint_words(fps), (3, 1)),
            payload_nbytes=np.array([p.nbytes for p in payloads], dtype=np.int64),
            payloads=[region_views(regions(p)) for p in payloads],
            checksum=checksum,  # type: ignore[arg-type]
        )
        for row, payload in enumerate(payloads):
            expected = build_header(keys[row], fps[row % 2], regions(payload), checksum)  # type: ignore[arg-type]
            assert headers[row].tobytes() == expected, (checksum, row)


def test_batch_verdicts_equal_verify_object_on_every_kind_of_damage() -> None:
    """Every header byte flipped, payload flips, short and long reads, other keys and layouts, an
    object without a checksum, both reader policies, checksums computed by "I/O threads" or not:
    the batch pass and the per-object function agree on every row."""
    spec = conformance_specs()["state"]
    fp, other_fp = layout_fingerprint(spec, "state"), layout_fingerprint(conformance_specs()["index"], "idx")
    rng = random.Random(7)
    payloads, headers, keys, expected_fps, reads = [], [], [], [], []
    for written_with in ("xxh3", "none"):
        for case in range(90):
            row = len(payloads)
            payload = np.frombuffer(rng.randbytes(40), dtype=np.uint8).copy()
            key, writer_key, expected_fp, read = f"key-{row}", f"key-{row}", fp, HEADER_BYTES + 40
            if case >= 78 and case < 82:
                writer_key = f"another-key-{row}"
            header = bytearray(build_header(writer_key, fp, regions(payload), written_with))  # type: ignore[arg-type]
            if case < HEADER_BYTES:
                header[case] ^= 1 << rng.randrange(8)
            elif case < 70:
                payload[rng.randrange(40)] ^= 0x20
            elif case < 74:
                read = rng.choice([-1, 0, 10, HEADER_BYTES - 1])
            elif case < 78:
                read = HEADER_BYTES + rng.choice([0, 39, 41])
            elif case >= 82 and case < 86:
                expected_fp = other_fp
            elif case in (86, 87) and written_with == "xxh3":
                # another writer's unusual header: reserved bytes set, checksummed with them
                header[48 + case % 16] = 0x5A
                header[40:48] = object_checksum(
                    bytes(header[:40]) + bytes(8) + bytes(header[48:]), regions(payload)
                ).to_bytes(8, "little")
            payloads.append(payload)
            headers.append(bytes(header))
            keys.append(key)
            expected_fps.append(expected_fp)
            reads.append(read)
    table = np.frombuffer(b"".join(headers), dtype=np.uint8).reshape(len(headers), HEADER_BYTES).copy()
    header_ptr = int(table.ctypes.data)
    batch = ObjectBatch(
        objects=[
            StorageObject(key, (BufferRegion(header_ptr + i * HEADER_BYTES, HEADER_BYTES), *regions(p)))
            for i, (key, p) in enumerate(zip(keys, payloads, strict=True))
        ],
        payloads=[regions(p) for p in payloads],
        headers=table,
        n_obj=1,
        payload_nbytes=np.full(len(keys), 40, dtype=np.int64),
        fingerprints=fingerprint_words(expected_fps),
        digests=key_digests(keys),
    )
    seen = set()
    for policy, in_threads in (("xxh3", True), ("xxh3", False), ("none", False)):
        checks = ReadChecks(batch)
        if in_threads:
            for row, read in enumerate(reads):
                if read >= 0:
                    checks(row, read)
        good, rejected = verify_batch(batch, reads, policy, checks if in_threads else None)  # type: ignore[arg-type]
        verdict_of = {key: verdict for verdict, bad in rejected.items() for key in bad}
        for row, read in enumerate(reads):
            if read < 0:
                assert not good[row] and keys[row] not in verdict_of  # a plain miss
                continue
            expected = verify_object(
                headers[row],
                key=keys[row],
                fingerprint=expected_fps[row],
                payload=regions(payloads[row]),
                bytes_read=read,
                checksum=policy,  # type: ignore[arg-type]
            )
            assert good[row] == (expected is Verdict.OK), (policy, row, expected)
            assert verdict_of.get(keys[row], Verdict.OK) is expected, (policy, row)
            seen.add(expected)
    assert len(seen) >= 8, seen  # the cases reach (almost) every verdict


class ObservedFileBackend(FileBackend):
    """OBSERVATION INJECTION: a real file backend whose ``check`` calls are recorded (thread and
    row) before the engine's check runs."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.check_threads: dict[int, int] = {}  # row -> thread that checked it
        self.read_threads: dict[int, int] = {}  # row -> thread that read it
        self.checked_rows: list[int] = []

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        assert check is not None, "the engine hands a check to a backend whose get takes one"
        lock = threading.Lock()

        def observed(row: int, nbytes: int) -> None:
            with lock:
                self.check_threads[row] = threading.get_ident()
                self.checked_rows.append(row)
            check(row, nbytes)

        return super().get(objects, observed)

    def _get_rows(
        self, objects: Sequence[StorageObject], start: int, stop: int, check: ReadCheck | None
    ) -> list[int]:
        for row in range(start, stop):  # one thread reads a piece of rows (dicts: atomic sets)
            self.read_threads[row] = threading.get_ident()
        return super()._get_rows(objects, start, stop, check)


class PlainGetFileBackend(FileBackend):
    """A subclass whose ``get`` takes no ``check`` (as a backend written before it existed)."""

    def get(self, objects: Sequence[StorageObject]) -> list[int]:  # type: ignore[override]
        return super().get(objects)


class SkippingFileBackend(FileBackend):
    """FAULT INJECTION: declares ``checks_reads`` (inherited) but leaves some rows unchecked, as a
    buggy backend could: the engine, which then makes no second pass, must still not trust them."""

    skip: frozenset[int] = frozenset()

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        assert check is not None

        def partial(row: int, nbytes: int) -> None:
            if row not in self.skip:
                check(row, nbytes)

        return super().get(objects, partial)


@pytest.mark.parametrize("backend_class", [ObservedFileBackend, PlainGetFileBackend])
def test_a_bad_object_is_a_counted_miss_wherever_it_is_verified(
    tmp_path: Path, backend_class: type[FileBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "_usable_cpus", lambda: 4)  # reads split over 4 threads
    backend = backend_class("l3", FileConfig(path=tmp_path, io_threads=4))
    backend.open()
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    units = 40  # 80 objects: the batch is split over the I/O threads
    source, target = KIT.pools(specs, units, seed=41), KIT.pools(specs, units, seed=None)
    hashes = page_hashes(units, seed=41)
    assert all(engine.put("attn", hashes, source["attn"].units(range(units))).ok)
    keys = engine.object_keys("attn", hashes)
    assert backend.corrupt_for_test(keys[1][7], "flip")  # object "v" of unit 7: a payload byte
    assert backend.corrupt_for_test(keys[0][30], "flip", offset=20)  # a header byte of unit 30
    result = engine.get("attn", hashes, target["attn"].units(range(units)))
    assert result.ok == [i not in (7, 30) for i in range(units)]
    assert engine.metrics.corrupt_detected == 2
    assert engine.metrics.corrupt_reasons == {"checksum_mismatch": 2}
    assert engine.metrics.corrupt_removed == 2
    KIT.assert_units_equal(source["attn"], target["attn"], [i for i in range(units) if i not in (7, 30)])
    if isinstance(backend, ObservedFileBackend):
        # every object found is checked; the two rejected ones again when read once more (a
        # batch of their own: storage_reread), before they were counted and removed
        first, again = backend.checked_rows[: 2 * units], backend.checked_rows[2 * units :]
        assert sorted(first) == list(range(2 * units)), "every object found is checked"
        assert sorted(again) == [0, 1] and engine.metrics.reread_cleared == 0
        # which thread takes which piece is tests/test_storage_file_io_threads.py's (and timing:
        # under load one thread may take every piece); here, each row is checked on the thread
        # that read it (a second pass on another thread would fail this)
        assert backend.check_threads == backend.read_threads, "each row checked where it was read"
    backend.close()


def test_reads_checked_by_the_backend_are_hashed_once_and_unchecked_rows_still_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``checks_reads`` declared the engine hashes nothing after the backend returns: each
    object is hashed once, by the thread that read it. A row the backend left unchecked is not
    trusted on the fast path: a damaged one is a miss, an intact one a hit (verify_object)."""
    hashed: list[bytes] = []  # per hash started, the expected header it starts from (one per row)
    original = storage_batch._xxh3_64

    def counted(prefix: memoryview) -> object:
        hashed.append(bytes(prefix))
        return original(prefix)

    monkeypatch.setattr(storage_batch, "_xxh3_64", counted)
    backend = SkippingFileBackend("l3", FileConfig(path=tmp_path, io_threads=2))
    assert backend.instance_capabilities().checks_reads
    backend.open()
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    units = 20
    source, target = KIT.pools(specs, units, seed=5), KIT.pools(specs, units, seed=None)
    hashes = page_hashes(units, seed=5)
    assert all(engine.put("attn", hashes, source["attn"].units(range(units))).ok)
    assert all(engine.get("attn", hashes, target["attn"].units(range(units))).ok)
    assert len(hashed) == len(set(hashed)) == 2 * units, "every object hashed exactly once"

    keys = engine.object_keys("attn", hashes)
    assert backend.corrupt_for_test(keys[0][3], "flip")  # object "k" of unit 3 = row 6
    with open(backend.path_for(keys[0][5]), "r+b") as handle:  # unit 5's "k" (row 10): its
        handle.seek(40)  # checksum field zeroed, what a row nobody hashed would "compute"
        handle.write(bytes(8))
    backend.skip = frozenset({6, 10, 12})  # row 12: unit 6's intact "k"
    target = KIT.pools(specs, units, seed=None)
    result = engine.get("attn", hashes, target["attn"].units(range(units)))
    assert result.ok == [i not in (3, 5) for i in range(units)]
    assert engine.metrics.corrupt_reasons == {"checksum_mismatch": 2}
    KIT.assert_units_equal(source["attn"], target["attn"], [i for i in range(units) if i not in (3, 5)])
    backend.close()


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


@pytest.mark.parametrize("staged", [False, True], ids=["zero-copy", "copy path"])
def test_batch_objects_carry_views_of_exactly_their_own_regions(staged: bool) -> None:
    """The views a batch hands its backend (and hashes itself) are its own regions, byte for byte:
    the header rows, then the caller's payload regions or the staging slices, empty ones left out
    (as region_views does). A backend that reads into ``object_views(obj)`` reads where the
    checksum looks."""
    pages = [np.zeros(100, dtype=np.uint8), np.zeros(30, dtype=np.uint8), np.zeros(70, dtype=np.uint8)]
    units = [[regions(pages[0][:60], pages[0][60:60], pages[0][60:])], [regions(pages[1], pages[2])]]
    staging = np.zeros(200, dtype=np.uint8) if staged else None
    batch = build_objects([["a", "b"]], [100], units, staging, fingerprint_words([bytes(16)]))
    for row, obj in enumerate(batch.objects):
        assert obj.views is not None
        nonempty = [region for region in obj.regions if region.nbytes]
        assert [(_address(v), len(v)) for v in obj.views] == [(r.ptr, r.nbytes) for r in nonempty]
        assert object_views(obj) is obj.views
        assert batch.views_of_payloads()[row] == obj.views[1:]
        assert [(_address(v), len(v)) for v in region_views(obj.regions)] == [
            (r.ptr, r.nbytes) for r in nonempty
        ]
    bare = StorageObject("c", regions(pages[0]))  # built by hand: views made on demand
    assert bare.views is None and [len(v) for v in object_views(bare)] == [100]


class OnceBadFileBackend(FileBackend):
    """FAULT INJECTION: the first get hands back one object with a flipped payload byte (a bad
    transfer, or a file rewritten under the reader); ``fail_again``: the next get raises."""

    fail_again = False
    gets = 0

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        self.gets += 1
        if self.gets == 1:
            read = super().get(objects)  # checked below, after the byte is flipped
            object_views(objects[0])[-1][0] ^= 0xFF
            if check is not None:
                for row, nbytes in enumerate(read):
                    check(row, nbytes)
            return read
        if self.fail_again:
            raise OSError("backend down")
        return super().get(objects, check)


@pytest.mark.parametrize("fail_again", [False, True])
def test_a_rejected_object_is_read_once_more_before_it_counts_or_is_removed(
    tmp_path: Path, fail_again: bool
) -> None:
    backend = OnceBadFileBackend("l3", FileConfig(path=tmp_path))
    backend.fail_again = fail_again
    backend.open()
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    source, target = KIT.pools(specs, 3, seed=43), KIT.pools(specs, 3, seed=None)
    hashes = page_hashes(3, seed=43)
    assert all(engine.put("attn", hashes, source["attn"].units(range(3))).ok)
    result = engine.get("attn", hashes, target["attn"].units(range(3)))
    assert backend.gets == 2, "one more read, of the rejected object only"
    metrics = engine.metrics
    if fail_again:  # the second read failed: the first verdict stands
        assert result.ok == [False, True, True] and result.rejected == (0,)
        assert (metrics.corrupt_detected, metrics.corrupt_removed, metrics.reread_cleared) == (1, 1, 0)
        assert engine.exists("attn", hashes).ok == [False, True, True]
    else:  # read again intact: served and kept, counted apart
        assert result.ok == [True, True, True] and result.rejected == ()
        KIT.assert_units_equal(source["attn"], target["attn"], range(3))
        assert (metrics.corrupt_detected, metrics.corrupt_removed, metrics.reread_cleared) == (0, 0, 1)
        assert engine.exists("attn", hashes).ok == [True, True, True]
    backend.close()
