"""kvstrata as SGLang's L3: a ``HiCacheStorage`` loaded by SGLang's dynamic storage backend.

Launch SGLang with (the README shows a complete command)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
        "module_path": "kvstrata.adapters.sglang", "class_name": "KvstrataHiCacheStorage",
        "interface_v1": 1, "kvstrata_config": "/etc/kvstrata/l3.yaml"}'

SGLang's ``StorageBackendFactory`` imports this module, checks that the class subclasses
``HiCacheStorage`` and calls ``KvstrataHiCacheStorage(storage_config, kwargs)``. ``kvstrata_config``
(a YAML/TOML/JSON path or an inline mapping, validated by
:class:`~kvstrata.adapters._sglang_support.SGLangL3Config`) names the storage backend -- any
kvstrata backend plugin, reached through ``PluginHost().storage_backends`` and planned from its
declared capabilities like kvstrata's own cache does (``StorageEngine`` over ``plan_pool``,
through :class:`kvstrata.adapters._shared.EngineStorage`) -- plus the namespace and checksum
policy. The model layout comes from SGLang's host pools as they register (see
:mod:`kvstrata.adapters._sglang_pages`).

Keys: SGLang's page keys become the page-hash component of kvstrata keys
(:func:`~kvstrata.adapters._shared.page_key`: hex digests as they are, any other string hashed
into a form no plain key can take)
``{namespace + salt}.{pool type}-{pool}-{layout digest}.{tp/pp/cp shard}.{page}.{object}``; the
namespace is the :class:`~kvstrata.adapters._shared.EngineIdentity` of (served model name,
``model.weights_digest``), so servers with another model, weights digest, salt, dtype, head
count, layer count, page size, TP size or TP rank (sharded pools) never read each other's pages.
Every object carries kvstrata's integrity header; a corrupt, truncated or foreign object is a
miss (counted in :attr:`KvstrataHiCacheStorage.metrics`), never data.

Interfaces, all implemented: generic ``get``/``set``/``batch_get``/``batch_set``/``exists``/
``batch_exists`` (SGLang's default path), zero-copy ``batch_get_v1``/``batch_set_v1`` (chosen by
``"interface_v1": 1``), the hybrid v2 calls ``batch_exists_v2``/``batch_get_v2``/``batch_set_v2``
for every pool registered with ``register_mem_host_pool_v2``, ``get_stats`` and ``close``.
``clear`` answers False: kvstrata backends have no "remove everything" operation (namespaced
keys already keep other deployments' pages apart).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvstrata.adapters._sglang_describe import describe_host_pool
from kvstrata.adapters._sglang_pages import PageFormat, is_mha
from kvstrata.adapters._sglang_store import KV_POOL, PageStore
from kvstrata.adapters._sglang_support import CONFIG_KEY, Stats, load_l3_config
from kvstrata.adapters._shared import EngineIdentity, EngineStorage
from kvstrata.engine_kit import IOMode, ParallelConfig, StorageMetrics
from kvstrata.plugins import ConfigError, PluginHost, StorageBackend

log = logging.getLogger(__name__)

#: Host pools SGLang writes from every TP rank even in rank-replicated (MLA) models: its
#: ``should_backup`` keeps Mamba state per rank (TP-sharded even under MLA).
TP_SHARDED_SIDE_POOLS = frozenset({"mamba"})


# --- the storage class ----------------------------------------------------------------------------


def _never_raises(failure: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """SGLang's storage threads die on an exception (leaking queued work): a data-path call that
    fails for any reason answers ``failure(*args)`` -- a miss / not stored -- and logs why."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("kvstrata L3: %s failed; SGLang sees a miss / failed write", method.__name__)
                try:
                    return failure(*args, **kwargs)
                except Exception:  # arguments too malformed to size the answer (keys=None)
                    return failure([])

        return call

    return wrap


def _all_false(keys: Sequence[Any], *_: Any, **__: Any) -> list[bool]:
    return [False] * len(keys)


