"""Write-back's backups ahead of a device eviction, in rounds where the host tier has fewer
state slots than the eviction's checkpoints.

An eviction of a chunked prompt's nodes backs up a checkpoint per node. With few host state
slots (``model.pools.<mamba>.host_units: 3``) the batch took what was free and skipped the rest:
the host keeps a node's state copy while the device holds the node (the drop pass of
:mod:`kvstrata.core.state_copies` does not run while write-back backs up, whose other nodes'
copies let them leave), and the copies the batch had just taken were not in the tree yet. The
device then dropped the skipped nodes unbacked: checkpoints 5-8 of 8 reached neither the host
tier nor L3. With an L3, the backups now go in rounds: each round is written, and once L3 has
stored it the state copies of its shallowest nodes, which stay on the device until this
eviction drops them, give their host slots to the next round (L3 holds them; the last round's,
the deepest checkpoints, stay on the host). Without an L3 the rounds go on as well, but a
state copy goes to a deeper round only from an ancestor of that round's nodes (:func:`_above`):
a host node with pages and no state is the middle of a longer prefix ending at a deeper
checkpoint (the state pool's hit rule), so the path's deepest checkpoints keep the slots and the
whole prefix restores from the host. Taken root first as one batch, nodes 1-3 of an 8-page
prompt chunked page by page took the 3 slots and nodes 4-8 were dropped unbacked (3 of 8 pages
restored, 28 of 32 host page units free). A shorter prefix ending at a shallow node loses its
checkpoint instead. Candidates above a checkpoint the host tier already holds go there without
their states where the free slots fall short (:func:`_back_up_pages`): a slot allocated for
them came from host eviction, oldest first, which took that deeper checkpoint of their path.
Before any of that, the device-only prefixes of nodes waiting on the host for their prefix's
L3 write get the free host room and are written (:func:`_write_waiting`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from kvstrata.core.backup_plan import Raw, Units, device_units, joined, unit_counts
from kvstrata.core.component_backup import EndWriter, back_up_gained, unbacked_components
from kvstrata.core.config import PolicyConfig
from kvstrata.core.l3_values import PageHashes
from kvstrata.core.metrics import CacheMetrics, Operation
from kvstrata.core.stack import PoolKind
from kvstrata.core.tier_units import TierUnits
from kvstrata.core.tree import PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT, unit_tensor
from kvstrata.core.write_back import (
    PendingWrite,
    PrefixWaits,
    device_only_ancestors,
    eviction_backups,
    gained_components,
    wait_writes,
)


class Writer(EndWriter, Protocol):
    """What the rounds use of :class:`~kvstrata.core.writer.Writer` (which imports them)."""

    units: TierUnits
    metrics: CacheMetrics
    policy: PolicyConfig
    pending: deque[PendingWrite]
    waits: PrefixWaits
    room_deadline: float | None

    def _copy_round(
        self, nodes: Iterable[TreeNode], admit: bool, *, rounds: bool = False
    ) -> tuple[list[TreeNode], list[TreeNode] | None]: ...

    def copy_to_host(self, nodes: Iterable[TreeNode], *, admit: bool = False) -> list[TreeNode]: ...

    def _copy_down(self, nodes: Sequence[TreeNode], devices: Raw, hosts: Raw) -> None: ...

    def _queue_write(
        self, nodes: Sequence[TreeNode], hashes: PageHashes | None, *, admitted: bool | None = False
    ) -> None: ...

    def drain(self) -> bool: ...


def back_up_for_eviction(writer: Writer, shortfall: Mapping[str, int]) -> None:
    """See :meth:`~kvstrata.core.writer.Writer.back_up_for_eviction`; in rounds (module docstring)."""
    with writer.units.keeping_copies():  # the other device pages' host copies let them leave
        if writer.engine is not None and writer.waits:
            _write_waiting(writer)  # (before this eviction's candidates take the free room)
        rest: list[TreeNode] | None = eviction_backups(writer.tree, writer.layout, shortfall)
        handed: set[TreeNode] = set()  # state copies given to a later round
        last: PendingWrite | None = None  # this eviction's last write
        copied: list[TreeNode] = []  # (without an L3: this eviction's backups so far)
        if writer.engine is None and rest:  # the deeper checkpoints the host holds stay there
            stood, rest = _back_up_pages(writer, rest)
            handed.update(stood)
        while rest:
            nodes, rest = writer._copy_round(rest, False, rounds=True)
            if not nodes:
                break
            if writer.engine is None:  # no L3: a deeper checkpoint on the path stands for it
                copied += nodes
                if rest:
                    handed.update(_give_slots(writer, _above(writer.tree, copied, rest), rest))
                continue
            above = writer.copy_to_host(device_only_ancestors(writer.tree, nodes))  # first
            before = writer.pending[-1] if writer.pending else None
            writer._queue_write(writer.waits.ready(above + nodes), None)  # (and what waited for them)
            write = writer.pending[-1] if writer.pending else None
            last = write if write is not before else last
            if rest and write is not None and write is not before:
                handed.update(_hand_on_states(writer, write, rest))
        if writer.engine is None and handed:
            handed = _stood_for(writer, handed)
        if last is not None:
            handed.update(_hand_on_to_gained(writer, last, handed))
        back_up_gained(writer, skip=handed)  # and components nodes backed up earlier gained since


def _write_waiting(writer: Writer) -> None:
    """Copy the device-only prefixes of the nodes waiting on the host (``PrefixWaits``) into
    free host units, root first while they fit (no eviction for them), and queue the writes
    they complete. Each eviction's own candidates took the free room first and the prefix got
    none: a waiting leaf stayed its path's only copy until a larger eviction took it."""
    above = writer.waits.prefixes()
    free = {name: writer.units.allocator(name, Tier.HOST) for name in writer.tree.index}
    room = {name: a.available if a is not None else 0 for name, a in free.items()}
    fits: list[TreeNode] = []
    for node in above:
        needs = unit_counts(node, writer.tree.index)
        if any(count > room[name] for name, count in needs.items()):
            break
        fits.append(node)
        room = {name: room[name] - count for name, count in needs.items()}
    if fits:
        writer._queue_write(writer.waits.ready(writer.copy_to_host(fits)), None)


