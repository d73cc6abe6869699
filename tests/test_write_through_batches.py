"""Write-through of a lease kept open (chunked prefill): its pages are backed up to the host
tier in batches of ``policy.write_through_batch_pages`` and, whatever is left, when the lease
closes or is released and at every flush -- never lost, and the bytes are the engine's."""

from __future__ import annotations

from pathlib import Path

import torch

import kvstrata
from controller_support import fill, tokens, verify
from kvstrata.core.tree import tree_path as _path

PAGE = 64


def config(l3: Path | None, batch: int | None = None, pages: int = 64) -> dict:
    policy = {} if batch is None else {"write_through_batch_pages": batch}
    return {
        "model": {
            "name": "write-through-batches",
            "page_size": PAGE,
            "pools": {
                "kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"},
                "mamba": {
                    "type": "mamba",
                    "layers": 1,
                    "states": {"conv": {"shape": [3, 8]}, "ssm": {"shape": [2, 4, 4], "dtype": "float32"}},
                    "device_units": pages,
                    "host_units": pages,
                },
            },
        },
        "tiers": {
            "device": {"capacity_tokens": pages * PAGE},
            "host": {"capacity_tokens": pages * PAGE},
            "storage": {"l3": {"type": "file", "path": str(l3)}} if l3 is not None else {},
        },
        "policy": policy,
    }


def chunk(cache: kvstrata.CacheController, lease: kvstrata.Lease, request: torch.Tensor, pages: int) -> None:
    """Compute the lease's new pages and insert them keeping it open, then extend it."""
    units = cache.allocate(lease)
    cache.fork_state(lease)  # the engine starts from the last checkpoint, then computes
    fill(cache, lease, units)
    cache.insert(lease, close=False)
    lease.extend(request[lease.pages * PAGE : (lease.pages + pages) * PAGE])


def backed_up_pages(cache: kvstrata.CacheController, lease: kvstrata.Lease) -> int:
    """Pages of the lease's inserted path that have a host copy (a contiguous prefix)."""
    return sum(n.pages for n in _path(cache.tree, lease._node) if cache.tree.backed_up(n))


def restored(l3: Path, request: torch.Tensor) -> int:
    """Pages a fresh cache over ``l3`` restores of ``request``, checked byte for byte."""
    with kvstrata.open(config(l3), environ={}) as fresh:
        lease = fresh.lookup(request, prefetch="wait")
        fresh.admit(lease)
        assert verify(fresh, lease) == 0
        fresh.release(lease)
        return lease.cached_pages


def test_an_open_lease_is_backed_up_every_batch_and_the_rest_at_close(tmp_path: Path) -> None:
    request = tokens(1, 40)
    with kvstrata.open(config(None, batch=16), environ={}) as cache:
        lease = cache.lookup(request[: 4 * PAGE])
        cache.admit(lease)
        seen = []
        for _ in range(9):  # 4-page chunks: 36 pages inserted, the lease still open
            chunk(cache, lease, request, 4)
            seen.append(backed_up_pages(cache, lease))
        assert seen == [0, 0, 0, 16, 16, 16, 16, 32, 32]
        units = cache.allocate(lease)
        cache.fork_state(lease)
        fill(cache, lease, units)
        cache.insert(lease)  # closes: the last 8 pages are backed up before the lock goes
        assert lease._node.depth_end == 40 and backed_up_pages(cache, lease) == 40


def test_batch_of_one_backs_up_at_every_insert() -> None:
    request = tokens(2, 12)
    with kvstrata.open(config(None, batch=1), environ={}) as cache:
        lease = cache.lookup(request[: 4 * PAGE])
        cache.admit(lease)
        for inserted in (4, 8):
            chunk(cache, lease, request, 4)
            assert backed_up_pages(cache, lease) == inserted
        cache.release(lease)


