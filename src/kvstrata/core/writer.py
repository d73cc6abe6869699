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
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstrata.core.admission import make_admission
from kvstrata.core.backup_plan import Raw, Units, backup_candidates, device_units, joined, unit_counts
from kvstrata.core.component_backup import (
    UnqueuedPools,
    back_up_components,
    back_up_hot,
    lookup_end_to_l3,
    requeue_lost,
    window_end_to_l3,
)
from kvstrata.core.eviction_rounds import back_up_for_eviction, wait_for_room
from kvstrata.core.l3_touch import HitTouch
from kvstrata.core.l3_values import (
    PageHashes,
    PerPool,
    host_values_per_pool,
    node_hashes_from_path,
)
from kvstrata.core.metrics import Operation, count_failure
from kvstrata.core.node_set import SplitFollowingSet, on_host
from kvstrata.core.part_context import PartContext
from kvstrata.core.stack import pool_batch, unit_bytes
from kvstrata.core.storage_engine import BatchResult, PoolBatch, StorageEngine
from kvstrata.core.transfer import settle_copies
from kvstrata.core.tree import MatchResult, PageKey, Tier, TreeNode, tree_path
from kvstrata.core.tree_bytes import UNIT, unit_tensor
from kvstrata.core.unit_digests import UnitDigests, check_nodes, record_nodes
from kvstrata.core.write_back import (
    OpenBackups,
    OpenChain,
    PendingWrite,
    PrefixWaits,
    RetryWrites,
    StoredWindowEnds,
    count_refused_writes,
    host_locks,
    unbacked_above,
    wait_writes,
)

log = logging.getLogger(__name__)


