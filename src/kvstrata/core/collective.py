"""How ranks agree on hit lengths: a MIN over small integer vectors.

Every rank of a tensor/context-parallel group holds its own shard of each page, so a prefix is
usable only if *every* rank holds it: the controller takes the MIN of its local lengths at fixed
points (one call per ``admit``), which all ranks reach in the same order because the engine drives
them in lockstep. A single process needs no communication (:class:`LocalCollective`, the
default); a ``torch.distributed`` process group (gloo, CPU tensors) does it across processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch


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


class RankAgreement:
    """The two points where ranks agree on what a request reuses, named so a reader finds them.

    ``prefetch_pages``: after each rank ended its prefetch, where the prefix every rank holds ends;
    ``cached_match``: after the load-back, the device prefix every rank holds. Each is one MIN
    over the group (``cached_match``: more rounds where ranks' trees end prefixes at different
    pages), reached in the same order on every rank. ``disagreements`` counts the calls
    where this rank had more than the group agreed on (pages it holds but may not serve).
    """

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.disagreements = 0

    def _agree(self, local: int) -> int:
        (agreed,) = self.collective.all_min([local])
        if agreed < local:
            self.disagreements += 1
        return agreed

    def prefetch_pages(self, start: int, local: int) -> int:
        """Pages of this rank's prefetch (``local`` read from page ``start``: it holds ``[0,
        start)`` already) that every rank holds. The ranks agree on where that prefix ends, not on
        how many pages each read: ranks whose trees differ start their reads at different pages
        (one holds 4 pages, another reads those 4 from L3: a MIN of the counts, 0 and 4, threw
        away a prefix both held)."""
        end = self._agree(start + local)
        return min(local, max(0, end - start))

    def cached_match(self, match: Match, within: Callable[[int], Match]) -> Match:
        """This rank's match of the device prefix every rank holds, from its own ``match``.
        ``within(n)``: this rank's match of the first ``n`` pages, whose prefix a state or window
        pool may end below ``n`` (a rank whose state is at page 12 only holds no 8-page prefix:
        one MIN of 8 and 12 served 8 pages on one rank and 0 on the other). Each round agrees on
        the MIN and the MAX; every rank sees both, so all stop at the same round, once every rank
        holds the MIN."""
        low, high = self._bounds(match.device_pages)
        if low < match.device_pages:
            self.disagreements += 1
        while low != high:
            match = within(low)
            low, high = self._bounds(match.device_pages)
        return match

    def _bounds(self, local: int) -> tuple[int, int]:
        low, negated = self.collective.all_min([local, -local])
        return low, -negated
