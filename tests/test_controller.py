"""The tier controller on every example stack: L1 <-> L2 <-> L3 with exact bytes and the hybrid
rules (state pools end a prefix, window pools drop whole, clamp pools clamp)."""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from controller_support import (
    DEVICE,
    EXAMPLES,
    REPO,
    GoneNode,
    LiveNode,
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
    verify,
)
from kvstrata.core.buffers import torch_dtype
from kvstrata.core.controller import CacheController, CacheFullError, PoolKind, SkipReason
from kvstrata.core.node_set import NodeSet
from kvstrata.core.storage_batch import BatchResult
from kvstrata.core.write_back import StoredWindowEnds

STACKS = sorted(EXAMPLES)
WAIT = ["policy.prefetch.policy=wait_complete"]


def kinds(cache: CacheController) -> set[PoolKind]:
    return {tp.kind for tp in cache.tree_pools.values()}


def push_off_device(cache: CacheController, pages: int = 4, seed: int = 1000) -> None:
    """Serve enough unrelated requests that everything older leaves the device tier."""
    for i in range(math.ceil(cache.pools.device_pages / pages)):
        serve(cache, tokens(seed + i, pages))


def hold_l3_writes(cache: CacheController) -> threading.Event:
    """Fault injection: every L3 write of ``cache`` waits (up to 60 s) until the returned event
    is set, so its host sources stay locked meanwhile."""
    assert cache.engine is not None
    put_group = cache.engine.put_group
    gate = threading.Event()
    cache.engine.put_group = lambda batches: (gate.wait(60), put_group(batches))[1]  # type: ignore[method-assign]
    return gate


@pytest.mark.parametrize("stack", STACKS)
def test_evicted_prefix_comes_back_from_host_with_exact_bytes(stack: str) -> None:
    with open_cache(stack) as cache:
        first = tokens(1, 4)
        lease, _ = serve(cache, first)
        assert lease.cached_pages == 0
        push_off_device(cache)
        again, bad = serve(cache, first)
        assert again.cached_pages == 4 and bad == 0
        assert again.hit_pages["host"] >= 1
        assert sum(again.hit_pages.values()) == again.cached_pages
        snapshot = cache.metrics.snapshot()
        assert snapshot["operations"]["load_backs"] >= 1 and snapshot["bytes"]["host_to_device"] > 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


@pytest.mark.parametrize("stack", STACKS)
def test_partial_match_splits_a_host_only_node(stack: str) -> None:
    with open_cache(stack) as cache:
        first = tokens(2, 6)
        serve(cache, first)
        push_off_device(cache)
        branch = torch.cat([first[: 2 * 64], tokens(3, 2)])
        lease = cache.lookup(branch)
        cache.admit(lease)
        cache.tree.check()
        node = cache.tree.match(cache.tree.keys_of(first), count_hit=False).path[0]
        assert node.depth_end == 2, "the host-only node was split where the branch diverged"
        if PoolKind.STATE in kinds(cache):
            assert lease.cached_pages == 0, "no state after page 2: the prefix is not usable"
        else:
            assert lease.cached_pages == 2 and lease.hit_pages["host"] >= 1
        cache.release(lease)


@pytest.mark.parametrize("host_tokens", [64, 0], ids=["host-smaller-than-a-node", "no-host-tier"])
@pytest.mark.parametrize("stack", STACKS)
def test_write_back_that_cannot_back_up_drops_cache_data_rather_than_refuse_requests(
    stack: str, host_tokens: int
) -> None:
    # the node stayed on the device, unlocked and never evictable: once such nodes filled the
    # device tier, every request was refused with no lease open (audit 28). SGLang drops a
    # subtree it cannot back up too.
    overrides = ["policy.write=write_back", f"tiers.host.capacity_tokens={host_tokens}"]
    with open_cache(stack, overrides=overrides) as cache:
        pages = cache.pools.device_pages * 5 // 8
        first = tokens(4, pages)
        serve(cache, first)
        for seed in (5, 6, 7):  # each needs room only dropping the previous one makes
            served, bad = serve(cache, tokens(seed, pages))
            assert served.cached_pages == 0 and bad == 0
        assert cache.metrics.failures == 0
        again, bad = serve(cache, tokens(7, pages))
        assert again.hit_pages["device"] == pages and bad == 0, "what is held is still served exactly"


