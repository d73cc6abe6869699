"""kvstrata-valkey: Valkey (or Redis) as a kvstrata L3 storage backend.

Installed with pip, found by kvstrata through the ``kvstrata.storage_backends`` entry point
``valkey``; configured as ``tiers.storage.<name>: {type: valkey, url: redis://host:port/db}``.
"""

from kvstrata_valkey.backend import ValkeyBackend, ValkeyConfig

__version__ = "0.1.0"
__all__ = ["ValkeyBackend", "ValkeyConfig", "__version__"]