class Writer:
    """Backups and L3 writes (owner thread; the L3 write itself runs on the writer thread)."""

    def __init__(self, context: PartContext, engine: StorageEngine | None) -> None:
        self.context = context
        self.pools, self.tree, self.layout = context.pools, context.tree, context.layout
        self.units, self.metrics, self.engine = context.units, context.metrics, engine
        self.policy = policy = context.policy
        self.page_size, self.namespace_root = context.page_size, context.namespace_root
        self.pending: deque[PendingWrite] = deque()
        self.host_admission = make_admission(policy.admission.host)
        self.storage_admission = make_admission(policy.admission.storage)
        #: a filter that counts sightings hears every insert, whatever the write policy
        #: (write-through tells it in :func:`_back_up_chain`, where its backup happens)
        self.hears_inserts = policy.write != "write_through" and (
            self.host_admission.selective or self.storage_admission.selective
        )
        self.refused = SplitFollowingSet(self.tree, on_host)  # by the storage filter: offered at a reuse
        self.retry = RetryWrites(self.tree)  # lost to a transient failure: offered again at a reuse
        self.waits = PrefixWaits(self.tree)  # write-back: on the host, L3 waits for their prefix
        self.unqueued = UnqueuedPools(self.tree)  # copied, their write not queued: an interrupt came
        self.window_ends = StoredWindowEnds(tree=self.tree)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-l3-write")
        self.hit_touch = HitTouch.of(engine, context, self._thread, self.window_ends)  # hot prefixes stay
        self.digests: UnitDigests | None = None  # debug.unit_digests
        self.open_backups = OpenBackups(policy.write_through_batch_pages)
        self.room_deadline: float | None = None  # ``flush(timeout)``: a backup waits for room no longer
        if policy.write == "write_back":
            self.units.before_device_eviction = self.back_up_for_eviction
            self.units.host_last = lambda: (self.waits.exposed(), not self.pending)  # (their only copy)

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
            record_nodes(self.digests, self.tree.index, tree_path(self.tree, node, since), hashes())
        if self.policy.write == "write_through":
            chain = self.open_backups.insert(owner, node, since, cached, hashes, keep_open)
            if chain is not None:
                _back_up_chain(self, chain)
        elif self.hears_inserts:  # write-back / selective: an insert is a sighting all the same
            _sighted(self, tree_path(self.tree, node, since))

    def end_open(self, owner: object | None = None) -> None:
        """Back up what write-through batched for ``owner``'s lease (closing), or for all (None)."""
        chains = self.open_backups.take_all() if owner is None else [self.open_backups.end(owner)]
        for chain in chains:
            if chain is not None:
                _back_up_chain(self, chain)

    def on_lookup(self, match: MatchResult, hashes: PageHashes, record: bool = True) -> None:
        """A request reused ``match``'s path: L3 is asked for it (``l3_touch``), selective write-
        through backs up the nodes that turned hot, admission filters hear of the reuse (not of a
        later chunk's: ``record`` False)."""
        self.hit_touch.after_lookup(match, hashes, record)
        if self.retry and (again := self.retry.due(match.host_path, self.engine)):
            self._queue_write(again, hashes, admitted=None)
        if self.policy.write == "write_back":
            lookup_end_to_l3(self, match, hashes)  # (a branch inside a backed-up node)
        host, storage = self.host_admission, self.storage_admission
        if not (host.selective or storage.selective or self.policy.write == "write_through_selective"):
            return
        if record:  # (a later chunk's lookup: its hits are the request's own pages, no reuse)
            host.seen(match.path)
            storage.seen(match.path)
        if self.policy.write == "write_through_selective":
            hot = [n for n in match.device_path if n.hit_count >= self.policy.write_through_threshold]
            back_up_hot(self, hot, hashes, admit=host.selective)
        elif host.selective and self.policy.write == "write_through":
            unbacked = [n for n in match.device_path if not self.tree.backed_up(n)]
            self.back_up(unbacked, hashes=hashes, admit=True)
        if self.refused and self.engine is not None:
            ready = []
            for n in match.host_path:  # root first: a node goes only once its parent has gone
                if n in self.refused and n.parent not in self.refused and storage.admit(n):
                    self.refused.discard(n)
                    ready.append(n)
            ready = [n for n in ready if n.host[0] is not None]
            if ready:
                self._queue_write(ready, hashes, admitted=True)

    def back_up(
        self, nodes: Iterable[TreeNode], *, hashes: PageHashes | None = None, admit: bool = False
    ) -> None:
        """:meth:`copy_to_host`, then queue the L3 write of what was copied. With an L3, in rounds
        where the batch's own host units fill a pool (a chunked prompt's checkpoints, more than
        the host tier has state slots): each round's write frees the units the next waits for."""
        rest: list[TreeNode] | None = list(nodes)
        with self.unqueued.call():
            while rest:
                todo, rest = self._copy_round(rest, admit, rounds=self.engine is not None)
                admit = False  # (the rest was admitted with the first round)
                if todo and self.engine is not None:
                    self._queue_write(todo, hashes)

    def wait_for_room(self, node: TreeNode, needs: dict[str, int]) -> dict[str, torch.Tensor] | None:
        """Host units for ``node`` once in-flight L3 writes freed them (:func:`wait_for_room`)."""
        return wait_for_room(self, node, needs)

    def copy_to_host(self, nodes: Iterable[TreeNode], *, admit: bool = False) -> list[TreeNode]:
        """Copy device-only nodes to host, root first, stopping at the first that does not fit,
        whose parent has no backup (backups stay a contiguous prefix) or, with ``admit``, that the
        host admission filter refuses. Returns the nodes copied."""
        return self._copy_round(nodes, admit)[0]

    def _copy_round(
        self, nodes: Iterable[TreeNode], admit: bool, *, rounds: bool = False
    ) -> tuple[list[TreeNode], list[TreeNode] | None]:
        """:meth:`copy_to_host`; with ``rounds``, also the candidates left for a next round
        where those copied hold the room they need (None: no next round)."""
        if not self.pools.host_enabled:
            return [], None
        candidates, refused = backup_candidates(
            self.tree,
            nodes,
            contiguous=self.policy.write != "write_back",
            admit=self.host_admission.admit if admit else None,
        )
        todo, device, host, stalled = _host_units(self, candidates, rounds)
        if refused and (len(todo) == len(candidates) or stalled):
            self.metrics.count(Operation.HOST_REJECTED, refused)
        if not todo:
            return [], None
        try:
            self._copy_down(todo, device, host)
        finally:  # (those the tree recorded, where an interrupt came after: ``Unqueued``)
            if self.engine is not None:
                self.unqueued.copied(todo)
        return todo, candidates[len(todo) :] if stalled else None

    def _copy_down(self, nodes: Sequence[TreeNode], devices: Raw, hosts: Raw) -> None:
        """Device -> host copies of ``nodes`` (per pool, their device units in order) into
        ``hosts`` (per pool, as many host units; both int64 bytes, as the tree stores them): one
        copy per pool, then the host units recorded in the tree, each node taking as many as it
        holds on the device."""
        handles = []
        nbytes = 0
        stored: dict[str, bytes] = {}
        tree_pools = self.layout.tree_pools
        try:
            for name, host in hosts.items():
                if not host:
                    continue
                handles += self.pools.device_to_host(name, devices[name], host)
                nbytes += len(host) // UNIT * unit_bytes(self.pools, tree_pools[name])
                stored[name] = host
            for handle in handles:
                handle.wait()
        except BaseException:  # a copy raised (or an interrupt): nothing is recorded yet, so every
            settle_copies(handles)  # host unit goes back, once no copy issued still writes into it
            self.units.free(Tier.HOST, {name: unit_tensor(host) for name, host in hosts.items() if host})
            raise
        try:
            self.tree.set_host_values(nodes, stored)
        except BaseException:  # the units no node took are no one's (those it took stay its own)
            self.units.free_unowned(Tier.HOST, {n: unit_tensor(host) for n, host in stored.items()})
            raise
        self.metrics.count(Operation.BACKUPS, len(nodes))
        # every page entering the host tier (the filter's or not: write-back, a refill's prefix),
        # once recorded (a copy that raised admitted nothing)
        self.metrics.count(Operation.HOST_ADMITTED, len(devices[self.layout.anchor]) // UNIT)
        self.metrics.add_bytes("device_to_host", nbytes)
        if self.digests is not None:
            _check_backups(self, self.digests, nodes)

    def back_up_for_eviction(self, shortfall: Mapping[str, int]) -> None:
        """Write-back: back up the device nodes the eviction then drops (see
        :func:`~kvstrata.core.write_back.eviction_backups`) and, with an L3, their device-only
        ancestors: what L3 holds is found only below its prefix (a hot shared prefix never left
        the device, and after close no page written below it was found). A node goes to L3 only
        with its whole prefix backed up (where the host tier cannot hold both, it waits in L2
        for that prefix: ``PrefixWaits``). First the device-only prefixes of nodes already
        waiting take the free host room; then the eviction's own backups, in rounds where host
        state slots run out (:mod:`~kvstrata.core.eviction_rounds`)."""
        with self.unqueued.call():
            back_up_for_eviction(self, shortfall)

    # --- L2 -> L3 -----------------------------------------------------------------------------

    def _admit_writes(self, nodes: Sequence[TreeNode]) -> Sequence[TreeNode]:
        """The nodes the storage filter takes now; the others wait for a reuse (``on_lookup``).
        Root first, and nothing below a node still waiting: L3 would hold pages no later cache
        reaches (a split's new upper half starts unseen by a frequency filter)."""
        admission = self.storage_admission
        if not admission.selective:
            self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in nodes))
            return nodes
        taken, refused = [], 0
        for n in nodes:
            if n.parent in self.refused or not admission.admit(n):
                self.refused.add(n)
                refused += n.pages
            else:
                taken.append(n)
        self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in taken))
        self.metrics.count(Operation.STORAGE_REJECTED, refused)
        return taken

    def _queue_write(
        self, nodes: Sequence[TreeNode], hashes: PageHashes | None, *, admitted: bool | None = False
    ) -> None:
        """L2 -> L3 for freshly backed-up nodes: batches built here, written on the worker.
        ``hashes()`` -- the request's page hashes -- is the one place a request's pages are hashed.
        ``admitted``: True, admitted now (counted); None, admitted and counted before (a retry)."""
        assert self.engine is not None
        self.unqueued.queued(nodes)
        if admitted:
            self.metrics.count(Operation.STORAGE_ADMITTED, sum(n.pages for n in nodes))
        elif admitted is not None:
            nodes = self._admit_writes(nodes)
        request_hashes = hashes() if hashes is not None and nodes else None
        per_pool, ends = host_values_per_pool(
            self.tree, self.layout, self.namespace_root, nodes, request_hashes, self.window_ends
        )
        self.submit(nodes, per_pool, ends)

    def submit(self, nodes: Sequence[TreeNode], per_pool: PerPool, ends: Sequence[TreeNode] = ()) -> None:
        """Queue the L3 write of ``per_pool`` (host units of ``nodes``, locked meanwhile; ``ends``
        the nodes whose last window it stores)."""
        assert self.engine is not None
        if self.engine.write_breaker.refusing():
            count_refused_writes(self.engine, self.metrics, per_pool)
            self.retry.lost(nodes)
            return
        batches: dict[str, PoolBatch] = {}
        for name, (page_hashes, values) in per_pool.items():
            if self.engine.plans[name].writes:
                batches[name] = pool_batch(self.pools, name, unit_tensor(b"".join(values)), page_hashes)
        if not batches:
            return
        last = self.pending[-1].locks[-1] if self.pending and self.pending[-1].locks else None
        locks = host_locks(self.tree, self.layout, last, nodes)
        if self.digests is not None:
            future = self._thread.submit(_checked_put, self.engine, self.digests, batches, per_pool)
        else:
            future = self._thread.submit(self.engine.put_group, batches)
        write = PendingWrite(locks, future, ends, nodes)
        self.window_ends.update(ends)
        self.pending.append(write)
        future.add_done_callback(write.mark_finished)
        self.metrics.count(Operation.STORAGE_WRITES)

    def drain(self) -> bool:
        """Commit finished writes: count bytes and failures, unlock their host sources. Returns
        whether any had finished."""
        # one writer thread finishes writes in order: stop at the first still running, so a
        # backlog of queued writes costs nothing per call (a chunked request queues one per chunk)
        pending = self.pending
        took = bool(pending) and pending[0].finished
        while pending and pending[0].finished:
            self._finish(pending.popleft())
        if (self.hit_touch.due or self.hit_touch.asked) and (lost := self.hit_touch.lost(self.refused)):
            self._queue_write(lost, None, admitted=True)  # hit pages L3 lost: stored again
        if self.unqueued.interrupted and self.unqueued.lost and (lost := requeue_lost(self)):
            self._queue_write(self.waits.ready(lost) if self.policy.write == "write_back" else lost, None)
        return took

    def _finish(self, write: PendingWrite) -> None:
        try:  # (a write ``close`` cancelled is counted abandoned there, not a failure)
            results = {} if write.future.cancelled() else write.future.result()
        except BaseException:  # a bug guard; a plugin's CancelledError / SystemExit fails this write
            log.exception("L3 write failed")
            self.metrics.fail()
            results = {}
        nbytes = 0
        for name, result in results.items():
            count_failure(self.metrics, result)
            nbytes += sum(result.ok) * self.pools.pools[name].spec.bytes_per_unit
        self.window_ends.settled(write.ends, results)  # failed: the next request ending there writes it
        if any(result.transient for result in results.values()):
            self.retry.lost(write.nodes)
        self.metrics.add_bytes("host_to_storage", nbytes)
        for shared in write.locks:
            shared.refs -= 1
            if shared.refs == 0:
                self.tree.unlock(shared.handle)

    def wait(self, deadline: float | None) -> None:
        """Back up what open leases batched, then wait (up to ``deadline``, a ``time.monotonic``
        value) for every queued write; a backup waiting for host room waits no longer either."""
        self.room_deadline = deadline
        try:
            self.end_open()
        finally:
            self.room_deadline = None
        if self.hit_touch.wait(deadline, self.refused) or self.unqueued.lost:
            self.drain()  # (what L3 lost of a hit, an interrupted backup's write: waited for below)
        wait_writes(self.pending, deadline)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the writer thread; ``wait=False`` cancels queued writes and returns at once."""
        self._thread.shutdown(wait=wait, cancel_futures=not wait)


def _host_units(
    writer: Writer, candidates: list[TreeNode], rounds: bool
) -> tuple[list[TreeNode], Raw, Raw, bool]:
    """Host units for the leading candidates: the nodes, per tree pool their device units and
    the host units, both in node order as int64 bytes, and whether it stalled. All at once
    from free units, else a node at a time (evicting, or waiting for L3 writes), stopping at
    the first that does not fit; with ``rounds``, where the units taken for earlier candidates
    hold the room it needs (stalled: no eviction can take units no node holds yet, and no
    write in flight frees them)."""
    if not candidates:
        return [], {}, {}, False
    index = writer.tree.index  # the tree pools, anchor first
    device = device_units(candidates, index)
    if len(candidates) > 1:
        needs = {name: len(units) // UNIT for name, units in device.items()}
        got = writer.units.try_alloc(Tier.HOST, needs, arrays=True)
        if got is not None:  # never evicts
            return candidates, device, {name: units.tobytes() for name, units in got.items()}, False
    todo: list[TreeNode] = []
    allocated: list[Units] = []
    stalled = False
    for node in candidates:
        needs = unit_counts(node, index)
        try:
            got = writer.units.alloc_protecting(node, Tier.HOST, needs)
            if got is None and rounds and allocated:
                stalled = True
                break
            if got is None and writer.pending:
                got = wait_for_room(writer, node, needs)
        except BaseException:  # the units taken for earlier nodes are no one's yet
            for taken in allocated:
                writer.units.free(Tier.HOST, taken)
            raise
        if got is None:  # the host tier is full of pages other requests hold
            writer.metrics.count(Operation.BACKUPS_SKIPPED)
            break
        todo.append(node)
        allocated.append(got)
    if len(todo) < len(candidates):
        device = device_units(todo, index)
    return todo, device, joined(allocated), stalled


def _check_backups(writer: Writer, digests: UnitDigests, nodes: Sequence[TreeNode]) -> None:
    """``debug.unit_digests``: the host copies just made hold what the device units did."""
    known: dict[TreeNode, list[str]] = {}
    for node in nodes:
        node_hashes_from_path(writer.tree, node, writer.page_size, writer.namespace_root, known)
    check_nodes(digests, "backup", writer.tree.index, nodes, known, Tier.HOST)


def back_up_prefix(writer: Writer, keys: Sequence[PageKey], hashes: PageHashes) -> bool:
    """Whether every page of ``keys`` has a host copy, backing device-only ones up first
    (an L3 refill below a page without one would break the contiguous-backup rule)."""
    match = writer.tree.match(keys, count_hit=False)
    if match.host_pages < len(keys):
        return False
    if writer.waits:  # write-back: nodes below the path wait for its L3 write, or it for theirs
        with writer.unqueued.call():
            todo = writer.copy_to_host(match.path)
            if writer.engine is not None and (ready := writer.waits.ready(todo)):
                writer._queue_write(ready, None)
    elif not all(writer.tree.backed_up(n) for n in match.path):
        writer.back_up(match.path, hashes=hashes)
    return all(writer.tree.backed_up(n) for n in match.path)


def _sighted(writer: Writer, path: Sequence[TreeNode]) -> None:
    """An insert's new nodes: one sighting for each admission filter (its reuse count, sketch)."""
    writer.host_admission.seen(path)
    writer.storage_admission.seen(path)


