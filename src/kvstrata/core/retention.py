"""Retention hints on a request: priority, pin and TTL, with a cap on pinned pages.

An engine knows things no eviction policy can learn: a system prompt every request will use, an
agent's scratch context that is dead after this call, a session that resumes in a minute. It says
so per request (``cache.lookup(tokens, retention=RetentionHint(...))``); the hint covers the
request's whole prefix once it is inserted:

- ``priority``: a level above the eviction policy -- a node leaves a tier only after every node
  of a lower level, whatever the policy ranks (negative: before ordinary pages; only the pages
  the request added, not the prefix it found cached: a scratch request's shared system prompt
  is other requests' too);
- ``ttl_s``: the priority (1 when none is given) lasts this long after the insert, then the pages
  are ordinary again. Soft: reads alone never renew it, only another hinted request does;
- ``pin``: the prefix stays on the device tier (a lock) until ``cache.unpin(lease)`` or its TTL.
  Pinned units are capped per pool (``policy.retention.max_pinned_fraction`` of each pool's
  device units: pages, a window pool's units of each pin's last window, and a state pool's
  slots, one per pin: its end node's) so pins can never starve the cache; a pin over the cap is
  refused and counted (``pins_refused``), the lease keeps the pin it held (a chunked request's
  earlier chunks, not counted beside the pin replacing it) and its priority / TTL still apply.

The evictor reads the levels (``levels()``) only while some node carries one; expired pins are
released when an eviction starts, the only moment they matter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core.metrics import CacheMetrics, Operation
from kvstrata.core.tokens import integer
from kvstrata.core.tree import LockHandle, PrefixTree, Tier, TreeNode, tree_path
from kvstrata.core.tree_bytes import UNIT

#: entries kept before expired levels are first swept out; each later sweep waits for twice
#: what the one before kept (sweeping at every hinted insert past a fixed bound cost O(levels)
#: per insert once more nodes than that held a live level: 3.8 ms at 10,000)
_SWEEP_AT = 4096

#: a node's timed levels, (level, when it lapses): by deadline, levels falling
Steps = tuple[tuple[int, float], ...]
#: a node's permanent level (None: none) and its timed levels
Entry = tuple[int | None, Steps]


@dataclass(frozen=True)
class RetentionHint:
    """How long a request's prefix should stay; see the module docstring."""

    priority: int = 0
    pin: bool = False
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        priority = integer(self.priority)  # any integer (a NumPy one, a 0-d tensor) but a bool
        if priority is None:
            raise TypeError(f"priority must be an int, got {self.priority!r}")
        object.__setattr__(self, "priority", priority)
        if self.ttl_s is not None and not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s!r}")

    @property
    def level(self) -> int:
        """The retention level the prefix gets (a TTL alone protects at level 1)."""
        return self.priority or (1 if self.ttl_s is not None else 0)


@dataclass(eq=False)
class Pin:
    """A pinned prefix: its device lock and when the pin lapses (None: at ``unpin``)."""

    lock: LockHandle
    deadline: float | None
    released: bool = False  # by unpin, its TTL, a new pin of the same lease, or a late pool
    #: the retention clock its deadline reads (the lock itself goes at the next expiry)
    clock: Callable[[], float] = time.monotonic

    @property
    def held(self) -> bool:
        """Whether it holds now: not released, and its TTL not run out (a lapsed pin holds
        nothing from then on, whether or not an eviction has released it since)."""
        return not self.released and (self.deadline is None or self.deadline > self.clock())


