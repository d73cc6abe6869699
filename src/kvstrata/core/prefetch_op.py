"""One L3 -> L2 read in flight: the handle a lease holds from ``lookup`` to ``admit``.

The prefetcher (:mod:`~kvstrata.core.prefetcher`) makes it and is the only reader of its fields;
a :class:`~kvstrata.core.lease.Lease` only carries it, so the lease knows nothing of how L3 is
read and the prefetcher nothing of leases.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvstrata.core.metrics import CacheMetrics, SkipReason


@dataclass(eq=False)
class PrefetchOp:
    """One L3 -> L2 read. The worker fills the result fields and sets ``done``; only the owner
    thread touches the tree or frees ``reserved`` (once ``done`` is set)."""

    start: int  # first page read (the request's host-usable prefix before it)
    hashes: list[str]  # page hashes of pages [start, start + len(hashes))
    started_s: float
    reserved: dict[str, torch.Tensor] = field(default_factory=dict)  # host units per tree pool
    short: dict[str, int] | None = None  # units the worker could not take without eviction
    found: int = 0  # leading pages whose anchor object exists
    found_known: bool = False  # the worker has set ``found`` (its existence query ended)
    exists_failed: bool = False  # an existence query failed: its False answers say nothing
    pages: int = 0  # pages whose objects the worker read and verified, every pool included
    read_end: int = 0  # pages the worker tried to read (window/state objects sit at its end)
    #: a shorter end the ranks settled on whose window/state objects the units now hold (0: none)
    settled: int = 0
    #: pages the settle reads lost to their objects (in ``lost``; not a rank's disagreement)
    settle_lost: int = 0
    blocking: bool = False  # admit waits for it whatever the end policy
    foreign: int = 0  # objects the reads refused as another layout / format (not damage)
    #: a read refused an object as damaged or failed: a short read is damage, not an eviction
    damaged: bool = False
    #: prefix ends where every state pool has an object (from the existence query)
    checkpoints: list[int] = field(default_factory=list)
    #: anchor pages found but not usable, by reason (filled by the worker)
    lost: dict[SkipReason, int] = field(default_factory=dict)
    cancelled: bool = False
    #: its pages count in ``Prefetcher.reserved_pages`` (cleared once, by ``Prefetcher.release``)
    counted: bool = True
    #: ``finish`` gave up waiting (what was read after that is a timeout's loss, not a rank's)
    timed_out: bool = False
    #: revoked before ``found_known``: the skip reason and the lease's ``skipped`` to count
    #: ``found`` into when the worker ends (a count of the pages asked for would overstate it)
    revoked: tuple[SkipReason, dict[str, int]] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def revoked_loss(self, why: SkipReason) -> tuple[SkipReason, int]:
        """What a revoked read lost: the pages L3 holds (not the pages asked for), or every page
        asked for where L3 could not say (its existence query failed)."""
        return (SkipReason.STORAGE_DOWN, len(self.hashes)) if self.exists_failed else (why, self.found)


def read_failed(op: PrefetchOp, metrics: CacheMetrics, asked: bool) -> None:
    """A worker that raised read nothing: one failure, and the pages no reason counts yet lost
    as a failed existence query's (``asked`` False: every page asked for) or a failed read's."""
    metrics.fail()
    op.pages = 0
    if not asked:
        op.exists_failed, op.found_known = True, True
        op.lost = {SkipReason.STORAGE_DOWN: len(op.hashes)}
    elif op.read_end > 0:
        op.lost[SkipReason.DAMAGED_OBJECT] = op.lost.get(SkipReason.DAMAGED_OBJECT, 0) + op.read_end
