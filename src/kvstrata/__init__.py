"""kvstrata: a hierarchical (device / host / storage) state cache for hybrid LLM inference.

The engine-facing API is :func:`kvstrata.open` and the :class:`CacheController` it returns (see
the README "Library API"). Pool types, storage backends and eviction policies are plugins found
through entry points; see ``kvstrata.plugins`` for the contracts and ``kvstrata.plugins.hookspecs``
for the hooks.
Everything but ``hookimpl`` loads lazily, so a plugin importing ``kvstrata`` does not pay for
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

__version__ = "0.1.0"

#: Decorate hook implementations with this marker (``@kvstrata.hookimpl``).
hookimpl = pluggy.HookimplMarker("kvstrata")

#: public name -> module defining it (imported on first use)
_LAZY = {
    "open": "kvstrata.api",
    "load": "kvstrata.core.config",
    "CacheController": "kvstrata.core.controller",
    "CacheFullError": "kvstrata.core.lease",
    "ConcurrentUseError": "kvstrata.core.boundary",
    "OpenLeasesWarning": "kvstrata.core.boundary",
    "Lease": "kvstrata.core.lease",
    "PrefetchMode": "kvstrata.core.prefetcher",
    "RetentionHint": "kvstrata.core.retention",
    "SkipReason": "kvstrata.core.metrics",
    "KvstrataConfig": "kvstrata.core.config",
    "ConfigError": "kvstrata.plugins.errors",
    "PluginHost": "kvstrata.plugins.host",
}

__all__ = [
    "CacheController",
    "CacheFullError",
    "ConcurrentUseError",
    "ConfigError",
    "KvstrataConfig",
    "Lease",
    "OpenLeasesWarning",
    "PluginHost",
    "PrefetchMode",
    "RetentionHint",
    "SkipReason",
    "__version__",
    "hookimpl",
    "load",
    "open",
]

if TYPE_CHECKING:
    from kvstrata.api import open
    from kvstrata.core.boundary import ConcurrentUseError, OpenLeasesWarning
    from kvstrata.core.config import KvstrataConfig, load
    from kvstrata.core.controller import CacheController
    from kvstrata.core.lease import CacheFullError, Lease
    from kvstrata.core.metrics import SkipReason
    from kvstrata.core.prefetcher import PrefetchMode
    from kvstrata.core.retention import RetentionHint
    from kvstrata.plugins.errors import ConfigError
    from kvstrata.plugins.host import PluginHost


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
