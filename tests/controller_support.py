"""Drive a CacheController like an engine would, with verifiable page content.

Every unit a request computes is filled with bytes derived from (pool, buffer, page hash, layer),
and every unit of a restored prefix is compared against what it must hold, so a test sees any
byte that came back wrong, from the wrong page or from another pool.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

from kvstrata.core.config import load
from kvstrata.core.controller import CacheController, Lease, PoolKind
from kvstrata.plugins import PluginHost

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {path.stem: path for path in sorted((REPO / "tests" / "stacks").glob("*.yaml"))}
#: torch device of the L1 pools (``KVSTRATA_TEST_DEVICE=cuda`` runs the controller tests on a GPU)
DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")


def open_cache(
    example: str,
    l3: Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    host: PluginHost | None = None,
    **kwargs: object,
) -> CacheController:
    """An example stack; with ``l3`` the file backend lives there, without it there is no L3."""
    host = host or PluginHost()
    sets = [f"tiers.storage.l3.path={l3}"] if l3 is not None else ["tiers.storage={}"]
    if DEVICE != "cpu":
        sets.append(f"tiers.device.device={DEVICE}")
    config = load([EXAMPLES[example]], overrides=[*sets, *overrides], plugins=host, environ={})
    return CacheController(config, host, **kwargs)  # type: ignore[arg-type]


def tokens(seed: int, pages: int, page_size: int = 64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * page_size,), generator=generator)


def _ids(hashes: list[str]) -> torch.Tensor:
    return torch.tensor([int(h[:15], 16) for h in hashes], dtype=torch.int64)


def _content(pool: str, buffer: str, ids: torch.Tensor, layers: int, nbytes: int) -> torch.Tensor:
    """Each unit's bytes carry its page id's own 8 bytes (every 8 bytes, every layer), offset per
    pool, buffer, layer and position: two pages' units differ in every layer of every buffer
    (a mix taken mod 251 made 1 pair of pages in 251 equal per buffer, so a swap passed)."""
    salt = zlib.crc32(f"{pool}/{buffer}".encode())
    position = torch.arange(nbytes)
    own = (ids[:, None] >> ((position % 8) * 8)[None, :]) & 0xFF  # the id's byte at each position
    offset = torch.arange(layers)[:, None] * 31 + (position // 8)[None, :] * 7 + salt % 251
    return ((own[:, None, :] + offset[None]) % 256).to(torch.uint8)


def _pages_of(cache: CacheController, pool: str, lease: Lease, first: int, count: int, end: int) -> list[str]:
    if cache.pool_kind(pool) is PoolKind.STATE:
        return [lease.page_hashes[end - 1]]
    return lease.page_hashes[first : first + count]


def fill(cache: CacheController, lease: Lease, units: dict[str, torch.Tensor]) -> None:
    for name, value in units.items():
        if not len(value):
            continue
        pool = cache.pools.pools[name]
        first = lease.allocated_first_page(name)
        ids = _ids(_pages_of(cache, name, lease, first, len(value), first + len(value)))
        for buffer in pool.spec.buffers:
            view = pool.device.unit_view(buffer.name)
            view[value.to(view.device)] = _content(name, buffer.name, ids, view.shape[1], view.shape[2]).to(
                view.device
            )


def verify(cache: CacheController, lease: Lease) -> int:
    """Units of the lease's cached prefix whose bytes are not what they must be (a unit wrong
    in several buffers counts once)."""
    bad = 0
    for name, pool in cache.pools.pools.items():
        value = lease.prefix_units(name)
        if not len(value):
            continue
        first = lease.prefix_first_page(name)
        ids = _ids(_pages_of(cache, name, lease, first, len(value), lease.cached_pages))
        wrong = torch.zeros(len(value), dtype=torch.bool)
        for buffer in pool.spec.buffers:
            view = pool.device.unit_view(buffer.name)
            expected = _content(name, buffer.name, ids, view.shape[1], view.shape[2])
            got = view[value.to(view.device)].cpu()
            wrong |= (got != expected).flatten(1).any(dim=1)
        bad += int(wrong.sum())
    return bad


def computed(cache: CacheController, request: torch.Tensor) -> Lease:
    """lookup, admit, allocate and the engine's writes: a lease ready to insert."""
    lease = cache.lookup(request)
    cache.admit(lease)
    fill(cache, lease, cache.allocate(lease))
    return lease


def serve(cache: CacheController, request: torch.Tensor) -> tuple[Lease, int]:
    """One request: lookup, admit, check the restored prefix, compute the rest, insert."""
    lease = cache.lookup(request)
    cache.admit(lease)
    bad = verify(cache, lease)
    units = cache.allocate(lease)
    fill(cache, lease, units)
    cache.insert(lease)
    cache.tree.check()
    return lease, bad


def host_units_in_use(cache: CacheController) -> dict[str, int]:
    return {
        name: pool.host_allocator.used
        for name, pool in cache.pools.pools.items()
        if pool.host_allocator is not None and pool.index_owner == name
    }


def host_units_held_by_tree(cache: CacheController) -> dict[str, int]:
    return {name: cache.tree.units(name, "host") for name in cache.tree_pools}


def device_accounting(cache: CacheController, open_leases: list[Lease]) -> None:
    """Every device unit in use is the tree's, pending in an open lease or kept by one (page
    units it computed that another request inserted first: its engine still reads them)."""
    for name in cache.tree_pools:
        allocated = sum(len(lease.pending.get(name, ())) for lease in open_leases)
        allocated += sum(len(kept.get(name, ())) for lease in open_leases for kept in lease._duplicates or ())
        used = cache.pools.pools[name].device_allocator.used
        assert used == cache.tree.units(name, "device") + allocated, f"device units of {name!r} leaked"


def holds_page(cache: CacheController, pool: str, units: torch.Tensor, page_hash: str) -> bool:
    """Whether every unit in ``units`` of ``pool`` holds the bytes ``fill`` writes for the page
    ``page_hash`` (a state slot: the state after that page)."""
    return holds_ids(cache, pool, units, _ids([page_hash] * len(units)))


def fork_checked(cache: CacheController, lease: Lease) -> None:
    """``cache.fork_state(lease)``, asserting that every state pool's new slot holds the
    checkpoint of the lease's last committed page (a wrong fork is a wrong state, silently)."""
    for name, slot in cache.fork_state(lease).items():
        if len(slot) and lease.committed_pages and cache.pool_kind(name) is PoolKind.STATE:
            checkpoint = lease.page_hashes[lease.committed_pages - 1]
            assert holds_page(cache, name, slot, checkpoint), f"{name}: forked a wrong state"


def holds_ids(cache: CacheController, pool: str, units: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether unit ``units[i]`` of ``pool`` holds the bytes of content id ``ids[i]``."""
    spec = cache.pools.pools[pool]
    for buffer in spec.spec.buffers:
        view = spec.device.unit_view(buffer.name)
        expected = _content(pool, buffer.name, ids, view.shape[1], view.shape[2])
        if not torch.equal(view[units.to(view.device)].cpu(), expected):
            return False
    return True


class LiveNode:
    """Stands for a tree node still in the tree and on the host, for the sets the write path
    remembers (``core/node_set.py``); counts how often a sweep looked at it."""

    reads = 0  # every LiveNode's, together

    @property
    def parent(self) -> object:
        LiveNode.reads += 1
        return self

    @property
    def host(self) -> list[object]:
        return [self]


class GoneNode:
    """Stands for a node eviction took out of the tree (and off the host)."""

    parent = None
    host = (None,)
