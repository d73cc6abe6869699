"""Write-back's component choices kept across evictions (``core/component_index.py``).

Before every device eviction write-back chose the components to back up and the components
backed-up nodes gained by scanning every device holder of every component pool: O(tier) per
allocation (5 ms per request with 3,000 device nodes on a window stack). The index must answer
what the scans answered, node for node and in order: these tests compare it with the scans (the
code they replaced, kept here) at every call write-back makes and after every request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from heapq import heappop
from typing import Any

import pytest

from controller_support import open_cache
from kvstrata.core import lru_heap, tree_eviction
from kvstrata.core.component_index import ComponentHeap, ComponentIndex
from kvstrata.core.lru_heap import CopyHeap
from kvstrata.core.tree import LruOrder, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_node import UNIT
from test_lru_heap import check_evictions, check_leaves, replay_requests
from tree_stacks import Units, kv_spec, mamba_spec, seq, swa_spec


def scanned_backups(
    tree: PrefixTree, p: int, chosen: dict[TreeNode, None], have: int, want: int
) -> list[TreeNode]:
    """The nodes ``eviction_backups`` added for pool ``p`` by ranking every holder (the scan)."""
    candidates = [
        n
        for n in tree.holding(tree.pools[p].name, Tier.DEVICE)
        if n not in chosen and not tree.backed_up(n) and not n.device_lock[p]
    ]
    candidates.sort(key=lambda n: (n.last_access, n.id))
    added = []
    for node in candidates:
        if have >= want:
            break
        added.append(node)
        have += len(node.device_raw[p]) // UNIT  # type: ignore[arg-type]
    return added


def scanned_gained(tree: PrefixTree, pools: list[int]) -> list[TreeNode]:
    """``gained_components`` by scanning every holder of every component pool (the scan)."""
    found: dict[TreeNode, None] = {}
    for p in pools:
        for node in tree.holding(tree.pools[p].name, Tier.DEVICE):
            if node.host_raw[0] is not None and node.host_raw[p] is None and not node.device_lock[p]:
                found[node] = None
    return sorted(found, key=lambda n: n.depth_end)


def _compare_everything(tree: PrefixTree, rng: random.Random, calls: list[int]) -> None:
    """Ask the index what the scans answer now, for every component pool and a random want."""
    index = tree.components
    pools = list(index.pools)
    rng.shuffle(pools)
    assert index.gained(pools) == scanned_gained(tree, pools)
    for p in index.pools:
        held = tree.units(tree.pools[p].name, Tier.DEVICE)
        want = rng.randint(1, held + 2)
        seed = [n for n in tree.holding(tree.pools[p].name, Tier.DEVICE) if rng.random() < 0.1]
        chosen = dict.fromkeys(seed)
        have = rng.randint(0, 2)
        expected = scanned_backups(tree, p, chosen, have, want)
        index.backups(p, chosen, have, want)
        assert list(chosen)[len(seed) :] == expected
        calls[0] += 1


def _check_walks(monkeypatch: pytest.MonkeyPatch, trees: Sequence[PrefixTree] = ()) -> dict[bool, int]:
    """Check every walk of the evictor's component heaps against the scan it replaced (every
    holder that may lose the units, ranked at the walk's start); count the walks per tier
    (device: True) that yielded a node."""
    walks = {True: 0, False: 0}
    ordered = ComponentHeap.ordered

    def checked_ordered(heap: ComponentHeap, may_lose: Any, keep: bool) -> Iterator[TreeNode]:
        for tree in trees:  # (retention levels and plugin orders rank by the scan)
            tier = Tier.HOST if heap.host else Tier.DEVICE
            assert tree.evictor._level is None and type(tree.evictor.orders[tier]) is LruOrder
        members = heap.members
        expected = sorted((n for n in members if may_lose(n)), key=lambda n: (n.last_access, n.id))
        walk = ordered(heap, may_lose, keep)
        i = 0
        for node in walk:  # the scan's nodes that left the pool meanwhile: skipped by the evictor
            while i < len(expected) and expected[i] not in members:
                i += 1
            assert i < len(expected) and node is expected[i], (
                f"the heap yielded {node}, the scan {expected[i : i + 1]}"
            )
            i += 1
            walks[not heap.host] += i == 1
            yield node
        missed = [n for n in expected[i:] if n in members]
        assert not missed, f"the heap stopped with {missed[:3]} still to lose"

    monkeypatch.setattr(ComponentHeap, "ordered", checked_ordered)
    return walks


@pytest.mark.parametrize(
    ("stack", "write"),
    [
        pytest.param(stack, write, marks=() if (stack == "kv" or write == "write_back") else pytest.mark.slow)
        for stack in ("kv", "swa", "hybrid-mamba")
        for write in ("write_through", "write_back", "write_through_selective")
    ],
)
def test_the_index_chooses_what_the_scans_choose(
    stack: str, write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer write-back gets (and one after every request, under every write policy) is
    the scan's: shared prefixes, hits, chunked inserts (locked chains), pins, retention levels,
    splits leaving checkpoints, host copies dropped from device nodes (a node un-backed up is a
    candidate again). Heaps rebuilt often."""
    monkeypatch.setattr(lru_heap, "_SLACK", 0)
    trees: list[PrefixTree] = []
    asked = check_index_answers(monkeypatch, trees)
    walks = _check_walks(monkeypatch, trees)
    overrides = ["tiers.storage={}", f"policy.write={write}", "policy.retention.max_pinned_fraction=0.25"]
    if stack == "hybrid-mamba":  # fewer state slots than nodes: states are evicted on their own
        overrides += ["model.pools.mamba.device_units=4", "model.pools.mamba.host_units=6"]
    calls = [0]
    with open_cache(stack, overrides=overrides) as cache:
        trees.append(cache.tree)

        def compare(n: int, rng: random.Random) -> None:
            if n % 3 == 0 and cache.tree.components.pools:
                _compare_everything(cache.tree, rng, calls)

        replay_requests(cache, f"{stack}/{write}", compare)
        cache.tree.check()
    if cache.tree.components.pools:
        assert calls[0] > 20
    if write == "write_back" and stack != "kv":
        assert asked["backups"] > 20 and asked["found"] > 20, asked
    if stack == "hybrid-mamba":
        assert walks[True] > 5 and (walks[False] > 5 or write != "write_through"), walks


