"""Every pluggy hook kvstrata calls. Implement them with ``@kvstrata.hookimpl``.

The hook specs are part of the plugin API, so they live beside the contracts in
``kvstrata.plugins``; ``kvstrata.hookspecs`` re-exports them under their first name.

Hooks carry *registration* and *events*. They are called per operation or per batch, never per
page or per token: a pluggy call costs microseconds, which the data path cannot afford. Events
come from more than one thread: stored batches and failed backend calls from the thread of the
storage call (a cache's storage worker threads, an engine adapter's own), a cache's
``kvstrata_backend_closing`` from its closing thread, the rest from the cache's caller; an
observer that keeps state guards it with a lock.

Hook-only plugins are modules listed under the ``kvstrata.plugins`` entry-point group, or objects
an application passes to ``PluginHost(plugins=[...])`` / ``PluginHost.register_plugin``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvstrata.plugins.storage_backend import BackendCapabilities, StorageBackend

hookspec = pluggy.HookspecMarker("kvstrata")


# --- registration -------------------------------------------------------------------------------


@hookspec(historic=True)
def kvstrata_register_pool_types(register: Callable[[type], None]) -> None:
    """Call ``register(cls)`` for each :class:`~kvstrata.plugins.pool_type.PoolType` subclass.

    Classes land in the same registry as entry-point plugins and pass the same validation; a name
    already taken is an error naming both providers. Historic: plugins registered late are called
    on registration.
    """


@hookspec(historic=True)
def kvstrata_register_storage_backends(register: Callable[[type], None]) -> None:
    """Call ``register(cls)`` for each :class:`~kvstrata.plugins.storage_backend.StorageBackend`."""


@hookspec(historic=True)
def kvstrata_register_eviction_policies(register: Callable[[type], None]) -> None:
    """Call ``register(cls)`` for each :class:`~kvstrata.plugins.eviction_policy.EvictionPolicy`."""


# --- lifecycle ----------------------------------------------------------------------------------


@hookspec
def kvstrata_configure(config: Any) -> None:
    """The resolved root config (``kvstrata.core.config.KvstrataConfig``) of a cache being
    opened (each cache, once; a plugin registered later does not hear the earlier ones)."""


@hookspec
def kvstrata_backend_opened(
    instance: str, backend: StorageBackend, capabilities: BackendCapabilities
) -> None:
    """A storage backend instance opened and is ready for I/O."""


@hookspec
def kvstrata_backend_closing(instance: str, backend: StorageBackend) -> None:
    """A storage backend instance is about to close."""


# --- data-path events (per batch) -------------------------------------------------------------


@hookspec
def kvstrata_pages_stored(instance: str, pool: str, pages: int, nbytes: int) -> None:
    """A batch of pages (or slots) of one pool reached a storage backend: ``pages`` stored of
    the batch, ``nbytes`` the bytes of their objects (a cache calls it on its L3 writer thread)."""


@hookspec
def kvstrata_prefetch_committed(request_id: str, tokens: int, pools: list[str]) -> None:
    """A storage prefetch finished for every pool and its prefix became usable on the host tier."""


@hookspec
def kvstrata_eviction(tier: str, pool: str, units: int) -> None:
    """``units`` pages or slots of ``pool`` left ``tier`` (``device`` or ``host``)."""


@hookspec
def kvstrata_operation_failed(operation: str, instance: str, error: BaseException) -> None:
    """A backend call raised or answered nonsense (a wrong number of results); ``operation`` is
    ``exists``, ``put``, ``get`` or ``remove``. The cache keeps serving; this is for metrics and
    alerts. Not called for calls the open circuit breaker refused, nor for objects a backend
    answered "not stored" (full, read-only): the storage counters ``breaker_rejected`` and
    ``put_failed`` count those."""