FRESH = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from controller_support import open_cache, serve, tokens
    stack, l3, seed, pages = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    extra = json.loads(sys.argv[6])
    with open_cache(stack, l3, ["policy.prefetch.policy=wait_complete", *extra]) as cache:
        lease, bad = serve(cache, tokens(seed, pages))
        print(json.dumps({"cached": lease.cached_pages, "hits": lease.hit_pages, "bad": bad,
                          "corrupt": cache.metrics.corrupt_detected}))
    """
)


def fresh_process(stack: str, l3: Path, seed: int, pages: int, extra: list[str] = ()) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH,
            str(REPO / "tests"),
            stack,
            str(l3),
            str(seed),
            str(pages),
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "KVSTRATA_TEST_DEVICE": DEVICE},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stack", STACKS)
def test_l3_write_then_a_fresh_process_restores_exact_bytes(stack: str, tmp_path: Path) -> None:
    with open_cache(stack, tmp_path) as cache:
        pages = min(8, cache.pools.device_pages // 2)
        serve(cache, tokens(6, pages))
        cache.flush()
        assert cache.metrics.snapshot()["bytes"]["host_to_storage"] > 0
    report = fresh_process(stack, tmp_path, 6, pages)
    assert report["bad"] == 0 and report["corrupt"] == 0
    assert report["cached"] == pages and report["hits"]["storage"] == pages


def delete_objects(cache: CacheController, pool: str, hashes: list[str]) -> None:
    assert cache.engine is not None and cache.backend is not None
    for keys in cache.engine.object_keys(pool, hashes):
        for key in keys:
            cache.backend.path_for(key).unlink()  # type: ignore[attr-defined]


def write_to_l3(stack: str, l3: Path, seed: int, pages: int) -> CacheController:
    cache = open_cache(stack, l3)
    lease, _ = serve(cache, tokens(seed, pages))
    cache.flush()
    cache.hashes = lease.page_hashes  # type: ignore[attr-defined]
    return cache


@pytest.mark.parametrize("stack", [s for s in STACKS if "mamba" in s])
def test_a_state_stack_reuses_l3_only_up_to_a_page_with_a_state(stack: str, tmp_path: Path) -> None:
    with open_cache(stack, tmp_path) as cache:
        whole = tokens(7, 8)
        serve(cache, whole[: 3 * 64])  # a state after page 3 ...
        serve(cache, whole)  # ... and after page 8
        cache.flush()
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease, bad = serve(cold, torch.cat([whole[: 6 * 64], tokens(8, 2)]))
        assert bad == 0
        assert lease.cached_pages == 3 and lease.hit_pages["storage"] == 3


@pytest.mark.parametrize("stack", [s for s in STACKS if "swa" in s])
def test_an_l3_window_with_a_missing_page_falls_back_to_the_longest_whole_window(
    stack: str, tmp_path: Path
) -> None:
    """Written in two chunks (6, then 8 pages), so L3 holds the window (and state) objects a
    restore needs at both node ends. Page 6 of the window pool is gone: a prefix may end only
    where its window is whole, so the restore scans down to the one ending at page 6."""
    whole = tokens(9, 8)
    with open_cache(stack, tmp_path) as writer:
        serve(writer, whole[: 6 * 64])
        lease, _ = serve(writer, whole)
        writer.flush()
        window = next(name for name, tp in writer.tree_pools.items() if tp.kind is PoolKind.WINDOW)
        assert writer.tree_pools[window].window <= 6, "the example's window must fit below the missing page"
        delete_objects(writer, window, lease.page_hashes[6:7])
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease = cold.lookup(whole)
        cold.admit(lease)
        assert lease.cached_pages == 6 and lease.hit_pages["storage"] == 6
        assert verify(cold, lease) == 0
        assert lease.skipped == {SkipReason.INCOMPLETE_STACK: 2}
        cold.release(lease)
        assert all(used <= 6 for used in host_units_in_use(cold).values()), "a host slot leaked"


@pytest.mark.parametrize("stack", [s for s in STACKS if "swa" in s])
def test_an_l3_window_missing_its_last_page_falls_back_to_the_longest_whole_window(
    stack: str, tmp_path: Path
) -> None:
    """Written in two chunks (5, then 8 pages): windows (and states) end at pages 5 and 8. With
    the window object of page 7 gone, the restore falls back to the prefix ending at page 5."""
    whole = tokens(9, 8)
    with open_cache(stack, tmp_path) as writer:
        serve(writer, whole[: 5 * 64])
        lease, _ = serve(writer, whole)
        writer.flush()
        window = next(name for name, tp in writer.tree_pools.items() if tp.kind is PoolKind.WINDOW)
        assert writer.tree_pools[window].window <= 5, "the example's window must fit in the first chunk"
        delete_objects(writer, window, lease.page_hashes[7:8])
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease = cold.lookup(whole)
        cold.admit(lease)
        assert lease.cached_pages == 5 and lease.hit_pages["storage"] == 5
        assert verify(cold, lease) == 0
        assert lease.skipped == {SkipReason.INCOMPLETE_STACK: 3}
        cold.release(lease)
        assert all(used <= 5 for used in host_units_in_use(cold).values()), "a host slot leaked"


@pytest.mark.parametrize("stack", [s for s in STACKS if "swa" in s and "mamba" not in s])
def test_l3_holds_the_window_of_a_prefix_ending_where_a_later_request_branched(
    stack: str, tmp_path: Path
) -> None:
    """A request reuses 5 pages of an 8-page one (inside its node, on the device). The 5-page
    prefix then ends at a node boundary: L3 holds its window too, so a fresh cache restores the
    same prefix the first one reused, with exact bytes."""
    whole = tokens(11, 8)
    with open_cache(stack, tmp_path) as writer:
        serve(writer, whole)
        lease, bad = serve(writer, torch.cat([whole[: 5 * 64], tokens(12, 3)]))
        assert lease.cached_pages == 5 and lease.hit_pages["device"] == 5 and bad == 0
        writer.flush()
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease, bad = serve(cold, torch.cat([whole[: 5 * 64], tokens(13, 3)]))
        assert lease.cached_pages == 5 and lease.hit_pages["storage"] == 5 and bad == 0


@pytest.mark.parametrize("stack", [s for s in STACKS if "swa" in s and "mamba" not in s])
def test_an_l3_window_with_no_whole_window_is_dropped(stack: str, tmp_path: Path) -> None:
    writer = write_to_l3(stack, tmp_path, 10, 8)
    window = next(name for name, tp in writer.tree_pools.items() if tp.kind is PoolKind.WINDOW)
    delete_objects(writer, window, writer.hashes[7:8])  # type: ignore[attr-defined]
    writer.close()
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease = cold.lookup(tokens(10, 8))
        cold.admit(lease)
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.INCOMPLETE_STACK: 8}
        assert cold.metrics.snapshot()["operations"]["prefetches_dropped"] == 1
        cold.release(lease)
        assert all(used == 0 for used in host_units_in_use(cold).values()), "a host slot leaked"


def test_an_indexer_shortfall_clamps_the_l3_prefix_and_draft_comes_with_the_target(tmp_path: Path) -> None:
    writer = write_to_l3("mla-nsa-draft", tmp_path, 10, 6)
    delete_objects(writer, "indexer", writer.hashes[4:])  # type: ignore[attr-defined]
    writer.close()
    with open_cache("mla-nsa-draft", tmp_path, WAIT) as cold:
        lease, bad = serve(cold, tokens(10, 6))
        assert lease.cached_pages == 4 and lease.hit_pages["storage"] == 4
        assert bad == 0, "target, indexer and draft bytes of the clamped prefix are exact"


DRAFT = {"type": "draft", "index_source": "kv", "layers": 1, "kv_heads": 1, "head_dim": 64}


def test_a_draft_pool_added_at_runtime_is_stored_and_restored(tmp_path: Path) -> None:
    with open_cache("kv", tmp_path) as cache:
        serve(cache, tokens(11, 4))
        cache.add_pool("draft", DRAFT)
        assert cache.engine is not None and cache.engine.plans["draft"].enabled
        again, _ = serve(cache, tokens(11, 4))
        assert again.cached_pages == 0, "pages cached before the draft pool existed were dropped"
        push_off_device(cache)
        back, bad = serve(cache, tokens(11, 4))
        assert back.cached_pages == 4 and back.hit_pages["host"] >= 1 and bad == 0
        cache.flush()
    extra = ["model.pools.draft=" + json.dumps(DRAFT)]
    report = fresh_process("kv", tmp_path, 11, 4, extra)
    assert report["hits"]["storage"] == 4 and report["bad"] == 0


def test_a_late_pool_must_be_a_sidecar() -> None:
    with open_cache("kv") as cache:
        with pytest.raises(ValueError, match="only sidecars"):
            cache.add_pool("swa2", {"type": "swa", "layers": 1, "kv_heads": 1, "head_dim": 8, "window": 64})
        assert "swa2" not in cache.pools.pools, "a refused pool was left in the group"
        cache.add_pool("swa2", DRAFT)  # the name is still free
        _, bad = serve(cache, tokens(13, 3))
        assert bad == 0


def test_what_a_late_pool_drops_counts_as_evicted() -> None:
    with open_cache("kv") as cache:
        serve(cache, tokens(18, 3))
        cache.flush()
        before = cache.metrics.snapshot()["evicted_units"]
        cache.add_pool("draft", DRAFT)
        after = cache.metrics.snapshot()["evicted_units"]
    assert after["device"].get("kv", 0) - before["device"].get("kv", 0) == 3
    assert after["host"].get("kv", 0) - before["host"].get("kv", 0) == 3


def test_a_late_pool_with_a_bad_config_names_the_field() -> None:
    from kvstrata.plugins.errors import ConfigError

    with open_cache("kv") as cache:
        with pytest.raises(ConfigError, match=r"model\.pools\.draft\.layers: "):
            cache.add_pool("draft", dict(DRAFT, layers=0))
        assert "draft" not in cache.pools.pools
        cache.add_pool("draft", DRAFT)


def test_a_late_pool_drops_write_back_nodes_whose_children_left_first() -> None:
    # write-back keeps a node's only copy: a device node with host-only children cannot leave
    # until they have; one device pass then one host pass left it cached, and a lookup then
    # served the new pool's units for it, which no one wrote
    overrides = [
        "policy.write=write_back",
        "tiers.device.capacity_tokens=256",
        "tiers.host.capacity_tokens=1024",
    ]
    with open_cache("kv", overrides=overrides) as cache:
        shared = tokens(14, 1)
        serve(cache, torch.cat([shared, tokens(15, 1)]))
        serve(cache, torch.cat([shared, tokens(16, 1)]))  # splits: the shared page, two children
        serve(cache, tokens(17, 3))  # device pressure: the leaves are backed up and leave the device
        cache.add_pool("draft", DRAFT)
        lease = cache.lookup(shared)
        cache.admit(lease)
        assert lease.cached_pages == 0, "a page cached before the draft pool existed was served"
        cache.release(lease)
        assert cache.tree.units("kv", "device") == 0 and cache.tree.units("kv", "host") == 0


def test_selective_write_through_backs_up_on_the_second_hit() -> None:
    overrides = ["policy.write=write_through_selective", "policy.write_through_threshold=2"]
    with open_cache("kv", overrides=overrides) as cache:
        request = tokens(12, 3)
        for expected in (0, 0, 1):
            serve(cache, request)
            assert cache.metrics.snapshot()["operations"]["backups"] == expected


def test_a_request_longer_than_the_device_tier_evicts_nothing_before_it_is_refused() -> None:
    # the whole request sits locked on the device: 2 cached + 3 new pages never fit in 4, yet the
    # other cached prefix was evicted for it first (the simulator did the same)
    overrides = ["tiers.storage={}", "tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=0"]
    with open_cache("kv", overrides=overrides) as cache:
        first, other = tokens(20, 2), tokens(21, 2)
        serve(cache, first)
        serve(cache, other)
        lease = cache.lookup(torch.cat([first, tokens(22, 3)]))
        cache.admit(lease)
        with pytest.raises(CacheFullError, match="even after evicting"):
            cache.allocate(lease)
        cache.release(lease)
        again, _ = serve(cache, other)
        assert again.hit_pages["device"] == 2, "the other prefix was not evicted for nothing"


@pytest.mark.parametrize("host_tokens", [None, 0], ids=["host-tier", "no-host-tier"])
@pytest.mark.parametrize("stack", STACKS)
def test_a_request_the_locked_prefixes_leave_no_room_for_evicts_nothing_before_it_is_refused(
    stack: str, host_tokens: int | None
) -> None:
    # requests in flight lock most of the device tier: evicting every unlocked page cannot make
    # the room, yet the cached prefix beside them was evicted first (without a host tier: lost)
    host = [] if host_tokens is None else [f"tiers.host.capacity_tokens={host_tokens}"]
    overrides = ["tiers.storage={}", *host]
    with open_cache(stack, overrides=overrides) as cache:
        room = cache.pools.device_pages
        other = tokens(23, 2)
        serve(cache, other)
        running = cache.lookup(tokens(24, room - 3))
        cache.admit(running)
        fill(cache, running, cache.allocate(running))  # locked, not inserted: one page stays free
        doomed = cache.lookup(tokens(25, 4))  # 1 free + 2 evictable < 4
        cache.admit(doomed)
        evicted = cache.metrics.snapshot()["evicted_units"]
        with pytest.raises(CacheFullError, match="even after evicting"):
            cache.allocate(doomed)
        assert cache.metrics.snapshot()["evicted_units"] == evicted, "evicted for a refused request"
        cache.release(doomed)
        cache.insert(running)
        again, bad = serve(cache, other)
        assert again.hit_pages["device"] == 2 and bad == 0, "the cached prefix was not evicted for nothing"


def test_bad_use_is_refused_clearly() -> None:
    with open_cache("kv") as cache:
        lease = cache.lookup(tokens(13, 2))
        with pytest.raises(RuntimeError, match="admit"):
            lease.prefix_units("kv")
        cache.admit(lease)
        with pytest.raises(KeyError, match="no pool 'nope'"):
            lease.prefix_units("nope")
        with pytest.raises(RuntimeError, match="allocate"):
            cache.insert(lease)
        cache.release(lease)
        with pytest.raises(RuntimeError, match="closed"):
            cache.admit(lease)
        before = cache.pools.pools["kv"].device_allocator.used
        with pytest.raises(TypeError, match="RetentionHint"):  # not at insert, after the pages
            cache.lookup(tokens(13, 2), retention="pin")  # type: ignore[arg-type]
        assert cache.open_leases == 0 and cache.pools.pools["kv"].device_allocator.used == before
        units = torch.tensor([0])
        rows = cache.read_units("kv", units)
    for call in (
        lambda: cache.read_units("kv", units),
        lambda: cache.write_units("kv", units, rows),
        lambda: cache.device_view("kv", "k"),
    ):
        with pytest.raises(RuntimeError, match="cache is closed"):  # its memory is no longer the engine's
            call()


@pytest.mark.mooncake
@pytest.mark.parametrize("stack", ["hybrid-mamba", "mla-nsa-draft"])
def test_mooncake_l3_then_a_fresh_process_restores_exact_bytes(
    stack: str, tmp_path: Path, mooncake_inprocess_config
) -> None:
    cfg = mooncake_inprocess_config
    mooncake = [
        "tiers.storage.l3.type=mooncake",
        f"tiers.storage.l3.master={cfg.master}",
        f"tiers.storage.l3.metadata_server={cfg.metadata_server}",
        "tiers.storage.l3.segment_bytes=0",
        "tiers.storage.l3.local_buffer_bytes=0",
        f"model.name=mooncake-{stack}-{tmp_path.name}",  # a namespace of its own on the shared master
    ]
    with open_cache(stack, tmp_path, mooncake) as cache:
        serve(cache, tokens(14, 4))
        cache.flush()
        assert cache.metrics.snapshot()["bytes"]["host_to_storage"] > 0
    report = fresh_process(stack, tmp_path, 14, 4, mooncake)
    assert report["hits"]["storage"] == 4 and report["bad"] == 0 and report["corrupt"] == 0


def test_a_prefetch_into_a_full_host_tier_makes_room_at_admit(tmp_path: Path) -> None:
    with open_cache("kv", tmp_path, WAIT) as cache:
        first = tokens(15, 4)
        serve(cache, first)
        host_pages = cache.pools.pools["kv"].host_allocator.units
        for i in range(host_pages // 4 + 4):  # `first` is the oldest: it leaves both tiers
            serve(cache, tokens(100 + i, 4))
        cache.flush()
        assert cache.pools.pools["kv"].host_allocator.available == 0, "the host tier is full"
        lease, bad = serve(cache, first)
        assert lease.hit_pages["storage"] == 4 and bad == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


def count_page_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pages hashed for leases (a counting wrapper around the real hash_pages)."""
    import kvstrata.core.lease as lease_module

    hashed: list[int] = []
    real = lease_module.hash_pages

    def counting(*args: object, **kwargs: object) -> list[str]:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        hashed.append(len(result))
        return result

    monkeypatch.setattr(lease_module, "hash_pages", counting)
    return hashed