class Retention:
    """Levels per node and pins with their page count; owned by the controller's owner thread."""

    def __init__(
        self,
        tree: PrefixTree,
        max_pinned_pages: int,
        metrics: CacheMetrics,
        clock: Callable[[], float] = time.monotonic,
        unit_caps: dict[int, int] | None = None,
    ) -> None:
        self.tree = tree
        self.max_pinned_pages = max_pinned_pages
        #: tree pool index -> the device units pins may hold of it (pools other than the anchor,
        #: whose cap is ``max_pinned_pages``): four 1-page pins held every Mamba slot of a stack
        self.unit_caps = unit_caps or {}
        self.metrics = metrics
        self.clock = clock
        #: node -> (its permanent level or None, its timed levels): a timed hint never replaces a
        #: permanent one, so the node is back at its permanent level after the TTL
        self._levels: dict[TreeNode, Entry] = {}
        self._pins: dict[int, Pin] = {}  # id(pin) -> pin, for TTL expiry
        self._pin_counts: dict[TreeNode, int] = {}
        self.pinned_pages = 0
        self._sweep_at = _SWEEP_AT  # size of ``_levels`` that starts the next sweep
        #: the last deadline of a timed level set, and the one the last lapse sweep passed
        self._lapse_at = self._lapsed_at = -math.inf

    # --- what the evictor reads ------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._levels)

    def levels(self) -> Callable[[TreeNode], int] | None:
        """The level of each node at this moment, or None when no node has one; releases
        pins whose TTL passed (an eviction is starting)."""
        now = self.clock()
        self._expire_pins(now)
        if self._lapsed_at < self._lapse_at <= now:
            self._sweep_lapsed()
        if not self._levels:
            return None
        levels = self._levels

        def level(node: TreeNode) -> int:
            entry = levels.get(node)
            return 0 if entry is None else _level_at(entry, now)

        return level

    def _sweep_lapsed(self) -> None:
        """Every timed level set has lapsed: drop them (once per such moment, O(levels)). Until
        the size sweep of ``_set_levels`` (4,096 entries) they kept ``levels()`` live after a
        few TTLs ran out, and every eviction ranked its whole tier for levels all 0."""
        self._lapsed_at = self._lapse_at
        levels = self._levels
        for node, (permanent, steps) in list(levels.items()):
            if steps:
                if permanent is None:
                    del levels[node]
                else:
                    levels[node] = (permanent, ())

    def expire(self) -> None:
        """Release the pins whose TTL passed, before the allocator asks whether evicting could
        make room: a lapsed pin's lock says it could not, no eviction starts, and the pin --
        released only when one does -- refused every allocation that needed its pages."""
        if self._pins:
            self._expire_pins(self.clock())

    def _expire_pins(self, now: float) -> None:
        for pin in [p for p in self._pins.values() if p.deadline is not None and p.deadline <= now]:
            self.release(pin)

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        entry = self._levels.get(lower)
        if entry is not None:
            self._levels[upper] = entry
        count = self._pin_counts.get(lower)
        if count:
            self._pin_counts[upper] = count

    def forget(self, node: TreeNode) -> None:
        self._levels.pop(node, None)

    # --- what a request asks for -------------------------------------------------------------

    def apply(self, node: TreeNode, hint: RetentionHint, held: Pin | None, own_from: int = 0) -> Pin | None:
        """Give the prefix ending at ``node`` its level (a negative one: only from page
        ``own_from``, where the request's own pages start) and, for a pin, replace the pin
        ``held`` (the lease's) by one there; returns the pin the lease holds now (None: refused)."""
        now = self.clock()
        deadline = None if hint.ttl_s is None else now + hint.ttl_s
        if hint.level:
            self._set_levels(node, hint.level, deadline, now, own_from if hint.level < 0 else 0)
        if not hint.pin:
            return held
        self._expire_pins(now)  # a lapsed pin holds no share of max_pinned_fraction
        pin = self._take(node, deadline, held)  # ``held`` goes if it is taken: not counted twice
        if pin is None:
            self.metrics.count(Operation.PINS_REFUSED)
            return None if held is None or held.released else held  # a longer chunk keeps its pin
        if held is not None:
            self.release(held)
        return pin

    def _set_levels(
        self, node: TreeNode, level: int, deadline: float | None, now: float, start: int = 0
    ) -> None:
        levels = self._levels
        if len(levels) > self._sweep_at:
            for stale in [n for n, (p, steps) in levels.items() if p is None and not _live(steps, now)]:
                del levels[stale]
            self._sweep_at = max(_SWEEP_AT, 2 * len(levels))
        if deadline is not None:
            self._lapse_at = max(self._lapse_at, deadline)
        cur: TreeNode | None = node
        while cur is not None and cur is not self.tree.root and cur.depth_start >= start:
            permanent, steps = levels.get(cur, (None, ()))
            if deadline is None:
                permanent = level if permanent is None else max(permanent, level)
            else:
                steps = _with_step(steps, level, deadline, now)
            levels[cur] = (permanent, steps)
            cur = cur.parent

    def _take(self, node: TreeNode, deadline: float | None, held: Pin | None) -> Pin | None:
        """A pin ending at ``node``, or None where it would go over a cap. ``held`` (the lease's
        pin, released once this one is taken) is not counted beside it: a chunked request re-pins
        after every chunk, and its earlier chunk's window and state slot would count twice."""
        path = tree_path(self.tree, node)
        fresh = [n for n in path if not self._pin_counts.get(n)]  # ``held``'s path: ``node``'s head
        new = sum(n.pages for n in fresh)
        if self.pinned_pages + new > self.max_pinned_pages or self._over_unit_caps(node, held):
            return None
        for n in path:
            self._pin_counts[n] = self._pin_counts.get(n, 0) + 1
        self.pinned_pages += new
        pin = Pin(self.tree.lock(node, Tier.DEVICE), deadline, clock=self.clock)
        self._pins[id(pin)] = pin
        return pin

    def _over_unit_caps(self, node: TreeNode, held: Pin | None) -> bool:
        """Whether a pin ending at ``node``, replacing ``held``, would hold more of a pool than
        its cap. Counted afresh as the pins' locks hold (pins are rare; a running count would
        drift where a pinned node's units change: splits, out-of-window tombstones): a window
        pool's units of each pin's last window (:func:`_window_units`), a state pool's one slot
        per pin, its end node's (the lock leaves the path's others), a paged pool's whole path."""
        ends = [pin.lock.node for pin in self._pins.values() if pin is not held]
        ends.append(node)
        layout = self.tree.layout
        for p, cap in self.unit_caps.items():
            if layout.window[p]:
                units = _window_units(self.tree, p, ends)
            else:  # a state pool's end nodes; a paged pool's whole paths (``held``'s: ``node``'s head)
                nodes = set(ends) if layout.state[p] else {*self._pin_counts, *tree_path(self.tree, node)}
                units = sum(len(raw) for n in nodes if (raw := n.device_raw[p]) is not None) // UNIT
            if units > cap:
                return True
        return False

    def release(self, pin: Pin) -> None:
        """Give a pin up (``cache.unpin``, its TTL, or a new pin of the same lease); a pin
        released before is a no-op."""
        if self._pins.pop(id(pin), None) is None:
            return  # expired and released before
        pin.released = True
        self.tree.unlock(pin.lock)
        cur: TreeNode | None = pin.lock.node
        while cur is not None and cur is not self.tree.root:
            count = self._pin_counts.get(cur, 0) - 1
            if count <= 0:
                self._pin_counts.pop(cur, None)
                self.pinned_pages -= cur.pages
            else:
                self._pin_counts[cur] = count
            cur = cur.parent

    def release_all(self) -> int:
        """Release every pin (a late pool drops every cached page: a pinned one would be served
        with the new pool's units, which no one wrote). Returns how many."""
        pins = list(self._pins.values())
        for pin in pins:
            self.release(pin)
        return len(pins)


