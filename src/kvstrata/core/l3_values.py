"""What one L2 -> L3 write carries: per pool, the page hashes and host units of its nodes.

A node's objects are its pages' in every all-pages pool, one slot under its last page in a state
pool, and its last window in a window pool (what a restore of a prefix ending there needs, as
SGLang stores them); a sidecar follows the pool owning its units. Where no request's page hashes
came with the nodes (write-back eviction) they are rebuilt from the keys of their path.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import numpy as np

from kvstrata.core.keys import hash_pages
from kvstrata.core.stack import PoolKind, StackLayout
from kvstrata.core.tree import PrefixTree, TreeNode, tree_path
from kvstrata.core.tree_bytes import UNIT

#: A request's page hashes, computed on demand: only an L3 write needs them.
PageHashes = Callable[[], Sequence[str]]
#: per pool to write: the page hashes and, per node, its host units as the tree stores them
#: (int64 bytes: joined into one index tensor per pool, no tensor per node)
PerPool = dict[str, tuple[list[str], list[bytes]]]


def host_values_per_pool(
    tree: PrefixTree,
    layout: StackLayout,
    namespace_root: str,
    nodes: Sequence[TreeNode],
    request_hashes: Sequence[str] | None,
    stored_ends: Container[TreeNode] = (),
) -> tuple[PerPool, list[TreeNode]]:
    """Per pool to write: the page hashes and host unit indices of ``nodes`` (a state pool one
    slot per node, under its last page; a window pool the last window ending at the node, what a
    restore of a prefix ending there needs, as SGLang stores them; a sidecar follows the pool
    owning its units); and the nodes whose last window goes whole (none without window pools).
    A node shorter than a window takes the rest from its ancestors' host units, unless its
    parent's own last window is written too (in this batch, or before: ``stored_ends``), which
    holds those pages."""
    per_pool: PerPool = {}
    known: dict[TreeNode, list[str]] = {}
    batch = set(nodes)
    whole: list[TreeNode] = []

    def hashes_of(node: TreeNode) -> list[str]:
        if request_hashes is not None:
            return list(request_hashes[node.depth_start : node.depth_end])
        return node_hashes_from_path(tree, node, tree.page_size, namespace_root, known)

    for node in nodes:
        node_hashes = hashes_of(node)
        ends_whole = True
        for name, tp in layout.tree_pools.items():
            value = node.host_raw[tree.index[name]]
            if value is None:
                ends_whole &= tp.kind is not PoolKind.WINDOW
                continue
            count = len(value) // UNIT  # a paged pool's value covers the node's last pages
            if not count:
                continue
            page_hashes = node_hashes[-1:] if tp.kind is PoolKind.STATE else node_hashes[-count:]
            if tp.kind is PoolKind.WINDOW and tp.window * UNIT < len(value):
                page_hashes, value = node_hashes[-tp.window :], value[-tp.window * UNIT :]
            elif (
                tp.kind is PoolKind.WINDOW
                and len(value) < tp.window * UNIT
                and node.depth_start
                and node.parent not in batch  # else the parent's own write holds the rest
                and node.parent not in stored_ends
            ):
                head, head_hashes = _window_head(tree, node, name, tp.window - count, hashes_of)
                page_hashes, value = head_hashes + page_hashes, head + value
                ends_whole &= len(value) // UNIT >= min(tp.window, node.depth_end)
            for follower in tp.followers:
                entry = per_pool.setdefault(follower, ([], []))
                entry[0].extend(page_hashes)
                entry[1].append(value)
        if ends_whole and layout.windowed:
            whole.append(node)
    return per_pool, whole


def _window_head(
    tree: PrefixTree, node: TreeNode, name: str, pages: int, hashes_of: Callable[[TreeNode], list[str]]
) -> tuple[bytes, list[str]]:
    """Up to ``pages`` host units of window pool ``name`` of the pages just above ``node`` (the
    rest of the window ending at it), and their page hashes: its ancestors' values, nearest
    last, as far as they run without a gap (a node's value covers its last pages: one covering
    fewer than all ends the run). None where ``node``'s own value does not start at its first
    page."""
    p = tree.index[name]
    if len(node.host_raw[p] or b"") // UNIT != node.pages:
        return b"", []
    values: list[bytes] = []
    hashes: list[list[str]] = []
    for ancestor in tree.window_nodes(node, name)[1:]:  # bottom-up, above ``node``
        value = ancestor.host_raw[p]
        if value is None:
            break
        count = len(value) // UNIT
        values.append(value)
        hashes.append(hashes_of(ancestor)[-count:])
        if count < ancestor.pages:
            break
    take = min(pages, sum(len(v) for v in values) // UNIT)
    if not take:
        return b"", []
    joined = b"".join(reversed(values))
    return joined[-take * UNIT :], [h for part in reversed(hashes) for h in part][-take:]


def trailing_windows(tree: PrefixTree, layout: StackLayout, node: TreeNode, hashes: PageHashes) -> PerPool:
    """Per window pool (and its sidecars), the page hashes and host units of the last window
    ending at ``node``, where the host tier holds it whole (for a prefix end that was inside a
    node when that node was written to L3)."""
    per_pool: PerPool = {}
    for name, tp in layout.tree_pools.items():
        if tp.kind is not PoolKind.WINDOW:
            continue
        p = tree.index[name]
        nodes = tree.window_nodes(node, name)[::-1]
        if not nodes or any(n.host_raw[p] is None for n in nodes):
            continue
        value = b"".join(n.host_raw[p] for n in nodes)[-tp.window * UNIT :]  # type: ignore[misc]
        page_hashes = list(hashes()[node.depth_end - len(value) // UNIT : node.depth_end])
        for follower in tp.followers:
            per_pool[follower] = (page_hashes, [value])
    return per_pool


def node_hashes_from_path(
    tree: PrefixTree, node: TreeNode, page_size: int, namespace_root: str, known: dict[TreeNode, list[str]]
) -> list[str]:
    """Page hashes of ``node``'s pages, rebuilt from the keys of its path (token pages) when no
    request's hashes came with it (write-back eviction). ``known`` holds the nodes of this batch
    already hashed: the chain continues from the nearest of them instead of the root, so a batch
    of nested nodes hashes each page once."""
    path = tree_path(tree, node)
    start, parent = 0, namespace_root
    for index in range(len(path) - 2, -1, -1):
        if known.get(path[index]):
            start, parent = index + 1, known[path[index]][-1]
            break
    tail = path[start:]
    keys = [k for n in tail for k in n.keys]
    tokens = np.frombuffer(b"".join(keys), dtype=np.int64)
    hashes = hash_pages(tokens, page_size, parent)
    offset = 0
    for n in tail:  # every node of the walk is hashed now: remember each
        known[n] = hashes[offset : offset + n.pages]
        offset += n.pages
    return known[node]


def path_hashes(tree: PrefixTree, node: TreeNode, page_size: int, namespace_root: str) -> PageHashes:
    """The page hashes of ``node``'s whole prefix, rebuilt from its path when needed (write-back
    evicts with no request's hashes at hand)."""

    def hashes() -> list[str]:
        known: dict[TreeNode, list[str]] = {}
        node_hashes_from_path(tree, node, page_size, namespace_root, known)
        return [h for n in tree_path(tree, node) for h in known[n]]

    return hashes