def check_index_answers(monkeypatch: pytest.MonkeyPatch, trees: list[PrefixTree]) -> dict[str, int]:
    """Check every answer write-back gets from the index (the components to back up, those
    backed-up nodes gained) against the scans, on the last tree of ``trees`` (the live cache's);
    count the answers and the nodes they named."""
    asked = {"backups": 0, "gained": 0, "found": 0}
    backups, gained = ComponentIndex.backups, ComponentIndex.gained

    def checked_backups(
        index: ComponentIndex, p: int, chosen: dict[TreeNode, None], have: int, want: int
    ) -> None:
        before = len(chosen)
        expected = scanned_backups(trees[-1], p, dict(chosen), have, want)
        backups(index, p, chosen, have, want)
        assert list(chosen)[before:] == expected
        asked["backups"] += 1
        asked["found"] += len(expected)

    def checked_gained(index: ComponentIndex, pools: Any) -> list[TreeNode]:
        found = gained(index, pools)
        assert found == scanned_gained(trees[-1], list(pools))
        asked["gained"] += 1
        asked["found"] += len(found)
        return found

    monkeypatch.setattr(ComponentIndex, "backups", checked_backups)
    monkeypatch.setattr(ComponentIndex, "gained", checked_gained)
    return asked


def check_against_scans(
    monkeypatch: pytest.MonkeyPatch, trees: list[PrefixTree]
) -> Callable[[], dict[str, int]]:
    """Every choice the kept heaps and the index make checked against the scan it replaced
    (anchor drops, host copy drops, component walks, write-back's leaves and components), on
    the last tree of ``trees``; heaps rebuilt often. Returns what counts the checks so far:
    ``drops`` (anchor nodes evictions dropped), ``copies``, ``walks``, ``leaves``, ``backups``,
    ``gained``."""
    monkeypatch.setattr(lru_heap, "_SLACK", 0)
    drops = check_evictions(monkeypatch, lru_heap.LruHeap)[0]
    copies = _check_copy_drops(monkeypatch)
    walks = _check_walks(monkeypatch, trees)
    asked = check_index_answers(monkeypatch, trees)
    leaves = check_leaves(monkeypatch)
    return lambda: {
        "drops": drops[0], "copies": copies[0], "walks": walks[True] + walks[False], "leaves": leaves[0],
        "backups": asked["backups"], "gained": asked["gained"],
    }  # fmt: skip


