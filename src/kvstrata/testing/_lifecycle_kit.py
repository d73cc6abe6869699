"""The backend kit's instance-lifecycle checks (part of
:class:`~kvstrata.testing.conformance.CoreConformance`): what ``close()`` may and may not take
with it. A process holds several instances of one backend at once (two L3 tiers of one type, a
vLLM scheduler and worker in one process, a cache opened for a check and closed); closing one of
them must leave the others working."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstrata.plugins.storage_backend import StorageBackend
from kvstrata.testing._backend_kit import BackendKit, conformance_specs, page_hashes


class LifecycleChecks(BackendKit):
    """``close()`` of one instance: the others keep working, and a ``persistent`` backend's
    objects outlive it."""

    def test_a_persistent_backend_keeps_its_objects_through_close(
        self, backend_factory: Callable[[str], StorageBackend]
    ) -> None:
        """``persistent`` promises objects that survive a restart: what an instance stored is
        read, bit exact, by a new instance opened once it closed (the factory's instances share
        one store, as for ``test_second_instance``)."""
        first = backend_factory("conformance")
        if not first.instance_capabilities().persistent:
            first.close()
            pytest.skip(f"backend {first.name!r} declares persistent=False: nothing outlives an instance")
        specs = conformance_specs()
        source, target = self.pools(specs, 2, seed=29), self.pools(specs, 2, seed=None)
        hashes = page_hashes(2, seed=29)
        try:
            assert all(self.engine(first, specs).put("attn", hashes, source["attn"].units(range(2))).ok)
        finally:
            first.close()
        again = backend_factory("conformance")
        try:
            got = self.engine(again, specs).get("attn", hashes, target["attn"].units(range(2))).ok
            assert got == [True, True], (
                f"backend {again.name!r} declares persistent, but a new instance opened after the "
                f"one that stored two pages closed finds {got}: flush on close, or declare "
                "persistent=False"
            )
            self.assert_units_equal(source["attn"], target["attn"], range(2))
        finally:
            again.close()

    def test_closing_one_instance_leaves_another_working(
        self, backend_factory: Callable[[str], StorageBackend]
    ) -> None:
        specs = conformance_specs()
        source, target = self.pools(specs, 2, seed=23), self.pools(specs, 2, seed=None)
        hashes = page_hashes(2, seed=23)
        first = backend_factory("conformance")
        try:
            assert all(self.engine(first, specs).put("attn", hashes[:1], source["attn"].units([0])).ok)
            backend_factory("conformance").close()  # another instance opened and closed meanwhile
            engine = self.engine(first, specs)
            put = engine.put("attn", hashes[1:], source["attn"].units([1])).ok
            got = engine.get("attn", hashes, target["attn"].units(range(2))).ok
            assert put == [True] and got == [True, True], (
                f"backend {first.name!r}: once another instance was closed, an instance still open "
                f"failed (put {put}, get {got}, expected all True; errors: {engine.metrics.backend_errors}): "
                "close() must release only its own instance's resources, not a client, connection or "
                "store the process's other instances still use"
            )
            self.assert_units_equal(source["attn"], target["attn"], range(2))
        finally:
            first.close()