def serve_in_chunks(cache: CacheController, request: torch.Tensor, chunk_pages: int) -> None:
    """A chunked prefill through the engine API, never asking for page hashes itself."""
    page = cache.page_size
    lease = cache.lookup(request[: chunk_pages * page])
    for start in range(chunk_pages, len(request) // page + chunk_pages, chunk_pages):
        cache.allocate(lease)
        last = start >= len(request) // page
        cache.insert(lease, close=last)
        if not last:
            lease.extend(request[start * page : (start + chunk_pages) * page])


def test_page_hashes_are_computed_once_per_lease_and_never_without_l3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed = count_page_hashing(monkeypatch)
    request = tokens(21, 12)
    # (the second request's chunks recompute pages the tree holds: its own units of them stay
    # its until it closes, 28 pages at most)
    with open_cache("kv", None, ["tiers.device.capacity_tokens=2048"]) as cache:
        serve_in_chunks(cache, request, 4)
        serve_in_chunks(cache, torch.cat([request, tokens(22, 4)]), 4)
    assert sum(hashed) == 0  # no L3: nothing needs a page hash
    with open_cache("kv", tmp_path) as cache:
        serve_in_chunks(cache, request, 4)
        cache.flush()
        assert cache.metrics.snapshot()["bytes"]["host_to_storage"] > 0
    assert sum(hashed) == 12  # each page of the lease once, over three chunked inserts


def test_write_back_eviction_of_nested_nodes_stores_the_right_hashes(tmp_path: Path) -> None:
    """Write-back hashes evicted nodes from their path; nested nodes of one batch continue the
    chain from each other. A fresh process must restore the whole prefix from L3."""
    longer = tokens(23, 8)
    with open_cache("kv", tmp_path, ["policy.write=write_back"]) as cache:
        serve(cache, longer[: 4 * cache.page_size])
        serve(cache, longer)  # a child node below the first request's
        serve(cache, tokens(24, cache.pools.device_pages))  # evicts both, backed up in one batch
        cache.flush()
        assert cache.metrics.snapshot()["bytes"]["host_to_storage"] > 0
    report = fresh_process("kv", tmp_path, 23, 8)
    assert report["bad"] == 0 and report["corrupt"] == 0
    assert report["hits"]["storage"] == 8


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba"])
def test_write_back_writes_a_hot_prefix_to_l3_with_the_pages_below_it(tmp_path: Path, stack: str) -> None:
    # a shared prefix every request reuses never leaves the device, so write-back never backed it
    # up; the pages below it were evicted and written to L3, where no later cache could reach them
    shared = tokens(25, 2)
    requests = [torch.cat([shared, tokens(600 + i, 3)]) for i in range(12)]
    with open_cache(stack, tmp_path, ["policy.write=write_back"]) as cache:
        for request in requests:
            serve(cache, request)
        assert cache.pools.device_pages < 2 + 3 * len(requests), "the first requests left the device"
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease, bad = serve(cold, requests[0])
        assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (5, 5, 0)


def test_a_late_pool_can_live_in_the_engines_own_device_tensors(tmp_path: Path) -> None:
    # a draft model the engine loads after start keeps its KV where it computes it: add_pool
    # takes its tensors as open() does for the first pools (it used to allocate its own)
    with open_cache("kv") as probe:
        spec = probe.add_pool("draft", DRAFT).spec
        units = probe.pools.pool("draft").device.units
    engine = {
        b.name: torch.zeros(b.layers, units, *b.unit_shape, dtype=torch_dtype(b.dtype), device=DEVICE)
        for b in spec.buffers
    }
    with open_cache("kv", tmp_path) as cache:
        with pytest.raises(ValueError, match=r"pool 'draft'.*buffer 'k'.*expected"):
            cache.add_pool("draft", DRAFT, device_tensors=dict(engine, k=engine["k"][..., :-1]))
        assert "draft" not in cache.pools.pools, "a refused pool was left in the group"
        cache.add_pool("draft", DRAFT, device_tensors=engine)
        serve(cache, tokens(18, 3))
        view = cache.pools.pool("draft").device.unit_view("k")
        same = view.untyped_storage().data_ptr() == engine["k"].untyped_storage().data_ptr()
        assert same, "the device tier is the engine's tensor"
        assert engine["k"].count_nonzero() > 0, "the request's draft KV landed in the engine's tensor"
        push_off_device(cache)
        back, bad = serve(cache, tokens(18, 3))
        assert back.cached_pages == 3 and back.hit_pages["host"] >= 1 and bad == 0


@pytest.mark.parametrize("stack", [s for s in STACKS if "swa" in s])
def test_a_window_ending_at_a_prefix_end_is_written_to_l3_once(tmp_path: Path, stack: str) -> None:
    # every request branching at the end of a stored prefix (users of one system prompt, each
    # turn of a conversation) wrote that prefix's last window again; each object is put once now
    prompt = tokens(26, 8)
    turns = [torch.cat([prompt, tokens(700 + i, 2)]) for i in range(4)]
    turns.append(torch.cat([turns[0], tokens(710, 2)]))  # the next turn of the first
    with open_cache(stack, tmp_path) as cache:
        assert cache.backend is not None
        put, puts = cache.backend.put, collections.Counter[str]()

        def counted(objects, *args, **kwargs):  # type: ignore[no-untyped-def]
            puts.update(obj.key for obj in objects)
            return put(objects, *args, **kwargs)

        cache.backend.put = counted  # type: ignore[method-assign]
        serve(cache, prompt)
        for request in turns:
            serve(cache, request)
        cache.flush()
        assert puts and max(puts.values()) == 1, [key for key, n in puts.items() if n > 1]
    for request in turns:  # and every branch restores from L3 alone, in a cache of its own
        with open_cache(stack, tmp_path, WAIT) as cold:
            lease, bad = serve(cold, request)
            pages = len(request) // cold.page_size
            assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (pages, pages, 0)


def test_a_window_end_whose_write_failed_is_written_again_and_gone_nodes_are_swept() -> None:
    ends = StoredWindowEnds()
    kept, failed, gone = LiveNode(), LiveNode(), LiveNode()
    ends.update([kept, failed, gone])  # type: ignore[list-item]
    ends.settled([kept], {"swa": BatchResult([True, True])})  # type: ignore[list-item]
    ends.settled([failed], {"swa": BatchResult([True, False], failed=1)})  # type: ignore[list-item]
    assert kept in ends and failed not in ends, "a failed write leaves the window to the next request"
    ends.discard(gone)  # type: ignore[arg-type]
    ends.update([GoneNode() for _ in range(NodeSet.FIRST_SWEEP)])  # type: ignore[misc]  # evicted ones
    assert len(ends) == 1 and kept in ends, "the sweep drops the nodes that left the tree"


def test_stored_window_ends_of_a_large_tree_are_not_swept_at_every_write(tmp_path: Path) -> None:
    """Past its bound the set of stored window ends was swept at every write carrying a window,
    though every node was still in the tree: O(tree) per write. A sweep now waits for the set to
    double (``NodeSet``)."""
    with open_cache("swa", tmp_path) as cache:
        ends = cache.writer.window_ends
        live = [LiveNode() for _ in range(NodeSet.FIRST_SWEEP)]
        ends.update(live)  # type: ignore[arg-type]
        LiveNode.reads = 0
        for n in range(1, 51):
            serve(cache, tokens(n, 3))
            cache.flush()  # each request's window end written
        assert len(ends) > len(live)
        assert LiveNode.reads <= len(live), f"{LiveNode.reads / len(live):.0f} sweeps of every node"


@pytest.mark.parametrize("writes", ["finished_not_drained", "finish_while_the_backup_waits"])
@pytest.mark.parametrize("stack", ["swa-mamba", "kv"])
def test_write_back_backups_for_an_eviction_keep_the_other_device_pages_copies(
    tmp_path: Path, stack: str, writes: str
) -> None:
    # backing up the page an eviction needed made host room by dropping the host copy of another
    # device page, which then could not leave the device either: allocate refused a request that
    # fit, with one lease open (host units held by L3 writes not yet drained)
    prompt = tokens(27, 6)
    with open_cache(stack, tmp_path, ["policy.write=write_through"]) as first_run:
        serve(first_run, prompt)
    with open_cache(stack, tmp_path, ["policy.write=write_back", *WAIT]) as cache:
        assert cache.engine is not None
        gate = hold_l3_writes(cache)  # L3 writes held back: their host sources stay locked
        serve(cache, prompt)  # restored from L3: on the device with a host copy
        for seed in (28, 29, 30):  # each evicts the one before: backed up, its write held
            serve(cache, prompt)
            serve(cache, tokens(seed, 10))
        serve(cache, prompt)
        lease = cache.lookup(tokens(31, 12))
        cache.admit(lease)
        if writes == "finished_not_drained":
            gate.set()
            for write in list(cache.writer.pending):
                write.future.result(30)
        else:
            threading.Timer(0.3, gate.set).start()  # well inside policy.backup_wait_s
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)
        cache.tree.check()
        gate.set()