def _back_up_chain(writer: Writer, chain: OpenChain) -> None:
    """Write-through of the nodes of ``chain`` (one insert's, or an open lease's batch)."""
    path = tree_path(writer.tree, chain.node, chain.since)
    _sighted(writer, path)
    # ancestors a backup skipped (the host tier was full): without them, backups being a
    # contiguous prefix, nothing below them would reach the host tier or L3 again
    path = unbacked_above(writer.tree, path) + path
    # nodes on the path that were on the host before this insert (split by it, where it left a
    # checkpoint or diverged): a backup carries every component, these may lack the new ones
    earlier = [node for node in path if node.host_raw[0] is not None]
    if earlier:
        back_up_components(writer, earlier, chain.hashes)
    if writer.engine is not None and writer.layout.windowed:
        # a prefix end that was inside a node when that node went to L3 gets its last window
        # there: the cached prefix this insert starts from, and the ends of those earlier nodes.
        # Before the new nodes' write, whose windows then leave out the pages these hold (each
        # went out twice: in the window below the end, and on its own)
        since = chain.since
        ends = [since] if since is not None and since.depth_end == chain.cached else []
        for end in ends + earlier:
            window_end_to_l3(writer, end, chain.hashes)
    writer.back_up(path, hashes=chain.hashes, admit=True)


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
