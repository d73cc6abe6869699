"""Unit tests of the prefix tree: every operation and the hybrid (swa / mamba) semantics."""

from __future__ import annotations

from array import array

import pytest
import torch

from kvstrata.core.tree import PrefixTree, Tier, TreeError, page_keys
from tree_stacks import PAGE, Units, kv_spec, mamba_spec, nsa_spec, seq, swa_spec


def insert(tree: PrefixTree, units: Units, keys, pools=("kv",), state=True):
    values = {}
    for name in pools:
        p = tree.index[name]
        values[name] = units.take(1 if tree._state[p] else len(keys))
    result = tree.insert(keys, values)
    tree.check()
    return result, values


def backup(tree: PrefixTree, units: Units, node) -> None:
    """Give every pool on ``node`` a host copy (as a finished write-through would)."""
    for name, p in tree.index.items():
        if node.device[p] is not None:
            tree.set_host_value(node, name, units.take(len(node.device[p])))
    tree.check()


# ---------------------------------------------------------------- basics
def test_page_keys_drop_partial_page_and_accept_tensors():
    from_list = page_keys(list(range(10)), 4)
    assert len(from_list) == 2 and from_list == page_keys(torch.arange(8, dtype=torch.int32), 4)
    assert from_list[0] != from_list[1] and page_keys([0, 1, 2, 3], 4) == from_list[:1]
    assert page_keys([1, 2, 3], 4) == []
    assert page_keys(array("q", range(10)), 4) == from_list


def test_token_keys_match_through_the_tree():
    tree, units = PrefixTree([kv_spec()]), Units()
    tokens = list(range(100, 100 + 3 * PAGE + 1))
    tree.insert(tree.keys_of(tokens), {"kv": units.take(3)})
    other = tokens[: 2 * PAGE] + [7] * PAGE
    assert tree.match(tree.keys_of(torch.tensor(other))).device_pages == 2
    tree.check()


def test_tree_needs_one_anchor_and_ignores_sidecars():
    with pytest.raises(TreeError, match="exactly one anchor"):
        PrefixTree([swa_spec()])
    tree = PrefixTree([nsa_spec(), swa_spec(), kv_spec()])
    assert [s.name for s in tree.pools] == ["kv", "swa"]
    with pytest.raises(TreeError, match="'nsa' is not tracked"):
        tree.insert(seq(1), {"kv": torch.tensor([0]), "nsa": torch.tensor([0])})


def test_insert_then_match_reuses_prefix_and_reports_duplicates():
    tree, units = PrefixTree([kv_spec()]), Units()
    first, v1 = insert(tree, units, seq(1, 2, 3))
    assert first.new_pages == 3 and first.duplicates == {}
    second, v2 = insert(tree, units, seq(1, 2, 4, 5))
    assert second.new_pages == 2
    assert torch.equal(second.duplicates["kv"], v2["kv"][:2])  # pages 1, 2 were already there
    m = tree.match(seq(1, 2, 4, 5, 6))
    assert (m.pages, m.device_pages, m.host_pages) == (4, 4, 4)
    assert m.device_tokens == 4 * PAGE
    got = tree.values(m.path, "kv")
    assert torch.equal(got, torch.cat([v1["kv"][:2], v2["kv"][2:]]))
    # the first insert's tail was split off by the second insert, values split by position
    m3 = tree.match(seq(1, 2, 3))
    assert torch.equal(tree.values(m3.path, "kv"), v1["kv"])
    tree.check()


def test_insert_rejects_wrong_lengths_and_missing_anchor():
    tree = PrefixTree([kv_spec(), mamba_spec()])
    with pytest.raises(TreeError, match="holds only the first 0"):
        tree.insert(seq(1, 2), {"kv": torch.tensor([0])})  # a suffix value with nothing before it
    with pytest.raises(TreeError, match="at most 2 units"):
        tree.insert(seq(1, 2), {"kv": torch.tensor([0, 1, 2])})
    with pytest.raises(TreeError, match="expected 1 units"):
        tree.insert(seq(1, 2), {"kv": torch.tensor([0, 1]), "mamba": torch.tensor([0, 1])})
    with pytest.raises(TreeError, match="anchor"):
        tree.insert(seq(1, 2), {"mamba": torch.tensor([0])})
    tree.check()