def _per_transfer_false(transfers: Sequence[Any], *_: Any, **__: Any) -> dict[Any, list[bool]]:
    return {transfer.name: [False] * len(transfer.keys or []) for transfer in transfers}


class KvstrataHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over any kvstrata storage backend (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ValueError(
                "kvstrata's SGLang adapter does not support decode context parallel (dcp_size > 1)"
            )
        if storage_config.should_split_heads:
            raise ValueError(
                "kvstrata's SGLang adapter does not support heterogeneous-TP head splitting (tp_lcm_size "
                "with page_head); use equal TP sizes"
            )
        self.storage_config = storage_config
        self.plugins = PluginHost()
        self.settings = load_l3_config(extra.get(CONFIG_KEY), self.plugins)
        model_name = self.settings.model.name or storage_config.model_name
        if not model_name:
            raise ConfigError(
                [(f"{CONFIG_KEY}.model.name", "required: SGLang passed no served model name to key pages by")]
            )
        self.model_name = model_name
        self.parallel = ParallelConfig(
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
        )
        self.identity = EngineIdentity(
            engine="sglang",
            model=model_name,
            weights=self.settings.model.weights_digest,
            dtypes=(self.settings.model.kv_cache_dtype,) if self.settings.model.kv_cache_dtype else (),
            parallel=self.parallel,
            cache_salt=self.settings.model.cache_salt,
        )
        ((instance, backend_config),) = self.settings.tiers.storage.items()
        self.storage = EngineStorage(
            self.identity,
            instance,
            backend_config,
            checksum=self.settings.policy.checksum,
            plugins=self.plugins,
            config_path=f"{CONFIG_KEY}.tiers.storage",
        )
        self.backend: StorageBackend = self.storage.backend
        self.engine = self.storage.engine
        self._pools: dict[str, PageFormat] = {}
        self._lock = threading.Lock()
        self._stats = Stats()
        self.pages = PageStore(self.engine, self._stats)

    # --- registration --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor host pool (or SGLang's ``HostPoolGroup``, whose anchor entry is used)."""
        super().register_mem_pool_host(mem_pool_host)
        anchor_entry = getattr(mem_pool_host, "anchor_entry", None)
        pool = anchor_entry.host_pool if anchor_entry is not None else mem_pool_host
        self._register(KV_POOL, pool)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of a hybrid stack (SWA, Mamba, indexer, draft ...), served by the v2 calls."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(str(host_pool_name), host_pool)

    def _register(self, sglang_name: str, pool: Any) -> PageFormat:
        with self._lock:
            known = self._pools.get(sglang_name)
            if known is not None and known.pool is pool:
                return known
            replicated = self.storage_config.is_mla_model and sglang_name not in TP_SHARDED_SIDE_POOLS
            page_format = describe_host_pool(pool, sglang_name, self.plugins, replicated=replicated)
            plan = self.storage.add_pool(
                page_format.name, page_format.spec, host_region=page_format.host_region(), owner=pool
            )
            self._pools[sglang_name] = page_format
        # a pool without bytes (DeepSeek-V4's logical anchor) reports uint8 too
        fp8 = page_format.unit_bytes and getattr(pool, "dtype", None) is torch.uint8
        if fp8 and not self.settings.model.kv_cache_dtype:
            log.warning(
                "kvstrata L3: SGLang pool %r holds uint8 pages (an fp8 KV cache is handed to host pools "
                "as uint8): set kvstrata_config.model.kv_cache_dtype to SGLang's --kv-cache-dtype, or "
                "servers of another fp8 variant under this model name read these pages",
                sglang_name,
            )
        if replicated and is_mha(pool) and self.parallel.tp_size > 1:
            log.warning(
                "kvstrata L3: SGLang pool %r holds each TP rank's own heads under a rank-replicated "
                "(MLA) model, and SGLang writes it from TP rank 0 only: other ranks find none of its "
                "pages, and the prefixes the ranks agree on include none from L3",
                sglang_name,
            )
        log.log(
            logging.WARNING if plan.mode is IOMode.OFF else logging.INFO,  # an L3 this pool never uses
            "kvstrata L3: SGLang pool %r -> %s; plan %s (%s)",
            sglang_name,
            page_format.description,
            plan.mode.value,
            plan.reason,
        )
        return page_format

    def _pool(self, sglang_name: Any) -> PageFormat | None:
        return self._pools.get(str(sglang_name))

    @property
    def metrics(self) -> StorageMetrics:
        """kvstrata's counters: hits, misses, ``corrupt_detected`` (objects refused), bytes, errors."""
        return self.engine.metrics

    def pool_formats(self) -> dict[str, str]:
        """How each registered SGLang pool is stored (for logs and tests)."""
        return {name: f"{fmt.name}: {fmt.description}" for name, fmt in self._pools.items()}

    # --- the data path ---------------------------------------------------------------------------

    def _anchor(self) -> PageFormat:
        pool = self._pools.get(KV_POOL)
        if pool is None:
            raise RuntimeError("no host pool registered: SGLang calls register_mem_pool_host first")
        return pool

    # v1: zero-copy from/to the registered anchor pool

    @_never_raises(_all_false)
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        pool = self._anchor()
        pages = _checked_pages(pool, host_indices, len(keys))  # (before the dedup: see its docstring)
        if pages is None:
            return [False] * len(keys)
        prefix = _prefix_keys(extra_info)
        since = self.pages.refresh(prefix, pool)
        ok = self.pages.write(pool, keys, lambda at: pool.write_units(pages[at]))
        self.pages.asked(pool, prefix, keys, since)  # its dedup asked for every key
        return ok

    @_never_raises(_all_false)
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        pool = self._anchor()
        return self.pages.read(pool, keys, lambda: pool.read_units(pool.pages(host_indices, len(keys))))

    # generic: flat data pages (SGLang's default path without interface_v1)

    @_never_raises(lambda *args, **kwargs: False)
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    @_never_raises(lambda *args, **kwargs: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        flats = values if values is not None else target_locations
        if flats is None or len(flats) != len(keys) or any(flat is None for flat in flats):
            log.warning("kvstrata L3: batch_set needs one flat page per key")
            return False
        pool = self._anchor()
        return all(self.pages.write(pool, keys, lambda at: pool.flat_write_units([flats[i] for i in at])))

    @_never_raises(lambda *args, **kwargs: None)
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    @_never_raises(lambda keys, *args, **kwargs: [None] * len(keys))
    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        pool = self._anchor()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            log.warning("kvstrata L3: batch_get got %d targets for %d keys", len(targets), len(keys))
            return [None] * len(keys)
        anchor_pool = pool.pool
        targets = [t if t is not None else anchor_pool.get_dummy_flat_data_page() for t in targets]
        ok = self.pages.read(pool, keys, lambda: pool.flat_read_units(targets))
        return [target if hit else None for target, hit in zip(targets, ok, strict=True)]

    @_never_raises(lambda *args, **kwargs: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_never_raises(lambda *args, **kwargs: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the backend holds (SGLang's prefix length). The
        ``prefix_keys`` above them (pages SGLang serves itself) are asked for too: a request
        that reads its pages from L3 backs up nothing, so no ``batch_set`` names its prefix."""
        anchor, prefix = self._anchor(), _prefix_keys(extra_info)
        since = self.pages.refresh(prefix, anchor)
        found = self.pages.leading(anchor, keys)
        if found == len(keys):  # every key asked for
            self.pages.asked(anchor, prefix, keys, since)
        return found

    # v2: hybrid stacks (every pool registered through register_mem_host_pool_v2)

    @_never_raises(lambda *args, **kwargs: PoolTransferResult.empty())
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Longest usable prefix: the KV prefix, cut by each pool's hit policy (SGLang's semantics:
        ``all_pages`` needs every page, ``trailing_pages`` the last ``len(keys)`` pages of a prefix);
        the ``prefix_keys`` above them are asked for in each pool, as in ``batch_exists``."""
        anchor, prefix = self._anchor(), _prefix_keys(extra_info)
        pools = {anchor.name: anchor} | {p.name: p for t in pool_transfers or [] if (p := self._pool(t.name))}
        self.pages.refresh(prefix, *pools.values())
        return self.pages.hybrid_prefix(anchor, self._pools, keys, pool_transfers or [])

    def _pool_transfer(self, transfer: PoolTransfer) -> tuple[PageFormat, list[str], torch.Tensor] | None:
        pool = self._pool(transfer.name)
        keys = list(transfer.keys or [])
        if pool is None:
            log.warning(
                "kvstrata L3: pool %r was never registered (register_mem_host_pool_v2)", transfer.name
            )
            return None
        pages = _checked_pages(pool, transfer.host_indices, len(keys))
        return None if pages is None else (pool, keys, pages)

    @_never_raises(_per_transfer_false)
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            found = self._pool_transfer(transfer)
            if found is None:
                results[transfer.name] = [False] * len(transfer.keys or [])
                continue
            pool, keys, pages = found
            results[transfer.name] = self.pages.read(
                pool, keys, lambda pool=pool, pages=pages: pool.read_units(pages)
            )
        return results

    @_never_raises(_per_transfer_false)
    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            found = self._pool_transfer(transfer)
            if found is None:
                results[transfer.name] = [False] * len(transfer.keys or [])
                continue
            pool, keys, pages = found
            self.pages.refresh(_prefix_keys(extra_info), pool)
            results[transfer.name] = self.pages.write(
                pool, keys, lambda at, pool=pool, pages=pages: pool.write_units(pages[at])
            )
        return results

    # --- housekeeping ----------------------------------------------------------------------------

    def clear(self) -> bool:
        log.warning(
            "kvstrata L3: clear() is not supported -- kvstrata storage backends have no bulk delete; "
            "pages of other models/layouts never hit anyway (namespaced keys). Remove them with the "
            "backend's own tools (e.g. delete the file backend's directory)."
        )
        return False

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call), or None."""
        prefetch_pgs, backup_pgs, prefetch_bw, backup_bw = self._stats.drain()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics as SGLangStorageMetrics
        except Exception:  # metrics module unavailable (CPU test stand-ins): SGLang then uses its own
            return None
        metrics = SGLangStorageMetrics()
        metrics.prefetch_pgs.extend(prefetch_pgs)
        metrics.backup_pgs.extend(backup_pgs)
        metrics.prefetch_bandwidth.extend(prefetch_bw)
        metrics.backup_bandwidth.extend(backup_bw)
        return metrics

    def close(self) -> None:
        self.storage.close()


def _checked_pages(pool: PageFormat, host_indices: Any, count: int) -> torch.Tensor | None:
    """The page numbers of ``count`` pages at ``host_indices`` in ``pool``, or None (logged) where
    they do not fit it. Checked before a write's dedup: bad indices are a failed write, never
    "stored" because the keys happened to be (nor a batch of pages stored before failed whole)."""
    if host_indices is None:
        log.warning("kvstrata L3: transfer of pool %r has no host indices", pool.name)
        return None
    try:
        return pool.pages(host_indices, count)
    except ValueError as exc:
        log.warning("kvstrata L3: bad host indices for %d pages: %s", count, exc)
        return None


def _prefix_keys(extra_info: HiCacheStorageExtraInfo | None) -> list[str]:
    """The page keys above a backup's, where SGLang passes them (its
    ``hicache_storage_pass_prefix_keys``; without it kvstrata cannot tell a hot prefix)."""
    return list(getattr(extra_info, "prefix_keys", None) or [])
