"""Batch verification: the vectorised header checks give verify_object's verdicts, checksums are
computed in the backend's I/O threads, and a bad object is still a counted miss either way."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvstrata.core.integrity import (
    HEADER_BYTES,
    VERDICTS,
    Verdict,
    build_header,
    fill_headers,
    fingerprint_words,
    key_digests,
    layout_fingerprint,
    object_checksum,
    verify_headers,
    verify_object,
)
from kvstrata.plugins.storage_backend import BufferRegion, ReadCheck, StorageObject
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
            payloads=[regions(p) for p in payloads],
            checksum=checksum,  # type: ignore[arg-type]
        )
        for row, payload in enumerate(payloads):
            expected = build_header(keys[row], fps[row % 2], regions(payload), checksum)  # type: ignore[arg-type]
            assert headers[row].tobytes() == expected, (checksum, row)


def _scalar(header: bytes, payload: np.ndarray, *, key: str, fp: bytes, read: int, checksum: str) -> Verdict:
    return verify_object(
        header,
        key=key,
        fingerprint=fp,
        payload=regions(payload),
        bytes_read=read,
        checksum=checksum,  # type: ignore[arg-type]
    )


def test_vectorised_verdicts_equal_verify_object_on_every_kind_of_damage() -> None:
    """Every header byte flipped, payload flips, short and long reads, other keys and layouts, an
    object without a checksum, both reader policies: the batch pass and the per-object function
    agree row by row (so the batch pass keeps verify_object's order of precedence too)."""
    spec = conformance_specs()["state"]
    fp, other_fp = layout_fingerprint(spec, "state"), layout_fingerprint(conformance_specs()["index"], "idx")
    rng = random.Random(7)
    rows: list[tuple[bytes, np.ndarray, str, bytes, int]] = []
    for written_with in ("xxh3", "none"):
        for case in range(90):
            payload = np.frombuffer(rng.randbytes(40), dtype=np.uint8).copy()
            header = bytearray(build_header("key", fp, regions(payload), written_with))  # type: ignore[arg-type]
            key, expected_fp, read = "key", fp, HEADER_BYTES + 40
            if case < HEADER_BYTES:
                header[case] ^= 1 << rng.randrange(8)
            elif case < 70:
                payload[rng.randrange(40)] ^= 0x20
            elif case < 74:
                read = rng.choice([-1, 0, 10, HEADER_BYTES - 1])
            elif case < 78:
                read = HEADER_BYTES + rng.choice([0, 39, 41])
            elif case < 82:
                key = "another-key"
            elif case < 86:
                expected_fp = other_fp
            rows.append((bytes(header), payload, key, expected_fp, read))
    for policy in ("xxh3", "none"):
        headers = np.frombuffer(b"".join(r[0] for r in rows), dtype=np.uint8).reshape(len(rows), HEADER_BYTES)
        computed = np.zeros(len(rows), dtype=np.uint64)
        have = np.zeros(len(rows), dtype=bool)

        def compute(row: int, headers: np.ndarray = headers) -> int:
            return object_checksum(headers[row].tobytes(), regions(rows[row][1]))

        codes = verify_headers(
            headers.copy(),
            np.array([r[4] for r in rows], dtype=np.int64),
            payload_nbytes=np.full(len(rows), 40, dtype=np.int64),
            fingerprints=fingerprint_words([r[3] for r in rows]),
            digests=key_digests([r[2] for r in rows]),
            checksum=policy,  # type: ignore[arg-type]
            computed=computed,
            have=have,
            compute=compute,
        )
        verdicts = set()
        for row, (header, payload, key, expected_fp, read) in enumerate(rows):
            if read < 0:
                continue  # a plain miss: the caller never looks at its verdict
            expected = _scalar(header, payload, key=key, fp=expected_fp, read=read, checksum=policy)
            assert VERDICTS[codes[row]] is expected, (policy, row)
            verdicts.add(expected)
        assert len(verdicts) >= 7, verdicts  # the cases reach almost every verdict


class ObservedFileBackend(FileBackend):
    """OBSERVATION INJECTION: a real file backend whose ``check`` calls are recorded (thread and
    row) before the engine's check runs."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.check_threads: set[int] = set()
        self.checked_rows: list[int] = []

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        assert check is not None, "the engine hands a check to a backend whose get takes one"
        lock = threading.Lock()

        def observed(row: int, nbytes: int) -> None:
            with lock:
                self.check_threads.add(threading.get_ident())
                self.checked_rows.append(row)
            check(row, nbytes)

        return super().get(objects, observed)


class PlainGetFileBackend(FileBackend):
    """A subclass whose ``get`` takes no ``check`` (as a backend written before it existed)."""

    def get(self, objects: Sequence[StorageObject]) -> list[int]:  # type: ignore[override]
        return super().get(objects)


@pytest.mark.parametrize("backend_class", [ObservedFileBackend, PlainGetFileBackend])
def test_a_bad_object_is_a_counted_miss_wherever_it_is_verified(
    tmp_path: Path, backend_class: type[FileBackend]
) -> None:
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
        assert sorted(backend.checked_rows) == list(range(2 * units)), "every object found is checked"
        assert threading.get_ident() in backend.check_threads, "the calling thread reads a chunk too"
        assert len(backend.check_threads) > 1, "the other chunks are checked by the I/O threads"
    backend.close()
