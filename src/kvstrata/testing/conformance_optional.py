"""Opt-in capability mixins of the backend conformance kit: a backend subclasses those it
supports next to :class:`~kvstrata.testing.conformance.CoreConformance`, instead of overriding
tests to skip them. :class:`~kvstrata.testing.conformance.BackendConformance` is all of them.

- :class:`IntegrityConformance`: damaged objects (payloads, markers) are refused (needs
  ``corrupt_for_test`` on the backend, or :meth:`BackendKit.corrupt` overridden: without either
  its tests fail saying so);
- :class:`RemovalConformance`: for ``capabilities.removable``: ``remove`` (an absent key counts as
  removed: True), damaged objects removed, a layout change heals.
"""

from __future__ import annotations

from typing import Literal

import pytest

from kvstrata.core.storage_engine import PoolBatch
from kvstrata.plugins.storage_backend import StorageBackend
from kvstrata.testing._backend_kit import BackendKit, conformance_specs, marker_specs, page_hashes


class IntegrityConformance(BackendKit):
    """A flipped byte or a cut object is a counted miss, never data."""

    @pytest.mark.parametrize("mode", ["flip", "truncate"])
    def test_integrity_rejection(self, backend: StorageBackend, mode: Literal["flip", "truncate"]) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 3, seed=4), self.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=4)
        assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
        key = engine.object_keys("state", hashes[1:2])[0][0]
        assert self.corrupt(backend, key, mode)
        result = engine.get("state", hashes, target["state"].units(range(3)))
        assert result.ok == [True, False, True]
        assert engine.metrics.corrupt_detected == 1
        assert sum(engine.metrics.corrupt_reasons.values()) == 1

    def test_cut_object_is_a_miss_without_checksums(self, backend: StorageBackend) -> None:
        """With ``policy.checksum: none`` the byte count ``get`` returns is all that tells a cut
        object from a whole one: a backend reporting the length it was asked for, not what it
        read, served the rest of the page as it was (stale or uninitialised bytes)."""
        specs = conformance_specs()
        engine = self.engine(backend, specs, checksum="none")
        source, target = self.pools(specs, 3, seed=17), self.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=17)
        assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
        key = engine.object_keys("state", hashes[1:2])[0][0]
        assert self.corrupt(backend, key, "truncate")
        result = engine.get("state", hashes, target["state"].units(range(3)))
        assert result.ok == [True, False, True], (
            f"backend {backend.name!r}: an object cut in half was read as whole ({result.ok}, checksum "
            "none): get() must return the bytes it read, not the length of the regions it was given"
        )
        self.assert_units_equal(source["state"], target["state"], [0, 2])
        assert engine.metrics.corrupt_detected == 1

    def test_damaged_marker_is_a_miss(self, backend: StorageBackend) -> None:
        """A damaged marker object (a bufferless anchor's page) is a miss, and the sidecar page
        it gates is not read at all."""
        specs = marker_specs()
        engine = self.engine(backend, specs)
        source = self.pools(specs, 3, seed=11)
        hashes = page_hashes(3, seed=11)
        put = engine.put_group(
            {"pages": PoolBatch(hashes), "index": PoolBatch(hashes, source["index"].units(range(3)))}
        )
        assert all(all(result.ok) for result in put.values()), put
        markers = engine.object_keys("pages", hashes)
        assert self.corrupt(backend, markers[0][1], "truncate")
        fresh = self.pools(specs, 3, seed=None)
        index_batch = PoolBatch(hashes, fresh["index"].units(range(3)))
        got = engine.get_group({"pages": PoolBatch(hashes, [[]] * 3), "index": index_batch})
        assert got["pages"].ok == [True, False, True], "a damaged marker must be a miss"
        assert got["index"].ok == [True, False, True], "the sidecar page of a missed marker is a miss"
        assert fresh["index"].unit_bytes(1) == bytes(len(fresh["index"].unit_bytes(1))), (
            "the sidecar page a damaged marker gates must not be read"
        )
        assert engine.metrics.corrupt_detected == 1


class RemovalConformance(BackendKit):
    """For backends that declare ``removable``: the core deletes objects it found damaged."""

    def test_removing_an_absent_key_returns_true(self, backend: StorageBackend) -> None:
        """The plugin contract: ``remove`` answers per key whether it is gone, and a key that was
        never stored (or another process removed first) is gone: True, not False."""
        got = backend.remove(["conformance-never-stored-1", "conformance-never-stored-2"])
        assert got == [True, True], (
            f"backend {backend.name!r}: remove() of keys that were never stored returned {got}; "
            "the contract is True for an absent key (it is gone), False only when a present object "
            "could not be deleted"
        )

    def test_layout_change_replaces_foreign_objects(self, backend: StorageBackend) -> None:
        """Objects of another layout under a reader's keys (keys hold the layout, so these are
        copied or crafted ones) are removed (or overwritten), so the reader gets storage hits
        again instead of skip-existing keeping the foreign objects forever."""
        caps = backend.instance_capabilities()
        if not caps.removable and caps.overwrite != "replace":
            pytest.skip(f"backend {backend.name!r} can neither remove nor replace objects")
        old_specs, new_specs = conformance_specs(), conformance_specs(dtype="bfloat16")
        hashes = page_hashes(3, seed=15)
        old_source = self.pools(old_specs, 3, seed=15)
        new = self.engine(backend, new_specs)
        self._forge(backend, old_specs, new, "attn", hashes, old_source)
        source, target = self.pools(new_specs, 3, seed=16), self.pools(new_specs, 3, seed=None)
        assert new.put("attn", hashes, source["attn"].units(range(3))).ok == [True] * 3  # skipped or replaced
        first = new.get("attn", hashes, target["attn"].units(range(3))).ok
        if first != [True] * 3:  # skip_existing kept the old objects: the read must clear them
            assert first == [False] * 3
            assert new.metrics.foreign_objects == 6 and new.metrics.foreign_removed == 6
            assert all(new.put("attn", hashes, source["attn"].units(range(3))).ok)
            assert all(new.get("attn", hashes, target["attn"].units(range(3))).ok)
        self.assert_units_equal(source["attn"], target["attn"], range(3))
        assert new.metrics.corrupt_detected == 0 and new.metrics.corrupt_reasons == {}

    def test_remove_and_damaged_objects_are_removed(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().removable:
            pytest.skip(f"backend {backend.name!r} declares removable=False (remove() is optional)")
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source = self.pools(specs, 3, seed=12)
        hashes = page_hashes(3, seed=12)
        assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
        keys = engine.object_keys("state", hashes)[0]
        assert backend.remove([keys[0], "conformance-never-stored"]) == [True, True]
        assert backend.exists(keys) == [False, True, True], (
            f"backend {backend.name!r}: after remove() of the first of three stored keys returned True, "
            f"exists() answers {backend.exists(keys)}: True means the object is gone, and only it"
        )
        assert self.corrupt(backend, keys[1], "flip")
        target = self.pools(specs, 3, seed=None)
        assert engine.get("state", hashes, target["state"].units(range(3))).ok == [False, False, True]
        assert engine.metrics.corrupt_detected == 1 and engine.metrics.corrupt_removed == 1
        assert backend.exists(keys) == [False, False, True], "the damaged object must be gone"
        # so a writer can store the page again, and it reads back bit exact
        assert all(engine.put("state", hashes[:2], source["state"].units(range(2))).ok)
        assert all(engine.get("state", hashes, target["state"].units(range(3))).ok)
        self.assert_units_equal(source["state"], target["state"], range(3))
