"""An interrupt (a ``BaseException``: KeyboardInterrupt, SystemExit) from an observer hook in the
middle of a cache call loses nothing (audit s35). ``PluginHost.notify`` swallows an observer's
``Exception``; a ``BaseException`` goes through, as it must, and the call it interrupts must
leave every unit, reservation and backend accounted for."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from controller_support import (
    computed,
    device_accounting,
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
    verify,
)
from kvstrata import hookimpl
from kvstrata.core import lease_units, prefetcher
from kvstrata.core import writer as writer_module
from kvstrata.core.controller import CacheController
from kvstrata.core.lease import Lease
from kvstrata.core.prefetcher import Prefetcher
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.eviction_policies.fifo import FifoPolicy
from kvstrata.plugins import PluginHost


class Interrupt(BaseException):
    """What a KeyboardInterrupt is to the cache: not an ``Exception``."""


def interrupt_once(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, *, after: bool = False) -> None:
    """Fault injection: ``owner.<name>`` raises :class:`Interrupt` on its next call (after the
    real call where ``after``: the interrupt lands once it did its work), then is itself again."""
    real = getattr(owner, name)

    def interrupted(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(owner, name, real)
        if after:
            real(*args, **kwargs)
        raise Interrupt(name)

    monkeypatch.setattr(owner, name, interrupted)


def _lease_that_backs_up(cache: CacheController, write: str) -> Lease:
    """The lease whose next call backs up a first request's 4 pages: under write-through that
    request's own (computed, its insert backs it up), under write-back a second request's, whose
    allocation evicts the first (the backup ahead of the eviction)."""
    first = tokens(1, 4)
    if write == "write_through":
        return computed(cache, first)
    serve(cache, first)
    lease = cache.lookup(tokens(2, 6))
    cache.admit(lease)
    return lease


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
    interrupt_once(monkeypatch, Lease, "add_allocation")
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
    interrupt_once(monkeypatch, PrefixTree, "lock")
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


# --- a finished L3 read, detached from the lease, interrupted on its way into the tree ---------------


def _stored(tmp_path: Path, request: torch.Tensor) -> Path:
    """An L3 holding ``request``'s pages, written by another cache."""
    l3 = tmp_path / "l3"
    with open_cache("kv", l3) as writer:
        serve(writer, request)
        writer.flush()
    return l3


def _prefetched(cache: CacheController, request: torch.Tensor) -> Lease:
    """A lease whose L3 read of every page of ``request`` has finished."""
    lease = cache.lookup(request, prefetch="wait")
    assert lease.prefetch is not None and lease.prefetch.done.wait(30)
    return lease


def _host_exact(cache: CacheController) -> None:
    """Every host unit in use is the tree's, and no prefetch counts as in flight."""
    assert host_units_in_use(cache) == host_units_held_by_tree(cache), "host units leaked or freed twice"
    assert cache.prefetcher is not None
    assert cache.prefetcher.reserved_pages == 0 and not cache.prefetcher.orphans


@pytest.mark.parametrize("call", ["admit", "release"])
def test_an_interrupt_as_a_prefetch_commits_frees_its_host_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """``admit`` / ``release`` took the finished read off the lease, then ``commit`` was
    interrupted at its entry: the read belonged to no one, its host units were never freed and
    its pages stayed in ``reserved_pages`` (throttling every later prefetch)."""
    request = tokens(1, 5)
    cache = open_cache("kv", _stored(tmp_path, request))
    lease = _prefetched(cache, request)
    interrupt_once(monkeypatch, Prefetcher, "commit")
    with pytest.raises(Interrupt):
        getattr(cache, call)(lease)
    cache.release(lease)
    _host_exact(cache)
    assert serve(cache, request)[1] == 0  # read from L3 again, exactly
    _host_exact(cache)
    cache.close()


def test_an_interrupt_while_a_prefetch_checks_its_digests_frees_its_host_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, interrupted inside ``check_span`` (``debug.unit_digests``), before the tree
    took the pages: ``reserved_pages`` was settled, the host units never freed."""
    request = tokens(2, 5)
    cache = open_cache("kv", _stored(tmp_path, request), ["debug.unit_digests=true"])
    lease = _prefetched(cache, request)
    interrupt_once(monkeypatch, prefetcher, "check_span")
    with pytest.raises(Interrupt):
        cache.admit(lease)
    cache.release(lease)
    _host_exact(cache)
    assert serve(cache, request)[1] == 0
    _host_exact(cache)
    cache.close()


class InterruptAtPrefetchCommitted:
    """Raises once, from the hook told a prefetch's pages are in the tree."""

    def __init__(self) -> None:
        self.armed = True

    @hookimpl
    def kvstrata_prefetch_committed(self, request_id: str, tokens: int, pools: list[str]) -> None:
        if self.armed:
            self.armed = False
            raise Interrupt("prefetch committed")


