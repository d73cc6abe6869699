"""``belady``: the offline reference (Belady's MIN through the tree): evict what is used
furthest in the future.

Needs every future access, so only ``kvstrata simulate`` can run it (it hands the trace over
through :meth:`bind_future`); it is the reference the online policies are measured against.
Chain-aware: a leaf is ranked by the next use of its last page and the tree trims the tail pages
it needs. That is leaf granularity, not page granularity: a trimmed tail may hold pages needed
sooner than another leaf's, so on some traces it falls short of the exact optimum (2 of 200
random tiny traces against a brute force).
"""

from __future__ import annotations

from typing import Literal

from kvstrata.plugins.eviction_policy import (
    E,
    EvictionPolicy,
    EvictionPolicyConfig,
    FutureAccesses,
    PolicyCapabilities,
    PolicyContext,
)


class BeladyConfig(EvictionPolicyConfig):
    type: Literal["belady"] = "belady"


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    Config = BeladyConfig
    capabilities = PolicyCapabilities(needs_future=True, chain_aware=True)

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        self.future: FutureAccesses | None = None

    def bind_future(self, future: FutureAccesses) -> None:
        self.future = future

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        if not entries:  # nothing to rank needs no future (the contract: none in, none out)
            return []
        if self.future is None:
            raise RuntimeError("belady needs the future accesses: only `kvstrata simulate` can run it")
        next_use = self.future.next_use
        return [(-float(next_use(n.keys[-1])), n.id, n) for n in entries]
