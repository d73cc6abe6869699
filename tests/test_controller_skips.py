"""No silent misses: every page the host tier or L3 held that a request could not use is counted
with its reason; a damaged object shortens a restore to the longest verified prefix; an L3
refill never hangs below a device page that has no host copy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from controller_support import (
    EXAMPLES,
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
    verify,
)
from kvstrata.core.controller import CacheController, PoolKind, SkipReason
from kvstrata.core.tree import Tier
from kvstrata.plugins import PluginHost
from kvstrata.testing.faults import FaultyBackend

WAIT = ["policy.prefetch.policy=wait_complete"]
STACKS = sorted(EXAMPLES)


def _damage(cache: CacheController, pool: str, page_hash: str) -> None:
    """Cut the object of ``pool`` for one page to half its length (a torn or truncated write)."""
    assert cache.engine is not None and cache.backend is not None
    for keys in cache.engine.object_keys(pool, [page_hash]):
        for key in keys:
            path: Path = cache.backend.path_for(key)  # type: ignore[attr-defined]
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])


def _all_pages_pools(cache: CacheController) -> list[str]:
    return [name for name in cache.pools.pools if cache.pool_kind(name) is PoolKind.PAGES]


@pytest.mark.parametrize("stack", STACKS)
def test_a_damaged_middle_object_truncates_the_restore_at_the_last_verified_end(
    stack: str, tmp_path: Path
) -> None:
    """Written in two chunks (3 then 8 pages: state and window ends at both), then page 5 of each
    all-pages pool in turn is damaged: the restore ends at the last end <= 5 every pool verifies."""
    whole = tokens(31, 8)
    with open_cache(stack, tmp_path / "probe") as probe:
        pools = _all_pages_pools(probe)
        # state and window pools hold their objects at insert ends only (3 and 8)
        ends_only = any(tp.kind is not PoolKind.PAGES for tp in probe.tree_pools.values())
    expected = 3 if ends_only else 5
    for pool in pools:
        l3 = tmp_path / pool
        with open_cache(stack, l3) as writer:
            serve(writer, whole[: 3 * 64])
            lease, _ = serve(writer, whole)
            writer.flush()
            _damage(writer, pool, lease.page_hashes[5])
        with open_cache(stack, l3, WAIT) as cold:
            lease = cold.lookup(whole)
            cold.admit(lease)
            assert lease.cached_pages == expected, f"damaged {pool}"
            assert lease.hit_pages["storage"] == expected
            assert verify(cold, lease) == 0, "every restored byte is exact"
            assert lease.skipped.get(SkipReason.DAMAGED_OBJECT) == 8 - expected
            cold.release(lease)


@pytest.mark.parametrize("stack", ["kv", "swa-mamba"])
def test_an_object_evicted_between_the_existence_answer_and_the_read_is_counted_as_gone(
    stack: str, tmp_path: Path
) -> None:
    """Another process's capacity eviction between L3's "present" and the read: a plain miss
    (correct bytes, a shorter restore), counted as ``object_gone``, not as damage."""
    whole = tokens(34, 8)
    with open_cache(stack, tmp_path) as writer:
        serve(writer, whole[: 3 * 64])
        lease, _ = serve(writer, whole)
        writer.flush()
        hashes = lease.page_hashes
    with open_cache(stack, tmp_path, WAIT) as cold:
        assert cold.prefetcher is not None and cold.engine is not None
        exists = cold.prefetcher.engine.exists
        gone = [
            key
            for pool in _all_pages_pools(cold)
            for keys in cold.engine.object_keys(pool, [hashes[5]])
            for key in keys
        ]

        def exists_then_evict(*args, **kwargs):  # L3 answers, then the objects leave it
            answer = exists(*args, **kwargs)
            for key in gone:
                cold.backend.path_for(key).unlink(missing_ok=True)  # type: ignore[union-attr]
            return answer

        cold.prefetcher.engine.exists = exists_then_evict  # type: ignore[method-assign]
        lease = cold.lookup(whole)
        cold.admit(lease)
        assert 0 < lease.cached_pages < 8 and verify(cold, lease) == 0
        assert lease.skipped == {SkipReason.OBJECT_GONE: 8 - lease.cached_pages}
        assert cold.metrics.snapshot()["skipped_pages"]["damaged_object"] == 0
        cold.release(lease)


def _compute_device_only(cache: CacheController, request) -> None:
    """Serve ``request`` computing every page (no L3 read): it lands on the device only."""
    lease = cache.lookup(request, prefetch="off")
    cache.admit(lease)
    fill(cache, lease, cache.allocate(lease))
    cache.insert(lease)


def test_an_l3_refill_below_an_unbacked_device_page_backs_it_up_first(tmp_path: Path) -> None:
    whole = tokens(32, 8)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, whole)
        writer.flush()
    selective = [*WAIT, "policy.write=write_through_selective", "policy.write_through_threshold=5"]
    with open_cache("kv", tmp_path, [*selective, "policy.prefetch.host_fraction_limit=1"]) as cache:
        _compute_device_only(cache, whole[: 3 * 64])  # not hot enough for a backup
        assert cache.tree.units("kv", "host") == 0
        lease, bad = serve(cache, whole)
        assert bad == 0 and lease.cached_pages == 8 and lease.hit_pages["storage"] == 5
        for node in cache.tree.nodes():  # backups stay a contiguous prefix from the root
            if node.host[0] is not None and node.parent is not cache.tree.root:
                assert node.parent.host[0] is not None  # type: ignore[union-attr]


def test_an_l3_refill_below_a_device_page_that_cannot_be_backed_up_is_dropped(tmp_path: Path) -> None:
    whole = tokens(33, 8)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, whole)
        writer.flush()
    # the host tier holds the 5 prefetched pages but not the 3-page parent on top
    tight = [
        *WAIT,
        "policy.write=write_through_selective",
        "policy.write_through_threshold=5",
        "policy.prefetch.host_fraction_limit=1",
        "tiers.host.capacity_tokens=320",
    ]
    with open_cache("kv", tmp_path, tight) as cache:
        _compute_device_only(cache, whole[: 3 * 64])
        lease = cache.lookup(whole)
        cache.admit(lease)
        assert lease.cached_pages == 3 and lease.hit_pages["storage"] == 0
        assert lease.skipped == {SkipReason.UNBACKED_PARENT: 5}
        cache.release(lease)
        cache.tree.check()
        assert cache.tree.units("kv", "host") == 0, "no host-only child under a device-only parent"
        assert all(used == 0 for used in host_units_in_use(cache).values())


def test_gates_count_threshold_host_fraction_and_rate_limit(tmp_path: Path) -> None:
    # host: 32 pages, budget 16 pages in flight
    sets = ["policy.prefetch.threshold_tokens=256", "policy.prefetch.host_fraction_limit=0.5"]
    with open_cache("kv", tmp_path, sets) as cache:
        small = cache.lookup(tokens(40, 2))  # 128 tokens < 256
        assert small.skipped == {SkipReason.BELOW_THRESHOLD: 2}
        huge = cache.lookup(tokens(41, 20))  # 20 pages > 16 on its own
        assert huge.skipped == {SkipReason.HOST_FRACTION: 20}
        first = cache.lookup(tokens(42, 10))  # in flight until admitted
        second = cache.lookup(tokens(43, 10))  # 10 + 10 > 16
        assert first.skipped == {} and second.skipped == {SkipReason.RATE_LIMIT: 10}
        waited = cache.lookup(tokens(44, 10), prefetch="wait")  # an engine may ask past the gates
        assert waited.skipped == {}
        for lease in (small, huge, first, second, waited):
            cache.release(lease)
        skipped = cache.metrics.snapshot()["skipped_pages"]
        assert skipped["below_threshold"] == 2 and skipped["host_fraction"] == 20
        assert skipped["rate_limit"] == 10


def test_a_read_still_running_at_admit_counts_as_timeout() -> None:
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    slow = [
        "tiers.storage={slow: {type: faults, fail: refuse, operations: [get], delay_s: 0.5}}",
        "policy.prefetch.policy=best_effort",
    ]
    with open_cache("kv", None, slow, host=host) as cache:
        lease = cache.lookup(tokens(45, 6))
        cache.admit(lease)  # best effort: the worker is still asleep in the backend
        cache.release(lease)
        cache.flush()  # (a read revoked before L3 said what it holds is counted when it ends)
        assert lease.skipped == {SkipReason.TIMEOUT: 6}  # (this backend says it holds every page)
        assert all(used == 0 for used in host_units_in_use(cache).values()), "revoked slots freed"


@pytest.mark.parametrize("answered", [True, False])
def test_a_revoked_read_counts_the_pages_l3_holds_not_the_pages_asked_for(
    tmp_path: Path, answered: bool
) -> None:
    # a timed-out read counted every page asked for (12) where L3 held 4: three times the loss
    request = tokens(48, 12)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, request[: 4 * writer.page_size])
    with open_cache("kv", tmp_path, ["policy.prefetch.policy=best_effort"]) as cache:
        prefetcher = cache.prefetcher
        assert prefetcher is not None
        gate, asked = threading.Event(), threading.Event()
        engine_get, engine_exists = prefetcher.engine.get_group, prefetcher.engine.exists

        def exists(*args, **kwargs):  # answered: L3 says what it holds before admit gives up
            if not answered:
                gate.wait(10)
            found = engine_exists(*args, **kwargs)
            asked.set()
            return found

        prefetcher.engine.exists = exists  # type: ignore[method-assign]
        prefetcher.engine.get_group = lambda batches: (gate.wait(10), engine_get(batches))[1]  # type: ignore[method-assign]
        lease = cache.lookup(request)
        if answered:
            assert asked.wait(10)
        cache.admit(lease)
        assert lease.skipped == ({SkipReason.TIMEOUT: 4} if answered else {})
        gate.set()
        cache.release(lease)
        cache.flush()
        assert lease.skipped == {SkipReason.TIMEOUT: 4}
        assert cache.metrics.snapshot()["skipped_pages"]["timeout"] == 4


def test_a_failed_existence_query_counts_the_pages_asked_for_as_storage_down(tmp_path: Path) -> None:
    # L3 held the pages, its exists call raised: the pages went unserved with no reason at all
    request = tokens(49, 5)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, request)
    with open_cache("kv", tmp_path, WAIT) as cache:
        assert cache.prefetcher is not None

        def broken(*args, **kwargs):
            raise OSError("exists: connection reset (fault injection)")

        cache.prefetcher.engine.backend.exists = broken  # type: ignore[method-assign]
        lease = cache.lookup(request)
        cache.admit(lease)
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.STORAGE_DOWN: 5}
        cache.release(lease)
        snapshot = cache.metrics.snapshot()
        assert snapshot["skipped_pages"]["storage_down"] == 5
        assert snapshot["failures"] == 1, "one failed call, not one per page"


def test_a_read_that_ends_just_after_admit_gave_up_counts_as_timeout(tmp_path: Path) -> None:
    # admit's wait gave up (nothing to commit), then the worker finished before commit looked:
    # the pages it read were counted as another rank's (rank_disagreement) on a cache of one
    request = tokens(46, 4)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, request)
    with open_cache("kv", tmp_path, ["policy.prefetch.policy=best_effort"]) as cache:
        prefetcher = cache.prefetcher
        assert prefetcher is not None
        finish = prefetcher.finish

        def finish_then_the_worker_ends(op, protect):  # the race, made certain
            got = finish(op, protect)
            op.done.wait(10)
            return got

        prefetcher.finish = finish_then_the_worker_ends  # type: ignore[method-assign]
        gate = threading.Event()
        run = prefetcher._run
        prefetcher._run = lambda op: (gate.wait(10), run(op))  # type: ignore[method-assign]
        lease = cache.lookup(request)
        gate.set()  # (after lookup: finish sees the read unfinished, then waits for it)
        cache.admit(lease)
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.TIMEOUT: 4}
        cache.release(lease)


@pytest.mark.parametrize("read", ["finished", "running"])
def test_a_lease_released_with_its_prefetch_counts_its_pages_as_released(tmp_path: Path, read: str) -> None:
    # an aborted request's read was counted as a rank disagreement (finished) or a timeout (running)
    request = tokens(47, 4)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, request)
    with open_cache("kv", tmp_path, WAIT) as cache:
        prefetcher = cache.prefetcher
        assert prefetcher is not None
        gate = threading.Event()
        run = prefetcher._run
        prefetcher._run = lambda op: (gate.wait(10), run(op))  # type: ignore[method-assign]
        lease = cache.lookup(request)
        op = lease.prefetch
        assert op is not None
        if read == "finished":
            gate.set()
            assert op.done.wait(10) and op.pages == 4
        cache.release(lease)
        gate.set()
        cache.flush()
        assert lease.skipped == {SkipReason.RELEASED: 4}
        assert cache.metrics.snapshot()["skipped_pages"]["released"] == 4
        assert all(used == 0 for used in host_units_in_use(cache).values()), "its host units were freed"


def test_a_lease_released_while_its_prefetch_waits_for_host_room_counts_its_pages(tmp_path: Path) -> None:
    """The worker found the pages in L3 but no free host units (a host tier full of evictable
    pages: the owner makes room at ``admit``); released before that, they were counted nowhere."""
    request = tokens(48, 8)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, request)
    with open_cache("kv", tmp_path, ["policy.prefetch.threshold_tokens=64"]) as cache:
        for seed in range(4):  # 4 x 8 pages: the host tier (32 pages) full
            serve(cache, tokens(100 + seed, 8))
        cache.flush()
        lease = cache.lookup(request)
        op = lease.prefetch
        assert op is not None and op.done.wait(10) and op.short is not None
        cache.release(lease)
        assert lease.skipped == {SkipReason.RELEASED: 8}
        assert cache.metrics.snapshot()["skipped_pages"]["released"] == 8


def test_a_prefix_larger_than_the_host_tier_counts_as_host_full(tmp_path: Path) -> None:
    whole = tokens(46, 40)
    big = ["tiers.device.capacity_tokens=4096", "tiers.host.capacity_tokens=4096"]
    with open_cache("kv", tmp_path, big) as writer:
        serve(writer, whole)
        writer.flush()
    with open_cache("kv", tmp_path, ["tiers.device.capacity_tokens=4096"]) as cache:  # host: 32 pages
        lease = cache.lookup(whole, prefetch="wait")
        cache.admit(lease)
        assert lease.cached_pages == 0
        assert lease.skipped == {SkipReason.HOST_FULL: 40}
        cache.release(lease)


def test_host_pages_not_loaded_back_say_why() -> None:
    with open_cache("kv", None, ["policy.load_back_threshold_tokens=640"]) as cache:
        request = tokens(47, 4)
        serve(cache, request)
        everything = {name: 1 << 30 for name in cache.tree_pools}
        cache.tree.evict_device(everything, cache.units.freer(Tier.DEVICE))
        lease = cache.lookup(request)
        cache.admit(lease)  # 4 host pages = 256 tokens < 640
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.BELOW_LOAD_BACK_THRESHOLD: 4}
        cache.release(lease)

    with open_cache("kv", None) as cache:
        request = tokens(48, 4)
        serve(cache, request)
        hog = cache.lookup(tokens(49, cache.pools.device_pages))
        cache.allocate(hog)  # takes every device unit (evicting the request's device copy)
        lease = cache.lookup(request)
        cache.admit(lease)
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.DEVICE_FULL: 4}
        cache.release(lease)
        cache.release(hog)
        assert cache.pools.pools["kv"].device_allocator.used == 0


def test_an_l3_restore_makes_room_by_dropping_host_copies_of_device_pages(tmp_path: Path) -> None:
    """L2 full of copies of pages L1 still holds: a 38-page restore takes their room."""
    sets = ["tiers.device.capacity_tokens=4096", "tiers.host.capacity_tokens=6144"]  # 64 and 96 pages
    wanted = tokens(62, 38)
    with open_cache("kv", tmp_path, sets) as writer:
        serve(writer, wanted)
        writer.flush()
    with open_cache("kv", tmp_path, sets) as cache:
        for i in range(12):
            serve(cache, tokens(200 + i, 8))
        assert cache.pools.pools["kv"].host_allocator.available == 0
        lease, bad = serve(cache, wanted)
        assert lease.cached_pages == 38 and lease.hit_pages["storage"] == 38 and bad == 0
        assert lease.skipped == {}


def test_objects_of_another_layout_are_a_miss_and_heal(tmp_path: Path) -> None:
    """The same model name, another unit layout: the layout is in every key (k2), so the old
    objects are never even read (a plain miss, not a layout mismatch: foreign objects under a
    reader's own key are the conformance kit's case), and the prefix is stored again in the
    new layout beside the old one."""
    whole = tokens(63, 6)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, whole)
        writer.flush()
    head_major = [*WAIT, "model.pools.kv.unit_layout=head_major"]
    with open_cache("kv", tmp_path, head_major) as cache:
        lease, bad = serve(cache, whole)
        assert lease.cached_pages == 0 and bad == 0
        assert SkipReason.LAYOUT_MISMATCH not in lease.skipped
        assert cache.engine.metrics.foreign_objects == 0
        cache.flush()
    with open_cache("kv", tmp_path, head_major) as again:
        lease, bad = serve(again, whole)
        assert lease.hit_pages["storage"] == 6 and bad == 0, "the keys healed in the new layout"


def test_the_unit_layout_is_in_the_fingerprint_even_when_shapes_coincide() -> None:
    from kvstrata.core.integrity import layout_fingerprint
    from kvstrata.plugins.pool_type import ModelContext
    from kvstrata.pool_types.kv import KVConfig, KVPoolType

    def spec(layout: str):
        config = KVConfig(layers=1, kv_heads=4, head_dim=8, unit_layout=layout)
        return KVPoolType("kv", config, ModelContext(page_size=4, anchor="kv")).spec()

    token, head = spec("token_major"), spec("head_major")
    assert token.buffers[0].unit_shape == head.buffers[0].unit_shape  # (4, 4, 8) both ways
    assert layout_fingerprint(token, "kv") != layout_fingerprint(head, "kv")


def _stuck_l3_cache(*overrides: str) -> CacheController:
    """A kv cache over a fault-injection backend (labelled fake) whose gets never return until
    the test calls ``unstall()``; existence answers "present", puts are refused."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    settings = [
        "tiers.storage={stuck: {type: faults, fail: refuse, operations: [put], stall: [get]}}",
        "policy.prefetch.threshold_tokens=0",
        "policy.prefetch.timeout_max_s=0.2",
        *overrides,
    ]
    return open_cache("kv", overrides=settings, host=host)


