"""A backend that raises on every call (a fault-injection fake, see kvstrata.testing.faults):
the cache keeps serving from L1/L2, counts the failures, keeps its storage workers alive and
leaks no host slot."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from controller_support import (
    device_accounting,
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
)
from kvstrata.core.controller import CacheController
from kvstrata.core.tree import Tier
from kvstrata.engine_kit import open_storage
from kvstrata.plugins import PluginHost
from kvstrata.plugins.errors import StorageError
from kvstrata.testing.faults import FaultyBackend, InjectedFault


@pytest.mark.parametrize("stack", ["kv", "swa-mamba"])
@pytest.mark.parametrize("fail", ["raise", "refuse"])
def test_a_failing_backend_fails_operations_not_the_cache(stack: str, fail: str) -> None:
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    overrides = [
        # the breaker off: this test watches every failing call reach the backend (see test_storage_breaker)
        f"tiers.storage={{broken: {{type: faults, fail: {fail}, circuit_breaker: {{failures: 0}}}}}}",
        "policy.prefetch.threshold_tokens=64",
    ]
    with open_cache(stack, overrides=overrides, host=host) as cache:
        backend = cache.backend
        assert isinstance(backend, FaultyBackend)
        first = tokens(31, 4)
        serve(cache, first)
        for i in range(6):
            serve(cache, tokens(40 + i, 4))
        cache.flush()
        puts = backend.calls["put"]
        again, bad = serve(cache, first)
        assert again.cached_pages == 4 and bad == 0, "L1/L2 keep serving"
        assert again.hit_pages["host"] >= 1
        serve(cache, tokens(50, 4))
        cache.flush()
        assert backend.calls["put"] > puts, "the write worker still takes work after failures"
        assert backend.calls["exists"] > 0
        snapshot = cache.metrics.snapshot()
        if fail == "raise":
            assert snapshot["failures"] >= backend.calls["put"] + backend.calls["exists"]
        assert snapshot["hit_tokens"]["storage"] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "a staged host slot leaked"
        workers = {t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("kvstrata-")}
        assert workers == {"kvstrata-l3-write", "kvstrata-l3-prefetch"}


@pytest.mark.parametrize("wait_s", [5.0, 0.0])
def test_write_through_waits_for_in_flight_l3_writes_instead_of_skipping_backups(wait_s: float) -> None:
    """A stuck L3 (fault injection: every put blocks until released, then refuses) holds the host
    units of the first two requests while they are written; the third request's backup must wait
    for them. The writes are released a while into the third request, however fast it runs."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    slow = [
        "tiers.storage={slow: {type: faults, fail: refuse, operations: [put], stall: [put]}}",
        f"policy.backup_wait_s={wait_s}",
        "policy.prefetch.threshold_tokens=1000000",  # no reads: only the writes are slow
    ]
    with open_cache("kv", None, slow, host=host) as cache:
        backend = cache.backend
        assert isinstance(backend, FaultyBackend)
        half = cache.pools.pools["kv"].host_allocator.units // 2
        for seed in range(2):
            serve(cache, tokens(300 + seed, half))
        release = threading.Timer(1.0, backend.unstall)
        release.start()
        try:
            serve(cache, tokens(302, half))
        finally:
            release.cancel()
            backend.unstall()
        ops = cache.metrics.snapshot()["operations"]
        if wait_s:
            assert ops["backups"] == 3 and ops["backups_skipped"] == 0 and ops["backups_waited"] >= 1
        else:  # the control: without waiting, the same run skips (and says so, apart from failures)
            assert ops["backups_skipped"] >= 1 and ops["backups"] < 3
        cache.flush()


