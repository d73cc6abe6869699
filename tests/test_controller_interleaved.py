"""Many requests in flight at once, in random order (a scheduler batching requests): every
restored byte is exact, the tree stays consistent, and no device or host unit leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from controller_support import (
    device_accounting,
    fill,
    holds_page,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
    verify,
)
from kvstrata.core.controller import CacheFullError, Lease, PoolKind


@pytest.mark.parametrize("stack", ["kv", "swa-mamba", "mla-nsa-draft", "logical-swa"])
@pytest.mark.parametrize("seed", [1, 2])
def test_interleaved_requests_keep_bytes_and_accounting_exact(stack: str, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    overrides = [
        "policy.prefetch.policy=" + rng.choice(["wait_complete", "best_effort", "timeout"]),
        "policy.write=" + rng.choice(["write_through", "write_through_selective", "write_back"]),
        "policy.prefetch.threshold_tokens=64",
    ]
    with open_cache(stack, tmp_path, overrides) as cache:
        stems = [tokens(500 + seed * 10 + i, 3) for i in range(4)]

        def request() -> torch.Tensor:
            stem = rng.choice(stems)[: 64 * rng.randint(1, 3)]
            return torch.cat([stem, tokens(rng.randrange(10**6), rng.randint(0, 3))])

        leases: list[Lease] = []
        for _ in range(120):
            action = rng.random()
            if action < 0.35 and len(leases) < 3:
                leases.append(cache.lookup(request()))
            elif leases:
                lease = rng.choice(leases)
                if not lease.admitted:
                    cache.admit(lease)
                    assert verify(cache, lease) == 0, "a restored unit holds the wrong bytes"
                elif lease._allocated is None and action < 0.9:
                    try:
                        fill(cache, lease, cache.allocate(lease))
                    except CacheFullError:
                        cache.release(lease)
                        leases.remove(lease)
                elif action < 0.95 and lease._allocated is not None:
                    cache.insert(lease)
                    leases.remove(lease)
                else:
                    cache.release(lease)
                    leases.remove(lease)
            cache.tree.check()
            device_accounting(cache, leases)
        for lease in leases:
            cache.release(lease)
        cache.flush()
        cache.tree.check()
        device_accounting(cache, [])
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "host units leaked"
        snapshot = cache.metrics.snapshot()
        assert snapshot["hit_tokens"]["total"] > 0


@pytest.mark.parametrize("stack", ["kv", "swa-mamba", "mla-nsa-draft", "hybrid-mamba"])
def test_a_chunk_another_request_inserted_first_keeps_the_units_its_engine_reads(stack: str) -> None:
    """Two requests of one prompt in chunked prefill, both computing before either inserts (a
    scheduler's batch). B's chunk goes into the tree first; A's ``insert(close=False)`` finds
    those pages there. A's engine goes on attending over them through the units ``allocate``
    gave it: they were freed as duplicates at that insert, handed to the next request, and its
    writes became A's KV. They stay A's until it closes; a state slot is freed at once."""
    with open_cache(stack, overrides=["tiers.device.capacity_tokens=2048"]) as cache:
        prompt = tokens(7, 8)
        a, b = (cache.lookup(prompt[: 4 * 64]) for _ in range(2))
        for lease in (a, b):
            cache.admit(lease)
        a_units = {name: units.clone() for name, units in cache.allocate(a).items()}
        cache.fork_state(a)
        fill(cache, a, a_units)
        pages = [n for n in a_units if cache.pool_kind(n) is not PoolKind.STATE and len(a_units[n])]

        def raw(name: str) -> list[bytes]:  # the bytes, NaN patterns and all
            return [
                t.contiguous().view(torch.uint8).numpy().tobytes()
                for t in cache.read_units(name, a_units[name]).values()
            ]

        before = {name: raw(name) for name in pages}
        fill(cache, b, cache.allocate(b))
        cache.insert(b, close=False)
        cache.insert(a, close=False)  # every page a duplicate of B's
        device_accounting(cache, [a, b])
        c = cache.lookup(tokens(99, 32))
        cache.admit(c)
        free = cache.pools.anchor.device_allocator.available
        c_units = cache.allocate(c, end_page=free)  # every free unit
        fill(cache, c, c_units)  # another request computes into them
        for name in pages:
            assert not set(a_units[name].tolist()) & set(c_units[name].tolist()), name
            assert raw(name) == before[name], f"A's {name} units were overwritten"
        cache.release(c)
        a.extend(prompt[4 * 64 :])
        units = cache.allocate(a)
        cache.fork_state(a)
        fill(cache, a, units)
        cache.insert(a)
        cache.insert(b)
        device_accounting(cache, [])  # A's kept units freed at its close
        again, bad = serve(cache, prompt)
        assert again.cached_pages == 8 and bad == 0


def test_a_refusal_counts_the_copies_a_lease_keeps() -> None:
    """B inserts each chunk after A and keeps its 8 units of A's pages; A released, B alone needs
    its 12 pages, the tree's 8 it holds locked and its own 8 copies on a 16-page tier. Refused,
    the error said only "the request's own prefix stays locked ... admit fewer requests at
    once" (one request was open): it names the copies and what avoids them."""
    with open_cache("kv", overrides=["tiers.device.capacity_tokens=1024"]) as cache:  # 16 pages
        prompt = tokens(7, 12)
        a, b = cache.lookup(prompt[: 4 * 64]), cache.lookup(prompt[: 4 * 64])
        for lease in (a, b):
            cache.admit(lease)
        for _ in range(2):
            for lease in (a, b):
                fill(cache, lease, cache.allocate(lease))
                cache.insert(lease, close=False)
                lease.extend(prompt[lease.pages * 64 : (lease.pages + 4) * 64])
        cache.release(a)
        with pytest.raises(
            CacheFullError, match=r"holds \{'kv': 8\} units its engine still reads outside the tree"
        ) as info:
            cache.allocate(b)
        assert "look up the whole prompt" in str(info.value) and not info.value.too_long
        cache.release(b)
        device_accounting(cache, [])
        whole = cache.lookup(prompt)  # the whole prompt: the 8 cached pages are not recomputed
        cache.admit(whole)
        assert whole.cached_pages == 8
        fill(cache, whole, cache.allocate(whole))
        cache.insert(whole)


@pytest.mark.parametrize("window_only", [False, True])
def test_a_second_allocate_keeps_the_window_the_new_pages_attend_over(window_only: bool) -> None:
    """Two allocates with no insert between them (``end_page=4``, then the rest) on a window
    pool short of room: the second gets units for the last window only and left the first's
    behind, all freed at once -- those of pages 2-3 too, which pages 4-5 attend over; the next
    request took them and its writes became this one's window. Now the units of the window
    before the new pages stay the lease's until it closes; the earlier ones are freed."""
    small_window_pool = ["model.pools.swa.device_units=6", "tiers.host.capacity_tokens=0"]
    with open_cache("swa", overrides=small_window_pool) as cache:
        assert cache.tree_pools["swa"].window == 2
        lease = cache.lookup(tokens(1, 8))
        cache.admit(lease)
        first = cache.allocate(lease, end_page=4)
        assert lease.allocated_first_page("swa") == 0 and len(first["swa"]) == 4
        fill(cache, lease, first)
        window = first["swa"][2:4]
        fill(cache, lease, cache.allocate(lease, end_page=8, window_only=window_only))
        other = cache.lookup(tokens(2, 4))  # the next request of the same batch step
        cache.admit(other)
        got = cache.allocate(other)  # the units of pages 0-1 were freed: no new page reads them
        assert set(got["swa"].tolist()) == set(first["swa"][:2].tolist())
        fill(cache, other, got)
        for page in (2, 3):
            assert holds_page(cache, "swa", window[page - 2 : page - 1], lease.page_hashes[page])
        cache.insert(other)
        cache.insert(lease)
        device_accounting(cache, [])