def test_suffix_values_extend_a_cached_prefix_without_touching_it():
    tree, units = PrefixTree([kv_spec(), swa_spec(window_tokens=PAGE), mamba_spec()]), Units()
    _, first = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa", "mamba"))
    # a request that reused pages 1..3 computes pages 4..5 only, and swa only for page 5
    new_kv, new_swa, state = units.take(2), units.take(1), units.take(1)
    result = tree.insert(seq(1, 2, 3, 4, 5), {"kv": new_kv, "swa": new_swa, "mamba": state})
    tree.check()
    assert result.new_pages == 2 and result.duplicates == {}
    m = tree.match(seq(1, 2, 3, 4, 5))
    assert m.device_pages == 5
    assert torch.equal(tree.values(m.path, "kv"), torch.cat([first["kv"], new_kv]))
    assert torch.equal(m.device_state["mamba"], state)
    # page 4 got no swa value: its node is a tombstone for swa, page 5's node holds it
    assert [n.pages for n in m.path[-2:]] == [1, 1]
    assert tree.is_tombstone(m.path[-2], "swa", Tier.DEVICE)
    assert torch.equal(m.path[-1].device[tree.index["swa"]], new_swa)


def test_suffix_value_starting_inside_a_node_splits_it_and_revives_only_its_part():
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    insert(tree, units, seq(1, 2, 3, 4), pools=("kv",))  # swa tombstoned on every page
    revive = units.take(2)
    result = tree.insert(seq(1, 2, 3, 4), {"kv": units.take(4), "swa": revive})
    tree.check()
    m = tree.match(seq(1, 2, 3, 4), count_hit=False)
    assert [n.pages for n in m.path] == [2, 2]
    assert tree.is_tombstone(m.path[0], "swa", Tier.DEVICE)
    assert torch.equal(m.path[1].device[tree.index["swa"]], revive)
    assert result.duplicate_ranges == {"kv": [(0, 4)]}


def test_match_without_split_leaves_tree_untouched():
    tree, units = PrefixTree([kv_spec()]), Units()
    insert(tree, units, seq(1, 2, 3, 4))
    before = len(tree.nodes())
    m = tree.match(seq(1, 2, 9), split=False)
    assert m.pages == 0 and len(tree.nodes()) == before
    m = tree.match(seq(1, 2, 9))
    assert m.pages == 2 and len(tree.nodes()) == before + 1
    assert m.last_node.depth_end == 2
    tree.check()


def test_split_moves_state_to_deeper_node_and_tombstones_parent():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    res, values = insert(tree, units, seq(1, 2, 3), pools=("kv", "mamba"))
    upper = tree.split(res.node, 1)
    tree.check()
    assert upper.device[tree.index["mamba"]] is None
    assert tree.is_tombstone(upper, "mamba", Tier.DEVICE)
    assert torch.equal(res.node.device[tree.index["mamba"]], values["mamba"])
    assert torch.equal(upper.device[0], values["kv"][:1])
    assert torch.equal(res.node.device[0], values["kv"][1:])
    with pytest.raises(TreeError):
        tree.split(upper, 1)  # a 1-page node has no inner boundary


