"""Which nodes a write-through backup copies, and their host units, decided per batch.

A chunked request backs up its open lease in batches (``policy.write_through_batch_pages``): one
batch is a chain of small nodes, one per chunk. Asking the allocator once per node and reading
each node's units as tensors cost more than the copy itself there, so the writer plans a batch
here: the candidates in one pass over the nodes' stored units (their lengths, no tensors), then
one allocation for all of them when the free units suffice, copied per pool as it is (the nodes'
units follow each other in it). Only when they do not (eviction, or waiting for L3 writes to
release units) does it fall back to a node at a time, joined per pool afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kvstrata.core.tree import PrefixTree, TreeNode
from kvstrata.core.tree_bytes import UNIT

#: one node's host units per tree pool
Units = dict[str, torch.Tensor]
#: admits a node to the host tier (the host admission filter), or None: every node
Admit = Callable[[TreeNode], bool] | None


def backup_candidates(
    tree: PrefixTree, pools: Sequence[str], nodes: Iterable[TreeNode], *, contiguous: bool, admit: Admit
) -> tuple[list[tuple[TreeNode, dict[str, int]]], TreeNode | None]:
    """The device-only nodes of ``nodes`` to back up, root first, each with the units it needs per
    tree pool; and the node the admission filter refused (None: none). Stops at the first node
    whose parent has no backup and is not a candidate itself (``contiguous``: backups stay a
    prefix from the root) or that ``admit`` refuses."""
    index, root = tree.index, tree.root
    slots = [(name, index[name]) for name in pools]
    out: list[tuple[TreeNode, dict[str, int]]] = []
    for node in nodes:
        stored = node.device_raw
        if node.host_raw[0] is not None or stored[0] is None:
            continue  # backed up already, or no device copy to back up
        parent = node.parent
        if (
            contiguous
            and parent is not root
            and parent.host_raw[0] is None  # type: ignore[union-attr]
            and not (out and out[-1][0] is parent)  # its parent is a candidate of this batch
        ):
            break
        if admit is not None and not admit(node):
            return out, node
        out.append((node, {name: 0 if stored[p] is None else len(stored[p]) // UNIT for name, p in slots}))  # type: ignore[arg-type]
    return out, None


def joined(allocated: Sequence[Units]) -> Units:
    """Per pool, the units of a node-at-a-time allocation joined in node order (the shape one
    allocation for the whole batch has)."""
    if len(allocated) <= 1:
        return allocated[0] if allocated else {}
    return {name: torch.cat([units[name] for units in allocated]) for name in allocated[0]}


def summed(needs: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Units per pool over every node of a batch."""
    total: dict[str, int] = {}
    for node_needs in needs:
        for name, count in node_needs.items():
            total[name] = total.get(name, 0) + count
    return total


def device_units(nodes: Sequence[TreeNode], p: int) -> torch.Tensor:
    """The device units of pool ``p`` over ``nodes``, in order, as one index tensor (their stored
    bytes joined: one tensor made, not one per node)."""
    joined = bytearray().join(node.device_raw[p] or b"" for node in nodes)
    if not joined:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(joined, dtype=torch.int64)
