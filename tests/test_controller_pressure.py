"""Under pressure, with L3 work in flight: what a call finds must be what it uses, and a refusal
must be one no drain of finished work would cure (audit 26: a crash and two false refusals)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from controller_support import EXAMPLES, device_accounting, fill, open_cache, serve, tokens, verify
from kvstrata.core.controller import CacheController
from kvstrata.core.retention import RetentionHint
from kvstrata.core.tier_units import room_by_evicting
from kvstrata.core.tree import Tier

#: no host tier, no L3: what leaves the device is gone
NO_LOWER = ["tiers.host.capacity_tokens=0", "tiers.storage={}"]


def serve_unread(cache: CacheController, request: torch.Tensor) -> None:
    """A request that reads nothing from L3 (its prefix is new)."""
    lease = cache.lookup(request, prefetch="off")
    cache.admit(lease)
    fill(cache, lease, cache.allocate(lease))
    cache.insert(lease)


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_admit_matches_again_after_a_load_back_that_failed(eviction: str) -> None:
    # the load-back's eviction took the window tail of the device prefix the first match
    # counted, then failed for want of room; admit settled on that match: TreeError
    overrides = [
        "tiers.device.capacity_tokens=512",
        "tiers.host.capacity_tokens=2048",
        f"policy.eviction={eviction}",
    ]
    with open_cache("swa", None, overrides) as cache:
        prompt = tokens(1, 6)
        queued = cache.lookup(prompt)  # before its prompt was cached: it locks nothing
        serve(cache, prompt)
        serve(cache, torch.cat([prompt[: 2 * cache.page_size], tokens(2, 2)]))  # a branch at page 2
        serve(cache, tokens(3, 4))  # pushes [2, 6) to the host tier
        running = cache.lookup(tokens(3, 4))
        cache.admit(running)  # holds those 4 device pages
        cache.admit(queued)
        assert verify(cache, queued) == 0
        cache.release(running)
        fill(cache, queued, cache.allocate(queued))
        cache.insert(queued)
        again, bad = serve(cache, prompt)
        assert again.cached_pages == 6 and bad == 0


def test_allocate_drains_a_finished_revoked_read_before_refusing(tmp_path: Path) -> None:
    # write-back: the device is full of pages with no host copy, and a released request's L3
    # read that finished after the last call still held the host units their backups need
    small = [
        "tiers.device.capacity_tokens=512",
        "tiers.host.capacity_tokens=512",
        "policy.prefetch.threshold_tokens=64",
    ]
    request = tokens(7, 6)
    with open_cache("kv", tmp_path, small) as writer:
        serve(writer, request)
    overrides = [*small, "policy.write=write_back", "policy.prefetch.policy=best_effort"]
    overrides.append("policy.prefetch.host_fraction_limit=1")
    with open_cache("kv", tmp_path, overrides) as cache:
        assert cache.engine is not None and cache.prefetcher is not None
        gate = threading.Event()
        get_group = cache.engine.get_group
        cache.engine.get_group = lambda batches: (gate.wait(10), get_group(batches))[1]  # type: ignore[method-assign]
        for seed in (11, 12):  # 8 device pages, none backed up
            serve_unread(cache, tokens(seed, 4))
        reader = cache.lookup(request)
        op = reader.prefetch
        assert op is not None
        cache.release(reader)  # its read goes on: an orphan holding host units
        lease = cache.lookup(tokens(13, 4), prefetch="off")
        cache.admit(lease)
        gate.set()
        assert op.done.wait(10)
        fill(cache, lease, cache.allocate(lease))  # refused before: poll() cured it
        cache.insert(lease)


def test_a_finished_l3_write_counts_with_no_time_to_wait(tmp_path: Path) -> None:
    # write-back, policy.backup_wait_s=0: a finished write nobody drained kept its host lock
    overrides = [
        "tiers.device.capacity_tokens=512",
        "tiers.host.capacity_tokens=256",
        "policy.write=write_back",
        "policy.backup_wait_s=0",
    ]
    with open_cache("kv", tmp_path, overrides) as cache:
        for seed in (1, 2):
            serve_unread(cache, tokens(seed, 4))
        first, second = cache.lookup(tokens(3, 4), prefetch="off"), cache.lookup(tokens(4, 4), prefetch="off")
        cache.admit(first)
        cache.admit(second)
        fill(cache, first, cache.allocate(first))  # backs the oldest up: host full, L3 write queued
        deadline = time.monotonic() + 10
        while not all(write.future.done() for write in cache.writer.pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        fill(cache, second, cache.allocate(second))
        for lease in (first, second):
            cache.insert(lease)


def _most_room(cache: CacheController, tier: Tier, pool: str) -> int:
    """The most units of ``pool`` that ``room_by_evicting`` says eviction could free in ``tier``."""
    low, high = 0, cache.pools.pools[pool].device_allocator.units + 4096
    while low < high:  # the largest want it allows
        mid = (low + high + 1) // 2
        low, high = (mid, high) if room_by_evicting(cache.tree.evictor, tier, {pool: mid}) else (low, mid - 1)
    return low


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("stack", sorted(EXAMPLES))
def test_the_refusal_check_bounds_what_any_eviction_frees(stack: str, seed: int) -> None:
    """``room_by_evicting`` lets an allocation go ahead only where evicting what no lock holds
    could cover it: it must never count fewer units than an eviction of everything frees, or an
    allocation eviction could serve is refused. Random shared prefixes, requests left running
    (locked, partly inserted), a pinned prefix, then every tier emptied of what it may drop."""
    rng = random.Random(seed)
    overrides = ["tiers.device.capacity_tokens=1024", "tiers.host.capacity_tokens=2048"]
    with open_cache(stack, overrides=overrides) as cache:
        heads = [tokens(100 * seed + i, 2) for i in range(3)]
        for i in range(12):
            serve(cache, torch.cat([rng.choice(heads), tokens(1000 * seed + i, rng.randint(1, 3))]))
        pinned = cache.lookup(rng.choice(heads), retention=RetentionHint(pin=True))
        cache.admit(pinned)
        fill(cache, pinned, cache.allocate(pinned))
        cache.insert(pinned)
        leases = []
        for i in range(2):  # running: locked prefixes, one with its first chunk inserted
            running = cache.lookup(torch.cat([rng.choice(heads), tokens(5000 * seed + i, 2)]))
            cache.admit(running)
            fill(cache, running, cache.allocate(running))
            if i:
                cache.insert(running, close=False)
            leases.append(running)
        bounds = []
        for tier in (Tier.DEVICE, Tier.HOST):
            bound = {name: _most_room(cache, tier, name) for name in cache.tree_pools}
            bounds.append(bound)
            everything = dict.fromkeys(cache.tree_pools, 1 << 40)
            if tier is Tier.DEVICE:
                freed = cache.tree.evict_device(everything, cache.units.freer(tier), delete_unbacked=True)
            else:
                freed = cache.tree.evict_host(everything, cache.units.freer(tier))
            for name, count in bound.items():
                assert freed.units.get(name, 0) <= count, (tier, name, freed.units, bound)
        assert any(bounds[0].values()), "the workload left nothing to evict: the check is vacuous"
        for lease in leases:
            cache.release(lease)


@pytest.mark.parametrize("stack", ["swa", "swa-mamba"])
def test_a_request_below_a_long_cached_prompt_locks_only_its_window_of_a_window_pool(stack: str) -> None:
    """A request continuing an 8-page cached prompt (one node) needs the window pool's units of
    the prompt's last window only; its lock counted on the whole node, so the prompt's older
    window data could not be tombstoned and a window pool of 8 units refused the next 2 pages
    ("device tier cannot hold 2 new pages")."""
    small = ["model.pools.swa.device_units=8", "tiers.host.capacity_tokens=0", "tiers.storage={}"]
    with open_cache(stack, overrides=small) as cache:
        assert cache.tree_pools["swa"].window < 8  # 2 pages (swa), 4 (swa-mamba)
        prompt = tokens(1, 8)
        serve(cache, prompt)  # one node holding 8 window units: the whole pool
        longer = torch.cat([prompt, tokens(2, 2)])
        lease, bad = serve(cache, longer)
        assert lease.cached_pages == 8 and bad == 0
        again, bad = serve(cache, longer)  # the continuation is cached whole, bytes intact
        assert again.cached_pages == 10 and bad == 0
        cache.tree.check()


def test_a_window_pools_prefix_units_are_its_last_window_and_stay_held_while_the_lease_is_open() -> None:
    """A lease continuing an 8-page cached prompt (one node) was handed the whole node's window
    units (pages 0..7) while its lock holds the last window only: another request's allocate
    tombstoned the head and was handed those very units, and the open lease read its bytes."""
    with open_cache("swa", overrides=["model.pools.swa.device_units=10", *NO_LOWER]) as cache:
        prompt = tokens(1, 8)
        serve(cache, prompt)
        a = cache.lookup(torch.cat([prompt, tokens(2, 2)]))
        cache.admit(a)
        window = cache.tree_pools["swa"].window
        assert a.cached_pages == 8 and a.prefix_first_page("swa") == 8 - window
        assert len(a.prefix_units("swa")) == window and verify(cache, a) == 0
        b = cache.lookup(tokens(3, 8))
        cache.admit(b)
        fill(cache, b, cache.allocate(b))  # tombstones the prompt's head, hands its units to b
        assert verify(cache, a) == 0
        cache.release(b)
        cache.release(a)


@pytest.mark.parametrize("stack", ["swa", "swa-mamba", "logical-swa"])
def test_a_requests_own_allocate_leaves_its_window_prefix_intact(stack: str) -> None:
    """As the replay driver serves a request: its allocate (spare units for every new page)
    tombstoned the head of the cached node its window reaches into and handed those units back
    as new pages, over what prefix_units said held the prefix."""
    with open_cache(stack, overrides=["model.pools.swa.device_units=10", *NO_LOWER]) as cache:
        prompt = tokens(1, 8)
        serve(cache, prompt)
        lease = cache.lookup(torch.cat([prompt, tokens(2, 6)]))
        cache.admit(lease)
        assert lease.cached_pages == 8 and verify(cache, lease) == 0
        fill(cache, lease, cache.allocate(lease))
        assert verify(cache, lease) == 0
        cache.insert(lease)
        device_accounting(cache, [])