# ---------------------------------------------------------------- host tier
def test_evict_to_host_then_match_through_host_only_node():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, values = insert(tree, units, seq(1, 2, 3, 4))
    backup(tree, units, res.node)
    freed = []
    out = tree.evict_device({"kv": 1}, on_free=lambda pool, v: freed.append((pool, v)))
    tree.check()
    assert out.demoted == [res.node] and out.deleted == 0
    assert out.units == {"kv": 4} and torch.equal(freed[0][1], values["kv"])
    m = tree.match(seq(1, 2, 3, 4))
    assert (m.pages, m.device_pages, m.host_pages) == (4, 0, 4)
    assert m.host_node is res.node and m.device_node is tree.root
    # load-back: device units attach again
    tree.set_device_value(res.node, "kv", units.take(4))
    tree.check()
    assert tree.match(seq(1, 2, 3, 4)).device_pages == 4


def test_partial_match_splits_host_only_node():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2, 3, 4))
    backup(tree, units, res.node)
    tree.evict_device({"kv": 4})
    host_before = res.node.host[0].clone()
    m = tree.match(seq(1, 2, 7))
    tree.check()
    assert (m.pages, m.device_pages, m.host_pages) == (2, 0, 2)
    assert m.last_node.device[0] is None and torch.equal(m.last_node.host[0], host_before[:2])
    assert torch.equal(res.node.host[0], host_before[2:])


def test_not_backed_up_leaf_is_deleted_on_device_eviction():
    tree, units = PrefixTree([kv_spec()]), Units()
    insert(tree, units, seq(1, 2))
    insert(tree, units, seq(1, 3))
    tree.match(seq(1, 3))  # seq(1, 2) is now least recently used
    out = tree.evict_device({"kv": 1})
    tree.check()
    assert out.deleted == 1 and out.units == {"kv": 1}
    assert tree.match(seq(1, 2)).pages == 1
    assert tree.match(seq(1, 3)).pages == 2


def test_eviction_cascades_to_parent_and_root_stays():
    tree, units = PrefixTree([kv_spec()]), Units()
    insert(tree, units, seq(1, 2))
    insert(tree, units, seq(1, 3))
    out = tree.evict_device({"kv": 100})
    tree.check()
    assert out.units == {"kv": 3} and out.deleted == 3 and tree.nodes() == []


def test_insert_revives_host_only_node_on_device():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2))
    backup(tree, units, res.node)
    tree.evict_device({"kv": 2})
    again, values = insert(tree, units, seq(1, 2, 3))
    assert again.duplicates == {}  # the host-only node adopted the new device units
    assert torch.equal(res.node.device[0], values["kv"][:2])
    assert tree.match(seq(1, 2, 3)).device_pages == 3


def test_host_only_insert_and_host_eviction():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2))
    backup(tree, units, res.node)
    host_vals = units.take(4)
    ins = tree.insert_host(seq(1, 2, 3, 4), {"kv": host_vals})
    tree.check()
    assert ins.new_pages == 2 and torch.equal(ins.duplicates["kv"], host_vals[:2])
    m = tree.match(seq(1, 2, 3, 4))
    assert (m.device_pages, m.host_pages) == (2, 4)
    # host eviction: host-only nodes go first; copies of device-resident nodes only when that
    # is not enough (their pages stay on the device), and never under a host lock
    lock = tree.lock(m.host_node, Tier.HOST)
    assert tree.evict_host({"kv": 10}).units == {}
    tree.unlock(lock)
    out = tree.evict_host({"kv": 2})
    tree.check()
    assert out.units == {"kv": 2} and out.deleted == 1
    assert tree.match(seq(1, 2, 3, 4)).host_pages == 2
    assert tree.backed_up(res.node)
    out = tree.evict_host({"kv": 10})
    tree.check()
    assert out.units == {"kv": 2} and out.deleted == 0, "the copy went, the node stayed"
    assert tree.match(seq(1, 2)).device_pages == 2 and not tree.backed_up(res.node)


