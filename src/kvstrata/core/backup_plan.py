"""Which nodes a write-through backup copies, and their host units, decided per batch.

A chunked request backs up its open lease in batches (``policy.write_through_batch_pages``): one
batch is a chain of small nodes, one per chunk. Asking the allocator once per node and reading
each node's units as tensors cost more than the copy itself there, so the writer plans a batch
here: the candidates in one pass over the nodes, their device units joined per pool (a backup
copies them: their count is what the batch needs), then one allocation for all of them when the
free units suffice, copied per pool as it is (the nodes' units follow each other in it). Only
when they do not (eviction, or waiting for L3 writes to release units) does it fall back to a
node at a time, joined per pool afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kvstrata.core.tree import PrefixTree, TreeNode
from kvstrata.core.tree_bytes import UNIT

#: one node's host units per tree pool
Units = dict[str, torch.Tensor]
#: units per tree pool as int64 bytes (as the tree stores them)
Raw = dict[str, bytes]
#: admits a node to the host tier (the host admission filter), or None: every node
Admit = Callable[[TreeNode], bool] | None


def backup_candidates(
    tree: PrefixTree, nodes: Iterable[TreeNode], *, contiguous: bool, admit: Admit
) -> tuple[list[TreeNode], int]:
    """The device-only nodes of ``nodes`` to back up, root first; and the pages the admission
    filter refused (0: none): the refused node's and those of the device-only nodes after it,
    which wait for it (counted as the storage filter counts a node below one it refuses).
    Stops at the first node whose parent has no backup and is not a candidate itself
    (``contiguous``: backups stay a prefix from the root) or that ``admit`` refuses. A node's
    backup copies its device units: their count per pool is what it needs."""
    root = tree.root
    out: list[TreeNode] = []
    nodes = list(nodes)
    for i, node in enumerate(nodes):
        if node.host_raw[0] is not None or node.device_raw[0] is None:
            continue  # backed up already, or no device copy to back up
        parent = node.parent
        if (
            contiguous
            and parent is not root
            and parent.host_raw[0] is None  # type: ignore[union-attr]
            and not (out and out[-1] is parent)  # its parent is a candidate of this batch
        ):
            break
        if admit is not None and not admit(node):
            return out, sum(
                n.pages for n in nodes[i:] if n.host_raw[0] is None and n.device_raw[0] is not None
            )
        out.append(node)
    return out, 0


def device_units(nodes: Sequence[TreeNode], index: Mapping[str, int]) -> Raw:
    """Per tree pool of ``index``, the device units of ``nodes`` in order as int64 bytes (their
    stored bytes joined: what the copy and the tree both take, no tensor per pool or node)."""
    return {name: b"".join([node.device_raw[p] or b"" for node in nodes]) for name, p in index.items()}


def unit_counts(node: TreeNode, index: Mapping[str, int]) -> dict[str, int]:
    """Units per tree pool one node's backup needs (its device units)."""
    return {name: len(node.device_raw[p] or b"") // UNIT for name, p in index.items()}


def joined(allocated: Sequence[Units]) -> Raw:
    """Per pool, the units of a node-at-a-time allocation joined in node order as int64 bytes
    (what one allocation for the whole batch gives)."""
    if not allocated:
        return {}
    return {name: b"".join([units[name].numpy().tobytes() for units in allocated]) for name in allocated[0]}