def _live(steps: Steps, now: float) -> Steps:
    return tuple(step for step in steps if step[1] > now)


def _level_at(entry: Entry, now: float) -> int:
    """A node's level at ``now``: the higher of its permanent level and its live timed one."""
    permanent, steps = entry
    timed = next((level for level, until in steps if until > now), None)  # the highest live one
    if permanent is None:
        return 0 if timed is None else timed
    return permanent if timed is None else max(permanent, timed)


def _with_step(steps: Steps, level: int, deadline: float, now: float) -> Steps:
    """``steps`` and a new timed level: each hint holds its level until its own deadline, so a
    higher, shorter one does not end a lower, longer one (the prefix fell to ordinary when the
    shorter lapsed). The live steps no other outlasts at its level or above are kept: by
    deadline, levels falling (a longer hint of the same level renews the TTL; reads never
    reach here)."""
    live = {*_live(steps, now), (level, deadline)}
    kept = [s for s in live if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in live)]
    return tuple(sorted(kept, key=lambda step: step[1]))


def _window_units(tree: PrefixTree, p: int, ends: list[TreeNode]) -> int:
    """Device units of window pool ``p`` that pins ending at ``ends`` hold: those of each pin's
    last window (older window data, the head of a node included, is tombstoned first, pinned
    or not: :mod:`~kvstrata.core.tree_eviction`). A node's units hold its last pages; each
    unit counted once."""
    window = tree.layout.window[p]
    held: dict[TreeNode, int] = {}
    for end in ends:
        bound, cur = end.depth_end - window, end
        while cur is not tree.root and cur.depth_end > bound:
            raw = cur.device_raw[p]
            if raw is not None:
                inside = min(len(raw) // UNIT, cur.depth_end - max(cur.depth_start, bound))
                held[cur] = max(held.get(cur, 0), inside)
            cur = cur.parent  # type: ignore[assignment]
    return sum(held.values())
