"""L3 writes of what a node gained after its backup: a component, the last window at its end.

A backup is decided on a node's anchor: once its pages are on the host, the node counts as
backed up. A component can join such a node later: a request whose chunk ends inside another
request's node splits it, and its state checkpoint -- or window data the first request did not
keep -- lands in the upper half, whose anchor went to the host with the first request. That
component stayed on the device only, and once it left, the prefix ending there was lost to the
host tier and to L3 (audit 29: a Mamba checkpoint at a shared prefix's end, 0 of 3 pages from
L3). Here such components are copied down and written to L3 on their own.

A prefix end can also come after a node's L3 write: a branch inside the node splits it, and the
upper half's end needs its last window in L3 for a restore ending there (a shared prompt's end).
Each write policy writes it where it sees that end (:func:`window_end_to_l3`): write-through at
the insert, selective write-through once the node is hot, write-back at the lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import Protocol

import torch

from kvstrata.core.l3_values import PageHashes, PerPool, host_values_per_pool, path_hashes, trailing_windows
from kvstrata.core.metrics import Operation
from kvstrata.core.node_set import on_host
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import PoolKind, StackLayout, unit_bytes
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.transfer import settle_copies
from kvstrata.core.tree import MatchResult, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT, unit_tensor
from kvstrata.core.write_back import Unqueued, gained_components


class UnqueuedPools(Unqueued):
    """:class:`Unqueued` knowing the nodes whose lost copies were components only (a checkpoint
    a backed-up node gained): the drain wrote the whole node again, objects L3 had, each page
    counted ``storage_admitted`` twice. :func:`requeue_lost` writes those components only."""

    def __init__(self, tree: PrefixTree) -> None:
        super().__init__(tree)
        self._call: dict[TreeNode, set[str]] = {}  # this call's component-only copies
        self.pools: dict[TreeNode, set[str]] = {}  # lost nodes that lost these components only

    def copied(self, nodes: Iterable[TreeNode], pool: str | None = None) -> None:
        """``pool``: a component's copy (None: a whole node's backup)."""
        if not self._depth:
            return
        nodes = list(nodes)
        for node in nodes:
            if pool is None:
                self._call.pop(node, None)
            elif node not in self._copied or node in self._call:  # (not after its whole backup)
                self._call.setdefault(node, set()).add(pool)
        super().copied(nodes)

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        for node in self._copied if kind is not None else ():
            if not on_host(node):
                continue
            if node in self._call and (node not in self.lost or node in self.pools):
                self.pools.setdefault(node, set()).update(self._call[node])
            else:  # (a whole node lost: written whole)
                self.pools.pop(node, None)
        super().__exit__(kind, *rest)
        if not self._depth:
            self._call.clear()


def requeue_lost(writer: EndWriter) -> list[TreeNode]:
    """Queue the component writes an interrupt lost (:class:`UnqueuedPools`); returns the other
    lost nodes (:meth:`~kvstrata.core.write_back.Unqueued.take`), to write whole."""
    nodes = writer.unqueued.take()
    pools, writer.unqueued.pools = writer.unqueued.pools, {}
    groups: dict[frozenset[str], list[TreeNode]] = {}
    for node in nodes:
        if node in pools and node not in writer.refused:
            groups.setdefault(frozenset(pools[node]), []).append(node)
    for names, group in groups.items():
        _write_components(writer, group, set(names), None)
    return [node for node in nodes if node not in pools]


class EndWriter(Protocol):
    """What these writes use of :class:`~kvstrata.core.writer.Writer` (which imports them)."""

    @property
    def context(self) -> PartContext: ...
    @property
    def engine(self) -> StorageEngine | None: ...
    @property
    def layout(self) -> StackLayout: ...
    @property
    def tree(self) -> PrefixTree: ...
    @property
    def namespace_root(self) -> str: ...
    @property
    def page_size(self) -> int: ...
    @property
    def refused(self) -> Container[TreeNode]: ...  # by the storage admission filter
    @property
    def window_ends(self) -> Container[TreeNode]: ...  # stored last windows
    @property
    def unqueued(self) -> UnqueuedPools: ...  # copied, their write not queued: an interrupt came

    def back_up(
        self, nodes: Iterable[TreeNode], *, hashes: PageHashes | None = None, admit: bool = False
    ) -> None: ...

    def submit(self, nodes: Sequence[TreeNode], per_pool: PerPool, ends: Sequence[TreeNode] = ()) -> None: ...

    def wait_for_room(self, node: TreeNode, needs: dict[str, int]) -> dict[str, torch.Tensor] | None: ...


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


def copy_components(
    context: PartContext,
    nodes: Sequence[TreeNode],
    room: Callable[[TreeNode, dict[str, int]], dict[str, torch.Tensor] | None] | None = None,
    unqueued: UnqueuedPools | None = None,
) -> tuple[list[TreeNode], set[str]]:
    """Copy each unbacked component of ``nodes`` to the host (evicting where needed, the node's
    path kept; else waiting for ``room``: in-flight L3 writes lock their sources); returns the
    nodes that gained a host copy and the pools copied (for their L3 write: :func:`only_pools`).
    Without the wait a write-back eviction dropped the checkpoint whose slot a write held. Each
    copy recorded is told to ``unqueued``: a node with its component on the host no longer
    counts as gaining it, so an interrupt before its L3 write was queued lost that write."""
    found = unbacked_components(context, nodes) if context.pools.host_enabled else []
    copied: list[TreeNode] = []
    names: set[str] = set()
    nbytes = 0
    for node, name in found:
        device = node.device_raw[context.tree.index[name]]
        assert device is not None
        count = len(device) // UNIT
        got = context.units.alloc_protecting(node, Tier.HOST, {name: count})
        if got is None and room is not None:
            got = room(node, {name: count})
        if got is None:  # the host tier is full of pages other requests hold
            context.metrics.count(Operation.BACKUPS_SKIPPED)
            continue
        host = got[name]
        handles = []
        try:  # (a copy that raises, or an interrupt: the units go back once no copy writes into them)
            handles = context.pools.device_to_host(name, unit_tensor(device), host)
            for handle in handles:
                handle.wait()
        except BaseException:
            settle_copies(handles)
            context.units.free(Tier.HOST, got)
            raise
        try:
            context.tree.set_host_value(node, name, host.numpy().tobytes())
        except BaseException:  # (not recorded: the unit is no one's; recorded: the node's)
            context.units.free_unowned(Tier.HOST, got)
            raise
        finally:  # (recorded, where an interrupt came after)
            if unqueued is not None and node.host_raw[context.tree.index[name]] is not None:
                unqueued.copied((node,), name)
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


def lookup_end_to_l3(writer: EndWriter, match: MatchResult, hashes: PageHashes) -> None:
    """Write-back: the last window at a lookup's prefix end where it ends at a node on the host
    (a branch split a backed-up node there: its upper half, a shared prompt's end). No eviction
    writes it -- the node is backed up -- and no insert does under write-back: a fresh cache
    restored none of the prompt for a new question."""
    end = match.path[-1] if match.path and writer.layout.windowed else None
    if writer.engine is not None and end is not None and end.host_raw[0] is not None:
        window_end_to_l3(writer, end, hashes)


def back_up_hot(writer: EndWriter, hot: Sequence[TreeNode], hashes: PageHashes, *, admit: bool) -> None:
    """Selective write-through of the nodes a reuse made hot. Those on the host already may
    have gained a component, and one a branch split (its upper half: a new prefix end, a shared
    prompt's) gets its last window in L3, as write-through's insert gives it -- never written,
    a fresh cache restored none of the prompt for a new question. Before the new backups,
    whose windows then leave out the pages it holds."""
    earlier = [n for n in hot if n.host_raw[0] is not None]
    if earlier:
        back_up_components(writer, earlier, hashes)
        for end in earlier if writer.engine is not None and writer.layout.windowed else ():
            window_end_to_l3(writer, end, hashes)
    writer.back_up(hot, hashes=hashes, admit=admit)


def back_up_gained(writer: EndWriter, skip: Container[TreeNode] = ()) -> None:
    """Write-back, before an eviction: the components nodes gained after their backup (see
    :func:`~kvstrata.core.write_back.gained_components`) to the host and L3, and the window
    ending at such a node (a prefix end inside the node L3 got it with) to L3. ``skip``: nodes
    whose host state copy this eviction's backups gave to a deeper node (L3 holds it)."""
    gained = [n for n in gained_components(writer.tree, writer.layout) if n not in skip]
    if not gained:
        return
    back_up_components(writer, gained, None)
    for node in gained if writer.engine is not None and writer.layout.windowed else ():
        window_end_to_l3(
            writer, node, path_hashes(writer.tree, node, writer.page_size, writer.namespace_root)
        )


def window_end_to_l3(writer: EndWriter, end: TreeNode, hashes: PageHashes) -> None:
    """The last window ending at ``end`` to L3, where a prefix ends inside the node L3 got it
    with (storage admission refused the prefix: its own write carries it)."""
    if end not in writer.window_ends and end not in writer.refused:
        writer.submit([end], trailing_windows(writer.tree, writer.layout, end, hashes), [end])


def back_up_components(writer: EndWriter, nodes: Sequence[TreeNode], hashes: PageHashes | None) -> None:
    """Host copies and the L3 write of the components ``nodes`` gained after their backup
    (``hashes``: the request's page hashes; None: hashed from the nodes' path). An interrupt
    before the write is queued leaves the copies to the writer's next drain (``Unqueued``)."""
    unqueued = writer.unqueued if writer.engine is not None else None
    with writer.unqueued.call():
        copied, names = copy_components(writer.context, nodes, writer.wait_for_room, unqueued)
        _write_components(writer, [node for node in copied if node not in writer.refused], names, hashes)
        writer.unqueued.queued(copied)  # (those storage admission refused too: offered at a reuse)


def _write_components(
    writer: EndWriter, copied: Sequence[TreeNode], names: set[str], hashes: PageHashes | None
) -> None:
    """The L3 write of the components ``names`` of ``copied`` (their host copies just made)."""
    if writer.engine is None or not copied:
        return
    per_pool, ends = host_values_per_pool(
        writer.tree,
        writer.layout,
        writer.namespace_root,
        copied,
        hashes() if hashes else None,
        writer.window_ends,
    )
    windows = any(writer.layout.tree_pools[name].kind is PoolKind.WINDOW for name in names)
    writer.submit(copied, only_pools(per_pool, writer.layout, names), ends if windows else ())