def test_an_eviction_backup_looks_at_the_nodes_it_takes_not_the_whole_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3,000 unbacked window holders: choosing the oldest costs a few entries, not 3,000 rankings;
    a node whose backup goes is a candidate again."""
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    nodes = [tree.insert(seq(i), {"kv": units.take(1), "swa": units.take(1)}).node for i in range(3000)]
    p = tree.index["swa"]
    tree.components.backups(p, {}, 0, 1)  # (built here, from the membership)
    popped = [0]

    def counted(heap: list[Any]) -> Any:
        popped[0] += 1
        return heappop(heap)

    monkeypatch.setattr(lru_heap, "heappop", counted)  # (pop_live pops for the index too)
    for i in range(10):
        chosen: dict[TreeNode, None] = {}
        tree.components.backups(p, chosen, 0, 2)
        assert list(chosen) == nodes[2 * i : 2 * i + 2]
        for node in chosen:
            tree.set_host_value(node, "kv", units.take(1))  # backed up: no longer a candidate
    assert popped[0] <= 40, f"{popped[0]} entries popped for 10 choices of two nodes in 3,000"
    tree.evict_host({"kv": 1})  # the oldest backed-up node's host copy goes: a candidate again
    chosen = {}
    tree.components.backups(p, chosen, 0, 1)
    assert list(chosen) == [nodes[0]]


def test_write_backs_choices_are_kept_from_their_first_ask_after_an_eviction_kept_first() -> None:
    """A host tier evicting a component before write-back first asks (an L3 prefetch filled it)
    keeps the evictor's heaps first: write-back's choices must still be built at its first ask
    (they were never built: no backup chosen, no gained component, from then on)."""
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    tree.evict_host({"swa": 1})  # the evictor's heap of host window holders is kept from here
    nodes = [tree.insert(seq(i), {"kv": units.take(1), "swa": units.take(1)}).node for i in range(4)]
    tree.set_host_value(nodes[3], "kv", units.take(1))  # backed up without its window
    chosen: dict[TreeNode, None] = {}
    tree.components.backups(1, chosen, 0, 2)
    assert list(chosen) == nodes[:2] == scanned_backups(tree, 1, {}, 0, 2)
    assert tree.components.gained([1]) == [nodes[3]] == scanned_gained(tree, [1])


def test_gained_components_keep_the_scans_order_among_equal_depths() -> None:
    """Nodes of one depth come in the order they joined the pool's holders (the scan's), not
    the order they were backed up in."""
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    assert tree.components.gained([1]) == []  # (built here: kept from now on)
    nodes = [tree.insert(seq(i), {"kv": units.take(1), "swa": units.take(1)}).node for i in range(4)]
    for node in reversed(nodes):  # backed up newest first, the window not
        tree.set_host_value(node, "kv", units.take(1))
    assert tree.components.gained([1]) == nodes == scanned_gained(tree, [1])


def test_an_eviction_that_may_delete_unbacked_nodes_finds_those_write_back_skipped() -> None:
    """Write-back's eviction skips unbacked state holders (dropped from the heap until backed
    up); the fallback that may delete them (nothing could be backed up) still finds them."""
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    nodes = [tree.insert(seq(i), {"kv": units.take(1), "mamba": units.take(1)}).node for i in range(10)]
    assert not tree.evict_device({"mamba": 2}, delete_unbacked=False).units  # nothing backed up
    assert tree.evict_device({"mamba": 2}, delete_unbacked=True).units == {"kv": 2, "mamba": 2}
    assert [n.parent is None for n in nodes] == [True, True] + [False] * 8, "the two oldest went"
    tree.check()


def test_a_state_eviction_looks_at_the_nodes_it_drops_not_the_whole_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3,000 state holders: evicting the oldest state asks about a few nodes, not 3,000."""
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    nodes = [tree.insert(seq(i), {"kv": units.take(1), "mamba": units.take(1)}).node for i in range(3000)]
    tree.evict_device({"mamba": 1})  # (built here)
    asked = [0]
    may_lose = tree_eviction._may_lose

    def counted(*args: Any) -> bool:
        asked[0] += 1
        return may_lose(*args)

    monkeypatch.setattr(tree_eviction, "_may_lose", counted)
    for _ in range(10):
        assert tree.evict_device({"mamba": 1}).units["mamba"] == 1
    assert asked[0] <= 20, f"{asked[0]} nodes asked for 10 evictions of one state in 3,000"
    assert all(n.parent is None for n in nodes[:11]) and nodes[11].parent is tree.root, "LRU: the oldest went"


