"""``fifo``: first in, first out: the order nodes entered the tier, whatever was read since.

A node cut in two keeps its entry time on both halves; a node first seen as a candidate (an
insert revived it from the host tier) enters then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)


class FifoConfig(EvictionPolicyConfig):
    type: Literal["fifo"] = "fifo"


class FifoPolicy(EvictionPolicy):
    name = "fifo"
    Config = FifoConfig
    capabilities = PolicyCapabilities(events=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        self._entered: dict[object, int] = {}
        self._tick = 0

    def _enter(self, node: object) -> int:
        self._tick += 1
        self._entered[node] = self._tick
        return self._tick

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        entered = self._entered
        return [(entered.get(n) or self._enter(n), n.id, n) for n in entries]

    def inserted(self, entries: Sequence[E]) -> None:
        for node in entries:
            if node not in self._entered:
                self._enter(node)

    def split(self, upper: E, lower: E) -> None:
        when = self._entered.get(lower)
        if when is not None:
            self._entered[upper] = when

    def removed(self, entries: Sequence[E]) -> None:
        for node in entries:
            self._entered.pop(node, None)
