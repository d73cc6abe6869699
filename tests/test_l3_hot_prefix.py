"""A prefix a cache keeps serving from its own tiers stays in a bounded L3 shared with others
(``core/l3_touch.py``): the file backend's ``capacity_bytes`` evicts least recently used objects
first, and a prefix hit on the device or host was never read or written in L3 again -- so it was
the first thing evicted, and every page keyed under it was unreachable to a fresh process."""

from __future__ import annotations

from pathlib import Path

import torch

from controller_support import open_cache, serve, tokens, verify

SYSTEM_PAGES = 2


def _objects(l3: Path) -> list[Path]:
    """The page objects under a file L3 (not its removals log)."""
    return [f for f in l3.rglob("*.kv") if f.is_file()]


def _object_bytes(tmp: Path) -> int:
    """One page object of the ``kv`` stack, as the file backend stores it."""
    with open_cache("kv", tmp / "probe") as cache:
        serve(cache, tokens(99, 1))
        cache.flush()
    (size,) = {f.stat().st_size for f in _objects(tmp / "probe")}
    return size


def _chats(count: int) -> list[torch.Tensor]:
    """Requests sharing a system prompt of two pages, two pages each of their own."""
    system = tokens(1, SYSTEM_PAGES)
    return [torch.cat([system, tokens(10 + i, 2)]) for i in range(count)]


def test_a_prefix_served_from_the_device_outlives_colder_pages_in_a_bounded_l3(tmp_path: Path) -> None:
    """Six chats through one cache (the system prompt hit on its device after the first), an L3
    of ten objects: the four evicted are the oldest chats' own pages, not the system prompt, and
    a fresh cache restores the last chat whole, bit-exact. Before, it restored nothing."""
    l3 = tmp_path / "l3"
    bound = [f"tiers.storage.l3.capacity_bytes={10 * _object_bytes(tmp_path)}"]
    chats = _chats(6)
    with open_cache("kv", l3, overrides=bound) as cache:
        for n, chat in enumerate(chats):
            lease, bad = serve(cache, chat)
            assert bad == 0 and lease.hit_pages["device"] == (SYSTEM_PAGES if n else 0)
            cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_units"] == 4 + 5 * 2
    assert len(_objects(l3)) == 10
    with open_cache("kv", l3, overrides=bound) as fresh:
        lease = fresh.lookup(chats[-1], prefetch="wait")
        fresh.admit(lease)
        assert lease.cached_pages == 4 and lease.hit_pages["storage"] == 4
        assert verify(fresh, lease) == 0
        fresh.release(lease)
        first = fresh.lookup(chats[0], prefetch="wait")  # its own pages were the coldest
        fresh.admit(first)
        assert first.cached_pages == SYSTEM_PAGES
        fresh.release(first)


def test_only_a_requests_own_lookup_asks_l3_for_its_hit(tmp_path: Path) -> None:
    """The ask costs an existence query on the writer thread per lookup that hits: none for a
    miss, none for a later chunk's lookup (``record=False``: its hits are its own pages)."""
    chat, other = _chats(2)
    with open_cache("kv", tmp_path / "l3") as cache:
        serve(cache, chat)
        cache.flush()

        def asked(request: torch.Tensor, record: bool) -> int:
            before = cache.metrics.snapshot()["storage"]["exists_calls"]
            lease = cache.lookup(request, record=record, prefetch="off")
            cache.flush()  # (waits for the ask too)
            cache.release(lease)
            return cache.metrics.snapshot()["storage"]["exists_calls"] - before

        assert asked(tokens(50, 3), record=True) == 0, "a miss"
        assert asked(chat, record=False) == 0, "a later chunk"
        assert asked(chat, record=True) == 1
        assert asked(other[: SYSTEM_PAGES * 64], record=True) == 1, "the shared prompt"


def test_a_hit_prefix_another_process_evicted_is_stored_again(tmp_path: Path) -> None:
    """Another process sharing the L3 evicted the system prompt (its LRU never saw it used)
    while this cache kept serving it from its device: the next lookup that hits it finds it
    gone and stores it again from the host copies, so a fresh cache restores a chat whole."""
    l3 = tmp_path / "l3"
    chat, other = _chats(2)
    with open_cache("kv", l3) as cache:
        first, _ = serve(cache, chat)
        cache.flush()
        system = first.page_hashes[:SYSTEM_PAGES]
        with open_cache("kv", l3) as elsewhere:  # its capacity eviction, as the store sees it
            assert elsewhere.engine.discard("kv", system).ok == [True] * SYSTEM_PAGES
        puts = cache.metrics.snapshot()["storage"]["put_units"]
        lease, bad = serve(cache, other)
        assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
        cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_units"] - puts == 2 + SYSTEM_PAGES
    with open_cache("kv", l3) as fresh:
        lease = fresh.lookup(chat, prefetch="wait")
        fresh.admit(lease)
        assert lease.cached_pages == 4 and lease.hit_pages["storage"] == 4
        assert verify(fresh, lease) == 0
        fresh.release(lease)