def _hand_on_to_gained(writer: Writer, write: PendingWrite, handed: set[TreeNode]) -> list[TreeNode]:
    """Host state slots for the checkpoints nodes backed up earlier gained (``back_up_gained``),
    where none is free: this eviction's copies, kept while their nodes are on the device, held
    every slot (2 slots, 2 checkpoints copied), and waiting for room freed none, so the gained
    checkpoint was skipped and the eviction dropped it, in no tier. Once ``write`` is stored its
    copies hand their slots on, as to a next round (:func:`_hand_on_states`)."""
    gained = [n for n in gained_components(writer.tree, writer.layout) if n not in handed]
    states: list[TreeNode] = []
    needs: dict[str, int] = {}  # (a state is one unit)
    for node, name in unbacked_components(writer.context, gained):
        if writer.layout.tree_pools[name].kind is PoolKind.STATE:
            states.append(node)
            needs[name] = needs.get(name, 0) + 1
    free = {name: writer.units.allocator(name, Tier.HOST) for name in needs}
    short = any(
        count > (a.available if (a := free[name]) is not None else 0) for name, count in needs.items()
    )
    return _hand_on_states(writer, write, states) if short else []


def _hand_on_states(writer: Writer, write: PendingWrite, rest: Sequence[TreeNode]) -> list[TreeNode]:
    """Wait for ``write`` (up to ``policy.backup_wait_s`` and a flush's deadline) and, where L3
    stored all of it, drop the host state copies of its nodes that the device still holds,
    shallowest first, until each state pool has the free host slots ``rest`` needs. Returns the
    nodes whose copy went (their checkpoint: on the device, and in L3)."""
    deadline = time.monotonic() + writer.policy.backup_wait_s
    if writer.room_deadline is not None:
        deadline = min(deadline, writer.room_deadline)
    wait_writes(writer.pending, deadline)  # (one thread writes them in order: ``write`` is last)
    if not write.future.done() or write.future.cancelled() or write.future.exception() is not None:
        return []
    results = write.future.result()
    if not results or not all(all(r.ok) for r in results.values()):
        return []  # (not stored: the next round skips, as one batch did)
    writer.drain()  # (unlocks the write's host sources)
    return _give_slots(writer, sorted(write.nodes, key=lambda n: n.depth_end), rest, results)


