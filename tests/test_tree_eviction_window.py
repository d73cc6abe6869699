"""Window pools on the device: what ``room_by_evicting`` counts, eviction frees.

A device window lock holds its last window only, so ``room_by_evicting`` counts the head of a
locked node above every lock's window as room. When an unlocked cached end (a branch point, a
sibling's prefix) still needed that head, neither eviction path freed it: out-of-window eviction
spares what a cached end needs, component eviction skipped locked nodes whole. An allocation was
then refused after an eviction that freed nothing useful. These tests pin that the counted room
is freed, and that nothing an open lease's window holds is.
"""

from __future__ import annotations

import torch

from controller_support import fill, open_cache, serve, tokens, verify
from kvstrata.core.tier_units import room_by_evicting
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.core.tree_eviction import window_tail
from kvstrata.core.tree_node import TreeNode
from tree_stacks import PAGE, Units, kv_spec, mamba_spec, seq, swa_spec

#: window 3 pages (192 tokens), no host tier, no L3: what leaves the device is gone
WINDOW = ["model.pools.swa.window=192", "tiers.host.capacity_tokens=0", "tiers.storage={}"]


def insert(tree: PrefixTree, units: Units, keys: list) -> None:
    tree.insert(keys, {"kv": units.take(len(keys)), "swa": units.take(len(keys))})
    tree.check()


def window_units(tree: PrefixTree, end: TreeNode, window: int = 3) -> dict[int, int]:
    """Page -> device window unit over the last window of the prefix ending at ``end``."""
    swa, first = tree.index["swa"], end.depth_end - window
    pages = {}
    for node in tree.window_nodes(end, "swa"):
        for i, unit in enumerate(node.device[swa].tolist()):
            pages[node.depth_start + i] = unit
    return {page: unit for page, unit in pages.items() if page >= first}


def test_component_eviction_frees_the_head_of_a_locked_window_node_that_room_counted() -> None:
    """Prefix P (5 pages, a branch point) below X and Y (2 pages each), window 3 pages, a lock
    at P+X's end (its window: pages [4, 7)). Room for 6 window units: Y whole (2) and P's pages
    [0, 4) (4); [0, 2) is out of every window, [2, 4) only in P's own (unlocked) end's window."""
    tree, units = PrefixTree([kv_spec(), swa_spec(3 * PAGE)]), Units()
    insert(tree, units, seq(1, 2, 3, 4, 5, 6, 7))
    insert(tree, units, seq(1, 2, 3, 4, 5, 8, 9))
    px = tree.match(seq(1, 2, 3, 4, 5, 6, 7), count_hit=False).last_node
    handle = tree.lock(px)
    held = window_units(tree, px)
    assert sorted(held) == [4, 5, 6]
    assert room_by_evicting(tree.evictor, Tier.DEVICE, {"swa": 6})
    out = tree.evict_device({"swa": 6})
    tree.check()
    assert out.units.get("swa", 0) >= 6, out
    # the lock's window is untouched: the same units on the same pages
    assert window_units(tree, px) == held
    assert tree.match(seq(1, 2, 3, 4, 5, 6, 7), count_hit=False).device_pages == 7
    assert not room_by_evicting(tree.evictor, Tier.DEVICE, {"swa": 1}), "nothing else is free"
    tree.unlock(handle)
    tree.check()


def test_window_tail_ignores_a_child_without_window_data() -> None:
    """A child whose window data is gone ends no usable prefix: its parent's end is then the
    path's last usable end, and its last window stays data (not out-of-window)."""
    tree, units = PrefixTree([kv_spec(), swa_spec(3 * PAGE)]), Units()
    insert(tree, units, seq(1, 2, 3, 4))
    insert(tree, units, seq(1, 2, 3, 4, 5))
    parent = tree.match(seq(1, 2, 3, 4), count_hit=False).last_node
    (child,) = parent.children.values()
    swa = tree.index["swa"]
    assert window_tail(parent, Tier.DEVICE, 3, swa) == 2  # the child's end needs pages [2, 4)
    tree.drop_component(child, "swa", Tier.DEVICE)
    tree.check()
    assert window_tail(parent, Tier.DEVICE, 3, swa) == 3  # now its own end needs [1, 4)
    out = tree.evict_device({"swa": 10}, out_of_window_only=True)
    tree.check()
    assert out.units.get("swa", 0) == 1  # page 0 only: the path's last usable end stays whole
    assert tree.match(seq(1, 2, 3, 4), count_hit=False).device_pages == 4


