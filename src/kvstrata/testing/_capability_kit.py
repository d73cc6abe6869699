"""The backend kit's checks of declared capabilities (part of
:class:`~kvstrata.testing.conformance.CoreConformance`): a backend that declares what it does not
do passed every other check, and the core plans from the declaration, never from the name.

- ``overwrite``: deterministic. Put a page, put other bytes under the same keys, get: ``replace``
  must read the second bytes; ``skip_existing`` must keep one whole object (the first, or the
  second where it replaced after all) and report the second put stored (a key already held is
  not a failure: the core counts it written and moves on).
- ``atomic_visibility`` (a key is visible only once fully written): no deterministic check can
  stop a backend between its writes, so the kit races a reader against a writer of fresh keys.
  The check never fails a backend that keeps its promise, and catches one whose objects are
  visible while written long enough for a reader to see (a passing run proves nothing more).
  Skipped for backends that do not declare it.
"""

from __future__ import annotations

import threading

import pytest

from kvstrata.core.storage_batch import BatchResult
from kvstrata.plugins.storage_backend import StorageBackend
from kvstrata.testing._backend_kit import (
    BackendKit,
    HostPoolForTests,
    answers,
    conformance_specs,
    page_hashes,
)

#: pages the writer of the atomic-visibility race puts, one put per page, while the reader reads
RACE_PAGES = 48


class CapabilityChecks(BackendKit):
    """A backend does what its ``instance_capabilities()`` declares."""

    def test_overwrite_is_what_the_backend_declares(self, backend: StorageBackend) -> None:
        mode = backend.instance_capabilities().overwrite
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        first, second = self.pools(specs, 3, seed=31), self.pools(specs, 3, seed=32)
        target = self.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=31)
        put = engine.put("attn", hashes, first["attn"].units(range(3)))
        assert all(put.ok), f"backend {backend.name!r}: put of three new pages: {answers(put)}"
        again = engine.put("attn", hashes, second["attn"].units(range(3)))
        assert again.ok == [True] * 3, (
            f"backend {backend.name!r} (overwrite={mode!r}): a second put of keys it holds, other "
            f"bytes, answered {answers(again)}: a key already stored is no failure (skip_existing "
            "keeps the object and reports it stored, replace stores the new bytes)"
        )
        got = engine.get("attn", hashes, target["attn"].units(range(3)))
        assert all(got.ok), f"backend {backend.name!r}: get after two puts of the same keys: {answers(got)}"
        for unit in range(3):
            read = target["attn"].unit_bytes(unit)
            if mode == "replace":
                assert read == second["attn"].unit_bytes(unit), (
                    f"backend {backend.name!r} declares overwrite='replace', but a second put of a key "
                    f"with other bytes left the first bytes (page {unit}): declare "
                    "overwrite='skip_existing', or replace the stored object"
                )
            else:
                assert read in (first["attn"].unit_bytes(unit), second["attn"].unit_bytes(unit)), (
                    f"backend {backend.name!r}: after two puts of the same key, page {unit} reads "
                    "neither the first bytes nor the second (a mix of the two objects)"
                )
        self.assert_read_right_first_time(backend, engine)

    def test_atomic_visibility_holds_against_a_concurrent_reader(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().atomic_visibility:
            pytest.skip(f"backend {backend.name!r} declares atomic_visibility=False")
        specs = conformance_specs()
        writer = self.engine(backend, specs, checksum="none")  # (no checksum shortcut: see the
        reader = self.engine(backend, specs, checksum="none")  # file backend's set_read_verification)
        source = self.pools(specs, RACE_PAGES, seed=33)
        hashes = page_hashes(RACE_PAGES, seed=33)
        done = threading.Event()
        failures: list[BaseException] = []

        def write() -> None:
            try:
                for page in range(RACE_PAGES):
                    put = writer.put("state", hashes[page : page + 1], source["state"].units([page]))
                    assert all(put.ok), f"put of page {page}: {answers(put)}"
            except BaseException as exc:  # surfaced in the main thread below
                failures.append(exc)
            finally:
                done.set()

        seen: list[str] = []
        thread = threading.Thread(target=write, name="kvstrata-kit-writer", daemon=True)
        thread.start()
        target = HostPoolForTests(specs["state"], RACE_PAGES)
        while not done.is_set() and not seen:
            got: BatchResult = reader.get("state", hashes, target.units(range(RACE_PAGES)))
            for page, hit in enumerate(got.ok):
                if hit and target.unit_bytes(page) != source["state"].unit_bytes(page):
                    seen.append(f"page {page} read with other bytes than it was put with")
            if reader.metrics.corrupt_detected:
                seen.append(f"{reader.metrics.corrupt_detected} objects read cut or damaged")
        thread.join(60)
        assert not failures, f"backend {backend.name!r}: the writer failed: {failures[0]!r}"
        assert not seen, (
            f"backend {backend.name!r} declares atomic_visibility, but a reader racing a writer of new "
            f"keys read one wrong: {seen[0]} (reasons: {reader.metrics.corrupt_reasons}). Where the "
            "round trips pass, the object was visible before it was fully written: a key must become "
            "visible only once all its bytes are stored (write aside, then publish), or declare "
            "atomic_visibility=False"
        )
