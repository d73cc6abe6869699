"""What every working part of a cache shares, built once at start-up and handed to each part.

Load-back, the writer and the prefetcher work on the same pools, tree, stack layout, unit
allocator and metrics, under the same policy and page hash chain. One frozen object names them,
so a part's constructor says what is particular to it (the storage engine, the plugin hooks) and
no part can swap a collaborator under the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.core.config import PolicyConfig
    from kvstrata.core.metrics import CacheMetrics
    from kvstrata.core.pool_group import PoolGroup
    from kvstrata.core.stack import StackLayout
    from kvstrata.core.tier_units import TierUnits
    from kvstrata.core.tree import PrefixTree


@dataclass(frozen=True)
class PartContext:
    """The collaborators and constants of the controller's parts (see the module docstring)."""

    pools: PoolGroup
    tree: PrefixTree
    layout: StackLayout
    units: TierUnits
    metrics: CacheMetrics
    policy: PolicyConfig
    page_size: int
    namespace_root: str  # the root of the page hash chain (a write-back rebuilds hashes from it)
