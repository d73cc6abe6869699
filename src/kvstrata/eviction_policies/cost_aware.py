"""``cost_aware``: keep what saves the most recompute per byte held (Marconi-style, for hybrid
stacks with state pools; Pan et al., MLSys'25).

A leaf's worth is the prefill it saves if kept, per byte it holds. Recompute of a page grows
with its position (attention reads the whole prefix before it): a page ending at depth ``d``
costs ``1 + attention_weight * d * page_size`` units. A node also holds its state slots
(``PolicyContext.state_bytes``, e.g. Mamba conv and SSM states) on top of its pages, so a short
leaf with a large state is poor value and goes first, a long one amortises its state. The score
mixes recency and that efficiency, each scaled to [0, 1] over the candidates of an eviction:
``score = recency + alpha * efficiency``; the lowest leaves first.

On a stack without state pools the efficiency only favours deep pages: a KV-only cache is
better served by ``lru`` or ``reuse``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
    PolicyContext,
)


class CostAwareConfig(EvictionPolicyConfig):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN rank orders nothing
    type: Literal["cost_aware"] = "cost_aware"
    alpha: float = Field(1.0, ge=0, description="weight of efficiency against recency")
    attention_weight: float = Field(
        1.0 / 8192,
        ge=0,
        le=1,  # (far above any model's; a huge weight overflowed every efficiency: NaN ranks)
        description="recompute of one token per token of prefix before it, relative to the "
        "per-token (MLP, projection, state update) work",
    )


class CostAwarePolicy(EvictionPolicy):
    name = "cost_aware"
    Config = CostAwareConfig
    capabilities = PolicyCapabilities(cost_aware=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, CostAwareConfig)
        self.alpha = config.alpha
        self.attention = config.attention_weight * context.page_size
        self.page_bytes = max(1, context.page_bytes)
        self.state_bytes = context.state_bytes
        # scales of the current eviction, so candidates ranked later compare with the first batch
        self._recency = (0.0, 1.0)
        self._efficiency = 1.0

    def efficiency(self, node: E) -> float:
        """Recompute saved per byte held: the node's pages at their depth, over its bytes."""
        pages = node.pages
        start = node.depth_end - pages
        # sum over the node's pages of (1 + attention * depth), depth = start+1 .. depth_end
        work = pages + self.attention * (pages * start + pages * (pages + 1) / 2)
        return work / (pages * self.page_bytes + self.state_bytes)

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        if len(entries) > 1:
            stamps = [n.last_access for n in entries]
            low, high = min(stamps), max(stamps)
            self._recency = (float(low), float(max(high - low, 1)))
            self._efficiency = max(self.efficiency(n) for n in entries) or 1.0
        low, span = self._recency
        top = self._efficiency
        return [
            ((n.last_access - low) / span + self.alpha * self.efficiency(n) / top, n.id, n) for n in entries
        ]