@pytest.mark.parametrize("backup_wait_s", ["0", "5"])
def test_write_back_writes_a_page_to_l3_only_with_its_prefix(tmp_path: Path, backup_wait_s: str) -> None:
    # the evicted leaf was queued to L3 first; where the host tier then had no room for its
    # device-only prefix (in-flight writes hold it), the prefix was skipped: objects no later
    # cache could reach. Now a page goes to L3 only with its prefix (else L2 only)
    overrides = [
        "policy.write=write_back",
        "tiers.device.capacity_tokens=512",
        "tiers.host.capacity_tokens=256",
        f"policy.backup_wait_s={backup_wait_s}",
    ]
    shared = tokens(32, 2)
    requests = [torch.cat([shared, tokens(800 + i, 3)]) for i in range(4)]
    with open_cache("kv", tmp_path, overrides) as cache:
        assert cache.engine is not None
        put_group = cache.engine.put_group
        cache.engine.put_group = lambda batches: (time.sleep(0.3), put_group(batches))[1]  # type: ignore[method-assign]
        hashes = [serve(cache, request)[0].page_hashes for request in requests]
    with open_cache("kv", tmp_path, WAIT) as cold:
        assert cold.engine is not None
        for page_hashes in hashes:
            stored = cold.engine.exists("kv", page_hashes).ok
            first_missing = stored.index(False) if False in stored else len(stored)
            assert not any(stored[first_missing:]), f"objects below a page L3 lacks: {stored}"


