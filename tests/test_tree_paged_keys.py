"""Page keys held as one ``PagedKeys`` per sequence: the sequence behaviour callers rely on, and
trees built from them agreeing with trees built from plain lists of page keys (and mixed trees).

The walk compares ``PagedKeys`` edges with ``startswith`` at byte offsets and finds where an edge
differs by binary search; a list edge is compared page by page. A random workload with a small
alphabet (many splits, matches ending inside edges, keys ending inside edges) must give the same
match lengths and the same node boundaries either way, at page sizes 1 and 3.
"""

from __future__ import annotations

import pickle
import random
from array import array

import pytest
import torch

from kvstrata.core.tree import PagedKeys, PrefixTree, Tier, page_keys
from kvstrata.plugins.pool_type import ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType


def tree_of(page: int) -> PrefixTree:
    spec = KVPoolType("kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=page)).spec()
    return PrefixTree([spec])


def test_paged_keys_is_a_sequence_of_page_keys() -> None:
    keys = page_keys(array("q", range(10)), 3)
    assert isinstance(keys, PagedKeys) and len(keys) == 3
    pages = [array("q", range(i, i + 3)).tobytes() for i in (0, 3, 6)]
    assert list(keys) == pages and keys == pages and pages == keys
    assert keys[0] == pages[0] and keys[-1] == pages[2] and keys[1:] == pages[1:]
    assert isinstance(keys[1:], PagedKeys) and len(keys[1:]) == 2 and keys[5:] == []
    assert keys[::2] == [pages[0], pages[2]]
    with pytest.raises(IndexError):
        keys[3]
    assert b"".join(keys) == keys.tokens() == array("q", range(9)).tobytes()
    assert keys != page_keys(array("q", range(9)), 1)  # same bytes, other page size
    assert keys[:2] + keys[2:] == keys
    assert "3 pages of 3 tokens" in repr(keys)
    copy = pickle.loads(pickle.dumps(keys))
    assert copy == keys and type(copy) is type(keys)


def test_page_keys_from_lists_arrays_and_tensors_agree() -> None:
    tokens = [5, 1, 4, 1, 5, 9, 2]
    want = page_keys(tokens, 2)
    assert page_keys(array("q", tokens), 2) == want == page_keys(torch.tensor(tokens, dtype=torch.int32), 2)
    assert len(want) == 3 and page_keys(tokens[:1], 2) == []


def _run(page: int, seed: int, representation: str) -> list[tuple[int, int, int]]:
    """Random inserts and matches; returns every match's (pages, device pages, host pages)."""
    rng = random.Random(seed)
    tree = tree_of(page)
    roots = [[rng.randrange(3) for _ in range(rng.randrange(1, 6) * page)] for _ in range(3)]
    out = []
    for step in range(120):
        tokens = list(rng.choice(roots))
        tokens += [rng.randrange(3) for _ in range(rng.randrange(0, 8) * page + rng.randrange(page))]
        keys = page_keys(tokens, page)
        if representation == "list" or (representation == "mixed" and step % 2):
            keys = list(keys)
        if not len(keys):
            continue
        if rng.random() < 0.5:
            tree.insert(keys, {"kv": torch.arange(len(keys))})
        else:
            result = tree.match(keys, split=rng.random() < 0.7)
            out.append((result.pages, result.device_pages, result.host_pages))
        if rng.random() < 0.1:
            tree.evict_device({"kv": rng.randrange(1, 6)})
        tree.check()
    bounds = sorted((n.depth_start, n.depth_end, n.keys[0]) for n in tree.nodes())
    out.append((len(bounds), sum(e - s for s, e, _ in bounds), hash(tuple(bounds))))
    return out


@pytest.mark.parametrize("page", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_paged_keys_list_keys_and_mixed_trees_agree(page: int, seed: int) -> None:
    paged = _run(page, seed, "paged")
    assert paged == _run(page, seed, "list") == _run(page, seed, "mixed")


def test_demoting_many_siblings_keeps_child_counts() -> None:
    """Every leaf under one parent demoted in one eviction: the O(1) per-tier child counts the
    eviction reads stay equal to a scan of the children (``check``), and the parent goes last."""
    tree = tree_of(1)
    shared = [7, 7, 7]
    for i in range(50):
        keys = tree.keys_of([*shared, 100 + i, 200 + i])
        tree.insert(keys, {"kv": torch.arange(len(keys))})
    for node in tree.nodes():
        tree.set_host_value(node, "kv", torch.arange(node.pages))
    parent = tree.match(tree.keys_of(shared)).last_node
    assert parent.device_children == 50 and parent.host_children == 50
    result = tree.evict_device({"kv": 100})
    tree.check()
    assert len(result.demoted) == 50 and parent.device_children == 0 and parent.host_children == 50
    assert parent.device[0] is not None  # 100 units: the leaves' pages, not the parent's
    tree.evict_device({"kv": 3})
    tree.check()
    assert parent.device[0] is None and len(tree.holding("kv", Tier.DEVICE)) == 0
