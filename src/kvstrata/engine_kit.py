"""What an engine adapter uses beside :func:`kvstrata.open`: storage for engines that move pages
themselves, and the pieces their keys, object layouts and configs are made of.

An adapter like the SGLang and vLLM ones moves the engine's pages between its host memory and a
storage backend itself, without the cache controller. It opens the storage with
:func:`open_storage`, plans each pool on the backend (:func:`plan_pool`) and adds it to the
engine (``engine.add_pool(name, spec, plan)``), then calls ``engine.put`` / ``get`` / ``exists``.
The names here are public and stable like those of ``kvstrata`` itself (changes get a CHANGELOG
entry); where they are defined is an internal matter, so adapters import them from here, never
from ``kvstrata.core`` (``tests/test_architecture.py`` checks it).
"""

from __future__ import annotations

from typing import Any

from kvstrata.core.builder import DeviceTensors, new_storage_engine, open_storage_backend
from kvstrata.core.config import (
    ParallelConfig,
    PluginBackendConfig,
    dotted,
    load_file,
    parse_override,
    set_path,
)
from kvstrata.core.integrity import ChecksumPolicy, layout_fingerprint, stored_objects
from kvstrata.core.io_plan import IOMode, IOPlan, plan_pool
from kvstrata.core.keys import hash_pages, namespace_root
from kvstrata.core.pinned_alias import cuda_alias
from kvstrata.core.storage_batch import BatchResult
from kvstrata.core.storage_engine import StorageEngine, StorageMetrics, longest_present_prefix
from kvstrata.core.tokens import integer
from kvstrata.plugins import PluginHost


def open_storage(
    instance: str,
    backend_config: Any,
    *,
    namespace: str,
    cache_salt: str = "",
    parallel: ParallelConfig | None = None,
    checksum: ChecksumPolicy = "xxh3",
    plugins: PluginHost,
    config_path: str = "tiers.storage",
) -> StorageEngine:
    """The backend plugin ``backend_config.type`` opened as ``instance``, and a storage engine over
    it with no pools yet, its keys namespaced by ``namespace`` and ``cache_salt``.

    ``backend_config``: the backend's validated config (a ``PluginBackendConfig``). The backend
    is ``engine.backend``; the caller closes it. The plugins hear ``kvstrata_backend_opened``.
    A backend that cannot open is a :class:`~kvstrata.plugins.StorageError` naming
    ``{config_path}.{instance}``: where the engine's user wrote it.
    """
    backend = open_storage_backend(plugins, instance, backend_config, config_path=config_path)
    try:
        return new_storage_engine(
            backend,
            {},
            {},
            model_name=namespace,
            cache_salt=cache_salt,
            parallel=parallel or ParallelConfig(),
            checksum=checksum,
            plugins=plugins,
        )
    except BaseException:
        backend.close()
        raise


__all__ = [
    "BatchResult",
    "ChecksumPolicy",
    "DeviceTensors",
    "IOMode",
    "IOPlan",
    "ParallelConfig",
    "PluginBackendConfig",
    "StorageEngine",
    "StorageMetrics",
    "cuda_alias",
    "dotted",
    "hash_pages",
    "integer",
    "layout_fingerprint",
    "load_file",
    "longest_present_prefix",
    "namespace_root",
    "open_storage",
    "parse_override",
    "plan_pool",
    "set_path",
    "stored_objects",
]
