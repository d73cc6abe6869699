"""``learned``: LRU shifted by an online reuse model fitted to the tier's own traffic.

Most prefixes a chat or agent workload inserts are never read again (three in four blocks of the
Mooncake conversation trace), yet LRU keeps each as long as the ones that are. ``learned``
predicts, when a request inserts its new pages, how likely a later request is to continue that
prefix, and ranks every leaf by

    rank = last read (in requests) + shift x log-odds of its prediction

so a prefix the model trusts outlives LRU and one it does not leaves early. The model is a
logistic regression over what the tree shows at insert time -- no engine hints:

- **pages new** to the cache's memory, **pages before** them and the **total**: a short
  follow-up on a known conversation is continued far more often than a long fresh document;
- **turn**: how many earlier requests built this chain.

"New" and "turn" come from a bounded **history** of page keys (``history_factor`` x the tier's
pages, oldest forgotten first), so a prefix evicted and sent again still counts as known. Every
prediction becomes a training sample once its outcome is known: a later request holding the
inserted prefix's last page within the **horizon** (a reuse), or the horizon passing (none).
The model is refitted by Newton steps on the last ``window`` outcomes every ``refit_every`` of
them (torch, well under a millisecond), and ranks always use the current fit.

Two scales keep it near LRU where prediction cannot pay: the shift is at most
``shift_lifetimes`` x the tier's mean lifetime (the requests a leaf stays before eviction, an
EWMA) and at most ``max_shift`` requests, and the horizon grows with the lifetime
(``horizon_lifetimes``, at least ``min_horizon``). A prefix read again since it entered the tier
ranks at least ``reread_bonus`` above the mean prediction: a shared document stays once it has
been shared. Chain-awareness comes from the tree (only leaves are ranked). Deterministic: no
randomness, insertion-ordered state. The defaults were chosen on the two bundled Mooncake
traces (docs/eviction.md has the sweep).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kvstrata.eviction_policies._ghosts import ghost_key
from kvstrata.plugins.eviction_policy import (
    NEVER,
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)

Features = tuple[float, ...]
_MEAN_EWMA = 0.01  # weight of one insert's log-odds in the running mean
_LIFETIME_EWMA = 0.01  # weight of one eviction's age in the running mean lifetime
_MAX_STEP = 2.0  # largest Newton step (norm): a fresh window cannot throw the model far
_MIN_OUTCOMES = 20  # of each kind before the first fit (until then every score is 0)


class LearnedConfig(EvictionPolicyConfig):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN rank orders nothing
    type: Literal["learned"] = "learned"
    max_shift: float = Field(400.0, ge=0, description="largest rank shift per unit of log-odds, in requests")
    shift_lifetimes: float = Field(1.5, ge=0, description="largest shift in mean lifetimes of the tier")
    min_horizon: int = Field(1000, ge=1, description="requests within which a reuse counts, at least")
    horizon_lifetimes: float = Field(1.5, ge=0, description="horizon in mean lifetimes, when longer")
    reread_bonus: float = Field(2.0, ge=0, description="least log-odds above the mean of a re-read prefix")
    window: int = Field(4096, ge=64, description="outcomes the model is fitted on (the latest)")
    refit_every: int = Field(256, ge=1, description="outcomes between refits")
    l2: float = Field(1.0, gt=0, description="ridge penalty of the logistic regression")
    history_factor: float = Field(16.0, ge=0, description="page keys remembered, in tier capacities")


def features(new: int, before: int, turn: int) -> Features:
    """What the model sees of one insert (see the module docstring); the first is the intercept."""
    return (
        1.0,
        math.log2(new + 1),
        math.log2(before + 1),
        math.log2(new + before + 1),
        float(min(turn, 64)),
    )


def _page_ids(node: E) -> list[Hashable]:
    """Each page of ``node`` as ``(position, page key)``: a live page key is the page's tokens,
    not chained to what precedes them, so the position keeps the same tokens elsewhere in
    another prefix from counting as this page's reuse (see ``_ghosts.ghost_key``)."""
    start = node.depth_end - node.pages
    return [(start + i, key) for i, key in enumerate(node.keys)]


def _last_key(node: E | None) -> Hashable | None:
    """The last page of ``node`` as :func:`_page_ids` names it (None for the root)."""
    return (node.depth_end - 1, node.keys[-1]) if node is not None and len(node.keys) else None


class ReuseModel:
    """Logistic regression of "this prefix is continued within the horizon", refitted online."""

    def __init__(self, dims: int, window: int, refit_every: int, l2: float) -> None:
        self.version = 0  # refits so far
        self._x = torch.zeros(window, dims, dtype=torch.float64)
        self._y = torch.zeros(window, dtype=torch.float64)
        self._next = 0  # ring-buffer slot of the next outcome
        self._count = 0  # outcomes held (at most window)
        self._since = 0
        self._refit_every = refit_every
        self._l2 = l2
        self._w = [0.0] * dims  # Python floats: scoring a handful of features needs no torch

    def log_odds(self, x: Features) -> float:
        return sum(w * v for w, v in zip(self._w, x, strict=True))

    def learn(self, x: Features, reused: bool) -> None:
        slot = self._next
        self._x[slot] = torch.tensor(x, dtype=torch.float64)
        self._y[slot] = float(reused)
        self._next = (slot + 1) % len(self._y)
        self._count = min(self._count + 1, len(self._y))
        self._since += 1
        if self._since >= self._refit_every:
            self._since = 0
            self.refit()

    def refit(self, steps: int = 2) -> None:
        """A few damped Newton steps of ridge logistic regression on the window."""
        x, y = self._x[: self._count], self._y[: self._count]
        positives = float(y.sum())
        if positives < _MIN_OUTCOMES or self._count - positives < _MIN_OUTCOMES:
            return
        w = torch.tensor(self._w, dtype=torch.float64)
        eye = torch.eye(len(w), dtype=torch.float64) * self._l2
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            gradient = x.T @ (p - y) + self._l2 * w
            hessian = (x * (p * (1 - p)).unsqueeze(1)).T @ x + eye
            try:  # a tiny l2 over collinear features (a constant one) leaves it singular
                step = torch.linalg.solve(hessian, gradient)
            except RuntimeError:  # (torch.linalg.LinAlgError)
                return  # the last fit stays: raising here failed the event that learned the outcome
            w = w - step * min(1.0, _MAX_STEP / max(float(step.norm()), 1e-12))
        if not bool(torch.isfinite(w).all()):
            return  # (an overflow): a NaN weight made every rank NaN, which orders nothing
        self._w = w.tolist()
        self.version += 1


