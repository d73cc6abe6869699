"""Write-through of a component a node gained after its backup.

A backup is decided on a node's anchor: once its pages are on the host, the node counts as
backed up. A component can join such a node later: a request whose chunk ends inside another
request's node splits it, and its state checkpoint -- or window data the first request did not
keep -- lands in the upper half, whose anchor went to the host with the first request. That
component stayed on the device only, and once it left, the prefix ending there was lost to the
host tier and to L3 (audit 29: a Mamba checkpoint at a shared prefix's end, 0 of 3 pages from
L3). Here such components are copied down and written to L3 on their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.core.l3_values import PerPool
from kvstrata.core.metrics import Operation
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import PoolKind, StackLayout, unit_bytes
from kvstrata.core.tree import Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT, unit_tensor


def unbacked_components(context: PartContext, nodes: Sequence[TreeNode]) -> list[tuple[TreeNode, str]]:
    """``(node, pool)`` for each component of ``nodes`` held whole on the device and not on the
    host, where the node's anchor is on the host (a node not backed up at all is the ordinary
    backup's)."""
    found: list[tuple[TreeNode, str]] = []
    index = context.tree.index
    components = [(name, index[name], tp.kind) for name, tp in context.layout.tree_pools.items()][1:]
    for node in nodes:  # (the anchor is the first tree pool: never a component)
        host = node.host_raw
        if host[0] is None or node.parent is None:
            continue
        device = node.device_raw
        for name, p, kind in components:
            value = device[p]
            if value is None or host[p] is not None:
                continue
            if len(value) == (UNIT if kind is PoolKind.STATE else node.pages * UNIT):
                found.append((node, name))  # (a window value over part of the node: not whole)
    return found


def copy_components(context: PartContext, nodes: Sequence[TreeNode]) -> tuple[list[TreeNode], set[str]]:
    """Copy each unbacked component of ``nodes`` to the host (evicting where needed, the node's
    path kept); returns the nodes that gained a host copy and the pools copied (for their L3
    write: :func:`only_pools`)."""
    found = unbacked_components(context, nodes) if context.pools.host_enabled else []
    copied: list[TreeNode] = []
    names: set[str] = set()
    nbytes = 0
    for node, name in found:
        device = node.device_raw[context.tree.index[name]]
        assert device is not None
        count = len(device) // UNIT
        got = context.units.alloc_protecting(node, Tier.HOST, {name: count})
        if got is None:  # the host tier is full of pages other requests hold
            context.metrics.count(Operation.BACKUPS_SKIPPED)
            continue
        host = got[name]
        for handle in context.pools.device_to_host(name, unit_tensor(device), host):
            handle.wait()
        context.tree.set_host_value(node, name, host.numpy().tobytes())
        nbytes += count * unit_bytes(context.pools, context.layout.tree_pools[name])
        if not copied or copied[-1] is not node:
            copied.append(node)
        names.add(name)
    if nbytes:
        context.metrics.add_bytes("device_to_host", nbytes)
    return copied, names


def only_pools(per_pool: PerPool, layout: StackLayout, names: set[str]) -> PerPool:
    """The objects of ``per_pool`` (an L3 write of whole nodes) of the pools ``names`` and the
    sidecars following them: the rest of those nodes is in L3 already."""
    followers = {follower for name in names for follower in layout.tree_pools[name].followers}
    return {name: entry for name, entry in per_pool.items() if name in followers}
