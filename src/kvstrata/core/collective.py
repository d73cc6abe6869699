"""How ranks agree on hit lengths: a MIN over small integer vectors.

Every rank of a tensor/context-parallel group holds its own shard of each page, so a prefix is
usable only if *every* rank holds it: the controller takes the MIN of its local lengths at two
fixed points of each ``admit`` (:class:`RankAgreement`: one call each, repeated while a state or
window pool lets the ranks end the prefix only at different pages; every call also carries the
admit's number), which all ranks reach in the same order because the engine drives them in
lockstep, also when an ``admit`` raises on one of them. A single
process needs no communication (:class:`LocalCollective`, the default); a ``torch.distributed``
process group (gloo, CPU tensors) does it across processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

log = logging.getLogger(__name__)


@runtime_checkable
class Collective(Protocol):
    """Element-wise MIN of an integer vector over every rank of the group."""

    @property
    def world_size(self) -> int: ...

    def all_min(self, values: Sequence[int]) -> list[int]: ...


class _Prefix(Protocol):
    @property
    def device_pages(self) -> int: ...


Match = TypeVar("Match", bound=_Prefix)


class LocalCollective:
    """One rank: the MIN over one value is the value itself."""

    @property
    def world_size(self) -> int:
        return 1

    def all_min(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


class TorchCollective:
    """MIN through ``torch.distributed.all_reduce`` on ``group`` (default: the world group).

    The group must have a CPU-capable backend (gloo): the vectors are a few int64 values, far
    cheaper to reduce on the CPU than to ship to an accelerator.
    """

    def __init__(self, group: Any | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchCollective needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group(backend='gloo', ...))"
            )
        self._dist = dist
        self._group = group

    @property
    def world_size(self) -> int:
        return int(self._dist.get_world_size(self._group))

    def all_min(self, values: Sequence[int]) -> list[int]:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)
        return [int(v) for v in tensor.tolist()]


def agreement_for(collective: Collective | None, parallel: Any) -> RankAgreement:
    """The rank agreement of a cache whose process has ``parallel``'s coordinates. A rank of
    several (tensor, pipeline or context parallel) with no collective is refused: each rank
    would decide alone what a request reuses and, one rank missing an object, they would serve
    different prefix lengths. ``LocalCollective()`` passed explicitly says this process decides
    alone on purpose (a tool reading one rank's objects). A group of several ranks must be
    exactly this config's ranks, each with its own coordinates (checked with one MIN: every rank
    of the group opens its cache, as every rank calls ``admit``)."""
    ranks = parallel.tp_size * parallel.pp_size * parallel.cp_size
    if collective is None and ranks > 1:
        raise ValueError(
            f"parallel: this process is one of {ranks} ranks (tp_size={parallel.tp_size}, "
            f"pp_size={parallel.pp_size}, cp_size={parallel.cp_size}) that must agree on what each "
            "request reuses: pass collective=TorchCollective(group) (kvstrata.core.collective, a gloo "
            "group of those ranks), or collective=LocalCollective() where this process decides alone"
        )
    size = 1 if collective is None else collective.world_size
    if size > 1:
        _check_group(collective, parallel, ranks)  # type: ignore[arg-type]
    return RankAgreement(collective or LocalCollective())


def _check_group(collective: Collective, parallel: Any, ranks: int) -> None:
    """Refuse a group that is not exactly this config's ranks: a group of 2 ranks whose configs
    both said ``tp_size=1`` (or both ``tp_rank=0``) wrote both shards under one key, and one rank
    then restored the other's bytes. One MIN at open that every rank reaches before it decides
    (a rank refusing alone would leave the others waiting in it): the MIN and MAX of each rank's
    count of ranks, and per place in the group whether some rank holds it (-1)."""
    size = collective.world_size
    place = (parallel.pp_rank * parallel.cp_size + parallel.cp_rank) * parallel.tp_size + parallel.tp_rank
    low, negated, *taken = collective.all_min([ranks, -ranks, *(-int(i == place) for i in range(size))])
    if low != -negated or low != size:
        raise ValueError(
            f"parallel: the collective's group has {size} ranks but this config describes {ranks} "
            f"(tp_size={parallel.tp_size} x pp_size={parallel.pp_size} x cp_size={parallel.cp_size}; "
            f"the group's configs say {low} to {-negated}): the group must be exactly the ranks that "
            "share each page (not the data-parallel replicas)"
        )
    if any(t == 0 for t in taken):
        raise ValueError(
            f"parallel: two ranks of the collective's group have the same coordinates (this one: "
            f"tp_rank={parallel.tp_rank}, pp_rank={parallel.pp_rank}, cp_rank={parallel.cp_rank}): "
            "each rank must set its own parallel.*_rank"
        )


#: What a rank that failed inside ``admit`` offers at the agreement points it still owes: a
#: length no rank holds, so the MIN tells every rank that one failed (all then agree on 0)
FAILED = -1
#: the agreement points of one ``admit``, in the order every rank meets them
_PREFETCH, _DEVICE = "prefetch", "device"


class RankAgreement:
    """The two points where ranks agree on what a request reuses, named so a reader finds them.

    ``prefetch_pages``: after each rank ended its prefetch, where the prefix every rank holds ends;
    ``cached_match``: after the load-back, the device prefix every rank holds. Each is one MIN
    over the group (more rounds where a rank cannot end its prefix at the MIN: a state or window
    pool's objects at another page), reached in the same order on every rank. ``disagreements``
    counts the calls where this rank had more than the group agreed on (pages it holds but may
    not serve), ``failures`` the calls a rank failed in (not also a disagreement).

    One ``admit`` runs inside ``with agreement:``. A rank whose admit raises (a plugin, a copy, an
    interrupt) still meets the points it owes, offering :data:`FAILED`, then re-raises: alone, it
    left the others waiting in the collective until the group's timeout (30 minutes for gloo), or
    its next admit met their stale point. The others see the failure and reuse nothing of that
    request (``failures`` counts such admits, on every rank). An error of the collective itself
    meets nothing more (the group is broken). An interrupt arriving inside the collective call is
    taken as having met that point (Python runs signal handlers once the call has returned); one
    landing between a call and what this rank notes it owes may leave it a call short or over,
    which the next call finds and mends (``_in_step``: every call carries the admit's number).
    """

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.disagreements = 0
        self.failures = 0
        self.admits = 0  # ``with`` blocks entered: the same on every rank (the engine's lockstep)
        self._owed: str | None = None  # the point this admit meets next (None: nothing owed)
        self._failed = False  # a point of this admit showed a failed rank: later ones agree on 0

    def __enter__(self) -> RankAgreement:
        self._owed, self._failed = _PREFETCH, False
        self.admits += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        (owed, self._owed), (failed, self._failed) = (self._owed, None), (self._failed, False)
        if error is None or owed is None or (owed == _DEVICE and failed):
            return
        try:  # meet the owed point with a length no rank holds (then every rank has seen it)
            self._in_step([FAILED, -FAILED])  # (either point: two values)
            self.failures += 1
        except Exception:  # the group's own error: the admit's error is the one to raise
            log.exception("rank agreement: could not tell the group this rank failed")

    def _reduce(self, values: list[int]) -> list[int]:
        try:
            return self._in_step(values)
        except Exception:
            self._owed = None  # the collective failed: the group meets no further point
            raise

    def _in_step(self, values: list[int]) -> list[int]:
        """The MIN of ``values`` over the group, each call tagged with this admit's number (its
        MIN and MAX). An interrupt landing just before or after a call, before this rank noted
        what it owes, left it a call short or over: it met another admit's point, and from then
        on every MIN paired two requests. A rank that sees one already past this admit takes
        this point as failed (that rank left it; it makes no further call of it); one that sees
        a rank still in an earlier admit meets the group again (its call was that admit's)."""
        tag = self.admits
        while True:
            *agreed, first, negated = self.collective.all_min([*values, tag, -tag])
            if -negated > tag:
                return [FAILED, *agreed[1:]]  # (as a failed rank's offer reads)
            if first == tag:
                return agreed

    def prefetch_pages(self, start: int, local: int, shorter: Callable[[int], int] | None = None) -> int:
        """Pages of this rank's prefetch (``local`` read from page ``start``: it holds ``[0,
        start)`` already) that every rank holds. The ranks agree on where that prefix ends, not on
        how many pages each read: ranks whose trees differ start their reads at different pages
        (one holds 4 pages, another reads those 4 from L3: a MIN of the counts, 0 and 4, threw
        away a prefix both held). ``shorter(n)``: this rank's pages of a read ending at most
        ``n`` pages after ``start`` (a window or state pool ends a prefix only where it holds
        objects, maybe below ``n``; None: any ``n`` is one). Each round agrees on the MIN end and
        the MAX end of a rank that may land below it; such a rank shortens and another round
        follows (one round when every rank lands on the MIN: it clamps, or holds the MIN)."""
        pages = local
        low, top = self._prefetch_round(start + pages, shorter is not None and pages > 0)
        gave_up = low < start + pages
        while low != FAILED and top > low:
            self._owed = _PREFETCH  # this rank owes the next round (also if ``shorter`` raises)
            if start + pages > low:  # (``shorter`` is None: clamped exactly, it lands on ``low``)
                fit = max(0, low - start)
                pages = min(pages, fit) if shorter is None or fit >= pages else shorter(fit)
            low, top = self._prefetch_round(start + pages, shorter is not None and pages > 0)
        if low == FAILED:  # (no length is negative: only a failed rank offers one)
            self._failed = True
            self.failures += 1
            return 0
        self.disagreements += int(gave_up)
        return min(pages, max(0, low - start))

    def _prefetch_round(self, end: int, inexact: bool) -> tuple[int, int]:
        """One round of the prefetch point: the MIN end, and the MAX end of the ranks that may
        end below a MIN they shorten to (0 if none)."""
        self._owed = _DEVICE  # (before the call: see the class docstring on interrupts)
        low, negated = self._reduce([end, -end if inexact else 0])
        return low, -negated

    def cached_match(self, match: Match, within: Callable[[int], Match]) -> Match:
        """This rank's match of the device prefix every rank holds, from its own ``match``.
        ``within(n)``: this rank's match of the first ``n`` pages, whose prefix a state or window
        pool may end below ``n`` (a rank whose state is at page 12 only holds no 8-page prefix:
        one MIN of 8 and 12 served 8 pages on one rank and 0 on the other). Each round agrees on
        the MIN and the MAX; every rank sees both, so all stop at the same round, once every rank
        holds the MIN. After a failed rank (this admit's prefetch point said so) every rank
        agrees on 0 without a call."""
        if self._failed:
            self._owed = None
            return within(0)
        low, high = self._bounds(match.device_pages)
        if FAILED < low < match.device_pages:  # (a failed rank is counted once, in ``failures``)
            self.disagreements += 1
        while low != high and low != FAILED:
            match = within(low)
            low, high = self._bounds(match.device_pages)
        self._owed = None
        if low == FAILED:
            self.failures += 1
            return within(0)
        return match

    def _bounds(self, local: int) -> tuple[int, int]:
        self._owed = None  # (an interrupt inside the call: met, and taken as the last round)
        low, negated = self._reduce([local, -local])
        self._owed = _DEVICE  # until ``cached_match`` returns: another round may follow
        return low, -negated