# ---------------------------------------------------------------- locks
def test_locks_prevent_eviction_and_unlock_is_exact():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2, 3))
    handle = tree.lock(res.node)
    tree.check()
    assert tree.evict_device({"kv": 10}).units == {}
    # a split under the lock keeps both halves locked; unlock releases both
    tree.match(seq(1, 9))
    tree.check()
    tree.unlock(handle)
    tree.check()
    assert all(n.device_lock[0] == 0 for n in tree.nodes())
    assert tree.evict_device({"kv": 10}).units == {"kv": 3}
    with pytest.raises(TreeError, match="unlock without lock"):
        tree.unlock(handle)


def test_window_lock_covers_only_last_window():
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    a, _ = insert(tree, units, seq(1), pools=("kv", "swa"))
    b, _ = insert(tree, units, seq(1, 2), pools=("kv", "swa"))
    c, _ = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa"))
    handle = tree.lock(c.node)
    tree.check()
    swa = tree.index["swa"]
    assert [n.device_lock[swa] for n in (a.node, b.node, c.node)] == [0, 1, 1]
    assert [n.device_lock[0] for n in (a.node, b.node, c.node)] == [1, 1, 1]
    assert tree.window_nodes(c.node, "swa") == [c.node, b.node]
    out = tree.evict_device({"swa": 10})
    tree.check()
    assert out.units == {"swa": 1} and tree.is_tombstone(a.node, "swa", Tier.DEVICE)
    tree.unlock(handle)
    tree.check()
    assert all(not any(n.device_lock) for n in tree.nodes())


def test_window_lock_survives_split_of_boundary_node():
    tree, units = PrefixTree([kv_spec(), swa_spec(3 * PAGE)]), Units()
    insert(tree, units, seq(1, 2), pools=("kv", "swa"))
    leaf, _ = insert(tree, units, seq(1, 2, 3, 4), pools=("kv", "swa"))
    handle = tree.lock(leaf.node)  # window = pages [1, 4): node [0,2) is the boundary node
    tree.match(seq(1, 9))  # split the boundary node at page 1: the upper half is outside the window
    tree.check()
    upper = tree.match(seq(1)).last_node
    swa = tree.index["swa"]
    assert upper.device_lock[swa] == 0 and upper.device_lock[0] == 1
    tree.unlock(handle)
    tree.check()
    assert all(not any(n.device_lock) for n in tree.nodes())


# ---------------------------------------------------------------- hybrid hit rules
def test_mamba_prefix_usable_only_up_to_last_state():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    _, values = insert(tree, units, seq(1, 2, 3, 4), pools=("kv", "mamba"))
    m = tree.match(seq(1, 2, 3, 4, 5))
    assert (m.pages, m.device_pages) == (4, 4)
    assert torch.equal(m.device_state["mamba"], values["mamba"])
    # a request sharing only the first 2 pages: the split point has no state -> nothing usable
    m2 = tree.match(seq(1, 2, 7))
    tree.check()
    assert (m2.pages, m2.device_pages, m2.host_pages) == (2, 0, 0) and m2.device_state == {}
    # a state at page 2 makes the shorter prefix usable
    tree.set_device_value(m2.last_node, "mamba", units.take(1))
    assert tree.match(seq(1, 2, 7)).device_pages == 2
    # inserting the kv pages 5, 6 without a state: usable prefix stays at the last state (4)
    ins, _ = insert(tree, units, seq(1, 2, 3, 4, 5, 6), pools=("kv",))
    assert tree.is_tombstone(ins.node, "mamba", Tier.DEVICE)
    m3 = tree.match(seq(1, 2, 3, 4, 5, 6))
    assert (m3.pages, m3.device_pages) == (6, 4)
    assert torch.equal(m3.device_state["mamba"], values["mamba"])


def test_mamba_state_on_host_counts_for_host_tier_only():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2), pools=("kv", "mamba"))
    backup(tree, units, res.node)
    out = tree.evict_device({"mamba": 1})
    tree.check()
    # the node is a device leaf: losing its state evicts it whole (backed up -> demoted)
    assert out.demoted == [res.node] and out.units == {"mamba": 1, "kv": 2}
    m = tree.match(seq(1, 2))
    assert (m.device_pages, m.host_pages) == (0, 2)
    assert m.host_state["mamba"][0] is Tier.HOST