class LearnedPolicy(EvictionPolicy):
    name = "learned"
    Config = LearnedConfig
    capabilities = PolicyCapabilities(events=True, needs_frequency=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, LearnedConfig)
        self.settings = config
        capacity = max(1, context.capacity_pages)
        self.model = ReuseModel(len(features(0, 0, 0)), config.window, config.refit_every, config.l2)
        self.requests = 0  # the clock: one tick per access event (request)
        self.lifetime = 100.0  # mean requests a leaf stays in the tier before eviction
        self.mean_log_odds = 0.0
        self.stamp: dict[object, int] = {}  # last request that read (or inserted) the node
        self.insert_features: dict[object, Features] = {}
        self.reread: set[object] = set()  # read again since it entered the tier
        # page (position, key) -> turn of the request that brought it (requests that built its chain)
        self.history: OrderedDict[Hashable, int] = OrderedDict()
        self.history_limit = int(min(config.history_factor * capacity, NEVER))
        self.pending: dict[Hashable, Features] = {}  # last page of an insert -> its features
        self.deadlines: deque[tuple[int, Hashable, Features]] = deque()

    # --- scales -------------------------------------------------------------------------------

    def shift(self) -> float:
        return min(self.settings.max_shift, self.settings.shift_lifetimes * self.lifetime)

    def horizon(self) -> float:
        return max(float(self.settings.min_horizon), self.settings.horizon_lifetimes * self.lifetime)

    # --- ranking ------------------------------------------------------------------------------

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        log_odds = self.model.log_odds
        shift = self.shift()
        floor = self.mean_log_odds + self.settings.reread_bonus
        out = []
        for node in entries:
            stamp = self.stamp.get(node)
            if stamp is None:  # unheard of (an insert revived a host-only node): as new
                stamp = self.stamp[node] = self.requests
            x = self.insert_features.get(node)
            if x is None:
                out.append((float(stamp), node.id, node))
                continue
            score = log_odds(x)  # always the current fit
            if node in self.reread and score < floor:
                score = floor
            out.append((stamp + shift * score, node.id, node))
        return out

    # --- events -------------------------------------------------------------------------------

    def accessed(self, entries: Sequence[E]) -> None:
        self.requests += 1
        self._expire()
        for node in entries:
            if not node.keys:
                continue
            self._outcome(ghost_key(node))  # its first page, named as _page_ids names it
            self._outcome(_last_key(node))
            if node in self.stamp:
                self.stamp[node] = self.requests
                if node in self.insert_features:
                    self.reread.add(node)

    def inserted(self, entries: Sequence[E]) -> None:
        if not entries:
            return
        keys = [page for node in entries for page in _page_ids(node)]
        for key in keys:  # a prefix evicted before its reuse comes back as a new insert
            self._outcome(key)
        history = self.history
        known = 0  # leading pages the history remembers (an evicted prefix sent again)
        while known < len(keys) and keys[known] in history:
            known += 1
        parent = entries[0].parent
        above = parent.depth_end if parent is not None else 0
        # the page the new ones continue: the last remembered one, else the end of the match
        anchor = keys[known - 1] if known else _last_key(parent)
        turn = history.get(anchor, 0) if anchor is not None else 0
        x = features(len(keys) - known, above + known, turn)
        self.mean_log_odds += _MEAN_EWMA * (self.model.log_odds(x) - self.mean_log_odds)
        for node in entries:
            self.stamp[node] = self.requests
            self.insert_features[node] = x
        for key in keys[known:]:
            history[key] = turn + 1
        while len(history) > self.history_limit:
            history.popitem(last=False)
        last = keys[-1]
        self.pending[last] = x
        self.deadlines.append((self.requests + int(min(self.horizon(), NEVER)), last, x))

    def split(self, upper: E, lower: E) -> None:
        if lower in self.stamp:
            self.stamp[upper] = self.stamp[lower]
        if lower in self.insert_features:
            self.insert_features[upper] = self.insert_features[lower]
        if lower in self.reread:
            self.reread.add(upper)

    def removed(self, entries: Sequence[E]) -> None:
        for node in entries:
            stamp = self.stamp.pop(node, None)
            self.insert_features.pop(node, None)
            self.reread.discard(node)
            if stamp is not None:
                self.lifetime += _LIFETIME_EWMA * ((self.requests - stamp) - self.lifetime)

    # --- outcomes -----------------------------------------------------------------------------

    def _outcome(self, key: Hashable) -> None:
        x = self.pending.pop(key, None)
        if x is not None:
            self.model.learn(x, True)

    def _expire(self) -> None:
        """Predictions whose horizon passed without a reuse are negative outcomes."""
        deadlines, pending = self.deadlines, self.pending
        while deadlines and deadlines[0][0] < self.requests:
            _, key, x = deadlines.popleft()
            if pending.get(key) is x:
                del pending[key]
                self.model.learn(x, False)
