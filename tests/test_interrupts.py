"""An interrupt (a ``BaseException``: KeyboardInterrupt, SystemExit) from an observer hook in the
middle of a cache call loses nothing (audit s35). ``PluginHost.notify`` swallows an observer's
``Exception``; a ``BaseException`` goes through, as it must, and the call it interrupts must
leave every unit, reservation and backend accounted for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from controller_support import computed, fill, open_cache, serve, tokens, verify
from kvstrata import hookimpl
from kvstrata.core import lease_units
from kvstrata.core.controller import CacheController
from kvstrata.core.lease import Lease
from kvstrata.core.tree import PrefixTree
from kvstrata.plugins import PluginHost


class Interrupt(BaseException):
    """What a KeyboardInterrupt is to the cache: not an ``Exception``."""


def _inside(function: str) -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


class InterruptDuringBackup:
    """Raises once from the eviction observer while ``back_up_prefix`` is on the stack."""

    def __init__(self) -> None:
        self.armed = False

    @hookimpl
    def kvstrata_eviction(self, tier: str, pool: str, units: int) -> None:
        if self.armed and _inside("back_up_prefix"):
            self.armed = False
            raise Interrupt("eviction")


def test_an_interrupt_while_admit_backs_up_the_prefix_frees_the_prefetchs_host_units(tmp_path: Path) -> None:
    """``admit`` handed the L3 read to be committed, then backed the device-only prefix below it
    up to the host (evicting host pages): interrupted there, the read belonged to no one and its
    host units and rate-limit pages were never freed."""
    l3 = tmp_path / "l3"
    p, q = tokens(1, 7), tokens(2, 8)
    with open_cache("kv", l3) as writer:  # L3 holds P+Q
        serve(writer, torch.cat([p, q]))
        writer.flush()
    observer = InterruptDuringBackup()
    host = PluginHost()
    host.register_plugin(observer, "interrupt")
    overrides = ["policy.write=write_back", "tiers.host.capacity_tokens=1536"]  # 24 host pages
    with open_cache("kv", l3, overrides, host=host) as cache:
        for seed in range(6):  # device evictions back these up: the host fills with unlocked pages
            lease = cache.lookup(tokens(10 + seed, 6), prefetch="off")
            cache.admit(lease)
            fill(cache, lease, cache.allocate(lease))
            cache.insert(lease)
        lease = cache.lookup(p, prefetch="off")  # P: on the device only (write-back)
        cache.admit(lease)
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)
        cache.flush()
        lease = cache.lookup(torch.cat([p, q]), prefetch="wait")
        assert lease.device_pages == 7 and lease.prefetch is not None
        observer.armed = True
        with pytest.raises(Interrupt):
            cache.admit(lease)
        assert not observer.armed  # it fired where meant
        cache.release(lease)  # what an engine does with a request whose admit failed
        cache.flush()
        pool = cache.pools.pools["kv"]
        assert pool.host_allocator.used == cache.tree.units("kv", "host")
        assert pool.device_allocator.used == cache.tree.units("kv", "device")
        assert cache.prefetcher.reserved_pages == 0
        assert not cache.prefetcher.orphans
        _, bad = serve(cache, torch.cat([p, q]))  # and the next request is served exactly
        assert bad == 0


class InterruptAtClosing:
    @hookimpl
    def kvstrata_backend_closing(self, instance: str, backend: object) -> None:
        raise Interrupt("closing")


def test_an_interrupt_in_the_closing_hook_still_closes_the_backend(tmp_path: Path) -> None:
    host = PluginHost()
    host.register_plugin(InterruptAtClosing(), "interrupt")
    cache = open_cache("kv", tmp_path / "l3", host=host)
    closed: list[str] = []
    backend = cache.parts.backend
    real_close = backend.close
    backend.close = lambda: (closed.append("closed"), real_close())  # type: ignore[method-assign]
    serve(cache, tokens(3, 2))
    with pytest.raises(Interrupt):
        cache.close()
    assert closed == ["closed"]


def _device_exact(cache: CacheController) -> None:
    """Every device unit in use is the tree's (no lease open)."""
    pool = cache.pools.pools["kv"]
    assert pool.device_allocator.used == cache.tree.units("kv", "device"), (
        "device units leaked or freed twice"
    )


def test_an_interrupt_before_the_lease_records_an_allocation_frees_its_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``allocate`` took the units, then was interrupted before the lease recorded them: no one
    held them, and they were never freed."""
    cache = open_cache("kv", overrides=["tiers.storage={}"])
    real = Lease.add_allocation

    def interrupted(self: Lease, *args: object) -> object:
        monkeypatch.setattr(Lease, "add_allocation", real)
        raise Interrupt("allocate")

    monkeypatch.setattr(Lease, "add_allocation", interrupted)
    lease = cache.lookup(tokens(1, 4))
    with pytest.raises(Interrupt):
        cache.allocate(lease)
    cache.release(lease)
    _device_exact(cache)
    for seed in range(2, 8):  # every unit of the tier is handed out again
        assert serve(cache, tokens(seed, 4))[1] == 0
    _device_exact(cache)
    cache.close()


def _reread_after_others(cache: CacheController, request: torch.Tensor, pages: int) -> int:
    """Restore ``request`` (its lease keeps it on the device), serve requests enough to hand out
    every free unit, then count its wrong units (a unit the tree indexes that was freed went to
    another request, whose bytes it holds now)."""
    lease = cache.lookup(request)
    cache.admit(lease)
    assert lease.cached_pages == pages and verify(cache, lease) == 0
    for seed in range(20, 26):
        serve(cache, tokens(seed, 3))
    bad = verify(cache, lease)
    cache.release(lease)
    return bad


def test_an_interrupt_while_insert_moves_the_lock_leaves_the_tree_its_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``insert`` handed the pages to the tree, then was interrupted before the lease dropped
    them (here: moving its lock): the engine's ``release`` freed units the tree indexed, and the
    next requests' writes were served as this prompt's pages."""
    cache = open_cache("kv", overrides=["tiers.storage={}"])
    request = tokens(1, 4)
    lease = computed(cache, request)
    real = PrefixTree.lock

    def interrupted(self: PrefixTree, *args: object) -> object:
        monkeypatch.setattr(PrefixTree, "lock", real)
        raise Interrupt("insert")

    monkeypatch.setattr(PrefixTree, "lock", interrupted)
    with pytest.raises(Interrupt):
        cache.insert(lease)
    cache.release(lease)
    assert _reread_after_others(cache, request, 4) == 0, "another request's bytes served"
    _device_exact(cache)
    cache.close()


def test_an_interrupt_while_insert_frees_duplicates_leaves_the_tree_its_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, interrupted while freeing the pages another request had inserted first: the
    lease's pages after them were the tree's and the lease's both."""
    cache = open_cache("kv", overrides=["tiers.storage={}"])
    first, request = tokens(1, 2), tokens(1, 4)
    shorter, longer = computed(cache, first), computed(cache, request)
    cache.insert(shorter)

    def interrupted(*args: object) -> object:
        raise Interrupt("insert")

    monkeypatch.setattr(lease_units, "free_duplicates", interrupted)
    with pytest.raises(Interrupt):
        cache.insert(longer)
    monkeypatch.undo()
    cache.release(longer)  # (its 2 duplicated units: freed here, never by the interrupted insert)
    assert _reread_after_others(cache, request, 4) == 0, "another request's bytes served"
    _device_exact(cache)
    cache.close()