def test_mamba_inner_state_eviction_tombstones():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    inner, _ = insert(tree, units, seq(1, 2), pools=("kv", "mamba"))
    leaf, _ = insert(tree, units, seq(1, 2, 3), pools=("kv", "mamba"))
    tree.match(seq(1, 2, 3))
    lock = tree.lock(leaf.node)  # locks the leaf's state only, not the inner state
    out = tree.evict_device({"mamba": 1})
    tree.check()
    assert out.tombstoned == 1 and tree.is_tombstone(inner.node, "mamba", Tier.DEVICE)
    assert tree.match(seq(1, 2)).device_pages == 0
    assert tree.match(seq(1, 2, 3)).device_pages == 3
    tree.unlock(lock)


def test_swa_window_rule_device_vs_host():
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    a, _ = insert(tree, units, seq(1, 2), pools=("kv", "swa"))
    b, _ = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa"))
    c, _ = insert(tree, units, seq(1, 2, 3, 4), pools=("kv", "swa"))
    for res in (a, b, c):
        backup(tree, units, res.node)
    # drop the device swa of the middle node (page 3): device windows ending at 3 or 4 break
    tree.match(seq(1, 2))
    tree.match(seq(1, 2, 3, 4))
    assert len(tree.drop_component(b.node, "swa", Tier.DEVICE)) == 1
    tree.check()
    m = tree.match(seq(1, 2, 3, 4))
    assert m.device_pages == 2  # window [0,2) intact on device
    assert m.host_pages == 4  # host holds page 3's swa, so the full window [2,4) is there
    # an interior tombstone outside the window does not matter
    tree.set_device_value(b.node, "swa", units.take(1))
    tree.drop_component(a.node, "swa", Tier.DEVICE)
    assert tree.match(seq(1, 2, 3, 4)).device_pages == 4
    assert tree.match(seq(1, 2, 3)).device_pages == 0  # window [1,3) needs page 2
    tree.check()


def test_insert_revives_swa_tombstone_and_returns_duplicates():
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    a, _ = insert(tree, units, seq(1, 2), pools=("kv", "swa"))
    insert(tree, units, seq(1, 2, 3), pools=("kv", "swa"))
    swa = tree.index["swa"]
    tree.drop_component(a.node, "swa", "device")
    res, values = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa"))
    tree.check()
    assert torch.equal(a.node.device[swa], values["swa"][:2])
    assert torch.equal(res.duplicates["swa"], values["swa"][2:])
    assert torch.equal(res.duplicates["kv"], values["kv"])


def test_component_eviction_priority_order():
    tree, units = PrefixTree([kv_spec(), swa_spec(PAGE), mamba_spec()]), Units()
    insert(tree, units, seq(1, 2), pools=("kv", "swa", "mamba"))
    insert(tree, units, seq(1, 2, 3), pools=("kv", "swa", "mamba"))
    # mamba (priority 0) goes first; its LRU state is the leaf's (touched before its ancestor),
    # and a device leaf without its state is useless, so the whole leaf goes, which also pays
    # for the kv and swa requests
    out = tree.evict_device({"kv": 1, "swa": 1, "mamba": 1})
    tree.check()
    assert out.units == {"mamba": 1, "kv": 1, "swa": 1} and out.deleted == 1
    assert tree.match(seq(1, 2, 3)).device_pages == 2