def test_write_back_writes_a_leaf_held_back_for_its_prefix_once_the_prefix_is_written(tmp_path: Path) -> None:
    # an evicted leaf fit on the host, its device-only shared prefix did not (in-flight L3 writes
    # locked the rest): the leaf went to L2 only, as it must, but when the prefix left the device
    # and was written, nothing wrote the leaf, still on the host: a fresh cache found the prefix
    # in L3 and not the leaf below it (2 of 4 pages)
    overrides = [
        "policy.write=write_back",
        "tiers.device.capacity_tokens=512",  # 8 pages
        "tiers.host.capacity_tokens=640",  # 10 pages
        "policy.backup_wait_s=0.05",
        *WAIT,
    ]
    shared = tokens(32, 2)
    requests = [torch.cat([shared, tokens(800 + i, 2)]) for i in range(4)]
    with open_cache("kv", tmp_path, overrides) as cache:
        assert cache.engine is not None
        gate = hold_l3_writes(cache)  # fault injection: L3 writes held, their host sources locked
        serve(cache, tokens(700, 4))
        serve(cache, tokens(701, 4))  # both evicted below: 8 host pages locked by their writes
        hashes = [serve(cache, request)[0].page_hashes for request in requests]  # the last evicts
        assert cache.metrics.snapshot()["operations"]["backups_skipped"] >= 1  # the prefix's backup
        gate.set()
        cache.flush()
        push_off_device(cache, seed=1300)  # the prefix leaves the device: backed up and written
        cache.flush()
    with open_cache("kv", tmp_path, WAIT) as cold:
        assert cold.engine is not None
        assert [sum(cold.engine.exists("kv", page_hashes).ok) for page_hashes in hashes] == [4] * 4
        lease, bad = serve(cold, requests[0])
        assert (lease.hit_pages["storage"], bad) == (4, 0)


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba"])
def test_write_back_host_eviction_keeps_a_leaf_waiting_for_its_prefix(tmp_path: Path, stack: str) -> None:
    # a leaf left the device while its shared prefix stayed there (a lease held it) and the host
    # tier had no room for the prefix (in-flight L3 writes locked it): the leaf waited on the host
    # for the prefix's write, as it must. Host eviction then took it like any other node before
    # the prefix was written: its pages were in no tier, and a fresh cache found 2 of its 4
    overrides = [
        "policy.write=write_back",
        "tiers.device.capacity_tokens=512",  # 8 pages
        "tiers.host.capacity_tokens=256",  # 4 pages
        "policy.backup_wait_s=0.5",  # (a file write takes well under it)
        *WAIT,
    ]
    shared = tokens(32, 2)
    request = torch.cat([shared, tokens(800, 2)])
    with open_cache(stack, tmp_path, overrides) as cache:
        assert cache.engine is not None
        gate = hold_l3_writes(cache)  # fault injection: L3 writes held, their host sources locked
        serve(cache, tokens(700, 2))
        hashes = serve(cache, request)[0].page_hashes
        serve(cache, tokens(701, 2))  # the device is full
        held = cache.lookup(shared)  # the shared prefix stays on the device
        cache.admit(held)
        serve(cache, tokens(702, 2))  # evicts the first request: on the host, its write held
        serve(cache, tokens(703, 2))  # evicts the leaf: no host room for its prefix, it waits
        assert cache.metrics.snapshot()["operations"]["backups_skipped"] >= 1  # the prefix's backup
        assert cache.writer.waits, "the leaf waits for its prefix"
        gate.set()
        cache.flush()
        for i in range(4):  # each evicts the least recently used device node: the host tier evicts
            serve(cache, tokens(1500 + i, 2))
        assert cache.metrics.snapshot()["evicted_units"]["host"]["kv"] >= 4
        cache.release(held)
        cache.flush()
        push_off_device(cache, pages=2, seed=1300)  # the prefix leaves the device: written with the leaf
        cache.flush()
    with open_cache(stack, tmp_path, WAIT) as cold:
        assert cold.engine is not None
        assert sum(cold.engine.exists("kv", hashes).ok) == 4
        lease, bad = serve(cold, request)
        assert (lease.hit_pages["storage"], bad) == (4, 0)


