"""What a cache writes to L3 it writes once: no object L3 is known to hold is put again.

Each test logs every key the backend's ``put`` is handed (a spy in the fault-injection style)
and checks that no page's object goes out twice, nor one the cache just read from L3.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from controller_support import fill, open_cache, serve, tokens, verify
from kvstrata.core.controller import CacheController


def _spy_puts(cache: CacheController) -> list[str]:
    """Every key ``cache``'s backend is asked to put, in order."""
    assert cache.engine is not None
    put = cache.engine.backend.put
    keys: list[str] = []

    def spy(objects: list, **options: object) -> list[bool]:
        keys.extend(obj.key for obj in objects)
        return put(objects, **options)

    cache.engine.backend.put = spy  # type: ignore[method-assign]
    return keys


def _pages(keys: list[str], hashes: list[str], pool: str) -> list[int]:
    """The request pages whose ``pool`` object ``keys`` hold (in put order)."""
    parts = [key.split(".") for key in keys]  # {namespace}.{type}-{pool}-{layout}.{shard}.{hash}.{suffix}
    return [hashes.index(p[-2]) for p in parts if p[-4].split("-")[1] == pool]


def test_a_window_restored_from_l3_is_not_written_back_to_it(tmp_path: Path) -> None:
    """A fresh cache restores a 4-page prompt from L3 (its last window: pages 2-3 of the ``swa``
    pool) and computes 2 pages more. Its writes carried pages 2-3's window objects again --
    the ones it had just read: the restored prefix end was not known as a stored window end."""
    prompt = tokens(1, 4)
    with open_cache("swa", tmp_path / "l3") as cache:
        serve(cache, prompt)
        cache.flush()
    for extra in (2, 1):  # the new node as long as the window, and shorter (its head is above it)
        with open_cache("swa", tmp_path / "l3") as cache:
            keys = _spy_puts(cache)
            lease = cache.lookup(torch.cat([prompt, tokens(2 + extra, extra)]), prefetch="wait")
            cache.admit(lease)
            assert lease.cached_pages == 4 and verify(cache, lease) == 0
            fill(cache, lease, cache.allocate(lease))
            cache.insert(lease)
            cache.flush()
            assert _pages(keys, lease.page_hashes, "swa") == list(range(4, 4 + extra))
            assert _pages(keys, lease.page_hashes, "full") == list(range(4, 4 + extra))


def test_a_branch_inside_a_node_writes_the_window_above_it_once(tmp_path: Path) -> None:
    """A 3-page prompt is written (its window ends at page 3); a request branching after its
    first page splits the node there and adds 1 page. That insert wrote page 0's ``swa`` object
    twice: the new node's window (pages 0-1) took its head from the branch point, and then the
    window ending at the branch point (page 0) went out on its own."""
    prompt = tokens(1, 3)
    branch = torch.cat([prompt[:64], tokens(2, 1)])
    with open_cache("swa", tmp_path / "l3") as cache:
        serve(cache, prompt)
        cache.flush()
        keys = _spy_puts(cache)
        lease, bad = serve(cache, branch)
        cache.flush()
        assert bad == 0 and lease.cached_pages == 1
        assert sorted(_pages(keys, lease.page_hashes, "swa")) == [0, 1]
        assert _pages(keys, lease.page_hashes, "full") == [1]
    with open_cache("swa", tmp_path / "l3") as fresh:  # and the window ending at page 2 is whole
        restored = fresh.lookup(branch, prefetch="wait")
        fresh.admit(restored)
        assert restored.cached_pages == 2 and verify(fresh, restored) == 0
        fresh.release(restored)


def _slow_exists(cache: CacheController, seconds: float) -> None:
    """Each existence query of ``cache``'s backend takes ``seconds`` longer (an L3 behind)."""
    assert cache.engine is not None
    exists = cache.engine.backend.exists

    def slow(*args: object, **options: object) -> object:
        time.sleep(seconds)
        return exists(*args, **options)  # type: ignore[arg-type]

    cache.engine.backend.exists = slow  # type: ignore[method-assign]


@pytest.mark.parametrize("confirmed", [True, False])
def test_a_branch_inside_a_hit_node_does_not_write_the_node_again(tmp_path: Path, confirmed: bool) -> None:
    """An 8-page prompt is written; a request reusing its first 6 pages from the device adds 1
    page. The hit is asked about (``l3_touch``), and the window ending at the branch point (a
    new prefix end) is not in L3 yet: the insert writes it. The whole 6-page node above the
    branch point was written again, every page, as lost by L3: where an earlier hit's answer
    had confirmed the prompt (``confirmed``: its split's upper half inherited that, end and
    all), and where the ask's answer came after the insert queued that window (a slow L3),
    which then counted as a stored end L3 had lost."""
    prompt = tokens(1, 8)
    with open_cache("swa", tmp_path / "l3") as cache:
        serve(cache, prompt)
        cache.flush()
        if confirmed:
            serve(cache, torch.cat([prompt, tokens(3, 1)]))  # a hit whose answer confirms the prompt
            cache.flush()
        else:
            _slow_exists(cache, 0.3)
        keys = _spy_puts(cache)
        lease, bad = serve(cache, torch.cat([prompt[: 6 * cache.page_size], tokens(2, 1)]))
        cache.flush()
        assert bad == 0 and lease.cached_pages == 6
        assert sorted(_pages(keys, lease.page_hashes, "swa")) == [4, 5, 6]
        assert _pages(keys, lease.page_hashes, "full") == [6]
