"""What the eviction benchmarks share: a hit-rate run that tells the future the clock, and
``learned``'s ranking with each insert's score fixed from outside its model."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.eviction_policies.learned import LearnedConfig, LearnedPolicy
from kvstrata.plugins import EvictionPolicy, PolicyContext
from kvstrata.plugins.eviction_policy import E
from kvstrata.replay.simulate import HitRateSimulator, TraceFuture
from kvstrata.replay.trace import TraceRequest


def hit_rate(
    trace: list[TraceRequest], capacity: int, policy: EvictionPolicy | None, future: TraceFuture
) -> float:
    """Token-weighted hit rate of ``policy`` (None: LRU); ``future.now`` follows the request."""
    sim = HitRateSimulator(capacity_tokens=capacity, policy=policy)
    hits = tokens = 0
    for index, request in enumerate(trace):
        future.now = index
        hits += sim.access(request)
        tokens += request.input_length
    return hits / tokens


class FixedInsertScore(LearnedPolicy):
    """``learned`` whose nodes keep the log-odds ``insert_score`` gave them when they entered
    (benchmark only): ranked ``stamp + shift x score`` like ``learned``, with an optional floor for
    re-read prefixes (``reread_floor``)."""

    def __init__(self, context: PolicyContext, future: TraceFuture) -> None:
        super().__init__(LearnedConfig(), context)
        self.future = future
        self.score: dict[E, float] = {}

    def insert_score(self, entries: Sequence[E]) -> float:
        raise NotImplementedError

    def reread_floor(self) -> float | None:
        return None

    def inserted(self, entries: Sequence[E]) -> None:
        super().inserted(entries)
        score = self.insert_score(entries)
        for node in entries:
            self.score[node] = score

    def split(self, upper: E, lower: E) -> None:
        super().split(upper, lower)
        if lower in self.score:
            self.score[upper] = self.score[lower]

    def removed(self, entries: Sequence[E]) -> None:
        super().removed(entries)
        for node in entries:
            self.score.pop(node, None)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        shift, floor = self.shift(), self.reread_floor()
        out = []
        for node in entries:
            score = self.score.get(node, 0.0)
            if floor is not None and node in self.reread:
                score = max(score, floor)
            out.append((self.stamp.get(node, self.requests) + shift * score, node.id, node))
        return out