def test_allocate_evicts_the_window_head_no_lock_needs_instead_of_refusing() -> None:
    """P (5 pages), then P+X and P+Y (2 more each), a window pool of 7 units; a lease continuing
    P+X by 3 pages. Evicting could make room (P+Y, and P's pages [2, 4) outside the lease's
    window), but only P+Y went and allocate raised CacheFullError."""
    with open_cache("swa", overrides=[*WINDOW, "model.pools.swa.device_units=7"]) as cache:
        assert cache.tree_pools["swa"].window == 3
        p, x, y = tokens(1, 5), tokens(2, 2), tokens(3, 2)
        for request in (p, torch.cat([p, x]), torch.cat([p, y])):
            assert serve(cache, request)[1] == 0
        longer = torch.cat([p, x, tokens(4, 3)])
        lease = cache.lookup(longer)
        cache.admit(lease)
        assert lease.cached_pages == 7 and verify(cache, lease) == 0
        fill(cache, lease, cache.allocate(lease))
        assert verify(cache, lease) == 0, "the lease's window pages survived the eviction"
        cache.insert(lease)
        cache.tree.check()
        again, bad = serve(cache, longer)
        assert again.cached_pages == 10 and bad == 0


def test_two_open_leases_on_sibling_branches_each_allocate_their_window() -> None:
    """Both continuations open at once: the first allocate's shortfall is P's head above both
    windows (counted as room, freed by nothing: CacheFullError); the second allocates once the
    first inserted. Every lease's window stays bit-exact throughout."""
    with open_cache("swa", overrides=[*WINDOW, "model.pools.swa.device_units=8"]) as cache:
        p, x, y = tokens(1, 5), tokens(2, 2), tokens(3, 2)
        for request in (p, torch.cat([p, x]), torch.cat([p, y])):
            assert serve(cache, request)[1] == 0
        requests = [torch.cat([p, x, tokens(4, 3)]), torch.cat([p, y, tokens(5, 3)])]
        leases = [cache.lookup(r) for r in requests]
        for lease in leases:
            cache.admit(lease)
            assert lease.cached_pages == 7 and verify(cache, lease) == 0
        for i, lease in enumerate(leases):
            fill(cache, lease, cache.allocate(lease))
            assert all(verify(cache, open_lease) == 0 for open_lease in leases[i:])
            cache.insert(lease)
            cache.tree.check()
        again, bad = serve(cache, requests[1])  # the last one inserted is cached whole
        assert again.cached_pages == 10 and bad == 0
        assert serve(cache, requests[0])[1] == 0  # (its room was made from the first's pages)


def test_out_of_window_eviction_keeps_the_window_of_a_state_checkpoint() -> None:
    """With a state pool, a prefix is served only where a node holds a state: a chunk's
    checkpoint inside a path is such an end. Out-of-window eviction counted only the ends and
    branch points of paths, tombstoned the checkpoint's last window, and the prefix ending there
    (its state still held) was lost. Chunks [0, 4) and [4, 8), window 2 pages: only pages
    [0, 2) and [4, 6) are outside every window."""
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE), mamba_spec()]), Units()
    first = tree.insert(seq(1, 2, 3, 4), {"kv": units.take(4), "swa": units.take(4), "mamba": units.take(1)})
    tree.insert(
        seq(5, 6, 7, 8), {"kv": units.take(4), "swa": units.take(4), "mamba": units.take(1)}, at=first.node
    )
    out = tree.evict_device({"swa": 8}, out_of_window_only=True)
    tree.check()
    assert out.out_of_window == {"swa": 4}
    assert tree.match(seq(1, 2, 3, 4, 9), count_hit=False).device_pages == 4
    assert tree.match(seq(1, 2, 3, 4, 5, 6, 7, 8), count_hit=False).device_pages == 8


def test_a_chunked_requests_checkpoint_stays_reusable_under_window_pressure() -> None:
    """A 12-page request in 6-page chunks (window 4 pages, a full window pool), then a request
    needing 2 window units: out-of-window data is pages [0, 2) and [6, 8) only, but its eviction
    tombstoned the least recent chunk's whole window, the checkpoint at page 6's included, and a
    prompt sharing those 6 pages then reused none."""
    overrides = [
        "tiers.storage={}",
        "tiers.host.capacity_tokens=0",
        "model.pools.swa.device_units=12",
        "model.pools.mamba.device_units=8",
    ]
    with open_cache("swa-mamba", overrides=overrides) as cache:
        assert cache.tree_pools["swa"].window == 4
        request, step = tokens(1, 12), 6 * cache.page_size
        lease = cache.lookup(request[:step])
        cache.admit(lease)
        for start in range(0, len(request), step):
            if start:
                lease.extend(request[start : start + step])
            fill(cache, lease, cache.allocate(lease))
            cache.insert(lease, close=start + step >= len(request))
        assert serve(cache, tokens(2, 2))[1] == 0  # its 2 window units: the pool is full
        again, bad = serve(cache, torch.cat([request[:step], tokens(3, 2)]))
        assert again.cached_pages == 6 and bad == 0
        assert cache.metrics.snapshot()["operations"]["out_of_window_device"] == 4  # [0, 2), then [6, 8)