def test_flush_backs_up_and_writes_what_open_leases_batched(tmp_path: Path) -> None:
    """``flush()`` means: every page inserted so far is on the host tier and in L3, open
    leases included; the lease then goes on from there."""
    request = tokens(3, 24)
    with kvstrata.open(config(tmp_path), environ={}) as cache:
        lease = cache.lookup(request[: 8 * PAGE])
        cache.admit(lease)
        chunk(cache, lease, request, 8)
        assert backed_up_pages(cache, lease) == 0  # 8 < 64 pages: batched
        cache.flush()
        assert backed_up_pages(cache, lease) == 8
        assert restored(tmp_path, request) == 8
        chunk(cache, lease, request, 8)
        assert backed_up_pages(cache, lease) == 8
        cache.flush()
        assert restored(tmp_path, request) == 16
        cache.release(lease)


def test_release_backs_up_what_the_open_lease_inserted(tmp_path: Path) -> None:
    request = tokens(4, 16)
    with kvstrata.open(config(tmp_path), environ={}) as cache:
        lease = cache.lookup(request[: 8 * PAGE])
        cache.admit(lease)
        chunk(cache, lease, request, 8)
        chunk(cache, lease, request, 8)
        cache.release(lease)  # an abort after two inserts keeps what they inserted
        assert lease._node.depth_end == 16 and backed_up_pages(cache, lease) == 16
        cache.flush()
    assert restored(tmp_path, request) == 16


def test_close_of_the_cache_writes_an_open_lease_pages_to_l3(tmp_path: Path) -> None:
    request = tokens(5, 16)
    cache = kvstrata.open(config(tmp_path), environ={})
    lease = cache.lookup(request[: 8 * PAGE])
    cache.admit(lease)
    chunk(cache, lease, request, 8)
    cache.release(lease)
    cache.close()
    assert restored(tmp_path, request) == 8


def test_device_pressure_never_drops_an_open_lease_unbacked_pages(tmp_path: Path) -> None:
    """Batched pages are held by the lease's device lock: other requests evict around them,
    and the pages reach the host tier and L3 when the lease closes."""
    request = tokens(6, 24)
    with kvstrata.open(config(tmp_path, pages=64), environ={}) as cache:
        lease = cache.lookup(request[: 8 * PAGE])
        cache.admit(lease)
        chunk(cache, lease, request, 8)
        chunk(cache, lease, request, 8)
        assert backed_up_pages(cache, lease) == 0
        for seed in range(3):  # 3 x 40 pages through a 64-page device tier
            busy = cache.lookup(tokens(10 + seed, 40))
            cache.admit(busy)
            fill(cache, busy, cache.allocate(busy))
            cache.insert(busy)
        assert all(n.device[0] is not None for n in _path(cache.tree, lease._node))
        units = cache.allocate(lease)
        cache.fork_state(lease)
        fill(cache, lease, units)
        cache.insert(lease)
        cache.flush()
    assert restored(tmp_path, request) == 24


def test_a_batch_that_needs_eviction_is_backed_up_a_node_at_a_time_byte_exact(tmp_path: Path) -> None:
    """When the free host units do not hold a whole batch, its nodes get their host units one at
    a time (evicting colder pages); the units, joined per pool for the copy, still land under
    the right node: every page restores byte for byte from L3."""
    older, request = tokens(20, 40), tokens(21, 32)
    with kvstrata.open(config(tmp_path, pages=64), environ={}) as cache:
        lease = cache.lookup(older)  # 40 of the 64 host pages, backed up at insert
        cache.admit(lease)
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)
        cache.flush()
        older_node = lease._node
        lease = cache.lookup(request[: 4 * PAGE])
        cache.admit(lease)
        for _ in range(7):  # 4-page chunks: one node each, batched (28 < 64 pages)
            chunk(cache, lease, request, 4)
        assert backed_up_pages(cache, lease) == 0
        units = cache.allocate(lease)
        cache.fork_state(lease)
        fill(cache, lease, units)
        cache.insert(lease)  # closes: 8 nodes, 32 pages, only 24 host pages free
        nodes = _path(cache.tree, lease._node)
        assert len(nodes) == 8 and backed_up_pages(cache, lease) == 32
        assert older_node.host[0] is None  # the older request's host pages made room
        cache.flush()
    assert restored(tmp_path, request) == 32
