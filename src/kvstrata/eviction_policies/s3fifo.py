"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23) over prefix-tree nodes.

Three FIFO queues: a small one (S, ``small_fraction`` of the tier) where new prefixes prove
themselves, a main one (M) and a ghost queue (G, first page keys only). A prefix read while in S
moves to M (at its first read: the tree tells the policy about reads as they happen); a leaf
leaving S untouched goes to G, and a prefix that comes back while remembered there enters M
directly. M is a CLOCK: a leaf with reads left is passed over (one read spent) instead of
evicted. One-time prefixes thus leave quickly while reused ones stay.

Which queue an eviction takes from is fixed for its length (ranks must compare); the CLOCK hand
is moved after each eviction, over the queue up to the last leaf it took.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from pydantic import Field

from kvstrata.eviction_policies._ghosts import Ghosts, ghost_key
from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)

_LEVEL = 1 << 50  # a queue or pass level ranks after every sequence number below it (int: exact)
_SMALL, _MAIN = 0, 1


class S3FifoConfig(EvictionPolicyConfig):
    type: Literal["s3fifo"] = "s3fifo"
    small_fraction: float = Field(0.1, gt=0, lt=1, description="share of the tier for new prefixes")
    max_reads: int = Field(3, ge=1, le=15, description="reads a main-queue prefix can bank")


class _Clock:
    """The main queue in CLOCK order, oldest first: a linked list, so that the upper half of a
    split node takes its lower half's place (an OrderedDict can only append: at the back, the
    hand went round the whole queue, spending a read of every node, before it reached it)."""

    __slots__ = ("_next", "_prev")

    def __init__(self) -> None:
        self._next: dict[object, object] = {None: None}  # None: the sentinel before the oldest
        self._prev: dict[object, object] = {None: None}

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, node: object) -> bool:
        return node is not None and node in self._next

    def __iter__(self) -> Iterator[object]:
        node = self._next[None]
        while node is not None:
            yield node
            node = self._next[node]

    def append(self, node: object, before: object = None) -> None:
        """Put ``node`` just before ``before`` (at the back when None)."""
        prev = self._prev[before]
        self._next[prev], self._prev[node] = node, prev
        self._next[node], self._prev[before] = before, node

    def remove(self, node: object) -> None:
        prev, after = self._prev.pop(node), self._next.pop(node)
        self._next[prev], self._prev[after] = after, prev

    def popleft(self) -> object:
        node = self._next[None]
        self.remove(node)
        return node


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"
    Config = S3FifoConfig
    capabilities = PolicyCapabilities(events=True, needs_frequency=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, S3FifoConfig)
        self.capacity = max(1, context.capacity_pages)
        self.small_limit = config.small_fraction * self.capacity
        self.max_reads = config.max_reads
        self._queue: dict[object, int] = {}
        self._seq: dict[object, int] = {}
        self._reads: dict[object, int] = {}
        self._size: dict[object, int] = {}
        self._main = _Clock()
        self.small_pages = 0
        self.ghosts = Ghosts(self.capacity)
        self._tick = 0

    def _enter(self, node: E, queue: int) -> None:
        self._tick += 1
        self._queue[node] = queue
        self._seq[node] = self._tick
        self._reads[node] = 0
        self._size[node] = node.pages
        if queue == _SMALL:
            self.small_pages += node.pages
        else:
            self._main.append(node)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        for node in entries:  # unheard of (an insert revived a host-only node): new, entered
            if node not in self._queue:  # before the queues' order is read from the counts,
                self._enter(node, _SMALL)  # else a node ranked alone next ranked otherwise
        small_first = self.small_pages >= self.small_limit or not self._main
        out = []
        for node in entries:
            queue = self._queue[node]
            if queue == _SMALL:
                level = 0 if small_first else self.max_reads + 1
            else:
                level = self._reads[node] + (1 if small_first else 0)
            out.append((level * _LEVEL + self._seq[node], node.id, node))
        return out

    def inserted(self, entries: Sequence[E]) -> None:
        for node in entries:
            if node not in self._queue:
                remembered = self.ghosts.take(ghost_key(node)) is not None
                self._enter(node, _MAIN if remembered else _SMALL)

    def accessed(self, entries: Sequence[E]) -> None:
        for node in entries:
            queue = self._queue.get(node)
            if queue is None:
                continue
            if queue == _SMALL:  # proved itself: into the main queue
                self.small_pages -= self._size[node]
                self._queue[node] = _MAIN
                self._tick += 1
                self._seq[node] = self._tick
                self._main.append(node)
            else:
                self._reads[node] = min(self._reads[node] + 1, self.max_reads)

    def split(self, upper: E, lower: E) -> None:
        queue = self._queue.get(lower)
        if queue is None:
            return
        self._queue[upper] = queue
        self._seq[upper] = self._seq[lower]
        self._reads[upper] = self._reads[lower]
        self._size[upper] = upper.pages
        self._size[lower] = lower.pages
        if queue == _MAIN:  # in lower's place: the hand reaches them together
            self._main.append(upper, before=lower)

    def removed(self, entries: Sequence[E]) -> None:
        taken = []  # main-queue leaves, in the order they were evicted
        for node in entries:
            queue = self._queue.pop(node, None)
            if queue is None:
                continue
            pages = self._size.pop(node)
            if queue == _SMALL:
                self.small_pages -= pages
                self.ghosts.add(ghost_key(node), pages)
            else:
                taken.append(node)
        self._sweep(taken)
        for node in entries:
            self._seq.pop(node, None)
            self._reads.pop(node, None)

    def _sweep(self, taken: list[object]) -> None:
        """Move the CLOCK hand as the evictions went, one evicted leaf at a time in the order they
        left: a leaf evicted with reads left (every other had as many) took the hand that many
        whole laps first, each lap spending one read of every node; then the hand passes the
        nodes before it, each spending a read and going to the back (leaves that could not leave
        too). Swept all at once in queue order, a leaf evicted later but queued earlier spent its
        laps on the nodes before a leaf evicted first, which a real CLOCK had passed once."""
        main, reads = self._main, self._reads
        for gone in taken:
            if gone not in main:
                continue
            laps = reads.get(gone, 0)
            if laps:
                for other in main:
                    reads[other] = max(0, reads[other] - laps)
            while True:
                node = main.popleft()
                if node is gone:
                    break
                if reads[node] > 0:
                    reads[node] -= 1
                self._tick += 1
                self._seq[node] = self._tick
                main.append(node)