def test_component_evictions_on_a_bare_tree_take_what_the_scan_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window and a state pool evicted on their own in both tiers, out of window or not,
    write-back's skipping of unbacked holders and its fallback, device and host locks (window
    heads), splits by matches, backups and host copies dropped: every walk is the scan's."""
    monkeypatch.setattr(lru_heap, "_SLACK", 0)
    walks, drops = _check_walks(monkeypatch), _check_copy_drops(monkeypatch)
    tree, units, rng = PrefixTree([kv_spec(), swa_spec(), mamba_spec()]), Units(), random.Random(7)
    locks: list[Any] = []
    for step in range(1500):
        roll = rng.random()
        base = rng.randrange(8)
        keys = seq(base, *(rng.randrange(40) for _ in range(rng.randint(0, 4))))
        if roll < 0.3:
            n = len(keys)
            tree.insert(keys, {"kv": units.take(n), "swa": units.take(n), "mamba": units.take(1)})
        elif roll < 0.4:
            tree.match(keys[: rng.randint(1, len(keys))])
        elif roll < 0.5:
            path = tree.match(keys).path
            _back_up(tree, units, [n for n in path if n.device_raw[0] is not None], rng)
        elif roll < 0.6:
            tier = rng.choice([Tier.DEVICE, Tier.HOST])
            held = tree.holding("kv", tier)
            if held:
                locks.append(tree.lock(rng.choice(held), tier))
        elif roll < 0.7 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        else:
            name = rng.choice(["swa", "mamba", "swa", "mamba", "kv"])
            want = {name: rng.randint(1, 6)}
            tree.evictor.keep_copies = rng.random() < 0.5
            if rng.random() < 0.6:
                tree.evict_device(
                    want, delete_unbacked=rng.random() < 0.4, out_of_window_only=rng.random() < 0.2
                )
            else:
                tree.evict_host(want, out_of_window_only=rng.random() < 0.2)
        if step % 50 == 49:
            tree.check()
    assert walks[True] > 50 and walks[False] > 20 and drops[0] > 20, (walks, drops)


def _back_up(tree: PrefixTree, units: Units, nodes: list[TreeNode], rng: random.Random) -> None:
    """Host copies of ``nodes`` (root first): the anchor, and each component now and then."""
    for node in nodes:
        if node.host_raw[0] is None:
            tree.set_host_value(node, "kv", units.take(node.pages))
        for name, count in (("swa", node.pages), ("mamba", 1)):
            p = tree.index[name]
            if node.device_raw[p] is not None and node.host_raw[p] is None and rng.random() < 0.7:
                tree.set_host_value(node, name, units.take(count))


def _check_copy_drops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Check every host copy the kept heap drops against the scan's choice (the droppable host
    copy of least stamp); count them."""
    return check_evictions(monkeypatch, CopyHeap)[0]


def test_a_host_copy_drop_looks_at_the_copies_it_drops_not_the_whole_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3,000 nodes on the device with host copies: dropping the oldest copy (the second host
    pass) asks about a few nodes, not 3,000; a copy whose child has one stays."""
    tree, units = PrefixTree([kv_spec()]), Units()
    nodes = [tree.insert(seq(i), {"kv": units.take(1)}).node for i in range(3000)]
    below = tree.insert(seq(0, 1), {"kv": units.take(2)}).node  # a child of the oldest
    for node in [*nodes, below]:
        tree.set_host_value(node, "kv", units.take(1))
    tree.evict_host({"kv": 1})  # (the first takes the stamps given since the entries were pushed)
    asked = [0]
    droppable = tree_eviction._copy_droppable

    def counted(node: TreeNode) -> bool:
        asked[0] += 1
        return droppable(node)

    monkeypatch.setattr(tree_eviction, "_copy_droppable", counted)
    for _ in range(10):
        assert tree.evict_host({"kv": 1}).units == {"kv": 1}
    assert asked[0] <= 40, f"{asked[0]} nodes asked for 10 drops of one copy in 3,000"
    gone = [n for n in [*nodes, below] if n.host_raw[0] is None]
    assert gone == nodes[1:12], "the oldest copies went, not the one whose child has a copy"


def test_a_node_back_on_the_device_has_its_host_copy_dropped_again() -> None:
    """A host copy whose node was host-only when the second host pass met it (dropped from the
    heap) may go once the node is loaded back to the device."""
    tree, units = PrefixTree([kv_spec()]), Units()
    old, new = (tree.insert(seq(i), {"kv": units.take(1)}).node for i in range(2))
    for node in (old, new):
        tree.set_host_value(node, "kv", units.take(1))
    assert tree.evict_device({"kv": 1}).demoted == [old]
    lock = tree.lock(old, Tier.HOST)  # the host pass cannot take it: the second pass meets it
    assert tree.evict_host({"kv": 1}).units == {"kv": 1} and new.host_raw[0] is None
    tree.unlock(lock)
    tree.set_device_value(old, "kv", units.take(1))  # loaded back
    assert tree.evict_host({"kv": 1}).units == {"kv": 1} and old.host_raw[0] is None
    tree.check()