def test_component_eviction_tombstones_inner_state_when_leaf_locked():
    tree, units = PrefixTree([kv_spec(), swa_spec(PAGE), mamba_spec()]), Units()
    inner, _ = insert(tree, units, seq(1, 2), pools=("kv", "swa", "mamba"))
    leaf, _ = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa", "mamba"))
    handle = tree.lock(leaf.node)
    out = tree.evict_device({"kv": 1, "mamba": 1, "swa": 1})
    tree.check()
    # mamba first: the leaf is locked, so the inner state is tombstoned; swa likewise (its window
    # lock covers only the leaf); kv finds no evictable leaf
    assert out.units == {"mamba": 1, "swa": 2} and out.tombstoned == 2 and out.deleted == 0
    assert tree.is_tombstone(inner.node, "mamba", Tier.DEVICE)
    assert tree.is_tombstone(inner.node, "swa", Tier.DEVICE)
    assert tree.match(seq(1, 2, 3)).device_pages == 3
    tree.unlock(handle)


def test_set_values_validate_invariants():
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2))
    with pytest.raises(TreeError, match="already holds device"):
        tree.set_device_value(res.node, "kv", units.take(2))
    with pytest.raises(TreeError, match="before component"):
        tree.set_host_value(res.node, "swa", units.take(2))
    with pytest.raises(TreeError, match="root"):
        tree.set_host_value(tree.root, "kv", units.take(0))
    tree.check()


def _raw(*units: int) -> bytes:
    return torch.tensor(units, dtype=torch.int64).numpy().tobytes()


def test_set_host_values_records_a_batch_as_one_value_at_a_time_would():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    upper, _ = insert(tree, units, seq(1, 2), pools=("kv", "mamba"))
    lower = tree.insert(seq(1, 2, 3), {"kv": units.take(1), "mamba": units.take(1)}, at=None).node
    assert lower.parent is upper.node
    # each node takes as many host units per pool as it holds device units (2 + 1 kv, 1 + 1 mamba)
    tree.set_host_values([upper.node, lower], {"kv": _raw(10, 11, 12), "mamba": _raw(20, 21)})
    tree.check()
    assert upper.node.host[0].tolist() == [10, 11] and upper.node.host[1].tolist() == [20]
    assert lower.host[0].tolist() == [12] and lower.host[1].tolist() == [21]
    assert tree.holding("kv", Tier.HOST) == [upper.node, lower] and tree.backed_up(lower)
    assert tree.match(seq(1, 2, 3)).host_pages == 3


def test_set_host_values_leaves_a_device_tombstone_without_a_host_value():
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    upper, _ = insert(tree, units, seq(1, 2), pools=("kv", "mamba"))
    lower = tree.insert(seq(1, 2, 3), {"kv": units.take(1)}).node  # no mamba slot: a tombstone
    tree.set_host_values([upper.node, lower], {"kv": _raw(10, 11, 12), "mamba": _raw(20)})
    tree.check()
    assert upper.node.host[1].tolist() == [20] and lower.host[1] is None and lower.host[0].tolist() == [12]


@pytest.mark.parametrize(
    ("pairs", "values", "message"),
    [
        (2, {"kv": _raw(*range(4))}, "more units given"),
        (1, {"kv": _raw(1, 2, 3)}, "more units given"),
        (1, {"kv": _raw(1)}, "fewer units given"),
        (2, {"kv": _raw(1, 2, 3), "swa": _raw(1)}, "not tracked"),
    ],
)
def test_set_host_values_refuses_units_the_nodes_do_not_hold(pairs, values, message):
    tree, units = PrefixTree([kv_spec(), mamba_spec()]), Units()
    upper, _ = insert(tree, units, seq(1, 2), pools=("kv", "mamba"))
    lower = tree.insert(seq(1, 2, 3), {"kv": units.take(1)}).node
    with pytest.raises(TreeError, match=message):
        tree.set_host_values([upper.node, lower][:pairs], values)
    assert lower.host[0] is None


