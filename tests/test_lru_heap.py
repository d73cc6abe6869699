"""The LRU order's eviction candidates kept across evictions (``core/lru_heap.py``).

Every eviction ranked every member of its tier: O(tier) per allocation once the tier was full
(79 ms per request with 10,000 device nodes, every request evicting). The heap must make an
eviction cost what it looks at, and drop exactly what the ranked scan dropped, in its order:
the second test checks every node it drops against the scan's choice.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from controller_support import fill, open_cache, tokens
from kvstrata.core import lru_heap, write_back
from kvstrata.core.controller import CacheController
from kvstrata.core.retention import RetentionHint
from kvstrata.core.tree import PrefixTree, Tier, TreeNode
from tree_stacks import Units, kv_spec, seq


def _counting(tree: PrefixTree) -> list[int]:
    """Counts the nodes the evictor asks whether they may leave (``_node_evictable``)."""
    asked = [0]
    evictable = tree.evictor._node_evictable

    def counted(node: TreeNode, tier: Tier) -> bool:
        asked[0] += 1
        return evictable(node, tier)

    tree.evictor._node_evictable = counted  # type: ignore[method-assign]
    return asked


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_an_eviction_looks_at_the_nodes_it_drops_not_the_whole_tier(tier: Tier) -> None:
    tree, units = PrefixTree([kv_spec()]), Units()
    nodes = [tree.insert(seq(i), {"kv": units.take(1)}).node for i in range(3000)]
    if tier is Tier.HOST:  # backed up, then demoted: 3,000 host-only nodes
        for node in nodes:
            tree.set_host_value(node, "kv", units.take(1))
        tree.evict_device({"kv": len(nodes)})
    tree.match(seq(0))  # the oldest is the newest now
    evict = tree.evict_device if tier is Tier.DEVICE else tree.evict_host
    evict({"kv": 1})  # (the first eviction takes the stamps given since the entries were pushed)
    asked = _counting(tree)
    for _ in range(10):
        assert evict({"kv": 1}).units == {"kv": 1}
    assert asked[0] <= 20, f"{asked[0]} nodes asked for 10 evictions of one node in 3,000"
    assert nodes[0].parent is tree.root and all(n.parent is None for n in nodes[1:12]), "LRU: the oldest went"
    tree.check()


def _step(cache: CacheController, request: torch.Tensor, hint: RetentionHint | None, chunked: bool) -> None:
    """One request; ``chunked``: its first page looked up, the rest extended after an insert
    that keeps the lease open (a locked chain, as a chunked prefill holds)."""
    page = cache.page_size
    first = request[:page] if chunked and len(request) > page else request
    lease = cache.lookup(first, retention=hint)
    cache.admit(lease)
    if first is not request:
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease, close=False)
        lease.extend(request[page:])
    fill(cache, lease, cache.allocate(lease))
    cache.insert(lease)
    if hint is not None and hint.pin and random.Random(len(request)).random() < 0.5:
        cache.unpin(lease)


def _empty_tiers(cache: CacheController) -> None:
    """Evict all that may leave each tier: the heap stops short, where the scan finds nothing."""
    units, everything = cache.parts.units, {spec.name: 1 << 40 for spec in cache.tree.pools}
    cache.tree.evict_device(everything, units.freer(Tier.DEVICE))
    cache.tree.evict_host(everything, units.freer(Tier.HOST))


def check_evictions(
    monkeypatch: pytest.MonkeyPatch, heap_type: type[lru_heap.LruHeap]
) -> tuple[list[int], list[int]]:
    """Check every node a ``heap_type``'s ``evict`` drops against the scan's choice (the evictable
    member of least stamp), and that it stops short of the want only where the scan finds
    nothing either; count the drops and the stops."""
    drops, stops = [0], [0]
    evict = heap_type.evict

    def checked(heap: lru_heap.LruHeap, evictable: Any, drop: Any, *args: Any) -> None:
        def drop_checked(node: TreeNode, tier: Tier, result: Any) -> object:
            scan = min((n for n in heap.members if evictable(n, tier)), key=lambda n: (n.last_access, n.id))
            assert node is scan, f"the heap dropped {node}, the scan {scan}"
            drops[0] += 1
            return drop(node, tier, result)

        evict(heap, evictable, drop_checked, *args)
        name, tier, want, result = args
        if result.units.get(name, 0) < want:
            missed = [n for n in heap.members if evictable(n, tier)]
            assert not missed, f"the heap stopped with {missed[:3]} still evictable"
            stops[0] += 1

    monkeypatch.setattr(heap_type, "evict", checked)
    return drops, stops


def check_leaves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Check every choice of what write-back backs up before an eviction (walked from the kept
    candidates) against the ranked scan's; count the choices."""
    asked = [0]
    walked = write_back._evictable_leaves

    def compared(tree: PrefixTree, layout: Any, want: int) -> list[TreeNode]:
        chosen = walked(tree, layout, want)
        level = tree.evictor.retention.levels() if tree.evictor.retention is not None else None
        assert chosen == write_back._evictable_leaves_ranked(tree, layout, want, level)  # levels first
        asked[0] += 1
        return chosen

    monkeypatch.setattr(write_back, "_evictable_leaves", compared)
    return asked


