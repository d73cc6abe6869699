"""The writer: device (L1) -> host (L2) backups, and host (L2) -> storage (L3) writes.

Backups follow the write policy: ``write_through`` backs up on insert, ``write_through_selective``
once a node is hot, ``write_back`` only when the device tier must evict. Except under write-back,
backups form a contiguous prefix from the root (a node is backed up only after its parent), so a
host hit never depends on a page that exists only on the device.

Every node that reaches the host tier is queued for L3 in ``put_group`` order (sidecars and
components first, the anchor object last: the anchor commits a page). Admission filters
(``policy.admission``, :mod:`kvstrata.core.admission`) may refuse a write-through backup or an L3
write; a refused node is offered again when a request reuses it, and pages are counted either way.
The write runs on one worker thread that only reads the host units it was handed; host locks
keep those units alive, and the owner thread drains finished writes (unlock, count) in :meth:`Writer.drain`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.core.admission import make_admission
from kvstrata.core.backup_plan import Units, backup_candidates, device_units, joined, unit_counts
from kvstrata.core.keys import hash_pages
from kvstrata.core.metrics import CacheMetrics, Operation, count_failure
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import PoolKind, pool_batch, unit_bytes
from kvstrata.core.storage_engine import BatchResult, PoolBatch, StorageEngine
from kvstrata.core.storage_metrics import StorageOperation
from kvstrata.core.tree import MatchResult, PageKey, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT, unit_tensor
from kvstrata.core.unit_digests import UnitDigests, check_nodes, record_nodes
from kvstrata.core.write_back import (
    OpenBackups,
    OpenChain,
    SharedLock,
    StoredWindowEnds,
    device_only_ancestors,
    eviction_backups,
    host_locks,
)

#: A request's page hashes, computed on demand: only an L3 write needs them.
PageHashes = Callable[[], Sequence[str]]
#: per pool to write: the page hashes and, per node, its host units as the tree stores them
#: (int64 bytes: joined into one index tensor per pool, no tensor per node)
PerPool = dict[str, tuple[list[str], list[bytes]]]

log = logging.getLogger(__name__)

#: refused nodes remembered for a second offer before the stale ones are swept out
_REFUSED_SWEEP = 8192


@dataclass(eq=False)
class PendingWrite:
    """One queued L2 -> L3 write; host locks keep its source slots alive until it is drained."""

    locks: list[SharedLock]
    future: Future[dict[str, BatchResult]]
    #: nodes whose last window this write stores (window stacks): unmarked if it fails
    ends: Sequence[TreeNode] = ()
    #: set by the future's done callback (or by whoever waited on the future): ``drain`` runs at
    #: every call and reads this plain flag instead of ``future.done()``, which takes the
    #: future's lock (contended by the writer thread)
    finished: bool = False

    def mark_finished(self, _future: Future[dict[str, BatchResult]]) -> None:
        self.finished = True


class Writer:
    """Backups and L3 writes (owner thread; the L3 write itself runs on the writer thread)."""

    def __init__(self, context: PartContext, engine: StorageEngine | None) -> None:
        self.context = context
        self.pools, self.tree, self.layout = context.pools, context.tree, context.layout
        self.units, self.metrics = context.units, context.metrics
        self.engine = engine
        self.policy = policy = context.policy
        self.page_size, self.namespace_root = context.page_size, context.namespace_root
        self.pending: deque[PendingWrite] = deque()
        self.host_admission = make_admission(policy.admission.host)
        self.storage_admission = make_admission(policy.admission.storage)
        self._refused: dict[TreeNode, None] = {}  # on host, refused by the storage filter
        self.window_ends = StoredWindowEnds(self.tree, self.layout)
        if self.storage_admission.selective:
            self.tree.on_split(self._split)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-l3-write")
        self.digests: UnitDigests | None = None  # debug.unit_digests
        self.open_backups = OpenBackups(policy.write_through_batch_pages)
        if policy.write == "write_back":
            self.units.before_device_eviction = self.back_up_for_eviction

    # --- L1 -> L2 -----------------------------------------------------------------------------

    def on_insert(
        self, node: TreeNode, hashes: PageHashes, since: TreeNode | None = None, cached: int = 0,
        *, owner: object = None, keep_open: bool = False,
    ) -> None:  # fmt: skip
        """Write-through: back up the nodes below ``since`` down to the new ``node`` (``hashes``:
        the request's page hashes, called only for an L3 write); a lease (``owner``) that stays
        open (``keep_open``) in batches (:class:`~kvstrata.core.write_back.OpenBackups`). ``since``
        ending at ``cached`` (the cached prefix) is a new node end: its last window goes to L3."""
        if self.digests is not None:
            record_nodes(self.digests, self.tree.index, _path(self.tree, node, since), hashes())
        if self.policy.write == "write_through":
            chain = self.open_backups.insert(owner, node, since, cached, hashes, keep_open)
            if chain is not None:
                _back_up_chain(self, chain)

    def end_open(self, owner: object | None = None) -> None:
        """Back up what write-through batched for ``owner``'s lease (closing), or for all (None)."""
        chains = self.open_backups.take_all() if owner is None else [self.open_backups.end(owner)]
        for chain in chains:
            if chain is not None:
                _back_up_chain(self, chain)

    def on_lookup(self, match: MatchResult, hashes: PageHashes) -> None:
        """A request reused ``match``'s path: selective write-through backs up the nodes that
        turned hot; admission filters hear of the reuse and take what passes now."""
        host, storage = self.host_admission, self.storage_admission
        if not (host.selective or storage.selective or self.policy.write == "write_through_selective"):
            return
        host.seen(match.path)
        storage.seen(match.path)
        if self.policy.write == "write_through_selective":
            hot = [n for n in match.device_path if n.hit_count >= self.policy.write_through_threshold]
            self.back_up(hot, hashes=hashes, admit=host.selective)
        elif host.selective and self.policy.write == "write_through":
            unbacked = [n for n in match.device_path if not self.tree.backed_up(n)]
            self.back_up(unbacked, hashes=hashes, admit=True)
        if self._refused and self.engine is not None:
            ready = [n for n in match.host_path if n in self._refused and storage.admit(n)]
            for n in ready:
                del self._refused[n]
            ready = [n for n in ready if n.host[0] is not None]
            if ready:
                self._queue_write(ready, hashes, admitted=True)

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        if lower in self._refused:  # both halves still wait for their L3 write
            self._refused[upper] = None

    def back_up(
        self, nodes: Iterable[TreeNode], *, hashes: PageHashes | None = None, admit: bool = False
    ) -> None:
        """Copy device-only nodes to host, root first, stopping at the first that does not fit,
        whose parent has no backup (backups stay a contiguous prefix) or, with ``admit``, that the
        host admission filter refuses; queue their L3 write."""
        if not self.pools.host_enabled:
            return
        candidates, refused = backup_candidates(
            self.tree,
            nodes,
            contiguous=self.policy.write != "write_back",
            admit=self.host_admission.admit if admit else None,
        )
        todo, device, host = self._host_units(candidates)
        if refused is not None and len(todo) == len(candidates):
            self.metrics.count(Operation.HOST_REJECTED, refused.pages)
        if not todo:
            return
        if admit:  # the anchor holds one unit per page
            self.metrics.count(Operation.HOST_ADMITTED, device[self.layout.anchor].shape[0])
        self._copy_down(todo, device, host)
        if self.engine is not None:
            self._queue_write(todo, hashes)

    def _host_units(self, candidates: list[TreeNode]) -> tuple[list[TreeNode], Units, Units]:
        """Host units for the leading candidates: the nodes, and per tree pool their device units
        and the host units, both in node order. All at once from free units, else a node at a
        time (evicting, or waiting for L3 writes), stopping at the first that does not fit."""
        if not candidates:
            return [], {}, {}
        index = self.tree.index  # the tree pools, anchor first
        device = device_units(candidates, index)
        if len(candidates) > 1:
            got = self.units.try_alloc(Tier.HOST, {name: units.shape[0] for name, units in device.items()})
            if got is not None:  # never evicts
                return candidates, device, got
        todo: list[TreeNode] = []
        allocated: list[Units] = []
        for node in candidates:
            needs = unit_counts(node, index)
            try:
                got = self.units.alloc_protecting(node, Tier.HOST, needs)
                if got is None and self.pending:
                    got = self._wait_for_room(node, needs)
            except BaseException:  # the units taken for earlier nodes are no one's yet
                for taken in allocated:
                    self.units.free(Tier.HOST, taken)
                raise
            if got is None:  # the host tier is full of pages other requests hold
                self.metrics.count(Operation.BACKUPS_SKIPPED)
                break
            todo.append(node)
            allocated.append(got)
        if len(todo) < len(candidates):
            device = device_units(todo, index)
        return todo, device, joined(allocated)

    def _wait_for_room(self, node: TreeNode, needs: dict[str, int]) -> dict[str, torch.Tensor] | None:
        """Backpressure: the host units may be held by in-flight L3 writes. Wait for them, oldest
        first, up to ``policy.backup_wait_s``, so write-through persists what it promised
        instead of skipping a backup whenever L3 is a little behind."""
        deadline = time.monotonic() + self.policy.backup_wait_s
        while self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            oldest = self.pending[0]
            try:
                oldest.future.exception(remaining)
            except TimeoutError:
                return None
            oldest.finished = True  # done: its callback may not have run yet
            self.drain()
            got = self.units.alloc_protecting(node, Tier.HOST, needs)
            if got is not None:
                self.metrics.count(Operation.BACKUPS_WAITED)
                return got
        return None

    def back_up_prefix(self, keys: Sequence[PageKey], hashes: PageHashes) -> bool:
        """Whether every page of ``keys`` has a host copy, backing device-only ones up first
        (an L3 refill below a page without one would break the contiguous-backup rule)."""
        match = self.tree.match(keys, count_hit=False)
        if match.host_pages < len(keys):
            return False
        if not all(self.tree.backed_up(n) for n in match.path):
            self.back_up(match.path, hashes=hashes)
        return all(self.tree.backed_up(n) for n in match.path)

    def _copy_down(self, nodes: Sequence[TreeNode], devices: Units, hosts: Units) -> None:
        """Device -> host copies of ``nodes`` (per pool, their device units in order) into
        ``hosts`` (per pool, as many host units): one copy per pool, then the host units
        recorded in the tree, each node taking as many as it holds on the device."""
        handles = []
        nbytes = 0
        stored: dict[str, bytes] = {}
        tree_pools = self.layout.tree_pools
        for name, host in hosts.items():
            if not host.shape[0]:
                continue
            handles += self.pools.device_to_host(name, devices[name], host)
            nbytes += host.shape[0] * unit_bytes(self.pools, tree_pools[name])
            stored[name] = host.numpy().tobytes()  # the tree stores int64 bytes: converted once
        for handle in handles:
            handle.wait()
        self.tree.set_host_values(nodes, stored)
        self.metrics.count(Operation.BACKUPS, len(nodes))
        self.metrics.add_bytes("device_to_host", nbytes)
        if self.digests is not None:
            known: dict[TreeNode, list[str]] = {}
            for node in nodes:
                node_hashes_from_path(self.tree, node, self.page_size, self.namespace_root, known)
            check_nodes(self.digests, "backup", self.tree.index, nodes, known, Tier.HOST)

    def back_up_for_eviction(self, shortfall: Mapping[str, int]) -> None:
        """Write-back: back up the device nodes the eviction then drops (see
        :func:`~kvstrata.core.write_back.eviction_backups`) and, with an L3, their device-only
        ancestors: what L3 holds is found only below its prefix (a hot shared prefix never left
        the device, and after close no page written below it was found)."""
        nodes = eviction_backups(self.tree, self.layout, shortfall)
        with self.units.keeping_copies():  # the other device pages' host copies let them leave
            self.back_up(nodes)
            if self.engine is not None and nodes:
                self.back_up(device_only_ancestors(self.tree, nodes))

    # --- L2 -> L3 -----------------------------------------------------------------------------

    def _admit_writes(self, nodes: Sequence[TreeNode]) -> Sequence[TreeNode]:
        """The nodes the storage filter takes now; the others wait for a reuse (``on_lookup``)."""
        admission = self.storage_admission
        if not admission.selective:
            self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in nodes))
            return nodes
        verdicts = [admission.admit(n) for n in nodes]
        taken = [n for n, ok in zip(nodes, verdicts, strict=True) if ok]
        refused = [n for n, ok in zip(nodes, verdicts, strict=True) if not ok]
        self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in taken))
        self.metrics.count(Operation.STORAGE_REJECTED, sum(n.pages for n in refused))
        if len(self._refused) > _REFUSED_SWEEP:
            self._refused = {n: None for n in self._refused if n.host[0] is not None and n.parent}
        self._refused.update(dict.fromkeys(refused))
        return taken

    def _queue_write(
        self, nodes: Sequence[TreeNode], hashes: PageHashes | None, *, admitted: bool = False
    ) -> None:
        """L2 -> L3 for freshly backed-up nodes: batches built here, written on the worker.
        ``hashes()`` -- the request's page hashes -- is the one place a request's pages are hashed."""
        assert self.engine is not None
        if admitted:
            self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in nodes))
        else:
            nodes = self._admit_writes(nodes)
        per_pool = _host_values_per_pool(self, nodes, hashes() if hashes is not None and nodes else None)
        self._submit(nodes, per_pool, self.window_ends.carried(nodes))

    def _submit(self, nodes: Sequence[TreeNode], per_pool: PerPool, ends: Sequence[TreeNode] = ()) -> None:
        """Queue the L3 write of ``per_pool`` (host units of ``nodes``, locked meanwhile; ``ends``
        the nodes whose last window it stores)."""
        assert self.engine is not None
        if self.engine.breaker.refusing():
            _count_refused(self.engine, self.metrics, per_pool)
            return
        batches: dict[str, PoolBatch] = {}
        for name, (page_hashes, values) in per_pool.items():
            if self.engine.plans[name].writes:
                batches[name] = pool_batch(self.pools, name, unit_tensor(b"".join(values)), page_hashes)
        if not batches:
            return
        locks = self._host_locks(nodes)
        if self.digests is not None:
            future = self._thread.submit(_checked_put, self.engine, self.digests, batches, per_pool)
        else:
            future = self._thread.submit(self.engine.put_group, batches)
        write = PendingWrite(locks, future, ends)
        self.window_ends.add(ends)
        self.pending.append(write)
        future.add_done_callback(write.mark_finished)
        self.metrics.count(Operation.STORAGE_WRITES)

    def drain(self) -> None:
        """Commit finished writes: count bytes and failures, unlock their host sources."""
        # one writer thread finishes writes in order: stop at the first still running, so a
        # backlog of queued writes costs nothing per call (a chunked request queues one per chunk)
        pending = self.pending
        while pending and pending[0].finished:
            self._finish(pending.popleft())

    def _finish(self, write: PendingWrite) -> None:
        try:
            results = write.future.result()
        except Exception:  # the engine does not raise on backend errors; this is a bug guard
            log.exception("L3 write failed")
            self.metrics.fail()
            results = {}
        nbytes = 0
        for name, result in results.items():
            count_failure(self.metrics, result)
            nbytes += sum(result.ok) * self.pools.pools[name].spec.bytes_per_unit
        self.window_ends.settled(write.ends, results)  # failed: the next request ending there writes it
        self.metrics.add_bytes("host_to_storage", nbytes)
        for shared in write.locks:
            shared.refs -= 1
            if shared.refs == 0:
                self.tree.unlock(shared.handle)

    def _host_locks(self, nodes: Sequence[TreeNode]) -> list[SharedLock]:
        last = self.pending[-1].locks[-1] if self.pending and self.pending[-1].locks else None
        return host_locks(self.tree, self.layout, last, nodes)

    def wait(self, deadline: float | None) -> None:
        """Back up what open leases batched, then wait (up to ``deadline``, a ``time.monotonic``
        value) for every queued write."""
        self.end_open()
        for write in list(self.pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                write.future.exception(remaining)
            except TimeoutError:
                return
            write.finished = True  # done: its callback may not have run yet (the next poll drains it)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the writer thread; ``wait=False`` cancels queued writes and returns at once."""
        self._thread.shutdown(wait=wait, cancel_futures=not wait)


def _count_refused(engine: StorageEngine, metrics: CacheMetrics, per_pool: PerPool) -> None:
    """L3 is down: count the refused write without the batch copies, host locks and worker hop
    it would cost (a dead L3 must not slow L1/L2; benchmarks/faults.py)."""
    for name, (page_hashes, _values) in per_pool.items():
        if engine.plans[name].writes:
            count_failure(metrics, engine.refused(StorageOperation.PUT, len(page_hashes)))


def _back_up_chain(writer: Writer, chain: OpenChain) -> None:
    """Write-through of the nodes of ``chain`` (one insert's, or an open lease's batch)."""
    path = _path(writer.tree, chain.node, chain.since)
    writer.host_admission.seen(path)
    writer.storage_admission.seen(path)
    writer.back_up(path, hashes=chain.hashes, admit=True)
    since = chain.since
    if (
        since is not None
        and since.depth_end == chain.cached
        and writer.engine is not None
        and since not in writer.window_ends
    ):
        writer._submit([since], _trailing_windows(writer, since, chain.hashes), [since])


def _host_values_per_pool(
    writer: Writer, nodes: Sequence[TreeNode], request_hashes: Sequence[str] | None
) -> PerPool:
    """Per pool to write: the page hashes and host unit indices of ``nodes`` (a state pool one
    slot per node, under its last page; a window pool the node's last window pages, what a
    restore of a prefix ending there needs, as SGLang stores them; a sidecar follows the pool
    owning its units)."""
    per_pool: PerPool = {}
    known: dict[TreeNode, list[str]] = {}
    tree = writer.tree
    for node in nodes:
        if request_hashes is not None:
            node_hashes = list(request_hashes[node.depth_start : node.depth_end])
        else:
            node_hashes = node_hashes_from_path(tree, node, writer.page_size, writer.namespace_root, known)
        for name, tp in writer.layout.tree_pools.items():
            value = node.host_raw[tree.index[name]]
            if value is None:
                continue
            page_hashes = node_hashes[-1:] if tp.kind is PoolKind.STATE else node_hashes
            if tp.kind is PoolKind.WINDOW and tp.window * UNIT < len(value):
                page_hashes, value = node_hashes[-tp.window :], value[-tp.window * UNIT :]
            for follower in tp.followers:
                entry = per_pool.setdefault(follower, ([], []))
                entry[0].extend(page_hashes)
                entry[1].append(value)
    return per_pool


def _trailing_windows(writer: Writer, node: TreeNode, hashes: PageHashes) -> PerPool:
    """Per window pool (and its sidecars), the page hashes and host units of the last window
    ending at ``node``, where the host tier holds it whole (for a prefix end that was inside a
    node when that node was written to L3)."""
    per_pool: PerPool = {}
    tree = writer.tree
    for name, tp in writer.layout.tree_pools.items():
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


def _checked_put(
    engine: StorageEngine,
    digests: UnitDigests,
    batches: dict[str, PoolBatch],
    per_pool: PerPool,
) -> dict[str, BatchResult]:
    """The writer thread's put under ``debug.unit_digests``: a pool whose host bytes no longer
    match their commit is not written (the anchor still is: the prefix ends before it)."""
    for name in list(batches):
        page_hashes, values = per_pool[name]
        if not digests.check("l3_write", name, page_hashes, unit_tensor(b"".join(values)), Tier.HOST):
            del batches[name]
    return engine.put_group(batches)


def _path(tree: PrefixTree, node: TreeNode, since: TreeNode | None = None) -> list[TreeNode]:
    """The nodes from the root's child (or ``since``'s) down to ``node``."""
    path = []
    cur: TreeNode | None = node
    while cur is not None and cur is not tree.root and cur is not since:
        path.append(cur)
        cur = cur.parent
    path.reverse()
    return path


def node_hashes_from_path(
    tree: PrefixTree, node: TreeNode, page_size: int, namespace_root: str, known: dict[TreeNode, list[str]]
) -> list[str]:
    """Page hashes of ``node``'s pages, rebuilt from the keys of its path (token pages) when no
    request's hashes came with it (write-back eviction). ``known`` holds the nodes of this batch
    already hashed: the chain continues from the nearest of them instead of the root, so a batch
    of nested nodes hashes each page once."""
    path = _path(tree, node)
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
