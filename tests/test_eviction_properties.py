"""Property tests for every installed eviction policy, through the real prefix tree.

A random workload of requests over a small alphabet of pages (so prefixes are shared, split and
extended) runs against a tree whose device tier holds ``capacity`` pages, as the controller runs
it: match (the access event), lock the prefix, evict what is missing, insert, then either release
the lock or keep it (a request still running). Some prefixes are pinned through the retention
hints. For every policy: a locked or pinned node never loses its pages, the tier never holds
more than its capacity, and the same workload gives the same evictions twice.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.core.lease import Lease
from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.retention import Retention, RetentionHint
from kvstrata.core.tree import LockHandle, PrefixTree, Tier, TreeNode
from kvstrata.plugins import NEVER, PluginHost, PolicyContext
from tree_stacks import PAGE, Units, kv_spec, seq

HOST = PluginHost()
POLICIES = HOST.eviction_policies.names()
CAPACITY = 12  # pages


class OpsFuture:
    """The workload's future for offline policies: the next op whose path holds a page key."""

    def __init__(self, paths: list[list[int]]) -> None:
        self.now = -1
        self.paths = [set(seq(*path)) for path in paths]

    def next_use(self, key: Hashable) -> int:
        for i in range(self.now + 1, len(self.paths)):
            if key in self.paths[i]:
                return i
        return NEVER


def request_paths() -> st.SearchStrategy[list[tuple[list[int], bool, bool]]]:
    """(page ids, keep the lock, pin) per request; ids from a small alphabet share prefixes."""
    path = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(lambda ids: [1, *ids])
    return st.lists(st.tuples(path, st.booleans(), st.booleans()), min_size=1, max_size=40)


def run_workload(policy_name: str, ops: list[tuple[list[int], bool, bool]]) -> list[tuple[Hashable, ...]]:
    """Serve ``ops``; check the invariants after every step; return what was evicted, in order."""
    tree = PrefixTree([kv_spec()])
    context = PolicyContext(tier="device", capacity_pages=CAPACITY, page_size=PAGE, page_bytes=64)
    policy = make_policy(HOST, policy_config(HOST, policy_name), context)
    future = OpsFuture([path for path, _, _ in ops])
    if policy.capabilities.needs_future:
        policy.bind_future(future)
    tree.set_eviction_order(Tier.DEVICE, policy)
    retention = Retention(tree, max_pinned_pages=CAPACITY // 3, metrics=CacheMetrics())
    tree.set_retention(retention)
    units = Units()
    held: list[LockHandle] = []
    pinned: list[Lease] = []
    evicted: list[tuple[Hashable, ...]] = []
    for index, (path, keep, pin) in enumerate(ops):
        future.now = index
        keys = seq(*path)
        match = tree.match(keys)
        lock = tree.lock(match.device_node) if match.device_pages else None
        new = len(keys) - match.device_pages
        used = tree.units("kv", Tier.DEVICE)
        if used + new > CAPACITY:
            protected = _protected(tree, held, pinned, lock)
            result = tree.evict_device({"kv": used + new - CAPACITY})
            for node in result.demoted:
                evicted.append(tuple(node.keys))
            evicted.append(("deleted", result.deleted, result.units.get("kv", 0)))
            for node, pages in protected.items():  # locked and pinned nodes kept every page
                assert node.parent is not None and node.device[0] is not None
                assert len(node.device[0]) == pages == node.pages
        tree.check()
        if tree.units("kv", Tier.DEVICE) + new <= CAPACITY and new:
            above = match.device_node if match.device_pages else None
            result = tree.insert(keys[match.device_pages :], {"kv": units.take(new)}, at=above)
            lock = tree.lock(result.node) if lock is None else tree.move_lock(lock, result.node)
            if pin:
                lease = Lease(list(keys), torch.empty(0, dtype=torch.int64), "ns", PAGE)
                lease._node = result.node
                retention.apply(lease, RetentionHint(pin=True))
                if lease.pinned:
                    pinned.append(lease)
        assert tree.units("kv", Tier.DEVICE) <= CAPACITY
        assert retention.pinned_pages <= CAPACITY // 3
        if lock is not None:
            if keep and len(held) < 2:
                held.append(lock)
            else:
                tree.unlock(lock)
        if len(pinned) > 1:
            retention.unpin(pinned.pop(0))
        tree.check()
    return evicted


def _protected(
    tree: PrefixTree, held: list[LockHandle], pinned: list[Lease], lock: LockHandle | None
) -> dict[TreeNode, int]:
    """Every node on a locked or pinned path, with its page count now."""
    ends = [h.node for h in held] + [lease._pin.lock.node for lease in pinned if lease._pin is not None]
    if lock is not None:
        ends.append(lock.node)
    out = {}
    for node in ends:
        cur: TreeNode | None = node
        while cur is not None and cur is not tree.root:
            out[cur] = cur.pages
            cur = cur.parent
    return out


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=request_paths())
def test_policy_keeps_locked_and_pinned_pages_and_the_capacity(name: str, ops: list) -> None:
    run_workload(name, ops)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=request_paths())
def test_policy_is_deterministic(name: str, ops: list) -> None:
    assert run_workload(name, ops) == run_workload(name, ops)


def test_the_workload_evicts_at_all() -> None:
    """The properties above are not vacuous: a plain workload overflows the tier."""
    ops = [([1, i, i, i], False, False) for i in range(8)]
    evicted = run_workload("lru", ops)
    assert sum(count for tag, _, count in evicted if tag == "deleted") >= 8
