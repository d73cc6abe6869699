"""A node that re-enters a tier by an insert adopting it (a host-only node revived on the device
by a request that recomputed it, a device-only node given a host copy by a committed prefetch)
is told to the tier's policy when it enters, as a load-back or a backup is: a policy that first
heard of it when ranking entered it then (FIFO took it for the newest) and never saw its ghost."""

from __future__ import annotations

import pytest

from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.tree import PrefixTree, Tier, TreeNode
from kvstrata.plugins import PluginHost, PolicyContext
from tree_stacks import PAGE, Units, kv_spec, seq

HOST = PluginHost()


def tree_with(name: str, tier: Tier, capacity: int = 16) -> PrefixTree:
    tree = PrefixTree([kv_spec()])
    context = PolicyContext(tier=tier.value, capacity_pages=capacity, page_size=PAGE, page_bytes=64)
    tree.set_eviction_order(tier, make_policy(HOST, policy_config(HOST, name), context))
    return tree


def back_up(tree: PrefixTree, units: Units, node: TreeNode) -> None:
    tree.set_host_values([node], {"kv": units.take(node.pages).numpy().tobytes()})


def test_fifo_takes_a_node_revived_by_an_insert_in_the_order_it_came_back() -> None:
    tree, units = tree_with("fifo", Tier.DEVICE), Units()
    a = tree.insert(seq(1, 2), {"kv": units.take(2)}).node
    back_up(tree, units, a)
    assert tree.evict_device({"kv": 2}).demoted == [a]  # host-only now
    tree.insert(seq(1, 2), {"kv": units.take(2)})  # recomputed: back on the device, first
    b = tree.insert(seq(3, 4), {"kv": units.take(2)}).node  # then another prefix
    result = tree.evict_device({"kv": 2})
    assert a.device_raw[0] is None and b.device_raw[0] is not None, "FIFO: the first to enter leaves first"
    assert result.units["kv"] == 2


def test_fifo_takes_a_node_a_host_insert_gave_a_copy_in_the_order_it_entered_the_host() -> None:
    tree, units = tree_with("fifo", Tier.HOST), Units()
    a = tree.insert(seq(1, 2), {"kv": units.take(2)}).node
    tree.insert_host(seq(1, 2), {"kv": units.take(2)})  # a committed prefetch: a's host copy, first
    b = tree.insert(seq(3, 4), {"kv": units.take(2)}).node
    back_up(tree, units, b)  # then b's
    tree.evict_device({"kv": 4})  # both host-only now
    assert a.device_raw[0] is None and b.device_raw[0] is None
    tree.evict_host({"kv": 2})
    assert a.host_raw[0] is None and b.host_raw[0] is not None, "FIFO: the first to enter leaves first"


@pytest.mark.parametrize(("name", "main"), [("s3fifo", "_main"), ("arc", "_list"), ("reuse", "segment")])
def test_a_revived_prefix_its_policy_remembers_returns_as_a_ghost(name: str, main: str) -> None:
    tree, units = tree_with(name, Tier.DEVICE), Units()
    a = tree.insert(seq(1, 2), {"kv": units.take(2)}).node
    back_up(tree, units, a)
    tree.evict_device({"kv": 2})  # left unread: a ghost of it is remembered
    tree.insert(seq(1, 2), {"kv": units.take(2)})  # the prefix came back
    order = tree.eviction_order(Tier.DEVICE)
    state = getattr(order, main)
    assert a in state, f"{name} did not hear that {a!r} entered the device tier"
    if name == "arc":
        assert state[a] == 2, "a recency ghost's return enters T2"
    elif name == "reuse":
        assert state[a] == 1, "a probation ghost's return enters main"


def test_a_node_backed_up_one_pool_at_a_time_is_told_to_the_host_policy_with_its_anchor() -> None:
    tree, units = tree_with("fifo", Tier.HOST), Units()
    a = tree.insert(seq(1, 2), {"kv": units.take(2)}).node
    b = tree.insert(seq(3, 4), {"kv": units.take(2)}).node
    tree.set_host_value(a, "kv", units.take(2))  # a backup through the per-pool call: a first
    back_up(tree, units, b)
    assert a in tree.eviction_order(Tier.HOST)._entered  # type: ignore[attr-defined]
    tree.evict_device({"kv": 4})
    tree.evict_host({"kv": 2})
    assert a.host_raw[0] is None and b.host_raw[0] is not None, "FIFO: the first to enter leaves first"
