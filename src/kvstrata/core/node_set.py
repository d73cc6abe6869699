"""A set of tree nodes remembered across calls, swept of the ones it no longer needs as it grows.

Parts of the L3 write path remember nodes past the call that saw them -- the nodes the storage
admission filter refused (offered again at a reuse), the nodes whose last window is in L3, the
hit nodes L3 confirmed (``core/l3_touch.py``). Given the tree, a set drops a node the moment
eviction deletes it: a deleted node keeps its page keys (8 bytes per token), and the sweep
alone let each set hold up to 8192 of them (34 MiB after 1,500 short requests on 512-token
pages, 256 KiB per node of a 32k-token prompt). Nothing tells a set when a node only leaves
its host tier: it sweeps for that, once the set has doubled since the last sweep, so a call
stays O(1) however large the tree grows (sweeping at every call past a fixed bound cost
4.6-5.9 ms per insert with 20,000 live nodes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from kvstrata.core.tree_node import TreeNode

if TYPE_CHECKING:
    from kvstrata.core.tree import PrefixTree


def in_tree(node: TreeNode) -> bool:
    """Whether ``node`` is still in the tree (eviction unlinks the nodes it deletes)."""
    return node.parent is not None


def on_host(node: TreeNode) -> bool:
    """Whether a node still waits for an L3 write of its host copy: in the tree, with host units."""
    return node.parent is not None and node.host[0] is not None


class NodeSet:
    """Nodes kept while ``keep(node)`` holds; the others are dropped at the next sweep."""

    #: size of the first sweep; each later one waits for twice what the one before kept
    FIRST_SWEEP = 8192

    def __init__(self, keep: Callable[[TreeNode], bool] = in_tree, tree: PrefixTree | None = None) -> None:
        self._nodes: dict[TreeNode, None] = {}
        self._keep = keep
        self._sweep_at = self.FIRST_SWEEP
        if tree is not None:  # a deleted node goes at once (see the module docstring)
            tree.evictor.delete_listeners.append(self.discard)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self._nodes)

    def add(self, node: TreeNode) -> None:
        self._nodes[node] = None
        if len(self._nodes) > self._sweep_at:
            self._sweep()

    def update(self, nodes: Iterable[TreeNode]) -> None:
        self._nodes.update(dict.fromkeys(nodes))
        if len(self._nodes) > self._sweep_at:
            self._sweep()

    def discard(self, node: TreeNode) -> None:
        self._nodes.pop(node, None)

    def difference_update(self, nodes: Iterable[TreeNode]) -> None:
        for node in nodes:
            self._nodes.pop(node, None)

    def _sweep(self) -> None:
        keep = self._keep
        self._nodes = {node: None for node in self._nodes if keep(node)}
        self._sweep_at = max(self.FIRST_SWEEP, 2 * len(self._nodes))


class SplitFollowingSet(NodeSet):
    """A :class:`NodeSet` of nodes waiting for something (an L3 write): a node the tree cuts in
    two stays in it as both halves, each still waiting."""

    def __init__(self, tree: PrefixTree, keep: Callable[[TreeNode], bool] = in_tree) -> None:
        super().__init__(keep, tree)
        tree.on_split(self._split)

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        if lower in self:
            self.add(upper)