def test_write_back_writes_a_waiting_leaf_once_the_host_has_room_for_its_prefix(tmp_path: Path) -> None:
    # a leaf waited on the host for its prefix (a lease kept it on the device; in-flight writes
    # locked the host room). Once the host had free room again, each device eviction copied its
    # own candidates into it and never the waiting leaf's prefix: the leaf stayed the prefix's
    # only chance, until a larger eviction took it (nothing else left to take) and a fresh cache
    # found 2 of its 4 pages. The prefix now takes free host room first: the leaf is written
    overrides = [
        "policy.write=write_back",
        "tiers.device.capacity_tokens=512",  # 8 pages
        "tiers.host.capacity_tokens=384",  # 6 pages
        "policy.backup_wait_s=0.5",
        *WAIT,
    ]
    shared = tokens(32, 2)
    request = torch.cat([shared, tokens(800, 2)])
    with open_cache("kv", tmp_path, overrides) as cache:
        assert cache.engine is not None
        gate = hold_l3_writes(cache)  # fault injection: L3 writes held, their host sources locked
        serve(cache, tokens(700, 3))
        hashes = serve(cache, request)[0].page_hashes
        held = cache.lookup(shared)  # the shared prefix stays on the device
        cache.admit(held)
        serve(cache, tokens(702, 2))  # evicts the first request: 3 host pages locked by its write
        serve(cache, tokens(703, 3))  # evicts the leaf: no host room for its prefix, it waits
        assert cache.writer.waits, "the leaf waits for its prefix"
        gate.set()
        cache.flush()
        serve(cache, tokens(1500, 2))  # evicts 702: the host drops the first request, 2 pages free
        cache.flush()
        serve(cache, tokens(1501, 3))  # evicts 703 into the free room: the prefix could have had it
        cache.flush()
        assert not cache.writer.waits, "the prefix took the free room: the leaf is written"
        serve(cache, tokens(1502, 6))  # evicts 5 pages: the host takes everything it may
        cache.release(held)
        cache.flush()
        push_off_device(cache, pages=2, seed=1300)  # the prefix leaves the device: written
        cache.flush()
    with open_cache("kv", tmp_path, WAIT) as cold:
        assert cold.engine is not None
        assert sum(cold.engine.exists("kv", hashes).ok) == 4
        lease, bad = serve(cold, request)
        assert (lease.hit_pages["storage"], bad) == (4, 0)


