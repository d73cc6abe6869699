"""``reuse``: adaptive probation with reuse prediction -- kvstrata's own policy for prefix caches.

Most prefixes of a chat or agent trace are never read again (three in four blocks of the
Mooncake conversation trace), and LRU keeps each of them as long as the ones that are. ``reuse``
gives a prefix two lives:

- **Probation.** A prefix enters its tier on probation. Read by a later request (an access
  event), it moves to **main**, which is LRU over requests. A prefix that comes back while a
  ghost of it is remembered (it left recently) enters main directly.
- **Adaptive split.** An eviction takes from probation while probation holds more than its
  target, else from main. The target adapts as in ARC: a prefix returning from the probation
  ghost says probation was too short (the target grows by its pages, more when the main ghost is
  the larger), one returning from the main ghost shrinks it; it stays within
  ``[min_probation, max_probation]`` of the tier. So a small cache filters one-time prefixes
  hard while a large one keeps new prefixes about as long as LRU would.
- **Reuse prediction by size.** Within probation, leaves are ranked by how long they have waited,
  shifted by the learned odds that a prefix of their size class (pages, powers of two) is read
  again: every leaf leaving probation is an outcome, a promotion or a ghost return a reuse; the
  shift is ``size_weight`` x the mean probation lifetime x the difference of log-odds to the mean.
  On the conversation trace a request adding a few pages is continued far more often than one
  adding a long document; on document Q&A the long prefix is the shared one. Both are learned,
  not assumed. Counts halve every ``decay`` outcomes, so the estimate follows the traffic.

Chain-awareness comes from the tree (only leaves are ranked: tails before heads). Everything
is counted in requests (one access event each), so the policy behaves the same in every tier,
in ``kvstrata simulate`` and in a replay. Deterministic: no randomness, insertion-ordered state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvstrata.eviction_policies._ghosts import Ghosts, ghost_key
from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)

_SEGMENT = float(1 << 50)  # the segment evicted second ranks after every stamp of the first
_PROBATION, _MAIN = 0, 1
_CLASSES = 9  # size classes: pages.bit_length(), capped (1, 2-3, 4-7, ..., 256+)
_LIFETIME_EWMA = 0.02  # weight of one leaf's probation lifetime in the running mean


class ReuseConfig(EvictionPolicyConfig):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN rank orders nothing
    type: Literal["reuse"] = "reuse"
    initial_probation: float = Field(0.1, gt=0, lt=1, description="probation share to start with")
    min_probation: float = Field(0.02, ge=0, lt=1, description="least probation share")
    max_probation: float = Field(0.5, gt=0, le=1, description="largest probation share")
    size_weight: float = Field(
        0.3, ge=0, le=100, description="weight of the learned reuse odds per size class"
    )
    prior: float = Field(4.0, gt=0, description="outcomes of the mean rate a size class starts with")
    decay: int = Field(4096, ge=16, description="outcomes between halvings of the learned counts")

    @model_validator(mode="after")
    def _ordered(self) -> ReuseConfig:
        if not self.min_probation <= self.initial_probation <= self.max_probation:
            raise ValueError("need min_probation <= initial_probation <= max_probation")
        return self


class ReusePolicy(EvictionPolicy):
    name = "reuse"
    Config = ReuseConfig
    capabilities = PolicyCapabilities(events=True, needs_frequency=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, ReuseConfig)
        self.settings = config
        capacity = max(1, context.capacity_pages)
        self.target = config.initial_probation * capacity
        self.low, self.high = config.min_probation * capacity, config.max_probation * capacity
        self.segment: dict[object, int] = {}
        self.stamp: dict[object, float] = {}  # last request that read (main) / entry (probation)
        self.size: dict[object, int] = {}
        self.size_class: dict[object, int] = {}  # probation leaves only
        self.pages = [0, 0]  # pages on probation, in main
        self.ghosts = (Ghosts(capacity), Ghosts(capacity))  # left probation, left main
        self.requests = 0  # the clock: one tick per access event (request)
        self.reused = [0.0] * _CLASSES
        self.outcomes = [0.0] * _CLASSES
        self.since_decay = 0
        self.lifetime = 1.0  # mean requests a leaf spends on probation before it leaves

    # --- bookkeeping --------------------------------------------------------------------------

    def _enter(self, node: E, segment: int) -> None:
        self.segment[node] = segment
        self.stamp[node] = self.requests
        self.size[node] = node.pages
        self.pages[segment] += node.pages
        if segment == _PROBATION:
            self.size_class[node] = min(node.pages.bit_length(), _CLASSES - 1)

    def _outcome(self, size_class: int, reused: bool) -> None:
        self.outcomes[size_class] += 1
        self.reused[size_class] += reused
        self.since_decay += 1
        if self.since_decay >= self.settings.decay:
            self.since_decay = 0
            self.reused = [r / 2 for r in self.reused]
            self.outcomes = [o / 2 for o in self.outcomes]

    def _log_odds(self) -> list[float]:
        """Per size class: log-odds of a reuse minus those of the mean, shrunk towards it."""
        mean = (sum(self.reused) + 1) / (sum(self.outcomes) + 2)
        prior = self.settings.prior
        out = []
        for reused, outcomes in zip(self.reused, self.outcomes, strict=True):
            rate = min(max((reused + prior * mean) / (outcomes + prior), 1e-3), 1 - 1e-3)
            out.append(math.log(rate / (1 - rate)) - math.log(mean / (1 - mean)))
        return out

    # --- ranking ------------------------------------------------------------------------------

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        for node in entries:  # unheard of (an insert revived a host-only node): new, entered
            if node not in self.segment:  # before the segments' order is read from the counts,
                self._enter(node, _PROBATION)  # else a node ranked alone next ranked otherwise
        probation_first = self.pages[_PROBATION] > self.target or self.pages[_MAIN] == 0
        shift = self.settings.size_weight * self.lifetime
        odds = self._log_odds() if shift else None
        out = []
        for node in entries:
            segment = self.segment[node]
            rank = self.stamp[node]
            if segment == _PROBATION and odds is not None:
                rank += shift * odds[self.size_class[node]]
            second = (segment == _MAIN) if probation_first else (segment == _PROBATION)
            out.append((second * _SEGMENT + rank, node.id, node))
        return out

    # --- events -------------------------------------------------------------------------------

    def inserted(self, entries: Sequence[E]) -> None:
        for node in entries:
            if node in self.segment:
                continue
            key = ghost_key(node)
            # ghost pages as ARC's delta counts them: with the returning prefix in its ghost
            probation, main = self.ghosts[_PROBATION].pages, self.ghosts[_MAIN].pages
            from_probation = self.ghosts[_PROBATION].take(key)
            from_main = None if from_probation is not None else self.ghosts[_MAIN].take(key)
            if from_probation is not None:
                self.target = min(self.high, self.target + max(main / max(probation, 1), 1.0) * node.pages)
                self.reused[from_probation[1]] += 1  # it left probation and came back
                self._enter(node, _MAIN)
            elif from_main is not None:
                self.target = max(self.low, self.target - max(probation / max(main, 1), 1.0) * node.pages)
                self._enter(node, _MAIN)
            else:
                self._enter(node, _PROBATION)

    def accessed(self, entries: Sequence[E]) -> None:
        self.requests += 1
        for node in entries:
            segment = self.segment.get(node)
            if segment is None:
                continue
            if segment == _PROBATION:  # read again: a reuse, into main
                self._outcome(self.size_class.pop(node), True)
                self.pages[_PROBATION] -= self.size[node]
                self.pages[_MAIN] += self.size[node]
                self.segment[node] = _MAIN
            self.stamp[node] = self.requests

    def split(self, upper: E, lower: E) -> None:
        segment = self.segment.get(lower)
        if segment is None:
            return
        self.segment[upper] = segment
        self.stamp[upper] = self.stamp[lower]
        self.size[upper] = upper.pages
        self.size[lower] = lower.pages  # the two halves together hold what ``lower`` held
        if segment == _PROBATION:
            self.size_class[upper] = self.size_class[lower]

    def removed(self, entries: Sequence[E]) -> None:
        for node in entries:
            segment = self.segment.pop(node, None)
            if segment is None:
                continue
            pages = self.size.pop(node)
            self.pages[segment] -= pages
            if segment == _PROBATION:
                size_class = self.size_class.pop(node)
                self._outcome(size_class, False)
                self._lived(node)
                self.ghosts[_PROBATION].add(ghost_key(node), pages, size_class)
            else:
                self.ghosts[_MAIN].add(ghost_key(node), pages)
            del self.stamp[node]

    def _lived(self, node: object) -> None:
        """A leaf was evicted from probation: fold its stay (in requests) into the mean
        lifetime, the time scale of the size shift."""
        stay = self.requests - self.stamp[node]
        self.lifetime += _LIFETIME_EWMA * (stay - self.lifetime)
