"""A request that keeps its place in the tree: insert below a node and move its lock down.

Both must give exactly what the from-the-root operations give (same nodes, same values, same
lock counts), while touching only the new part of the path.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.tree import PrefixTree, Tier, TreeError
from tree_stacks import Units, kv_spec, mamba_spec, seq, swa_spec

STACKS = {
    "kv": lambda: [kv_spec()],
    "kv+swa": lambda: [kv_spec(), swa_spec()],
    "kv+mamba": lambda: [kv_spec(), mamba_spec()],
    "kv+swa+mamba": lambda: [kv_spec(), swa_spec(), mamba_spec()],
}


def _values(tree: PrefixTree, units: Units, pages: int) -> dict:
    return {spec.name: units.take(1 if tree._state[tree.index[spec.name]] else pages) for spec in tree.pools}


def _shape(tree: PrefixTree) -> list[tuple]:
    """Every node's span, values and lock counts: what must not differ between the two ways."""
    out = []
    for node in sorted(tree.nodes(), key=lambda n: (n.depth_end, n.keys)):
        values = tuple(None if v is None else tuple(v.tolist()) for v in node.device)
        windows = {p: sorted(b) for p, b in (node.device_windows or {}).items()}
        out.append((node.depth_start, node.depth_end, tuple(node.keys), values, node.device_lock, windows))
    return out


@settings(max_examples=40, deadline=None)
@given(
    stack=st.sampled_from(sorted(STACKS)),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    shared=st.integers(0, 5),
)
def test_chunked_insert_below_a_node_equals_inserting_from_the_root(stack, chunks, shared) -> None:
    specs = STACKS[stack]
    pages = sum(chunks)
    keys = seq(*range(1, pages + 1))
    trees = []
    for below in (False, True):
        tree, units = PrefixTree(specs()), Units()
        other = keys[: min(shared, pages)] + seq(99)  # another request shares a prefix
        tree.insert(other, _values(tree, units, len(other)))
        node, lock, done = tree.root, None, 0
        for size in chunks:
            part = keys[done : done + size]
            values = _values(tree, units, size)
            if below:
                result = tree.insert(part, values, at=node)
                lock = (
                    tree.lock(result.node, Tier.DEVICE) if lock is None else tree.move_lock(lock, result.node)
                )
            else:
                full = tree.insert(keys[: done + size], values)
                result = full
                if lock is not None:
                    tree.unlock(lock)
                lock = tree.lock(result.node, Tier.DEVICE)
            tree.check()
            node, done = result.node, done + size
            assert node.depth_end == done
        trees.append(_shape(tree))
    assert trees[0] == trees[1]


def test_a_lock_moves_only_down() -> None:
    tree, units = PrefixTree([kv_spec()]), Units()
    first = tree.insert(seq(1, 2), _values(tree, units, 2)).node
    second = tree.insert(seq(1, 2, 3), {"kv": units.take(1)}).node
    lock = tree.lock(second, Tier.DEVICE)
    try:
        tree.move_lock(lock, first)
    except TreeError as exc:
        assert "not below" in str(exc)
    else:
        raise AssertionError("moving a lock up must fail")
    tree.unlock(lock)
    tree.check()
    assert all(not any(n.device_lock) for n in tree.nodes())