def test_a_backend_that_cannot_open_is_named_by_its_config_entry(tmp_path: Path) -> None:
    """A file L3 whose directory cannot be created (its parent is a file) fails the open with an
    error naming the config entry, the backend and the path, the OSError kept as its cause."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError) as caught:
        open_cache("kv", l3=blocker / "l3")
    message = str(caught.value)
    assert "tiers.storage.l3" in message and "'file'" in message
    assert f"cannot create {blocker / 'l3'}" in message
    assert isinstance(caught.value.__cause__, StorageError)
    assert isinstance(caught.value.__cause__.__cause__, NotADirectoryError)


@pytest.mark.parametrize("entry", ["cache", "engine_kit"])
@pytest.mark.parametrize("where", ["open", "constructor", "capabilities"])
def test_a_plugin_raising_anything_at_open_is_a_storage_error_and_closed(entry: str, where: str) -> None:
    """Fault injection: a backend plugin's constructor, ``open`` or ``instance_capabilities``
    raises. The cache, and the adapters' path (``engine_kit.open_storage``), report it as a
    StorageError naming the instance and type (the plugin's error as the cause), after closing
    the half-opened backend (a raising ``instance_capabilities`` once left it open, unreported)."""
    opened: list[FaultyBackend] = []

    class RecordedFaultyBackend(FaultyBackend):
        def __init__(self, instance: str, config: FaultyBackend.Config) -> None:
            if where == "constructor":
                raise InjectedFault(f"injected open failure ({instance})")
            super().__init__(instance, config)

        def open(self) -> None:
            opened.append(self)
            super().open()

        def instance_capabilities(self):  # type: ignore[no-untyped-def]
            if where == "capabilities":
                raise InjectedFault(f"injected open failure ({self.instance})")
            return super().instance_capabilities()

    host = PluginHost()
    host.storage_backends.register(RecordedFaultyBackend)
    operations = ["open"] if where == "open" else []
    with pytest.raises(StorageError) as caught:
        if entry == "cache":
            storage = f"tiers.storage={{broken: {{type: faults, operations: {operations}}}}}"
            open_cache("kv", overrides=[storage], host=host)
        else:
            config = RecordedFaultyBackend.Config(type="faults", operations=operations)
            open_storage("broken", config, namespace="test", plugins=host)
    assert "storage instance 'broken' (tiers.storage.broken, type 'faults') could not be opened" in str(
        caught.value
    )
    assert "InjectedFault: injected open failure (broken)" in str(caught.value)
    assert isinstance(caught.value.__cause__, InjectedFault)
    assert len(opened) == (where != "constructor") and all(backend.closed.is_set() for backend in opened)


def test_a_backend_raising_a_base_exception_in_put_fails_that_write_not_the_next_call() -> None:
    """A plugin's put raising a BaseException subclass on the writer thread (an async client's
    ``asyncio.CancelledError`` once its loop went away, ``SystemExit``): the next call of the
    cache re-raised it, and the write's host lock was never released (its pages never left)."""
    import asyncio

    class Cancelled(FaultyBackend):
        def put(self, objects: object) -> list[bool]:
            raise asyncio.CancelledError("event loop closed")

    host = PluginHost()
    host.storage_backends.register(Cancelled)
    no_prefetch = "policy.prefetch.threshold_tokens=1000000"
    overrides = ["tiers.storage={l3: {type: faults, operations: []}}", no_prefetch]
    with open_cache("kv", overrides=overrides, host=host) as cache:
        serve(cache, tokens(1, 4))
        cache.writer.pending[0].future.exception(10)  # failed on the writer thread
        serve(cache, tokens(2, 4))  # raised the plugin's CancelledError
        cache.flush()
        assert cache.metrics.snapshot()["failures"] >= 1
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        locked = [n for n in cache.tree.nodes() if any(n.host_lock)]
        assert not locked, f"host locks never released: {locked}"