@pytest.mark.parametrize(
    ("stack", "write"),
    [
        ("swa", "write_back"),
        ("swa", "write_through_selective"),
        ("logical-swa", "write_through_selective"),
        ("swa-mamba", "write_through"),
    ],
)
def test_a_branch_inside_a_stored_node_is_restored_whole_by_a_fresh_cache(
    tmp_path: Path, stack: str, write: str
) -> None:
    # the branch's node (shorter than a window) was written with its own pages only: the window
    # ending at it spans the page above the branch point, which L3 never got (it lay outside the
    # first node's last window), so a fresh cache restored nothing of the branch
    overrides = [f"policy.write={write}", "policy.write_through_threshold=1"]
    first = tokens(37, 6)
    branch = torch.cat([first[: 3 * 64], tokens(38, 1)])
    with open_cache(stack, tmp_path, overrides) as cache:
        serve(cache, first)
        serve(cache, first)  # a reuse: selective write-through writes it
        if write == "write_back":  # the first request reaches L3 before the branch: it leaves the device
            push_off_device(cache, seed=1100)
            cache.flush()
        serve(cache, branch)
        serve(cache, branch)
        push_off_device(cache, seed=1200)  # write-back writes what leaves the device
        cache.flush()
    with open_cache(stack, tmp_path, WAIT) as cold:
        lease, bad = serve(cold, branch)
        assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (4, 4, 0)