def replay_requests(
    cache: CacheController, seed: str, after: Callable[[int, random.Random], None] | None = None
) -> None:
    """100 requests on shared prompts (hits, chunked inserts, pins), some with retention levels
    (requests 30-39: ranked by a scan while a level lives); at request 55 the levels cleared and
    the tiers emptied (the kept candidates again, the heap stopping short). ``after``: called
    after each request with its number and the replay's random generator."""
    rng = random.Random(seed)
    prompts = [tokens(seed, rng.randint(1, 3)) for seed in range(6)]
    for n in range(100):
        suffix = tokens(1000 + n, rng.randint(0, 4))
        request = torch.cat([rng.choice(prompts), suffix]) if rng.random() < 0.7 else suffix
        if not len(request):
            continue
        roll = rng.random()
        timed = 30 <= n < 40 and roll < 0.3
        hint = RetentionHint(ttl_s=60) if timed else RetentionHint(pin=True) if roll < 0.1 else None
        if n == 55:
            cache.parts.retention._levels.clear()
            _empty_tiers(cache)
        _step(cache, request, hint, chunked=rng.random() < 0.3)
        if after is not None:
            after(n, rng)


#: one write policy per stack in the fast loop (each case replays 100 requests)
_FAST = {("kv", "write_back"), ("swa", "write_through"), ("hybrid-mamba", "write_through_selective")}


@pytest.mark.parametrize(
    ("stack", "write"),
    [
        pytest.param(stack, write, marks=() if (stack, write) in _FAST else pytest.mark.slow)
        for stack in ("kv", "swa", "hybrid-mamba")
        for write in ("write_through", "write_back", "write_through_selective")
    ],
)
def test_the_kept_candidates_evict_what_the_ranked_scan_evicts(
    stack: str, write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At every node the heap drops, the ranked scan would have dropped the same one: the least
    recently used of the members that may leave. Shared prefixes, hits, chunked inserts, pins
    (locked nodes set aside), retention levels for a while (ranked by a scan then, while the
    setter keeps the heaps up). Rebuilt often (once pushed from the tree's setter before the
    node's own values were set, a rebuild lost a demoted node: the host tier kept it past
    newer ones)."""
    monkeypatch.setattr(lru_heap, "_SLACK", 0)
    drops, stops = check_evictions(monkeypatch, lru_heap.LruHeap)
    leaf_choices = check_leaves(monkeypatch)  # write-back: what it backs up before an eviction
    overrides = ["tiers.storage={}", f"policy.write={write}", "policy.retention.max_pinned_fraction=0.25"]
    with open_cache(stack, overrides=overrides) as cache:
        replay_requests(cache, f"{stack}/{write}")
        cache.parts.retention._levels.clear()
        _empty_tiers(cache)
        cache.tree.check()
    assert drops[0] > 20, "the requests evicted"
    assert stops[0] >= 2, "the tiers were emptied"
    assert leaf_choices[0] > 20 if write == "write_back" else not leaf_choices[0]
