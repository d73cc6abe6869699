"""``PluginHost``: the one object that owns plugin state (registries + pluggy manager).

There are no module-level registries: an application, a test or the CLI builds a host, and two
hosts in one process never see each other's in-process registrations.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstrata.plugins import hookspecs
from kvstrata.plugins.eviction_policy import (
    EVICTION_API_VERSION,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
)
from kvstrata.plugins.pool_type import POOL_API_VERSION, PoolConfig, PoolRole, PoolType
from kvstrata.plugins.registry import Registry, check_name
from kvstrata.plugins.storage_backend import (
    BACKEND_API_VERSION,
    BackendCapabilities,
    BackendConfig,
    StorageBackend,
)

POOL_TYPES_GROUP = "kvstrata.pool_types"
STORAGE_BACKENDS_GROUP = "kvstrata.storage_backends"
EVICTION_POLICIES_GROUP = "kvstrata.eviction_policies"
HOOK_PLUGINS_GROUP = "kvstrata.plugins"


class PluginSettings(BaseSettings):
    """Environment switches that control discovery (read once per host)."""

    model_config = SettingsConfigDict(env_prefix="KVSTRATA_", extra="ignore")

    disable_plugin_autoload: bool = Field(
        default=False, description="scan no entry points; only in-process registrations count"
    )
    disabled_plugins: str = Field(default="", description="comma-separated plugin names to skip")

    @property
    def disabled(self) -> set[str]:
        return {name.strip() for name in self.disabled_plugins.split(",") if name.strip()}


def _validate_pool_type(name: str, cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, PoolType)):
        raise ValueError(f"{cls!r} is not a kvstrata PoolType subclass")
    check_name("pool type", name, cls)
    if not issubclass(cls.Config, PoolConfig):
        raise ValueError(f"{cls.__qualname__}.Config must subclass kvstrata PoolConfig")
    if cls.api_version != POOL_API_VERSION:
        raise ValueError(
            f"written for pool-type API {cls.api_version}, this kvstrata supports {POOL_API_VERSION}"
        )
    if not isinstance(getattr(cls, "default_role", None), PoolRole):
        raise ValueError(f"{cls.__qualname__}.default_role must be a PoolRole")


def _validate_backend(name: str, cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(f"{cls!r} is not a kvstrata StorageBackend subclass")
    check_name("storage backend", name, cls)
    if not issubclass(cls.Config, BackendConfig):
        raise ValueError(f"{cls.__qualname__}.Config must subclass kvstrata BackendConfig")
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, BackendCapabilities):
        raise ValueError(f"{cls.__qualname__}.capabilities must be a BackendCapabilities instance")
    if cls.api_version != BACKEND_API_VERSION or caps.api != BACKEND_API_VERSION:
        raise ValueError(f"written for backend API {caps.api}, this kvstrata supports {BACKEND_API_VERSION}")


def _validate_eviction_policy(name: str, cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ValueError(f"{cls!r} is not a kvstrata EvictionPolicy subclass")
    check_name("eviction policy", name, cls)
    if not issubclass(cls.Config, EvictionPolicyConfig):
        raise ValueError(f"{cls.__qualname__}.Config must subclass kvstrata EvictionPolicyConfig")
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, PolicyCapabilities):
        raise ValueError(f"{cls.__qualname__}.capabilities must be a PolicyCapabilities instance")
    if cls.api_version != EVICTION_API_VERSION or caps.api != EVICTION_API_VERSION:
        raise ValueError(
            f"written for eviction-policy API {caps.api}, this kvstrata supports {EVICTION_API_VERSION}"
        )


@dataclass(frozen=True)
class HookPluginError:
    """A ``kvstrata.plugins`` hook module that failed to load (reported, never fatal)."""

    name: str
    distribution: str | None
    version: str | None
    error: str


class PluginHost:
    """Owns the pool-type, storage-backend and eviction-policy registries and the pluggy manager."""

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        disabled: set[str] | None = None,
        plugins: list[Any] | tuple[Any, ...] = (),
    ) -> None:
        settings = PluginSettings()
        self.autoload = (not settings.disable_plugin_autoload) if autoload is None else autoload
        self.disabled = settings.disabled if disabled is None else set(disabled)
        self.pm = pluggy.PluginManager("kvstrata")
        self.pm.add_hookspecs(hookspecs)
        self.pool_types: Registry[PoolType] = Registry(
            "pool type", POOL_TYPES_GROUP, _validate_pool_type, disabled=self.disabled
        )
        self.storage_backends: Registry[StorageBackend] = Registry(
            "storage backend", STORAGE_BACKENDS_GROUP, _validate_backend, disabled=self.disabled
        )
        self.eviction_policies: Registry[EvictionPolicy] = Registry(
            "eviction policy", EVICTION_POLICIES_GROUP, _validate_eviction_policy, disabled=self.disabled
        )
        self.hook_plugin_errors: list[HookPluginError] = []
        if self.autoload:
            self.pool_types.discover()
            self.storage_backends.discover()
            self.eviction_policies.discover()
            self._load_hook_plugins()
        # Historic calls: every plugin registered now or later feeds the same registries.
        self.pm.hook.kvstrata_register_pool_types.call_historic(kwargs={"register": self.pool_types.register})
        self.pm.hook.kvstrata_register_storage_backends.call_historic(
            kwargs={"register": self.storage_backends.register}
        )
        self.pm.hook.kvstrata_register_eviction_policies.call_historic(
            kwargs={"register": self.eviction_policies.register}
        )
        for plugin in plugins:
            self.register_plugin(plugin)

    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``host.hook.kvstrata_backend_opened(...)``)."""
        return self.pm.hook

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a hook plugin (module or object) in-process."""
        self.pm.register(plugin, name=name)

    def _load_hook_plugins(self) -> None:
        # A custom loop instead of pluggy's load_setuptools_entrypoints: one broken plugin is
        # reported with its distribution and does not hide the others.
        for ep in importlib.metadata.entry_points(group=HOOK_PLUGINS_GROUP):
            if ep.name in self.disabled or self.pm.get_plugin(ep.name) is not None:
                continue
            dist = getattr(ep, "dist", None)
            try:
                self.pm.register(ep.load(), name=ep.name)
            except Exception as exc:
                error = HookPluginError(
                    ep.name,
                    dist.name if dist else None,
                    dist.version if dist else None,
                    f"{type(exc).__name__}: {exc}",
                )
                self.hook_plugin_errors.append(error)
                warnings.warn(
                    f"kvstrata hook plugin {ep.name!r} from {error.distribution} failed to load: "
                    f"{error.error}",
                    stacklevel=2,
                )

    def close(self) -> None:
        for plugin in list(self.pm.get_plugins()):
            self.pm.unregister(plugin)