def _give_slots(
    writer: Writer, givers: Sequence[TreeNode], rest: Sequence[TreeNode], pools: Container[str] | None = None
) -> list[TreeNode]:
    """Drop the host state copies of ``givers`` (root first) that the device still holds,
    shallowest first, until each state pool (of ``pools``; None: all) has the free host slots
    ``rest`` needs. Returns the nodes whose copy went."""
    tree, units = writer.tree, writer.units
    dropped: list[TreeNode] = []
    for name, p in tree.index.items():
        if writer.layout.tree_pools[name].kind is not PoolKind.STATE:
            continue
        if pools is not None and name not in pools:
            continue
        allocator = units.allocator(name, Tier.HOST)
        if allocator is None:
            continue
        need = sum(unit_counts(node, {name: p})[name] for node in rest) - allocator.available
        for node in givers:
            if need <= 0:
                break
            held = node.host_raw[p]
            if held is not None and node.device_raw[p] is not None and not node.host_lock[p]:
                try:
                    freed = tree.drop_component(node, name, Tier.HOST)
                except BaseException:  # (dropped, where an interrupt came after: no one's units)
                    if node.host_raw[p] is None:
                        units.free(Tier.HOST, {name: unit_tensor(held)})
                    raise
                units.free(Tier.HOST, {name: freed})
                need -= freed.shape[0]
                dropped.append(node)
                units.on_eviction(Tier.HOST.value, name, freed.shape[0])
                writer.metrics.evicted(Tier.HOST.value, {name: freed.shape[0]})
    return dropped


