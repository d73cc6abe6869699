"""A request's hold on its cached prefix: what ``lookup`` found, ``admit`` settled, and the
units the engine reads. The controller fills it; an engine reads its public fields and calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstrata.core.keys import hash_pages
from kvstrata.core.stack import NO_UNITS, PoolKind, StackLayout
from kvstrata.core.tree import LockHandle, MatchResult, PrefixTree

if TYPE_CHECKING:
    from kvstrata.core.prefetcher import PrefetchOp


class CacheFullError(RuntimeError):
    """The device tier cannot hold a request's new pages even after evicting everything unlocked."""


@dataclass(eq=False)
class Lease:
    """A request's hold on its cached prefix, from ``lookup`` to ``insert`` or ``release``."""

    tokens: torch.Tensor
    keys: list[bytes]
    namespace_root: str
    page_size: int
    device_pages: int = 0  # usable on device at lookup
    host_pages: int = 0  # usable on device + host at lookup
    cached_pages: int = 0  # usable on device after admit
    hit_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    record: bool = True  # count this request in the hit metrics
    #: pages the host tier or L3 held that this request could not use, by SkipReason
    skipped: dict[str, int] = field(default_factory=dict)
    admitted: bool = False
    closed: bool = False
    _hashes: list[str] | None = None
    _prefix: dict[str, torch.Tensor] = field(default_factory=dict)  # tree pool -> device units
    _first: dict[str, int] = field(default_factory=dict)
    _owner_of: dict[str, str] = field(default_factory=dict)
    _device_lock: LockHandle | None = None
    _host_lock: LockHandle | None = None
    _prefetch: PrefetchOp | None = None
    _storage_pages: int = 0  # pages [host_pages, host_pages + this) came from L3
    _allocated: dict[str, torch.Tensor] | None = None

    @property
    def pages(self) -> int:
        return len(self.keys)

    @property
    def page_hashes(self) -> list[str]:
        """Chained hashes (hex) of every whole page, computed once when first needed."""
        if self._hashes is None:
            self._hashes = hash_pages(self.tokens, self.page_size, self.namespace_root)
        return self._hashes

    @property
    def cached_tokens(self) -> int:
        return self.cached_pages * self.page_size

    def prefix_units(self, pool: str) -> torch.Tensor:
        """Device units holding the cached prefix of ``pool`` (see ``prefix_first_page``)."""
        self._require_admitted()
        return self._prefix[self._owner(pool)]

    def prefix_first_page(self, pool: str) -> int:
        """The page ``prefix_units(pool)[0]`` holds (0 for all-pages pools; for a node-state pool
        the slot holds the state after page ``cached_pages - 1``)."""
        self._require_admitted()
        return self._first[self._owner(pool)]

    def _owner(self, pool: str) -> str:
        try:
            return self._owner_of[pool]
        except KeyError:
            raise KeyError(f"no pool {pool!r}; pools: {sorted(self._owner_of)}") from None

    def _require_admitted(self) -> None:
        if not self.admitted:
            raise RuntimeError("call cache.admit(lease) before reading its prefix")


def prefix_units(
    tree: PrefixTree, layout: StackLayout, match: MatchResult
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Per tree pool, the device units of ``match``'s device prefix and the page the first holds:
    every page for all-pages pools, the last window for window pools, one slot for state pools."""
    units: dict[str, torch.Tensor] = {}
    first: dict[str, int] = {}
    cached = match.device_pages
    for tp in layout.tree_pools.values():
        if cached == 0:
            units[tp.name], first[tp.name] = NO_UNITS, 0
        elif tp.kind is PoolKind.STATE:
            units[tp.name], first[tp.name] = match.device_state[tp.name], cached - 1
        elif tp.kind is PoolKind.WINDOW:
            nodes = list(reversed(tree.window_nodes(match.device_node, tp.name)))
            units[tp.name], first[tp.name] = tree.values(nodes, tp.name), nodes[0].depth_start
        else:
            units[tp.name], first[tp.name] = tree.values(match.device_path, tp.name), 0
    return units, first
