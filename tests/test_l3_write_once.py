"""What a cache writes to L3 it writes once: no object L3 is known to hold is put again.

Each test logs every key the backend's ``put`` is handed (a spy in the fault-injection style)
and checks that no page's object goes out twice, nor one the cache just read from L3.
"""

from __future__ import annotations

from pathlib import Path

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