def wait_for_room(writer: Writer, node: TreeNode, needs: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """Backpressure: the host units may be held by in-flight L3 writes. Wait for them, oldest
    first, up to ``policy.backup_wait_s`` (and a flush's deadline), so write-through persists
    what it promised instead of skipping a backup whenever L3 is a little behind (a component
    backup too: :func:`~kvstrata.core.component_backup.copy_components`)."""
    deadline = time.monotonic() + writer.policy.backup_wait_s
    if writer.room_deadline is not None:
        deadline = min(deadline, writer.room_deadline)
    while writer.pending:
        oldest = writer.pending[0]
        if not oldest.future.done():  # (with no time left, a write that finished still counts)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                oldest.future.exception(remaining)
            except TimeoutError:
                return None
        oldest.finished = True  # done: its callback may not have run yet
        writer.drain()
        got = writer.units.alloc_protecting(node, Tier.HOST, needs)
        if got is not None:
            writer.metrics.count(Operation.BACKUPS_WAITED)
            return got
    return None


def _above(tree: PrefixTree, copied: Sequence[TreeNode], rest: Sequence[TreeNode]) -> list[TreeNode]:
    """Of ``copied`` (this eviction's backups, no L3), the ancestors of a node of ``rest``, root
    first: a checkpoint below them on their path makes their prefix restorable from the host
    (a host node with pages and no state is the middle of a longer prefix), so their state slots
    go to ``rest``'s deeper checkpoints. The others' states are their paths' only ones."""
    ancestors: set[TreeNode] = set()
    for node in rest:
        parent = node.parent
        while parent is not None and parent is not tree.root and parent not in ancestors:
            ancestors.add(parent)
            parent = parent.parent
    return sorted((n for n in copied if n in ancestors), key=lambda n: n.depth_end)


def _stood_for(writer: Writer, handed: set[TreeNode]) -> set[TreeNode]:
    """Of ``handed`` (nodes whose state went to a deeper backup or that were backed up without
    it, no L3), those below which a node holds every state pool's copy on the host. A later
    round that copied nothing under one, or a host eviction that took the copy it stood for,
    leaves it standing for no checkpoint: it is backed up again if it fits (``back_up_gained``),
    as before the rounds."""
    covered = _covered(_state_pools(writer))
    return {node for node in handed if covered(node)}


def _state_pools(writer: Writer) -> dict[str, int]:
    """The stack's state pools (name: tree index)."""
    pools = writer.layout.tree_pools
    return {name: p for name, p in writer.tree.index.items() if pools[name].kind is PoolKind.STATE}


def _covered(states: Mapping[str, int]) -> Callable[[TreeNode], bool]:
    """Whether a node has a descendant holding every state pool of ``states`` on the host: a
    prefix through it continues to a checkpoint the host tier restores. Walks the node's subtree,
    stopping at the first such descendant (the nodes asked about are the eviction's, mostly
    leaves): collecting the ancestors of every host checkpoint cost O(host state slots x depth)
    per eviction, 0.76 -> 8.5 ms per write-back request at 5,000 device nodes."""
    wanted = tuple(states.values())

    def covered(node: TreeNode) -> bool:
        below = list(node.children.values())
        while below:
            child = below.pop()
            if wanted and all(child.host_raw[q] is not None for q in wanted):
                return True
            below.extend(child.children.values())
        return False

    return covered


def _back_up_pages(writer: Writer, rest: list[TreeNode]) -> tuple[list[TreeNode], list[TreeNode]]:
    """No L3, where the checkpoints of the eviction's candidates (``rest``, root first)
    outnumber the free host state slots: back up, shallowest first until the others' states fit,
    the candidates above a checkpoint the host tier already holds without their states (a host
    node with pages and no state is the middle of a longer prefix, as in :func:`_above`). Their
    state slots came from host eviction, which takes the oldest copies: the deeper checkpoints of
    the same path (an 8-page prompt, 2 host state slots at pages 7 and 8: each 4-page request
    evicting pages 1-4 took both for pages 3 and 4, and the prompt restored 4 of its 8 pages, then
    none). Returns the nodes backed up so (their checkpoint stays on the device until this
    eviction drops it) and the candidates left."""
    tree, units = writer.tree, writer.units
    states = _state_pools(writer)
    short: dict[str, int] = {}
    for name, p in states.items():
        allocator = units.allocator(name, Tier.HOST)
        need = sum(len(n.device_raw[p] or b"") // UNIT for n in rest)
        if allocator is not None and need > allocator.available:
            short[name] = need - allocator.available
    if not short:
        return [], rest
    covered = _covered(states)
    chosen: list[TreeNode] = []
    for node in rest:
        if not short:
            break
        if any(node.device_raw[p] is not None for p in states.values()) and covered(node):
            chosen.append(node)
            for name in list(short):
                short[name] -= len(node.device_raw[states[name]] or b"") // UNIT
                if short[name] <= 0:
                    del short[name]
    if not chosen:
        return [], rest
    index = {name: p for name, p in tree.index.items() if name not in states}
    todo: list[TreeNode] = []
    allocated: list[Units] = []
    try:
        for node in chosen:
            got = units.alloc_protecting(node, Tier.HOST, unit_counts(node, index))
            if got is None:  # the host tier is full of pages other requests hold
                writer.metrics.count(Operation.BACKUPS_SKIPPED)
                break
            todo.append(node)
            allocated.append(got)
    except BaseException:  # the units taken for earlier nodes are no one's yet
        for taken in allocated:
            units.free(Tier.HOST, taken)
        raise
    if todo:
        writer._copy_down(todo, device_units(todo, index), joined(allocated))
    done = set(todo)
    return todo, [node for node in rest if node not in done]
