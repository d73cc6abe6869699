"""Debug mode ``debug.unit_digests``: follow each unit's bytes from commit to restore.

A stored object's checksum proves the object is what was written, not that what was written is
what the engine committed: when a host slot is reused under a queued write (issue 29), the wrong
bytes are checksummed and verify. This mode records an xxh3 digest of every unit's bytes, per
pool and page hash, when the engine commits it on the device, and compares it where the bytes
move: the device -> host backup, the host bytes the writer thread is about to store in L3
(a mismatching pool is not written), the L3 -> host restore and the host -> device load-back.
The first mismatch is logged with its stage, pool and page; all are kept in ``mismatches``.
A restore is checked only against digests this process recorded. It costs a pass over every
byte moved, so it is off by default: for tests, replays and bug hunts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.stack import StackLayout
from kvstrata.core.tree import Tier, TreeNode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DigestMismatch:
    """One unit whose bytes differ from what was committed for its page."""

    stage: str  # "backup", "l3_write", "l3_restore", "load_back"
    pool: str
    page_hash: str
    tier: str

    def __str__(self) -> str:
        return (
            f"unit digest mismatch at {self.stage}: pool {self.pool!r} page {self.page_hash[:16]} "
            f"({self.tier} copy) no longer holds the bytes committed for that page"
        )


class UnitDigests:
    """Digests of committed units and the checks along their way (thread-safe: the writer
    thread checks what the owner thread recorded)."""

    def __init__(self, pools: PoolGroup, layout: StackLayout) -> None:
        self.pools = pools
        self.layout = layout
        self._digests: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.mismatches: list[DigestMismatch] = []
        self.checked = 0

    def digests(self, pool: str, tier: Tier, units: torch.Tensor) -> list[int]:
        """xxh3 of each unit's bytes over every buffer (and layer) of ``pool`` in ``tier``."""
        buffers = self.pools.pools[pool].device if tier is Tier.DEVICE else self.pools.pools[pool].host
        assert buffers is not None
        hashers = [xxhash.xxh3_64() for _ in range(len(units))]
        for spec in buffers.spec.buffers:
            layers = range(spec.layers) if buffers.split_layers(spec.name) else [None]
            for layer in layers:
                view = buffers.unit_view(spec.name, layer=layer)
                rows = view[units.to(view.device)].cpu().contiguous().numpy()
                for hasher, row in zip(hashers, rows, strict=True):
                    hasher.update(row.tobytes())
        return [h.intdigest() for h in hashers]

    def record(self, pool: str, page_hashes: Sequence[str], units: torch.Tensor, tier: Tier) -> None:
        values = self.digests(pool, tier, units)
        with self._lock:
            for page_hash, value in zip(page_hashes, values, strict=True):
                self._digests[(pool, page_hash)] = value

    def check(
        self, stage: str, pool: str, page_hashes: Sequence[str], units: torch.Tensor, tier: Tier
    ) -> bool:
        """Whether every unit still holds its page's committed bytes (unknown pages pass)."""
        values = self.digests(pool, tier, units)
        ok = True
        with self._lock:
            for page_hash, value in zip(page_hashes, values, strict=True):
                want = self._digests.get((pool, page_hash))
                if want is None:
                    continue
                self.checked += 1
                if want != value:
                    ok = False
                    found = DigestMismatch(stage, pool, page_hash, tier.value)
                    if not self.mismatches:
                        log.error("%s (the first; later ones are in UnitDigests.mismatches)", found)
                    self.mismatches.append(found)
        return ok

    def span(
        self, values: Mapping[str, torch.Tensor | None], page_hashes: Sequence[str]
    ) -> Iterator[tuple[str, list[str], torch.Tensor]]:
        """(pool, page hashes, units) of every pool for tree-pool ``values`` covering the pages of
        ``page_hashes``: a pool's units belong to the span's last pages (one per page for paged
        pools, the last window's for window pools, the last page's state for state pools);
        sidecars share their owner's units."""
        for name, tp in self.layout.tree_pools.items():
            units = values.get(name)
            if units is None or not len(units):
                continue
            hashes = list(page_hashes[len(page_hashes) - len(units) :])
            for follower in tp.followers:
                yield follower, hashes, units

    def node_values(
        self, node: TreeNode, tier: Tier, index: Mapping[str, int]
    ) -> dict[str, torch.Tensor | None]:
        held = node.device if tier is Tier.DEVICE else node.host
        return {name: held[index[name]] for name in self.layout.tree_pools}


def record_nodes(
    digests: UnitDigests, index: Mapping[str, int], nodes: Sequence[TreeNode], hashes: Sequence[str]
) -> None:
    """Record the device bytes of freshly inserted ``nodes`` (``hashes``: the request's pages)."""
    for node in nodes:
        values = digests.node_values(node, Tier.DEVICE, index)
        for pool, page_hashes, units in digests.span(values, hashes[node.depth_start : node.depth_end]):
            digests.record(pool, page_hashes, units, Tier.DEVICE)


def check_nodes(
    digests: UnitDigests,
    stage: str,
    index: Mapping[str, int],
    nodes: Sequence[TreeNode],
    node_hashes: Mapping[TreeNode, Sequence[str]],
    tier: Tier,
) -> bool:
    ok = True
    for node in nodes:
        values = digests.node_values(node, tier, index)
        for pool, page_hashes, units in digests.span(values, node_hashes[node]):
            ok = digests.check(stage, pool, page_hashes, units, tier) and ok
    return ok


def check_span(
    digests: UnitDigests,
    stage: str,
    values: Mapping[str, torch.Tensor | None],
    page_hashes: Sequence[str],
    tier: Tier,
) -> bool:
    """Whether tree-pool ``values`` covering ``page_hashes`` hold their committed bytes."""
    ok = True
    for pool, hashes, units in digests.span(values, page_hashes):
        ok = digests.check(stage, pool, hashes, units, tier) and ok
    return ok
