"""A stateful policy's own bookkeeping follows the tree: through a real cache (splits, demotions,
host evictions), its per-node dicts hold only nodes of its tier, with their page counts, and its
ghosts stay within their bounds; a split node keeps its place in the policy's queues."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from controller_support import open_cache, serve, tokens
from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.tree import Tier, TreeNode
from kvstrata.eviction_policies._ghosts import ghost_key
from kvstrata.plugins import PluginHost, PolicyContext
from kvstrata.replay.simulate import HitRateSimulator
from kvstrata.replay.trace import TraceRequest

HOST = PluginHost()
POLICIES = HOST.eviction_policies
STATEFUL = [name for name in POLICIES.names() if POLICIES.get(name).capabilities.events]


def tracked(policy: Any) -> dict[str, list[TreeNode]]:
    """Every dict, set or queue of the policy keyed by tree nodes."""
    out = {}
    for name, value in vars(policy).items():
        keys = list(value) if isinstance(value, dict | set) else None
        if keys is None and isinstance(getattr(value, "_next", None), dict):  # s3fifo's CLOCK
            keys = [node for node in value._next if node is not None]
        if keys and isinstance(keys[0], TreeNode):
            out[name] = keys
    return out


def check_policy(policy: Any, alive: set[TreeNode]) -> None:
    for name, keys in tracked(policy).items():
        assert set(keys) <= alive, f"{type(policy).__name__}.{name} holds nodes that left the tier"
    for sizes in (getattr(policy, "_size", None), getattr(policy, "size", None)):
        if isinstance(sizes, dict):
            assert all(node.pages == pages for node, pages in sizes.items()), "a node's pages went stale"
    if hasattr(policy, "b1"):  # arc: T1/T2 sums and the directory bounds of the paper
        c, lists = policy.capacity, policy._list
        t1 = sum(p for node, p in policy._size.items() if lists[node] == 1)
        t2 = sum(p for node, p in policy._size.items() if lists[node] == 2)
        assert [t1, t2] == policy.sizes[1:]
        assert t1 + policy.b1.pages <= c, "|T1| + |B1| > c"
        assert t1 + t2 + policy.b1.pages + policy.b2.pages <= 2 * c, "|T1| + |T2| + |B1| + |B2| > 2c"
    if hasattr(policy, "small_pages"):  # s3fifo
        queues = policy._queue
        assert policy.small_pages == sum(p for node, p in policy._size.items() if queues[node] == 0)
        assert len(policy._main) == sum(1 for q in queues.values() if q == 1)
        assert policy.ghosts.pages <= policy.capacity
    if hasattr(policy, "segment"):  # reuse
        sizes, segments = policy.size, policy.segment
        assert policy.pages == [sum(p for n, p in sizes.items() if segments[n] == s) for s in (0, 1)]
        assert all(g.pages <= g.limit for g in policy.ghosts)


@pytest.mark.parametrize("name", STATEFUL)
def test_policy_state_follows_the_tree_through_a_cache(name: str) -> None:
    """Shared documents cut at random pages (splits) with random tails, through a device tier of
    16 pages and a host tier of 24 (demotions, host evictions, load-backs)."""
    rng = random.Random(3)
    overrides = ["tiers.device.capacity_tokens=1024", "tiers.host.capacity_tokens=1536"]
    with open_cache("kv", None, [*overrides, f"policy.eviction={name}"]) as cache:
        page = cache.page_size
        docs = [tokens(100 + i, 8, page) for i in range(6)]
        for _ in range(60):
            head = docs[rng.randrange(len(docs))][: rng.randint(1, 8) * page]
            serve(cache, torch.cat([head, tokens(rng.randrange(40), rng.randint(0, 3), page)]))
            nodes = cache.tree.nodes()
            on_device = {n for n in nodes if n.device_raw[0] is not None}
            on_host = {n for n in nodes if n.host_raw[0] is not None}
            check_policy(cache.tree.eviction_order(Tier.DEVICE), on_device)
            check_policy(cache.tree.eviction_order(Tier.HOST), on_host)


def test_s3fifo_split_upper_half_takes_its_place_in_the_clock() -> None:
    """Room for 4 pages, a small queue of 2. (1, 2) and then 3 enter the main queue, 3 banks two
    reads; (1, 9) splits (1, 2): the new (1) holds the first pages of (1, 2), so it takes its
    place at the head of the CLOCK (and banks the split request's read). The miss on 7 evicts
    (2): the hand passes (1), which cannot leave (9 is below it), spending its read. The miss on
    12 then passes 3 (a read spent) and evicts (1), read no more. Appended at the back instead,
    (1) was never passed, kept its read, and the fresh 7 left in its place."""
    context = PolicyContext(tier="device", capacity_pages=4, page_size=1)
    s3fifo = make_policy(HOST, policy_config(HOST, {"type": "s3fifo", "small_fraction": 0.5}), context)
    cache = HitRateSimulator(1, 4, s3fifo)
    for ids in [(1, 2), (1, 2), (3,), (3,), (3,), (3,), (1, 9), (7,), (8,), (7,), (12,)]:
        cache.access(TraceRequest(0.0, len(ids), 1, ids))
    held = {x for x in (1, 3, 7, 8, 12) if cache.lookup(TraceRequest(0.0, 1, 1, (x,)))}
    assert held == {3, 7, 8, 12}


@pytest.mark.parametrize("name", ["arc", "reuse"])
def test_a_prefix_loaded_back_from_the_host_tier_is_a_ghost_return(name: str) -> None:
    """Device tier of 4 pages over a host tier: A (2 pages) leaves the device for the host when C
    comes (B, read twice, stays), a ghost of A stays in the device policy, and a request for A
    loads it back. That is ARC's ghost hit (A enters T2, the target grows) and ``reuse``'s (A
    enters main). The tree told policies only of inserts, so a loaded-back A ranked as new (T1,
    probation) with its ghost still remembered beside it: on a device tier over a host tier,
    where a prefix that comes back is loaded rather than computed again, no ghost ever returned."""
    overrides = ["tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=1024"]
    with open_cache("kv", None, [*overrides, f"policy.eviction={name}"]) as cache:
        policy = cache.tree.eviction_order(Tier.DEVICE)
        a, b, c = (tokens(seed, 2, cache.page_size) for seed in (1, 2, 3))
        for prompt in (a, b, b, c):
            serve(cache, prompt)
        (gone,) = [node for node in cache.tree.nodes() if node.device_raw[0] is None]
        assert gone.host_raw[0] is not None and ghost_key(gone) in (
            policy.b1 if name == "arc" else policy.ghosts[0]
        )
        host = cache.tree.eviction_order(Tier.HOST)  # and the host tier's heard of the backup
        assert gone in (host._list if name == "arc" else host.segment)
        lease, bad = serve(cache, a)
        assert lease.cached_pages == 2 and bad == 0 and gone.device_raw[0] is not None
        if name == "arc":
            assert policy._list[gone] == 2 and policy.target == 2 and ghost_key(gone) not in policy.b1
        else:
            assert policy.segment[gone] == 1 and ghost_key(gone) not in policy.ghosts[0]


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_write_back_evicts_by_the_policy_not_by_recency(write: str) -> None:
    """Device tier of 4 pages: A, then B, then A read again; C needs room. ``fifo`` evicts A
    (first in) under either write policy. Write-back backs up, before evicting, the nodes the
    eviction will take, and chose them by recency under every policy: only B was backed up, so
    only B could leave (the policy's order was ignored)."""
    overrides = ["tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=1024"]
    with open_cache("kv", None, [*overrides, "policy.eviction=fifo", f"policy.write={write}"]) as cache:
        a, b, c = (tokens(seed, 2, cache.page_size) for seed in (1, 2, 3))
        for prompt in (a, b, a, c):
            serve(cache, prompt)
        heads = {name: cache.tree.root.children[cache.tree.keys_of(t)[0]] for name, t in (("a", a), ("b", b))}
        assert heads["a"].device_raw[0] is None and heads["b"].device_raw[0] is not None


class _Entry:
    """A one-page entry as a policy reads it (hashed by identity, as tree nodes are)."""

    def __init__(self, node_id: int, hits: int, stamp: int) -> None:
        self.id, self.hit_count, self.last_access = node_id, hits, stamp
        self.pages, self.keys, self.depth_end = 1, [(node_id,)], 1


def _entry(node_id: int, hits: int, stamp: int) -> _Entry:
    return _Entry(node_id, hits, stamp)


@pytest.mark.parametrize("hits", [1, 600, 100_000])
def test_lfu_ties_go_to_the_least_recent_at_any_hit_count(hits: int) -> None:
    """Float ranks (hits x 2^44 + stamp) lost the stamp's low bits past 2^53: at 600 hits,
    stamps 11 and 12 ranked equal and the node id (the older node) decided."""
    lfu = make_policy(
        HOST, policy_config(HOST, "lfu"), PolicyContext(tier="device", capacity_pages=8, page_size=1)
    )
    older_but_recent, newer_but_stale = _entry(1, hits, 12), _entry(2, hits, 11)
    ranks = sorted(lfu.ranked([older_but_recent, newer_but_stale]))  # type: ignore[list-item]
    assert ranks[0][2] is newer_but_stale


def test_s3fifo_ranks_stay_exact_at_the_highest_read_level() -> None:
    """``max_reads`` 15, the small queue under its share (main goes first): a small-queue leaf
    ranks at level 16, and 16 x 2^50 as a float has a spacing of 4, so the small queue's FIFO
    order was lost among 4 consecutive entries (the node ids decided)."""
    context = PolicyContext(tier="device", capacity_pages=8, page_size=1)
    s3fifo = make_policy(
        HOST, policy_config(HOST, {"type": "s3fifo", "max_reads": 15, "small_fraction": 0.9}), context
    )
    main = _entry(9, 0, 0)
    s3fifo.inserted([main])  # type: ignore[list-item]
    s3fifo.accessed([main])  # type: ignore[list-item]  # into the main queue: main goes first now
    small = [_entry(i, 0, 0) for i in (1, 2, 3)]
    s3fifo.inserted(list(reversed(small)))  # type: ignore[arg-type]  # 3 entered first
    order = [entry[2].id for entry in sorted(s3fifo.ranked([*small, main]))]  # type: ignore[list-item]
    assert order == [9, 3, 2, 1]


@pytest.mark.parametrize(("main", "returning", "target"), [(4, 1, 10 + 4 / 2), (2, 5, 10 - 4 / 2)])
def test_reuse_adapts_its_target_by_ghost_pages_counting_the_returning_prefix(
    main: int, returning: int, target: float
) -> None:
    """Six one-page prefixes leave a 100-page tier (target 10), the last ``main`` of them from
    main. A return from the probation ghost grows the target by |main ghost| / |probation
    ghost|, one from the main ghost shrinks it by the inverse (at least a page each): ARC's
    delta, with the returning prefix still in its ghost. Counted after taking it out, 4 / 2
    was 4 / 1 and the target moved twice as far."""
    context = PolicyContext(tier="device", capacity_pages=100, page_size=1)
    reuse = make_policy(HOST, policy_config(HOST, "reuse"), context)
    entries = [_entry(i, 0, 0) for i in range(1, 7)]
    reuse.inserted(entries)  # type: ignore[arg-type]
    reuse.accessed(entries[6 - main :])  # type: ignore[arg-type]  # into main
    reuse.removed(entries)  # type: ignore[arg-type]
    assert reuse.target == 10
    reuse.inserted([_entry(returning, 0, 0)])  # type: ignore[list-item]
    assert reuse.target == target
