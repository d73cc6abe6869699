"""The SGLang adapter's data path over kvstrata's storage engine: store the pages not stored yet,
read only verified pages into place, the leading run of stored pages and the hybrid prefix that
every pool's hit policy allows. ``KvstrataHiCacheStorage`` maps SGLang's calls onto it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

from kvstrata.adapters._sglang_pages import PageFormat, Transfer
from kvstrata.adapters._sglang_support import Stats, trailing_prefixes
from kvstrata.adapters._shared import page_key
from kvstrata.engine_kit import StorageEngine, longest_present_prefix

log = logging.getLogger("kvstrata.adapters.sglang")

#: SGLang's pool name of the anchor KV pool (``PoolName.KV``).
KV_POOL = "kv"
#: Second chunk of an existence query (after one probe page); each further chunk doubles.
FIRST_EXISTS_CHUNK = 16


class PageStore:
    """SGLang's pages through one storage engine, with the adapter's transfer statistics."""

    def __init__(self, engine: StorageEngine, stats: Stats) -> None:
        self.engine = engine
        self._stats = stats
        # the prefix continuation (see ``refresh``): one count per call of this store, and
        # (pool, last key, chain length, count) of the call that asked L3 for a whole chain
        self._lock = threading.Lock()
        self._calls = 0
        self._chain: tuple[str, str, int, int] | None = None

    def _step(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def write(self, pool: PageFormat, keys: Sequence[str], make: Any) -> list[bool]:
        """Store the pages of ``keys`` not stored yet; ``make(positions)`` gives their Transfer."""
        self._step()
        if not keys:
            return []
        hashes = [page_key(key) for key in keys]
        start = time.perf_counter()
        # dedup first (SGLang backs up every page reaching the host tier): no gather, no checksum
        # for pages already stored
        present = self.engine.exists(pool.name, hashes)
        ok = list(present.ok) if present.error is None else [False] * len(keys)
        missing = [i for i, stored in enumerate(ok) if not stored]
        if not missing:
            return ok
        try:
            transfer = make(missing)
        except (ValueError, RuntimeError) as exc:
            log.warning("kvstrata L3: cannot write %d pages of %r: %s", len(missing), pool.name, exc)
            return [False] * len(keys)
        result = self.engine.put(pool.name, [hashes[i] for i in missing], transfer.units)
        for i, stored in zip(missing, result.ok, strict=True):
            ok[i] = stored
        written = sum(result.ok)
        self._stats.record(False, written, written * pool.unit_bytes, time.perf_counter() - start)
        return ok

    def refresh(self, prefix_keys: Sequence[str], *pools: PageFormat) -> int:
        """Ask L3, in each of ``pools``, for the pages above a backup or a query (SGLang's
        ``prefix_keys``): SGLang serves them from its own tiers and never reads or writes them
        here again, so a store that evicts in LRU order (``capacity_bytes``) would drop that hot
        prefix first -- and every page keyed under it with it. Asking is a use to such a store;
        the answer is not needed.

        SGLang splits a request into batches of 128 pages and names, above each, the prefix and
        every batch before it: asking for all of them each time cost O(pages^2 / 128) lookups
        (32k one-token pages: 4.2M). A continuation -- ``prefix_keys`` ending with the chain the
        previous call on this store asked for whole (:meth:`asked`), no call of this store in
        between -- asks nothing: that chain was used just now, in the same LRU order a repeat
        would give it but for the last batch. Returns the count :meth:`asked` takes."""
        with self._lock:
            chain, self._chain = self._chain, None
            self._calls += 1
            call = self._calls
        if not prefix_keys:
            return call
        if (
            chain is not None
            and len(pools) == 1
            and chain == (pools[0].name, prefix_keys[-1], len(prefix_keys), call - 1)
        ):
            return call
        keys = [page_key(key) for key in prefix_keys]
        for pool in pools:
            self.engine.exists(pool.name, keys)
        return call

    def asked(self, pool: PageFormat, prefix_keys: Sequence[str], keys: Sequence[str], since: int) -> None:
        """The call whose :meth:`refresh` returned ``since`` has asked L3 (in ``pool``) for each of
        ``keys`` after ``prefix_keys`` with one call of this store (a write or a leading query);
        if no other call came in between, ``prefix_keys + keys`` is now the chain a next
        ``refresh`` may take as used (SGLang's next batch names exactly that as its prefix)."""
        if not keys:
            return
        with self._lock:
            if self._calls == since + 1:
                self._chain = (pool.name, keys[-1], len(prefix_keys) + len(keys), self._calls)

    def read(self, pool: PageFormat, keys: Sequence[str], make: Any) -> list[bool]:
        """Read the pages of ``keys``; ``make()`` gives the Transfer; only verified pages land."""
        self._step()
        if not keys:
            return []
        start = time.perf_counter()
        try:
            transfer: Transfer = make()
        except (ValueError, RuntimeError) as exc:
            log.warning("kvstrata L3: cannot read %d pages of %r: %s", len(keys), pool.name, exc)
            return [False] * len(keys)
        result = self.engine.get(pool.name, [page_key(key) for key in keys], transfer.units)
        ok = list(result.ok)
        try:
            transfer.finish(ok)
        except Exception:  # pages may be half copied into place: none of them is usable
            log.exception(
                "kvstrata L3: copying %d pages of %r into the host pool failed", len(keys), pool.name
            )
            return [False] * len(keys)
        hits = sum(ok)
        self._stats.record(True, hits, hits * pool.unit_bytes, time.perf_counter() - start)
        return ok

    def leading(self, pool: PageFormat, keys: Sequence[str]) -> int:
        """Leading run of stored pages, asked in growing chunks (1, 16, 32, 64 ...) that stop at the
        first missing page: a prefix missing from the start costs one lookup, a partial hit a few,
        not one per page of the query."""
        self._step()
        done, chunk = 0, 1
        while done < len(keys):
            batch = [page_key(key) for key in keys[done : done + chunk]]
            found = self.engine.exists_prefix(pool.name, batch)
            done += found
            if found < len(batch):
                break
            chunk = FIRST_EXISTS_CHUNK if chunk == 1 else chunk * 2
        return done

    def hybrid_prefix(
        self,
        anchor: PageFormat,
        pools: Mapping[str, PageFormat],
        keys: Sequence[str],
        pool_transfers: Sequence[PoolTransfer],
    ) -> PoolTransferResult:
        """Longest usable prefix: the KV prefix, cut by each pool's hit policy (SGLang's semantics:
        ``all_pages`` needs every page, ``trailing_pages`` the last ``len(keys)`` pages of a prefix)."""
        kv_pages = self.leading(anchor, keys)
        hashes = [page_key(key) for key in keys[:kv_pages]]
        hit_count: dict[Any, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers:
            if not restorable:
                break
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                # block_groups, unused by SGLang 0.5.23: by its definition it never gates the KV hit
                log.warning(
                    "kvstrata L3: hit policy %r of pool %r not evaluated", transfer.hit_policy, transfer.name
                )
                continue
            pool = pools.get(str(transfer.name))
            present = (
                list(self.engine.exists(pool.name, hashes).ok) if pool is not None else [False] * kv_pages
            )
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = longest_present_prefix(present)
                allowed = set(range(1, boundary + 1))
            else:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = trailing_prefixes(present, window)
                boundary = max(allowed, default=0)
            if boundary:
                hit_count[transfer.name] = boundary
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)