def stuck_l3_cache(*overrides: str) -> tuple[CacheController, FaultyBackend]:
    """A kv cache on the faults fake as L3: it stores nothing (answers 'not stored') and holds
    every put until ``backend.unstall()``: writes stay queued, their host units in use."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    stuck = "tiers.storage={l3: {type: faults, operations: [], stall: [put]}}"
    cache = open_cache("kv", overrides=[stuck, *overrides], host=host)
    assert isinstance(cache.backend, FaultyBackend)
    return cache, cache.backend


def test_a_backup_skipped_while_l3_was_slow_is_taken_with_the_next_pages_below_it() -> None:
    """write_through: a system prompt's backup skipped once (the host tier full of pages whose
    L3 writes were stuck, ``backup_wait_s`` over) kept every page later requests added below it
    off the host tier and L3 for good (backups form a contiguous prefix), the host tier half
    empty again or not."""
    cache, backend = stuck_l3_cache("policy.backup_wait_s=0", "policy.prefetch.threshold_tokens=1000000")
    with cache:
        half = cache.pools.pools["kv"].host_allocator.units // 2
        for seed in range(2):  # the host tier fills with pages whose L3 writes are stuck
            serve(cache, tokens(300 + seed, half))
        prompt = tokens(7, 4)
        serve(cache, prompt)
        assert cache.metrics.snapshot()["operations"]["backups_skipped"] >= 1
        backend.unstall()  # L3 answers again: its writes release the host units
        cache.flush()
        for turn in range(3):  # conversations below the prompt, with room on the host tier
            serve(cache, torch.cat([prompt, tokens(100 + turn, 4)]))
        cache.flush()
        unbacked = [n for n in cache.tree.holding("kv", "device") if not cache.tree.backed_up(n)]
        assert not unbacked, f"{sum(n.pages for n in unbacked)} device pages were never backed up"


@pytest.mark.parametrize("call", ["flush", "close"])
def test_flush_and_close_with_a_timeout_return_by_it_while_l3_is_stuck(call: str) -> None:
    """The host tier full of pages whose L3 writes are stuck, one chunked lease with batched
    pages: ``flush(timeout=0.3)`` / ``close(timeout=0.3)`` backed that batch up first and waited
    ``policy.backup_wait_s`` (5 s) for host room before their own timeout applied."""
    import time
    import warnings

    cache, backend = stuck_l3_cache("policy.backup_wait_s=5")
    with cache:
        try:
            half = cache.pools.pools["kv"].host_allocator.units // 2
            for seed in range(2):
                serve(cache, tokens(300 + seed, half))
            lease = cache.lookup(tokens(9, 4))
            cache.admit(lease)
            cache.allocate(lease)
            cache.insert(lease, close=False)  # 4 pages batched (write_through_batch_pages: 64)
            started = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                getattr(cache, call)(timeout=0.3)
            took = time.monotonic() - started
            if call == "flush":
                cache.release(lease)
        finally:
            backend.unstall()
    assert took < 2.0, f"{call}(timeout=0.3) took {took:.1f} s"


def test_writes_close_cancelled_are_counted_once_as_abandoned(caplog: pytest.LogCaptureFixture) -> None:
    """``close(timeout)`` counts the queued writes it cancels as abandoned; a later ``flush`` /
    ``poll`` logged an "L3 write failed" traceback for each and counted it as a failure too."""
    import logging
    import warnings

    cache, backend = stuck_l3_cache()
    try:
        for seed in range(3):  # one write stuck in the backend, two queued behind it
            serve(cache, tokens(200 + seed, 2))
        failures = cache.metrics.snapshot()["failures"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache.close(timeout=0.1)
        assert cache.metrics.snapshot()["operations"]["storage_writes_abandoned"] == 3
    finally:
        backend.unstall()
    with caplog.at_level(logging.ERROR, logger="kvstrata"):
        cache.flush()
        cache.poll()
    assert not [r for r in caplog.records if "L3 write failed" in r.getMessage()]
    # the write running in the backend ended on its own and its answer counts (this fake stores
    # nothing: one failure); the two close cancelled count nothing more
    assert cache.metrics.snapshot()["failures"] == failures + 1


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba"])
def test_a_load_back_whose_copy_raises_gives_back_its_device_units(stack: str) -> None:
    """A host -> device copy that raises (fault injection: a patched copy) left the units the
    load-back had allocated for it in use by no one: 6 device units lost per failed load-back."""
    with open_cache(stack) as cache:
        request = tokens(1, 6)
        serve(cache, request)  # write-through: the host holds the prefix
        cache.tree.evict_device({name: 1 << 30 for name in cache.tree_pools}, cache.units.freer(Tier.DEVICE))
        lease = cache.lookup(request)

        def copy_fails(*args: object, **kwargs: object) -> list:
            raise RuntimeError("injected copy fault")

        cache.pools.host_to_device = copy_fails  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected copy fault"):
            cache.admit(lease)
        del cache.pools.host_to_device
        cache.release(lease)
        device_accounting(cache, [])
        again, bad = serve(cache, request)
        assert again.cached_pages == 6 and bad == 0, "the next request loads the prefix back"


class _Interrupt(BaseException):
    """What a KeyboardInterrupt / SystemExit is to the cache: not an ``Exception``."""


@pytest.mark.parametrize("error", [InjectedFault, _Interrupt])
@pytest.mark.parametrize(("call", "reason"), [("get", "damaged_object"), ("exists", "storage_down")])
def test_a_backend_raising_anything_fails_that_read_counted_and_leaks_nothing(
    error: type, call: str, reason: str
) -> None:
    """Fault injection (a backend whose ``get`` or ``exists`` raises): an ``Exception`` fails the
    read as a counted failure with its pages skipped (damaged objects; L3 down); a
    ``BaseException`` (an interrupt, ``SystemExit``, an async client's ``CancelledError``) on the
    prefetch worker failed it too, but counted neither the failure nor the pages (a silent miss)."""

    class Raising(FaultyBackend):
        def exists(self, keys: Sequence[str]) -> list[bool]:
            if call == "exists":
                raise error("injected exists failure")
            return [True] * len(keys)

        def get(self, objects: object) -> list[int]:
            raise error("injected get failure")

    host = PluginHost()
    host.storage_backends.register(Raising)
    overrides = ["tiers.storage={l3: {type: faults, operations: []}}", "policy.prefetch.threshold_tokens=64"]
    with open_cache("kv", overrides=overrides, host=host) as cache:
        lease = cache.lookup(tokens(1, 4), prefetch="wait")
        assert lease.prefetch is not None and lease.prefetch.done.wait(30)
        cache.admit(lease)
        assert lease.cached_pages == 0
        assert lease.skipped == {reason: 4}, "the pages L3 held are counted"
        assert cache.metrics.snapshot()["failures"] >= 1
        cache.release(lease)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        assert cache.prefetcher is not None and cache.prefetcher.reserved_pages == 0


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba"])
def test_a_backup_whose_copy_raises_gives_back_its_host_units(stack: str) -> None:
    """A device -> host copy that raises (fault injection: a patched copy) left the host units
    the backup had allocated for it in use by no one (6 host units per failed backup of 6 pages),
    and ``host_admitted`` counted its 6 pages, which never entered the host tier."""
    with open_cache(stack) as cache:
        lease = cache.lookup(tokens(1, 6))
        cache.admit(lease)
        fill(cache, lease, cache.allocate(lease))

        def copy_fails(*args: object, **kwargs: object) -> list:
            raise RuntimeError("injected copy fault")

        cache.pools.device_to_host = copy_fails  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected copy fault"):
            cache.insert(lease)  # write-through: backs the pages up
        del cache.pools.device_to_host
        cache.release(lease)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "host units leaked"
        assert cache.metrics.snapshot()["operations"]["host_admitted"] == 0, "no page entered the host"
        assert serve(cache, tokens(2, 6))[1] == 0
        assert cache.tree.units(cache.layout.anchor, "host") >= 6, "the next backups are made"
        assert cache.metrics.snapshot()["operations"]["host_admitted"] == 6
