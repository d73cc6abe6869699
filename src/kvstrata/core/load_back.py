"""Load-back: host (L2) -> device (L1) for the part of a match that only the host tier holds.

A plan names, per tree pool, the nodes whose host units must be copied up: every page for
all-pages pools (for components, also pages above the device prefix that the component dropped),
the nodes covering the last window for window pools, and the end node's slot for state pools.
Executing a plan is all-or-nothing over pools: either every needed device unit is allocated and
filled, or nothing changes (a partial hybrid prefix is never served).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.core.metrics import Operation
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import PoolKind, unit_bytes
from kvstrata.core.transfer import settle_copies
from kvstrata.core.tree import MatchResult, Tier, TreeNode, tree_path


@dataclass(frozen=True)
class LoadBackPlan:
    """What to copy: per tree pool, the nodes (in copy order) whose host units go to the device."""

    end: TreeNode  # the last node of the host-usable prefix (locked while room is made)
    nodes: dict[str, list[TreeNode]]
    units: dict[str, int]  # device units needed per tree pool

    @property
    def empty(self) -> bool:
        return not any(self.units.values())


@dataclass(frozen=True)
class LoadBackResult:
    loaded: bool  # False: nothing to load, or the device tier could not make room
    bytes: int = 0
    device_full: bool = False  # the device tier could not make room


class LoadBack:
    """Plans and runs host -> device copies (owner thread)."""

    def __init__(self, context: PartContext) -> None:
        self.context = context
        self.pools, self.tree, self.layout = context.pools, context.tree, context.layout
        self.units, self.metrics = context.units, context.metrics

    def plan(self, match: MatchResult) -> LoadBackPlan:
        """The copies that make the host part of ``match`` usable on the device."""
        return self._plan(match.host_node)

    def _plan(self, end: TreeNode) -> LoadBackPlan:
        """The copies for the prefix ending at ``end``: read from the tree as it is now (a node
        split since is read as its two halves)."""
        path = tree_path(self.tree, end)
        wanted: dict[str, list[TreeNode]] = {}
        for tp in self.layout.tree_pools.values():
            p = self.tree.index[tp.name]
            if not path:
                candidates = []
            elif tp.kind is PoolKind.STATE:
                candidates = [end]
            elif tp.kind is PoolKind.WINDOW:
                candidates = list(reversed(self.tree.window_nodes(end, tp.name)))
            else:  # every page the device lacks (components may have dropped pages the anchor keeps)
                candidates = path
            wanted[tp.name] = [n for n in candidates if n.device[p] is None and n.host[p] is not None]
        needs = {
            name: sum(len(n.host[self.tree.index[name]]) for n in nodes)  # type: ignore[arg-type]
            for name, nodes in wanted.items()
        }
        return LoadBackPlan(end, wanted, needs)

    def run(self, plan: LoadBackPlan) -> LoadBackResult:
        """Allocate, copy and index every unit of ``plan``, or change nothing."""
        if plan.empty:
            return LoadBackResult(False)
        # making room on the device may back nodes up first (write-back), which evicts host
        # pages: the host copies being loaded must stay, so their path is host-locked meanwhile
        host_guard = self.tree.lock(plan.end, Tier.HOST)
        try:
            got = self.units.alloc_protecting(plan.end, Tier.DEVICE, plan.units)  # the nodes stay
        finally:
            self.tree.unlock(host_guard)
        if got is None:
            self.metrics.fail()
            return LoadBackResult(False, device_full=True)
        # making room may have split a planned node (a window pool's out-of-window head is
        # tombstoned on its own node): read the plan again, the units it no longer needs freed
        plan, surplus = self._plan(plan.end), got
        if any(plan.units[name] > units.shape[0] for name, units in surplus.items()):
            self.units.free(Tier.DEVICE, surplus)  # (eviction dropped a unit the copy needs: none is made)
            self.metrics.fail()
            return LoadBackResult(False, device_full=True)
        got = {name: units[: plan.units[name]] for name, units in surplus.items()}
        self.units.free(Tier.DEVICE, {name: units[plan.units[name] :] for name, units in surplus.items()})
        handles = []
        nbytes = 0
        try:
            for name, nodes in plan.nodes.items():
                if not nodes:
                    continue
                p = self.tree.index[name]
                host = torch.cat([n.host[p] for n in nodes])  # type: ignore[misc]
                handles += self.pools.host_to_device(name, host, got[name])
                nbytes += len(host) * unit_bytes(self.pools, self.layout.tree_pools[name])
            for handle in handles:
                handle.wait()
        except BaseException:  # a copy raised (or an interrupt): nothing is indexed yet, so every
            settle_copies(handles)  # unit goes back, once no copy issued still writes into it
            self.units.free(Tier.DEVICE, got)
            raise
        # anchor first, root to leaf (device prefixes stay closed), then the components
        try:
            for name, nodes in plan.nodes.items():
                p = self.tree.index[name]
                offset = 0
                for node in nodes:
                    width = len(node.host[p])  # type: ignore[arg-type]
                    self.tree.set_device_value(node, name, got[name][offset : offset + width])
                    offset += width
        except BaseException:  # the device order's hook interrupted (it hears each node come back):
            self.units.free_unowned(Tier.DEVICE, got)  # the units not indexed yet are no one's
            raise
        self.metrics.count(Operation.LOAD_BACKS)
        self.metrics.add_bytes("host_to_device", nbytes)
        return LoadBackResult(True, nbytes)
