"""The hook specs under their first name; they live in :mod:`kvstrata.plugins.hookspecs`.

Kept so that ``import kvstrata.hookspecs`` and ``pm.add_hookspecs(kvstrata.hookspecs)`` keep
working for plugins written against it.
"""

from kvstrata.plugins.hookspecs import (
    hookspec,
    kvstrata_backend_closing,
    kvstrata_backend_opened,
    kvstrata_configure,
    kvstrata_eviction,
    kvstrata_operation_failed,
    kvstrata_pages_stored,
    kvstrata_prefetch_committed,
    kvstrata_register_eviction_policies,
    kvstrata_register_pool_types,
    kvstrata_register_storage_backends,
)

__all__ = [
    "hookspec",
    "kvstrata_backend_closing",
    "kvstrata_backend_opened",
    "kvstrata_configure",
    "kvstrata_eviction",
    "kvstrata_operation_failed",
    "kvstrata_pages_stored",
    "kvstrata_prefetch_committed",
    "kvstrata_register_eviction_policies",
    "kvstrata_register_pool_types",
    "kvstrata_register_storage_backends",
]