def test_set_host_values_refuses_a_node_gone_or_backed_up():
    tree, units = PrefixTree([kv_spec()]), Units()
    res, _ = insert(tree, units, seq(1, 2))
    with pytest.raises(TreeError, match="root"):
        tree.set_host_values([tree.root], {"kv": _raw(1, 2)})
    tree.set_host_values([res.node], {"kv": _raw(1, 2)})
    with pytest.raises(TreeError, match="already holds host"):
        tree.set_host_values([res.node], {"kv": _raw(3, 4)})
    gone = res.node
    tree.evict_host({"kv": 2})
    tree.evict_device({"kv": 2})
    assert gone.parent is None or tree.root.children.get(gone.first_key) is not gone
    with pytest.raises(TreeError, match="no longer in the tree"):
        tree.set_host_values([gone], {"kv": _raw(1, 2)})
    tree.check()


def test_drop_component_respects_locks_and_anchor():
    tree, units = PrefixTree([kv_spec(), swa_spec()]), Units()
    res, values = insert(tree, units, seq(1, 2), pools=("kv", "swa"))
    handle = tree.lock(res.node)
    with pytest.raises(TreeError, match="locked"):
        tree.drop_component(res.node, "swa", Tier.DEVICE)
    with pytest.raises(TreeError, match="evict_device"):
        tree.drop_component(res.node, "kv", Tier.DEVICE)
    tree.unlock(handle)
    assert torch.equal(tree.drop_component(res.node, "swa", Tier.DEVICE), values["swa"])
    with pytest.raises(TreeError, match="holds no device"):
        tree.drop_component(res.node, "swa", Tier.DEVICE)
    tree.check()


def test_device_eviction_can_keep_nodes_that_have_no_backup():
    tree, units = PrefixTree([kv_spec()]), Units()
    insert(tree, units, seq(1, 2))
    result, _ = insert(tree, units, seq(7, 8))
    backup(tree, units, result.node)
    kept = tree.evict_device({"kv": 4}, delete_unbacked=False)
    assert kept.units == {"kv": 2} and kept.deleted == 0 and kept.demoted == [result.node]
    assert tree.match(seq(1, 2)).device_pages == 2  # the node without a backup stayed on device
    gone = tree.evict_device({"kv": 2})
    assert gone.deleted == 1 and tree.match(seq(1, 2)).pages == 0
    tree.check()


# ---------------------------------------------------------------- hot-path bookkeeping
def test_match_and_insert_touch_the_path_deepest_first_and_count_hits():
    tree, units = PrefixTree([kv_spec()]), Units()
    insert(tree, units, seq(1, 2))
    insert(tree, units, seq(1, 2, 3))
    insert(tree, units, seq(1, 2, 3, 4))
    m = tree.match(seq(1, 2, 3, 4))
    assert len(m.path) == 3 and [n.hit_count for n in m.path] == [1, 1, 1]
    # an ancestor is never older than its descendants, so the LRU evicts leaves first
    assert m.path[0].last_access > m.path[1].last_access > m.path[2].last_access
    before = [n.last_access for n in m.path]
    again = tree.match(seq(1, 2), count_hit=False)
    assert again.path == m.path[:1] and m.path[0].hit_count == 1
    assert m.path[0].last_access > before[0] and [n.last_access for n in m.path[1:]] == before[1:]
    # an insert touches its whole path too (here: the new leaf and its existing ancestors)
    res, _ = insert(tree, units, seq(1, 2, 3, 4, 5))
    assert res.node.last_access < m.path[2].last_access < m.path[0].last_access
    assert m.path[2].last_access > before[0]
    evicted = tree.evict_device({"kv": 1})
    assert evicted.deleted == 1 and res.node.parent is None  # the leaf went first


