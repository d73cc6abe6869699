"""Admission per tier (counted, so an SSD write budget holds) and retention hints on a request
(priority, pin with a cap, TTL that reads do not renew), through the controller's public calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from controller_support import fill, open_cache, serve, tokens, verify
from kvstrata.core.controller import CacheController, CacheFullError, Lease
from kvstrata.core.retention import RetentionHint
from kvstrata.core.tree import page_keys

WAIT = ["policy.prefetch.policy=wait_complete", "policy.prefetch.host_fraction_limit=1"]
#: 4 device pages, 16 host pages: every new 2-page request evicts on the device
SMALL = ["tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=1024"]


@contextmanager
def device_only_cache(now: list[float] | None = None) -> Iterator[CacheController]:
    """A kv cache of a 256-token device tier and no host or L3: what a level keeps is what stays
    on the device. ``now``: the retention clock reads ``now[0]`` (a TTL without sleeping)."""
    with open_cache(
        "kv", overrides=["tiers.storage={}", "tiers.host.capacity_tokens=0", *SMALL[:1]]
    ) as cache:
        if now is not None:
            cache.parts.retention.clock = lambda: now[0]
        yield cache


def ops(cache: CacheController) -> dict[str, int]:
    return cache.metrics.snapshot()["operations"]


def serve_hinted(cache: CacheController, request: torch.Tensor, hint: RetentionHint | None) -> Lease:
    lease = cache.lookup(request, retention=hint)
    cache.admit(lease)
    assert verify(cache, lease) == 0
    fill(cache, lease, cache.allocate(lease))
    cache.insert(lease)
    return lease


def storage_pages(l3: Path, request: torch.Tensor) -> int:
    """Pages of ``request`` a fresh cache finds in the L3 at ``l3``."""
    with open_cache("kv", l3, WAIT) as cold:
        lease = cold.lookup(request)
        cold.admit(lease)
        found = lease.hit_pages["storage"]
        cold.release(lease)
    return found


def test_storage_admission_writes_a_prefix_only_once_it_was_reused(tmp_path: Path) -> None:
    request = tokens(3, 4)
    with open_cache("kv", tmp_path, ["policy.admission.storage={type: reuse, min_hits: 1}"]) as cache:
        serve(cache, request)
        cache.flush()
        assert ops(cache)["storage_rejected"] == 4 and ops(cache)["storage_admitted"] == 0
        assert storage_pages(tmp_path, request) == 0  # nothing reached the SSD
        serve(cache, request)  # reused (from the device): now it is worth writing
        cache.flush()
        assert ops(cache)["storage_admitted"] == 4
    assert storage_pages(tmp_path, request) == 4


def test_tinylfu_admission_counts_sightings_across_requests(tmp_path: Path) -> None:
    hot, cold = tokens(4, 2), tokens(5, 2)
    overrides = ["policy.admission.storage={type: tinylfu, min_count: 3}"]
    with open_cache("kv", tmp_path, overrides) as cache:
        serve(cache, cold)  # seen once (its insert): refused
        for _ in range(3):
            serve(cache, hot)  # insert + two reuses: admitted on the second reuse
        cache.flush()
        assert ops(cache)["storage_admitted"] == 2 and ops(cache)["storage_rejected"] == 4
    assert storage_pages(tmp_path, hot) == 2 and storage_pages(tmp_path, cold) == 0


def test_host_admission_backs_up_only_reused_prefixes(tmp_path: Path) -> None:
    request = tokens(6, 3)
    overrides = ["tiers.storage={}", "policy.admission.host={type: reuse, min_hits: 1}"]
    with open_cache("kv", overrides=overrides) as cache:
        serve(cache, request)
        assert cache.tree.units("kv", "host") == 0 and ops(cache)["host_rejected"] == 3
        serve(cache, request)
        assert cache.tree.units("kv", "host") == 3 and ops(cache)["host_admitted"] == 3


@pytest.mark.parametrize("write", ["write_through", "write_through_selective", "write_back"])
def test_by_default_every_page_is_admitted_and_counted(tmp_path: Path, write: str) -> None:
    # host_admitted counted write-through's backups only: the other policies' were not counted
    overrides = [f"policy.write={write}", "policy.write_through_threshold=1", *SMALL]
    with open_cache("kv", tmp_path, overrides) as cache:
        request = tokens(7, 3)
        serve(cache, request)
        serve(cache, request)  # a reuse: selective write-through backs it up
        for seed in range(40, 44):  # device pressure: write-back backs it up to evict it
            serve(cache, tokens(seed, 2))
        cache.flush()
        counted = ops(cache)
        assert counted["host_admitted"] >= 3 and counted["host_rejected"] == 0
        assert counted["storage_admitted"] == counted["host_admitted"] and counted["storage_rejected"] == 0


def _stream(cache: CacheController, first_seed: int, count: int, pages: int = 2) -> None:
    for seed in range(first_seed, first_seed + count):
        serve(cache, tokens(seed, pages))


@pytest.mark.parametrize("hint", [None, RetentionHint(priority=2)])
def test_a_prioritised_prefix_outlives_ordinary_traffic(hint: RetentionHint | None) -> None:
    with open_cache("kv", overrides=["tiers.storage={}", *SMALL]) as cache:
        system = tokens(1, 2)
        serve_hinted(cache, system, hint)
        _stream(cache, 100, 6)  # 12 pages through a 4-page device tier
        lease = cache.lookup(system)
        cache.admit(lease)
        assert lease.hit_pages["device"] == (2 if hint else 0)
        cache.release(lease)


def test_a_ttl_decays_to_ordinary_and_reads_do_not_renew_it() -> None:
    now = [0.0]
    with device_only_cache(now) as cache:
        session = tokens(1, 2)
        serve_hinted(cache, session, RetentionHint(ttl_s=60))
        _stream(cache, 100, 3)
        now[0] = 30.0
        assert serve(cache, session)[0].hit_pages["device"] == 2  # protected; this read renews nothing
        now[0] = 61.0
        _stream(cache, 200, 3)
        assert serve(cache, session)[0].hit_pages["device"] == 0  # ordinary again: LRU took it


def test_pins_hold_until_unpinned_and_are_capped() -> None:
    overrides = [
        "tiers.storage={}",
        "tiers.host.capacity_tokens=0",
        *SMALL[:1],
        "policy.retention.max_pinned_fraction=0.5",
    ]
    with open_cache("kv", overrides=overrides) as cache:
        pinned = serve_hinted(cache, tokens(1, 2), RetentionHint(pin=True))
        assert pinned.pinned and cache.parts.retention.pinned_pages == 2
        refused = serve_hinted(cache, tokens(2, 1), RetentionHint(pin=True))  # 3 > 0.5 x 4 pages
        assert not refused.pinned and ops(cache)["pins_refused"] == 1
        _stream(cache, 100, 4)
        assert serve(cache, tokens(1, 2))[0].hit_pages["device"] == 2  # the pin held
        cache.unpin(pinned)
        assert not pinned.pinned and cache.parts.retention.pinned_pages == 0
        _stream(cache, 200, 4)
        assert serve(cache, tokens(1, 2))[0].hit_pages["device"] == 0


def test_a_pin_with_a_ttl_lapses_on_its_own() -> None:
    now = [0.0]
    with device_only_cache(now) as cache:
        lease = serve_hinted(cache, tokens(1, 2), RetentionHint(pin=True, ttl_s=5))
        now[0] = 4.9
        assert lease.pinned
        now[0] = 6.0
        # lapsed: it says so before any eviction released it (README: "whether or not an
        # eviction has run since"; it said pinned until one ran)
        assert not lease.pinned and cache.parts.retention.pinned_pages == 2
        _stream(cache, 100, 4)  # the first eviction after the TTL releases the pin
        assert cache.parts.retention.pinned_pages == 0
        assert not lease.pinned, "the lease still said pinned after its pin lapsed"
        assert serve(cache, tokens(1, 2))[0].hit_pages["device"] == 0


class _CountedLevels(dict):  # type: ignore[type-arg]
    """``Retention._levels`` counting its sweeps (the one reader of ``items()``)."""

    sweeps = 0

    def items(self):  # type: ignore[no-untyped-def]
        self.sweeps += 1
        return super().items()


def test_retention_levels_of_a_large_tree_are_not_swept_at_every_hinted_insert() -> None:
    """Past 4,096 entries every hinted insert swept every node's level for expired ones, though
    none had expired (a priority without TTL never does): O(levels) per insert, 3.8 ms at
    10,000. A sweep now waits for the levels to double; expired ones still go at the sweep."""
    with open_cache("kv", overrides=["tiers.storage={}"]) as cache:
        retention = cache.parts.retention
        held = _CountedLevels({object(): (1, ()) for _ in range(4097)})  # permanent levels
        retention._levels = held  # type: ignore[assignment]
        for n in range(20):
            serve_hinted(cache, tokens(n, 2), RetentionHint(priority=1))
        assert held.sweeps == 1, f"{held.sweeps} sweeps of every level in 20 hinted inserts"
        lapsed = _CountedLevels({object(): (None, ((1, 0.0),)) for _ in range(4 * len(held))})  # TTLs run out
        retention._levels = lapsed  # type: ignore[assignment]
        serve_hinted(cache, tokens(99, 2), RetentionHint(priority=1))
        assert lapsed.sweeps == 1 and len(lapsed) <= 2, "expired levels are swept out"


def test_a_hint_on_a_prefix_already_cached_whole_holds() -> None:
    # the hint was applied only where an insert added pages: pinning a cached system prompt
    # did nothing (not pinned, not refused), and it was evicted like any other
    overrides = ["tiers.storage={}", "tiers.host.capacity_tokens=0", *SMALL[:1]]
    with open_cache("kv", overrides=overrides) as cache:
        system = tokens(1, 2)
        serve(cache, system)
        lease = serve_hinted(cache, system, RetentionHint(pin=True))  # a full hit
        assert lease.pinned and cache.parts.retention.pinned_pages == 2
        _stream(cache, 100, 4)
        assert serve(cache, system)[0].hit_pages["device"] == 2


def test_a_lapsed_pin_leaves_room_under_the_cap() -> None:
    now = [0.0]
    overrides = ["tiers.storage={}", "tiers.host.capacity_tokens=0", *SMALL[:1]]
    overrides.append("policy.retention.max_pinned_fraction=0.5")
    with open_cache("kv", overrides=overrides) as cache:
        cache.parts.retention.clock = lambda: now[0]
        serve_hinted(cache, tokens(1, 2), RetentionHint(pin=True, ttl_s=5))
        now[0] = 6.0  # no eviction since: the lapsed pin was still counted and B refused
        second = serve_hinted(cache, tokens(2, 2), RetentionHint(pin=True))
        assert second.pinned and ops(cache)["pins_refused"] == 0


def test_a_lapsed_pin_does_not_refuse_a_request_that_needs_its_pages() -> None:
    """Pins lapse when an eviction starts; the allocator first asks whether evicting could make
    room, took the lapsed pin's lock as holding its pages and started none: a request needing
    them got ``CacheFullError`` ("2 device pages are pinned"), every retry too."""
    now = [0.0]
    overrides = ["tiers.storage={}", "tiers.host.capacity_tokens=0", "tiers.device.capacity_tokens=256"]
    with open_cache("kv", overrides=overrides) as cache:  # 4 pages: pins may hold 2
        cache.parts.retention.clock = lambda: now[0]
        pinned = serve_hinted(cache, tokens(1, 2), RetentionHint(pin=True, ttl_s=5))
        assert pinned.pinned
        now[0] = 6.0
        lease, bad = serve(cache, tokens(2, 4))  # the whole tier
        assert lease.cached_pages == 0 and bad == 0
        assert not pinned.pinned and cache.parts.retention.pinned_pages == 0
        now[0] = 0.0  # an unexpired pin still holds: the same request is refused
        held = serve_hinted(cache, tokens(3, 2), RetentionHint(pin=True, ttl_s=5))
        assert held.pinned
        refused = cache.lookup(tokens(4, 4))
        cache.admit(refused)
        with pytest.raises(CacheFullError, match="2 device pages are pinned"):
            cache.allocate(refused)
        cache.release(refused)


def test_a_timed_priority_falls_back_to_the_permanent_one() -> None:
    # one (level, deadline) per node: a higher priority with a TTL replaced a permanent one, and
    # after the TTL the prefix was ordinary (evicted first) instead of back at its priority
    now = [0.0]
    with open_cache("kv", overrides=["tiers.storage={}", *SMALL]) as cache:
        cache.parts.retention.clock = lambda: now[0]
        system = tokens(1, 2)
        serve_hinted(cache, system, RetentionHint(priority=1))
        serve_hinted(cache, torch.cat([system, tokens(2, 1)]), RetentionHint(priority=2, ttl_s=5))
        now[0] = 6.0
        _stream(cache, 100, 6)
        lease = cache.lookup(system)
        cache.admit(lease)
        assert lease.hit_pages["device"] == 2, "back at priority 1, above ordinary traffic"
        cache.release(lease)


def test_hints_are_checked() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        RetentionHint(ttl_s=0)
    with pytest.raises(TypeError, match="priority"):
        RetentionHint(priority=1.5)  # type: ignore[arg-type]


def test_a_refused_prefix_split_by_a_shorter_request_is_written_whole_once_reused(tmp_path: Path) -> None:
    request = tokens(8, 4)
    with open_cache("kv", tmp_path, ["policy.admission.storage={type: reuse, min_hits: 1}"]) as cache:
        serve(cache, request)  # refused: one 4-page node
        serve(cache, request[: 2 * 64])  # reuses its first half: the node splits, the head is reused
        cache.flush()
        assert ops(cache)["storage_admitted"] == 2  # the head, now reused, is written
        serve(cache, request)  # the tail is reused too
        cache.flush()
        assert ops(cache)["storage_admitted"] == 4
    assert storage_pages(tmp_path, request) == 4


@pytest.mark.parametrize("stack", ["kv", "swa"])
def test_storage_admission_takes_no_page_below_a_prefix_it_still_refuses(tmp_path: Path, stack: str) -> None:
    # a split's new upper half starts unseen by tinylfu: a reuse admitted the lower half while the
    # upper (its prefix) stayed refused, and L3 held pages no later cache could reach
    first = tokens(33, 4)
    branch = torch.cat([first[: 2 * 64], tokens(34, 2)])  # splits the first request's node at 2
    overrides = ["policy.admission.storage={type: tinylfu, min_count: 3}"]
    with open_cache(stack, tmp_path, overrides) as cache:
        serve(cache, first)
        cache.release(cache.lookup(first))
        serve(cache, branch)
        reuse = cache.lookup(first)
        hashes = reuse.page_hashes
        cache.release(reuse)
        cache.flush()
    with open_cache(stack, tmp_path, WAIT) as cold:
        assert cold.engine is not None
        stored = cold.engine.exists(cold.layout.anchor, hashes).ok
    first_missing = stored.index(False) if False in stored else len(stored)
    assert not any(stored[first_missing:]), f"objects below a page L3 lacks: {stored}"


def test_a_branch_at_a_refused_prefix_writes_none_of_its_window(tmp_path: Path) -> None:
    # write-through stored the last window of the prefix a request branched at, with no check
    # that storage admission had taken that prefix: window objects with no anchor pages in L3
    first = tokens(35, 4)
    branch = torch.cat([first[: 2 * 64], tokens(36, 2)])
    overrides = ["policy.admission.storage={type: reuse, min_hits: 5}"]  # refuses everything here
    with open_cache("swa", tmp_path, overrides) as cache:
        assert cache.engine is not None
        put_group, pages = cache.engine.put_group, []
        cache.engine.put_group = lambda batches: (pages.extend(batches), put_group(batches))[1]  # type: ignore[method-assign]
        serve(cache, first)
        serve(cache, branch)
        cache.flush()
        assert ops(cache)["storage_admitted"] == 0 and pages == []


@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_pins_cannot_hold_every_state_slot(stack: str) -> None:
    # the cap counted anchor pages only: 1-page pins (half the pages) held every Mamba slot, and
    # then every allocate failed, even of 1 page on an almost empty device tier
    with open_cache(stack, overrides=["tiers.storage={}"]) as cache:
        slots = cache.pools.pools["mamba"].device_allocator.units
        leases = [serve_hinted(cache, tokens(10 + i, 1), RetentionHint(pin=True)) for i in range(slots)]
        pinned = sum(lease.pinned for lease in leases)
        assert 0 < pinned <= slots // 2 and ops(cache)["pins_refused"] == slots - pinned
        lease, bad = serve(cache, tokens(99, 1))
        assert lease.cached_pages == 0 and bad == 0, "a 1-page request still gets a state slot"
        for held in leases:
            cache.unpin(held)
        assert cache.parts.retention.pinned_pages == 0


def test_a_refusal_caused_by_pins_names_them() -> None:
    from kvstrata.core.controller import CacheFullError

    overrides = ["tiers.storage={}", "tiers.host.capacity_tokens=0", "tiers.device.capacity_tokens=1024"]
    with open_cache("kv", overrides=overrides) as cache:  # 16 pages, pins up to 8
        pins = [serve_hinted(cache, tokens(1 + i, 4), RetentionHint(pin=True)) for i in range(2)]
        assert all(lease.pinned for lease in pins)
        lease = cache.lookup(tokens(9, 9))
        cache.admit(lease)
        with pytest.raises(CacheFullError, match=r"8 device pages are pinned .*cache\.unpin\(lease\)"):
            cache.allocate(lease)
        cache.release(lease)
        for held in pins:
            cache.unpin(held)
        assert serve(cache, tokens(9, 9))[1] == 0


def test_a_chunk_over_the_pin_cap_keeps_the_pin_of_the_earlier_chunks() -> None:
    overrides = ["tiers.storage={}", "tiers.host.capacity_tokens=0", *SMALL[:1]]  # 4 pages, pins up to 2
    with open_cache("kv", overrides=overrides) as cache:
        request = tokens(1, 3)
        lease = cache.lookup(request[: 2 * cache.page_size], retention=RetentionHint(pin=True))
        cache.admit(lease)
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease, close=False)
        assert lease.pinned and cache.parts.retention.pinned_pages == 2
        lease.extend(request[2 * cache.page_size :])
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)  # 3 pages: over the cap, refused
        assert ops(cache)["pins_refused"] == 1
        assert lease.pinned and cache.parts.retention.pinned_pages == 2, "the first chunks' pin was dropped"
        _stream(cache, 100, 4)
        assert serve(cache, request[: 2 * cache.page_size])[0].hit_pages["device"] == 2
        cache.unpin(lease)
        assert cache.parts.retention.pinned_pages == 0


def test_a_late_pool_releases_pins_and_serves_no_pinned_page(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a pinned prefix survived add_pool: served with draft units no one wrote (and written to L3
    # with them under write_back, where a fresh cache restored them as valid)
    draft = {"type": "draft", "index_source": "kv", "layers": 1, "kv_heads": 1, "head_dim": 64}
    with open_cache("kv", tmp_path, ["policy.write=write_back"]) as cache:
        system = tokens(1, 3)
        lease = serve_hinted(cache, system, RetentionHint(pin=True))
        assert lease.pinned
        cache.add_pool("draft", draft)
        assert not lease.pinned and cache.parts.retention.pinned_pages == 0
        assert "released 1 pin(s)" in caplog.text
        assert cache.tree.units("kv", "device") == 0 and cache.tree.units("kv", "host") == 0
        again, bad = serve(cache, system)
        assert again.cached_pages == 0 and bad == 0
        cache.unpin(lease)  # released already: a no-op


def test_a_window_pools_pin_cap_counts_the_last_window_a_pin_holds() -> None:
    """A pin holds a window pool's units of its last window only: older window data (the head of
    its own node too) is tombstoned first, pinned or not. The cap counted every window unit on
    the pinned path, so with the window pool a quarter of the anchor (SGLang's
    swa_full_tokens_ratio sizing) an 8-page pin holding 2 of 8 window units was refused."""
    no_host = ["tiers.storage={}", "tiers.host.capacity_tokens=0"]
    with open_cache("swa", overrides=["model.pools.swa.device_units=8", *no_host]) as cache:  # cap: 4
        assert cache.tree_pools["swa"].window == 2
        first = serve_hinted(cache, tokens(1, 8), RetentionHint(pin=True))
        assert first.pinned and ops(cache)["pins_refused"] == 0
        lease = cache.lookup(tokens(3, 6))  # the pinned node's older window data makes room
        cache.admit(lease)
        assert len(cache.allocate(lease, window_only=True)["swa"]) == 2
        cache.release(lease)
        second = serve_hinted(cache, tokens(2, 8), RetentionHint(pin=True))  # 2 + 2 units: the cap
        third = serve_hinted(cache, tokens(4, 8), RetentionHint(pin=True))  # 6 > 4
        assert second.pinned and not third.pinned and ops(cache)["pins_refused"] == 1


def _serve_chunks(cache: CacheController, request: torch.Tensor, chunk_pages: int) -> Lease:
    """Serve ``request`` pinned in chunks of ``chunk_pages``, ``insert(close=False)`` after each
    but the last: the lease re-pins after every chunk."""
    step = chunk_pages * cache.page_size
    lease = cache.lookup(request[:step], retention=RetentionHint(pin=True))
    cache.admit(lease)
    for start in range(0, len(request), step):
        if start:
            lease.extend(request[start : start + step])
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease, close=start + step >= len(request))
    return lease


def test_a_chunked_pin_counts_only_its_own_last_window() -> None:
    """A lease re-pins after each chunk; the window cap counted the window of the pin being
    replaced (its previous chunk's) on top of the new one: two 4-page chunks under a 4-unit cap
    (window 4 pages) were refused, though the pin holds 4 units."""
    no_host = ["tiers.storage={}", "tiers.host.capacity_tokens=0"]
    overrides = ["model.pools.swa.device_units=8", "model.pools.swa.window=256", *no_host]
    with open_cache("swa", overrides=overrides) as cache:  # window cap: 4 units
        assert cache.tree_pools["swa"].window == 4
        lease = _serve_chunks(cache, tokens(1, 8), 4)
        assert lease.pinned and ops(cache)["pins_refused"] == 0
        other = serve_hinted(cache, tokens(2, 4), RetentionHint(pin=True))  # 4 + 4 > 4: a real excess
        assert not other.pinned and ops(cache)["pins_refused"] == 1
        cache.unpin(lease)
        again = serve_hinted(cache, tokens(3, 4), RetentionHint(pin=True))
        assert again.pinned and ops(cache)["pins_refused"] == 1


def test_a_chunked_pin_holds_one_state_slot() -> None:
    """A pin's lock holds its end node's state slot only; the state cap counted a slot for every
    checkpoint on the pinned path, so a chunked request under a 1-slot cap was refused at its
    second chunk."""
    no_host = ["tiers.storage={}", "tiers.host.capacity_tokens=0"]
    with open_cache("hybrid-mamba", overrides=["model.pools.mamba.device_units=3", *no_host]) as cache:
        assert cache.parts.retention.unit_caps == {1: 1}  # int(0.5 x 3) slots; 8 pages
        lease = _serve_chunks(cache, tokens(1, 6), 2)
        assert lease.pinned and ops(cache)["pins_refused"] == 0
        assert cache.parts.retention.pinned_pages == 6
        other = serve_hinted(cache, tokens(2, 1), RetentionHint(pin=True))  # a second slot: over the cap
        assert not other.pinned and ops(cache)["pins_refused"] == 1
        cache.unpin(lease)
        again = serve_hinted(cache, tokens(3, 1), RetentionHint(pin=True))
        assert again.pinned and ops(cache)["pins_refused"] == 1
        cache.unpin(again)
        assert cache.parts.retention.pinned_pages == 0


@pytest.mark.parametrize("policy", [[], ["policy.eviction={type: fifo}"]])
def test_write_back_backs_up_what_the_retention_levels_evict(policy: list[str]) -> None:
    """Write-back backs up the nodes the eviction will drop, picked by recency (or the plugin's
    order) alone: the prioritised prefix, the oldest, was the one backed up, the only node the
    eviction could then drop, and it left the device before ordinary pages."""
    overrides = ["tiers.storage={}", "policy.write=write_back", *SMALL, *policy]
    with open_cache("kv", overrides=overrides) as cache:
        system = tokens(1, 1)
        serve_hinted(cache, system, RetentionHint(priority=2))
        _stream(cache, 100, 2)  # 1 + 2 x 2 pages: the device tier is full
        serve(cache, tokens(200, 1))  # one eviction
        keys = list(page_keys(system, cache.page_size))
        assert cache.tree.match(keys, count_hit=False).device_pages == 1, "the prioritised prefix left"


#: (stack, its component pool, device units, host units, pages per request): only that pool runs out
COMPONENT_BOUND = [
    ("hybrid-mamba", "mamba", 3, 1, 1),
    ("swa-mamba", "mamba", 3, 1, 1),
    ("swa", "swa", 6, 2, 2),
]


@pytest.mark.parametrize("policy", [[], ["policy.eviction={type: fifo}"]])
@pytest.mark.parametrize(("stack", "pool", "device", "host", "pages"), COMPONENT_BOUND)
def test_write_back_backs_up_the_component_the_retention_levels_evict(
    stack: str, pool: str, device: int, host: int, pages: int, policy: list[str]
) -> None:
    """Write-back backed up a state (window) pool's units by recency alone, ignoring retention
    levels: the prioritised prefix's, the oldest, were the ones backed up, the only ones the
    eviction could then drop, and with a small host pool the prefix was lost to both tiers
    before any ordinary request's."""
    units = [f"model.pools.{pool}.device_units={device}", f"model.pools.{pool}.host_units={host}"]
    overrides = ["tiers.storage={}", "policy.write=write_back", *units, *policy]
    with open_cache(stack, overrides=overrides) as cache:
        system = tokens(1, pages)
        serve_hinted(cache, system, RetentionHint(priority=2))
        _stream(cache, 100, 6, pages)  # more than once through the pool's device units
        lease = cache.lookup(system)
        cache.admit(lease)
        assert lease.hit_pages["device"] == pages, "the prioritised prefix lost its state / window"
        assert verify(cache, lease) == 0
        cache.release(lease)


def test_host_admission_counts_every_page_it_keeps_out() -> None:
    """A chunked request backs up its chunks' nodes together; the host filter refusing the first
    counted that node's pages only, the chunks below it (kept out with it) in neither counter,
    while the storage filter counts them as refused."""
    overrides = ["tiers.storage={}", "policy.admission.host={type: reuse, min_hits: 1}"]
    with open_cache("kv", overrides=overrides) as cache:
        request = tokens(9, 3)
        lease = cache.lookup(request[:64])
        cache.admit(lease)
        for chunk in range(3):
            if chunk:
                lease.extend(request[64 * chunk : 64 * (chunk + 1)])
            fill(cache, lease, cache.allocate(lease))
            cache.insert(lease, close=chunk == 2)
        assert cache.tree.units("kv", "host") == 0
        assert ops(cache)["host_rejected"] == 3 and ops(cache)["host_admitted"] == 0


def test_a_negative_priority_leaves_the_cached_prefix_it_shares_ordinary() -> None:
    """A scratch request (priority -1) marked its whole prefix, the system prompt every request
    reuses included: once a leaf, the prompt went before every ordinary page, however recently
    it was read, and no unhinted request ever set it back."""
    with device_only_cache() as cache:
        system = tokens(1, 1)
        serve(cache, system)
        serve_hinted(cache, torch.cat([system, tokens(2, 1)]), RetentionHint(priority=-1))
        serve(cache, tokens(3, 1))
        serve(cache, tokens(4, 1))  # 4 pages: the prompt, the scratch page, two ordinary ones
        serve(cache, tokens(5, 1))  # evicts the scratch page (-1): the prompt is a leaf now
        serve(cache, system)  # read last
        serve(cache, tokens(6, 1))  # evicts the least recently used ordinary page, not the prompt
        keys = list(page_keys(system, cache.page_size))
        assert cache.tree.match(keys, count_hit=False).device_pages == 1, "the shared prompt went first"


def test_a_negative_priority_leaves_a_host_prompt_it_computed_again_ordinary() -> None:
    """The shared prompt was on the host only and not loaded back (below the load-back threshold
    here; a full device under pressure): the scratch request computed it again and its insert
    adopted the prompt's node, which then took the request's -1 as if the request had added it
    (evict-first on both tiers)."""
    overrides = ["tiers.storage={}", *SMALL, "policy.load_back_threshold_tokens=100000"]
    with open_cache("kv", overrides=overrides) as cache:
        system = tokens(1, 1)
        serve(cache, system)
        keys = list(page_keys(system, cache.page_size))
        cache.writer.copy_to_host(cache.tree.match(keys, count_hit=False).path)
        cache.tree.evict_device({cache.layout.anchor: 1 << 20})  # the prompt: host only
        assert cache.tree.match(keys, count_hit=False).device_pages == 0
        lease = serve_hinted(cache, torch.cat([system, tokens(2, 1)]), RetentionHint(priority=-1))
        assert lease.cached_pages == 0, "the prompt was computed again, not loaded back"
        level = cache.parts.retention.levels()
        assert level is not None and level(lease.node) == -1, "the request's own page is marked"
        assert level(cache.tree.match(keys, count_hit=False).path[-1]) == 0, "the shared prompt is not"


def test_a_higher_shorter_ttl_does_not_end_a_lower_longer_one() -> None:
    """One timed level per node: a second hint with a higher priority and a shorter TTL replaced
    the first's, and once it lapsed the prefix was ordinary though the first TTL still ran."""
    now = [0.0]
    with device_only_cache(now) as cache:
        session = tokens(1, 2)
        serve_hinted(cache, session, RetentionHint(ttl_s=100))  # level 1 for 100 s
        serve_hinted(cache, session, RetentionHint(priority=2, ttl_s=10))  # level 2 for 10 s
        now[0] = 50.0
        _stream(cache, 100, 3)
        keys = list(page_keys(session, cache.page_size))
        assert cache.tree.match(keys, count_hit=False).device_pages == 2, "the 100 s TTL ended at 10 s"
        now[0] = 101.0
        _stream(cache, 200, 2)
        assert cache.tree.match(keys, count_hit=False).device_pages == 0, "ordinary after both TTLs"


def test_lapsed_ttls_leave_evictions_unranked() -> None:
    """Once every TTL set has run out, no node has a level: evictions (and write-back's backups
    ahead of them) take the kept LRU candidates again. The lapsed entries stayed until the size
    sweep at 4,096, and each eviction ranked its whole tier meanwhile."""
    now = [0.0]
    with device_only_cache(now) as cache:
        retention = cache.parts.retention
        serve_hinted(cache, tokens(1, 2), RetentionHint(ttl_s=60))
        serve_hinted(cache, tokens(2, 2), RetentionHint(priority=2, ttl_s=30))
        now[0] = 45.0
        assert retention.levels() is not None  # the 60 s one still holds
        now[0] = 61.0
        assert retention.levels() is None and not retention.active
        _stream(cache, 300, 3)  # (evicts: nothing ranks the tier)
        serve_hinted(cache, tokens(3, 2), RetentionHint(priority=1))  # a permanent level stays
        serve_hinted(cache, tokens(4, 2), RetentionHint(ttl_s=10))
        now[0] = 100.0
        level = retention.levels()
        assert level is not None and retention.active
        assert len(retention._levels) == 1  # (the permanent one's node)


def test_a_retention_priority_of_any_integer_type_is_taken_as_an_int_and_a_bool_refused() -> None:
    import numpy as np

    hint = RetentionHint(priority=np.int64(2))
    assert hint.priority == 2 and type(hint.priority) is int and hint.level == 2
    with pytest.raises(TypeError, match="priority must be an int"):
        RetentionHint(priority=True)
    with pytest.raises(TypeError, match="priority must be an int"):
        RetentionHint(priority=1.0)  # type: ignore[arg-type]