def test_an_interrupt_after_a_prefetch_is_in_the_tree_leaves_the_tree_its_units(tmp_path: Path) -> None:
    """Interrupted once the tree holds the read's pages (the committed hook): what frees the
    rest of an interrupted read must not free the units the tree indexes too."""
    request = tokens(3, 5)
    l3 = _stored(tmp_path, request)
    host = PluginHost()
    observer = InterruptAtPrefetchCommitted()
    host.register_plugin(observer, "interrupt")
    cache = open_cache("kv", l3, host=host)
    lease = _prefetched(cache, request)
    with pytest.raises(Interrupt):
        cache.admit(lease)
    assert not observer.armed  # it fired where meant
    cache.release(lease)
    _host_exact(cache)
    assert cache.tree.units("kv", "host") >= 5  # the pages it read are the tree's
    assert _reread_after_others(cache, request, 5) == 0, "another request's bytes served"
    _host_exact(cache)
    cache.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_inside_insert_host_frees_the_units_the_tree_did_not_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Fault injection (a patched ``PrefixTree.insert_host`` raising before, or after, the real
    insert: an eviction order's ``split`` / ``inserted`` hook interrupted). ``commit`` had handed
    the read's units to the tree, so an interrupt before the tree took them left them allocated
    and no one's (5 host units per interrupted commit); after, the tree's must stay its own."""
    request = tokens(4, 5)
    cache = open_cache("kv", _stored(tmp_path, request))
    lease = _prefetched(cache, request)
    interrupt_once(monkeypatch, PrefixTree, "insert_host", after=when == "after")
    with pytest.raises(Interrupt):
        cache.admit(lease)
    cache.release(lease)
    cache.tree.check()
    _host_exact(cache)
    assert cache.tree.units("kv", "host") == (5 if when == "after" else 0)
    assert _reread_after_others(cache, request, 5) == 0, "another request's bytes served"
    _host_exact(cache)
    cache.close()


# --- an eviction order's hook interrupted inside a tree update of the device or host tier ---------


class InterruptOnce:
    """Patches ``FifoPolicy.<event>`` to raise once, on the ``tier``'s order, once armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, event: str, tier: str) -> None:
        self.armed = False
        real = getattr(FifoPolicy, event)

        def hook(policy: FifoPolicy, *args: object) -> None:
            if self.armed and policy.context.tier == tier:
                self.armed = False
                raise Interrupt(event)
            real(policy, *args)

        monkeypatch.setattr(FifoPolicy, event, hook)


def test_an_interrupt_in_the_device_orders_inserted_hook_leaves_the_tree_its_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection (the device eviction order's ``inserted`` hook raising an interrupt):
    ``PrefixTree.insert`` had set the lease's units on the nodes, then told the order; the lease
    never learnt the tree took them, and ``release`` freed units the tree indexed (the next
    requests' writes were served as this prompt's pages)."""
    cache = open_cache("kv", overrides=["tiers.storage={}", "policy.eviction={type: fifo}"])
    hook = InterruptOnce(monkeypatch, "inserted", "device")
    request = tokens(1, 4)
    lease = computed(cache, request)
    hook.armed = True
    with pytest.raises(Interrupt):
        cache.insert(lease)
    assert not hook.armed  # it fired where meant
    cache.release(lease)
    cache.tree.check()
    _device_exact(cache)
    assert _reread_after_others(cache, request, 4) == 0, "another request's bytes served"
    _device_exact(cache)
    cache.close()


def test_an_interrupt_in_the_device_orders_split_hook_during_insert_frees_the_leases_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection (the device order's ``split`` hook raising an interrupt while ``insert``
    cuts the node another request inserted meanwhile): the tree took none of the lease's units
    yet, so its ``release`` frees them all, once."""
    cache = open_cache("kv", overrides=["tiers.storage={}", "policy.eviction={type: fifo}"])
    hook = InterruptOnce(monkeypatch, "split", "device")
    request, longer = tokens(1, 4), tokens(1, 6)
    lease = computed(cache, request)
    serve(cache, longer)  # inserted first: one node of 6 pages, ``lease``'s 4 end inside it
    hook.armed = True
    with pytest.raises(Interrupt):
        cache.insert(lease)
    assert not hook.armed
    cache.release(lease)
    cache.tree.check()
    _device_exact(cache)
    assert _reread_after_others(cache, longer, 6) == 0, "another request's bytes served"
    _device_exact(cache)
    cache.close()


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba"])
def test_an_interrupt_in_the_device_orders_hook_during_a_load_back_frees_the_units_not_indexed(
    monkeypatch: pytest.MonkeyPatch, stack: str
) -> None:
    """Fault injection (the device eviction order's ``inserted`` hook raising an interrupt as the
    load-back's first ``set_device_value`` tells it the node came back): the copies were done and
    the tree had taken the first node's units, the rest of them (the second node's pages, a
    component's) stayed allocated and no one's, for good."""
    cache = open_cache(stack, overrides=["tiers.storage={}", "policy.eviction={type: fifo}"])
    hook = InterruptOnce(monkeypatch, "inserted", "device")
    shorter, request = tokens(1, 4), tokens(1, 6)
    serve(cache, shorter)
    serve(cache, request)  # write-through: the host holds both nodes, [0, 4) and [4, 6)
    cache.tree.evict_device({name: 1 << 30 for name in cache.tree_pools}, cache.units.freer(Tier.DEVICE))
    lease = cache.lookup(request)
    assert lease.host_pages == 6 and lease.device_pages == 0
    hook.armed = True
    with pytest.raises(Interrupt):
        cache.admit(lease)
    assert not hook.armed
    cache.release(lease)
    cache.tree.check()
    device_accounting(cache, [])
    again, bad = serve(cache, request)
    assert again.cached_pages == 6 and bad == 0, "the next request loads the prefix back"
    device_accounting(cache, [])
    cache.close()


@pytest.mark.parametrize("when", ["before", "after", "digests"])
def test_an_interrupt_after_a_backups_copies_frees_the_host_units_no_node_took(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Fault injection (a patched ``PrefixTree.set_host_values`` raising before, or after, the
    real call -- the host order's ``inserted`` hook interrupted -- or the ``debug.unit_digests``
    check of the copies raising): the device -> host copies had finished, so before the tree
    recorded them the backup's host units were no one's (4 per 4-page write-through, for good);
    after, they are the tree's and hold the pages' bytes."""
    cache = open_cache("kv", overrides=["tiers.storage={}", "debug.unit_digests=true"])
    request = tokens(1, 4)
    lease = computed(cache, request)

    def check_fails(*args: object) -> None:
        monkeypatch.undo()
        raise Interrupt("digests")

    if when == "digests":
        monkeypatch.setattr(writer_module, "_check_backups", check_fails)
    else:
        interrupt_once(monkeypatch, PrefixTree, "set_host_values", after=when == "after")
    with pytest.raises(Interrupt):
        cache.insert(lease)
    cache.release(lease)
    cache.tree.check()
    assert host_units_in_use(cache) == host_units_held_by_tree(cache), "host units leaked or freed twice"
    assert cache.tree.units("kv", "host") == (0 if when == "before" else 4)
    _device_exact(cache)
    cache.tree.evict_device({name: 1 << 30 for name in cache.tree_pools}, cache.units.freer(Tier.DEVICE))
    again, bad = serve(cache, request)  # from the host copies (after), or computed again (before)
    assert bad == 0 and again.cached_pages == (0 if when == "before" else 4)
    assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    cache.close()


def _restored(l3: Path, request: torch.Tensor) -> int:
    """Pages a fresh cache on ``l3`` restores of ``request``, every byte checked."""
    with open_cache("kv", l3) as fresh:
        lease = fresh.lookup(request, prefetch="wait")
        fresh.admit(lease)
        assert verify(fresh, lease) == 0
        fresh.release(lease)
        return lease.cached_pages


@pytest.mark.parametrize(
    ("write", "where"),
    [("write_through", "recorded"), ("write_back", "recorded"), ("write_back", "ancestors")],
)
def test_an_interrupt_after_a_backup_recorded_its_copies_still_writes_them_to_l3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str, where: str
) -> None:
    """Fault injection: ``PrefixTree.set_host_values`` raises once its real call recorded a
    backup's copies (the host order's ``inserted`` hook interrupted) -- write-through's at the
    insert, write-back's ahead of the eviction that makes room for the next request -- or the
    eviction's copy of the nodes' device-only ancestors does, before it copies (a host eviction
    it makes room with, interrupted). The pages stayed on the host with no L3 write queued, and
    none came later: every backup passes over a node on the host, reuse and flush included. A
    fresh cache restored 0 of the 4 pages."""
    l3 = tmp_path / "l3"
    device = ["tiers.device.capacity_tokens=512"]  # 8 pages: the second request evicts the first
    cache = open_cache("kv", l3, overrides=[f"policy.write={write}", *device])
    first, lease = tokens(1, 4), _lease_that_backs_up(cache, write)
    if where == "recorded":
        interrupt_once(monkeypatch, PrefixTree, "set_host_values", after=True)
    else:
        interrupt_once(monkeypatch, cache.writer, "copy_to_host")
    with pytest.raises(Interrupt):
        cache.insert(lease) if write == "write_through" else cache.allocate(lease)
    cache.release(lease)
    assert cache.tree.units("kv", "host") == 4, "(the copies are recorded)"
    again, bad = serve(cache, first)  # (the next call)
    assert again.cached_pages == 4 and bad == 0
    cache.flush()
    assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    cache.close()
    assert _restored(l3, first) == 4, "the pages reached L3"


def test_an_interrupt_after_a_state_copy_gave_its_host_slot_frees_the_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: ``PrefixTree.drop_component`` raises once its real call dropped a host
    state copy that write-back's rounds (no L3, 1 host state slot) give to a deeper checkpoint
    (a Ctrl-C landing after the drop). The tree no longer held the slot and nothing had freed
    it: one host state unit in use by no one, for the cache's life (the token fuzz machine's
    leak check, interrupts injected, found it)."""
    slots = [
        "policy.write=write_back",
        "policy.prefetch.policy=wait_complete",
        "model.pools.mamba.host_units=1",
    ]
    prompt = tokens(96, 8)
    with open_cache("hybrid-mamba", None, slots) as cache:
        lease = cache.lookup(prompt[:64])  # a chunked prefill: a checkpoint at every page
        cache.admit(lease)
        for end in range(1, 9):
            if end > 1:
                lease.extend(prompt[(end - 1) * 64 : end * 64])
            fill(cache, lease, cache.allocate(lease))
            cache.fork_state(lease)
            cache.insert(lease, close=end == 8)
        interrupt_once(monkeypatch, PrefixTree, "drop_component", after=True)
        interrupted = False
        for seed in (97, 98):  # the prompt leaves the device
            other = cache.lookup(tokens(seed, 8))
            cache.admit(other)
            try:
                fill(cache, other, cache.allocate(other))
            except Interrupt:
                cache.release(other)
                interrupted = True
                break
            cache.insert(other)
        assert interrupted
        cache.tree.check()
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        assert serve(cache, tokens(99, 8))[1] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_flush_after_an_interrupted_backup_waits_for_its_l3_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """Fault injection as above, then ``flush`` (or ``close``: what an interrupted engine calls
    next) with no call between. The write the interrupt left for the next drain was queued by
    flush's own closing poll, after its wait: flush returned with the pages not in L3 yet, and
    close counted the write abandoned ("cancelled, not stored"), cancelled where the writer
    thread had not started it."""
    l3 = tmp_path / "l3"
    cache = open_cache("kv", l3, overrides=[f"policy.write={write}", "tiers.device.capacity_tokens=512"])
    first, lease = tokens(1, 4), _lease_that_backs_up(cache, write)
    interrupt_once(monkeypatch, PrefixTree, "set_host_values", after=True)
    with pytest.raises(Interrupt):
        cache.insert(lease) if write == "write_through" else cache.allocate(lease)
    cache.release(lease)
    engine = cache.writer.engine
    assert engine is not None
    put_group = engine.put_group

    def slow(*args: object, **kwargs: object) -> object:  # (an L3 a little behind)
        time.sleep(0.2)
        return put_group(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "put_group", slow)
    cache.flush()
    assert all(write.future.done() for write in cache.writer.pending), "flush left a write running"
    assert _restored(l3, first) == 4, "the pages reached L3 by flush's return"
    cache.close()
    assert cache.metrics.snapshot()["operations"]["storage_writes_abandoned"] == 0