def _admit_returns(cache: CacheController, lease: object) -> bool:
    """Whether ``admit`` returned (on a thread, so a hang fails the test instead of the run)."""
    thread = threading.Thread(target=cache.admit, args=(lease,), daemon=True)
    thread.start()
    thread.join(60)
    return not thread.is_alive()


@pytest.mark.parametrize(
    ("how", "host_full"),
    [("wait_complete", False), ("prefetch='wait'", False), ("wait_complete", True)],
)
def test_a_backend_call_that_never_returns_costs_the_request_its_pages_not_the_scheduler(
    how: str, host_full: bool
) -> None:
    """``wait_complete`` and ``prefetch="wait"`` waited without limit: a backend whose get never
    returns (a third-party plugin without deadlines of its own) held ``admit`` forever. They wait
    at most ``timeout_max_s`` now, as does the read the owner makes room for when the worker
    found the host tier full (that one ran on the owner thread, with no deadline at all)."""
    policy = ["policy.prefetch.policy=wait_complete"] if how == "wait_complete" else []
    small_host = ["tiers.host.capacity_tokens=1024"] if host_full else []  # 16 pages
    with _stuck_l3_cache(*policy, *small_host) as cache:
        backend = cache.backend
        assert isinstance(backend, FaultyBackend)
        if host_full:  # the host tier full of cached pages: the worker cannot reserve, admit can
            hog = cache.lookup(tokens(70, 16), prefetch="off")
            cache.allocate(hog)
            cache.insert(hog)  # write-through: a host copy of each page
            cache.flush()  # (their L3 writes, refused, no longer hold them)
            assert cache.pools.pools["kv"].host_allocator.available == 0
        lease = cache.lookup(tokens(71, 4), prefetch="wait" if how == "prefetch='wait'" else "policy")
        assert _admit_returns(cache, lease), "admit is still waiting on the stuck backend"
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.TIMEOUT: 4}
        assert backend.calls["get"] == 1, "the read was started (and is still stuck)"
        cache.release(lease)
        backend.unstall()
        cache.flush()
        held = host_units_held_by_tree(cache)
        assert host_units_in_use(cache) == held, "the orphaned read's host units were freed when it ended"
        assert cache.metrics.snapshot()["latency_count"]["prefetch"] == 1, "one sample per prefetch"