def test_locks_of_one_branch_leave_siblings_and_split_halves_exact():
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    a, _ = insert(tree, units, seq(1, 2, 3), pools=("kv", "swa"))
    b, _ = insert(tree, units, seq(1, 2, 7), pools=("kv", "swa"))
    shared = b.node.parent
    handle = tree.lock(a.node)
    tree.check()
    assert list(b.node.device_lock) == [0, 0] and list(a.node.device_lock) == [1, 1]
    assert list(shared.device_lock) == [1, 1]  # page 2 is inside a's 2-page window
    upper = tree.split(shared, 1)  # page 1: below the window, kv-locked only
    tree.check()
    assert (
        list(upper.device_lock) == [1, 0]
        and list(shared.device_lock) == [1, 1]
        and list(b.node.device_lock) == [0, 0]
    )
    tree.unlock(handle)
    tree.check()
    assert all(list(n.device_lock) == [0, 0] and list(n.host_lock) == [0, 0] for n in tree.nodes())
    with pytest.raises(TreeError, match="unlock without lock"):
        tree.unlock(handle)
    assert all(list(n.device_lock) == [0, 0] for n in tree.nodes())


# ---------------------------------------------------------------- out-of-window window data
def test_out_of_window_window_data_is_tombstoned_first_and_every_cached_end_stays_whole():
    """Window 2 pages. Ends: a 6-page leaf, a branch after page 3 and its two leaves. Only the
    window pages outside the last window of every end go (a node split where an end needs its
    tail), counted apart, and no full KV page; a prefix ending inside a path then misses."""
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    insert(tree, units, seq(1, 2, 3, 4, 5, 6), pools=("kv", "swa"))
    insert(tree, units, seq(1, 2, 3, 7, 8), pools=("kv", "swa"))  # branches after page 3
    insert(tree, units, seq(9, 10, 11, 12, 13, 14), pools=("kv", "swa"))
    kv_before = tree.units("kv", Tier.DEVICE)
    out = tree.evict_device({"swa": 100}, out_of_window_only=True)
    tree.check()
    # page 0 (below the branch's window), page 3 (below A's), pages 0-3 of the third request
    assert out.out_of_window == {"swa": 6} and out.units == {"swa": 6} and out.deleted == 0
    assert tree.units("kv", Tier.DEVICE) == kv_before == 14 and tree.units("swa", Tier.DEVICE) == 14 - 6
    for keys, usable in (
        (seq(1, 2, 3, 4, 5, 6), 6),
        (seq(1, 2, 3, 7, 8), 5),
        (seq(1, 2, 3, 99), 3),  # the branch point: a shared prompt stays reusable
        (seq(9, 10, 11, 12, 13, 14), 6),
        (seq(9, 10, 11, 12, 99), 0),  # ends inside a path, in tombstoned window data
    ):
        assert tree.match(keys, count_hit=False).device_pages == usable, keys
    assert tree.evict_device({"swa": 1}, out_of_window_only=True).units == {}, "nothing else goes"
    more = tree.evict_device({"swa": 1})  # then the usual rules: here the oldest leaf goes whole
    assert more.out_of_window == {} and more.units["swa"] >= 1 and more.units.get("kv", 0) >= 1
    tree.check()


def test_out_of_window_window_data_leaves_the_host_tier_first_too():
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    tree.insert_host(seq(1, 2, 3, 4, 5, 6), {"kv": units.take(6), "swa": units.take(6)})
    tree.check()
    out = tree.evict_host({"swa": 3})
    tree.check()
    assert out.out_of_window == {"swa": 4} and "kv" not in out.units and out.deleted == 0
    assert tree.match(seq(1, 2, 3, 4, 5, 6), count_hit=False).host_pages == 6
    assert tree.match(seq(1, 2, 3, 99), count_hit=False).host_pages == 0


def test_a_window_pool_makes_room_after_the_anchor():
    """Both pools short: the anchor's leaf frees window units too, so nothing is tombstoned."""
    tree, units = PrefixTree([kv_spec(), swa_spec(2 * PAGE)]), Units()
    insert(tree, units, seq(1, 2, 3, 4), pools=("kv", "swa"))
    insert(tree, units, seq(5, 6, 7, 8), pools=("kv", "swa"))
    out = tree.evict_device({"kv": 4, "swa": 4})
    tree.check()
    assert out.units == {"kv": 4, "swa": 4} and out.deleted == 1 and out.out_of_window == {}
    assert out.tombstoned == 0
