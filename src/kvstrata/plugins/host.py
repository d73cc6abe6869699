"""``PluginHost``: the one object that owns plugin state (registries + pluggy manager).

There are no module-level registries: an application, a test or the CLI builds a host, and two
hosts in one process never see each other's in-process registrations.
"""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pluggy
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstrata.plugins import hookspecs
from kvstrata.plugins.errors import ConfigError
from kvstrata.plugins.eviction_policy import (
    EVICTION_API_VERSION,
    EvictionPolicy,
    EvictionPolicyConfig,
    PolicyCapabilities,
)
from kvstrata.plugins.pool_type import POOL_API_VERSION, PoolConfig, PoolRole, PoolType
from kvstrata.plugins.registry import (
    UNKNOWN_DISTRIBUTION,
    DistributionNames,
    Registry,
    check_name,
    disabled_item,
    distribution_of,
    installed_entry_points,
)
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

log = logging.getLogger(__name__)


class PluginSettings(BaseSettings):
    """Environment switches that control discovery (read once per host). An empty variable is an
    unset one (``KVSTRATA_DISABLE_PLUGIN_AUTOLOAD=`` in a compose file or CI matrix stopped every
    command with "Input should be a valid boolean")."""

    model_config = SettingsConfigDict(env_prefix="KVSTRATA_", extra="ignore", env_ignore_empty=True)

    disable_plugin_autoload: bool = Field(
        default=False, description="scan no entry points; only in-process registrations count"
    )
    disabled_plugins: str = Field(default="", description="comma-separated plugin names to skip")

    @property
    def disabled(self) -> set[str]:
        return {name.strip() for name in self.disabled_plugins.split(",") if name.strip()}


def plugin_settings() -> PluginSettings:
    """The switches from the environment; a bad value is a :class:`ConfigError` naming the
    variable (every command reads them: a traceback there would stop all of them)."""
    try:
        return PluginSettings()
    except ValidationError as exc:
        errors = [
            (f"KVSTRATA_{'_'.join(str(part) for part in error['loc']).upper()}", error["msg"])
            for error in exc.errors()
        ]
        raise ConfigError(errors, "the environment") from None


def _pool_role(cls: type) -> None:
    if not isinstance(getattr(cls, "default_role", None), PoolRole):
        raise ValueError(f"{cls.__qualname__}.default_role must be a PoolRole")


@dataclass(frozen=True)
class PluginKind:
    """The class contract of one plugin kind: what its registry checks before it loads a plugin.

    ``capabilities``: the type a class's ``capabilities`` attribute must be an instance of (its
    ``api`` must match too); ``None`` for kinds without one. ``check``: a kind's own extra rule.
    """

    kind: str  # as errors name it: "pool type"
    group: str  # entry-point group
    base: type
    config_base: type
    api_version: int
    api_name: str  # as errors name the API: "pool-type API"
    register_hook: str  # the historic hook through which in-process plugins register classes
    capabilities: type | None = None
    check: Callable[[type], None] | None = None

    def validate(self, name: str, cls: type) -> None:
        """Raise ``ValueError`` saying what ``cls`` lacks to be a plugin of this kind named ``name``."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{cls!r} is not a kvstrata {self.base.__name__} subclass")
        check_name(self.kind, name, cls)
        if not issubclass(cls.Config, self.config_base):
            raise ValueError(f"{cls.__qualname__}.Config must subclass kvstrata {self.config_base.__name__}")
        extra = cls.Config.model_config.get("extra")
        if extra != "forbid":  # (a subclass may set it again): a misspelt key would be ignored
            raise ValueError(
                f"{cls.__qualname__}.Config sets extra={extra!r}: a plugin's config forbids unknown "
                "keys (extra='forbid'), so a misspelt one is an error, not silently ignored"
            )
        api = cls.api_version
        if self.capabilities is not None:
            caps = getattr(cls, "capabilities", None)
            if not isinstance(caps, self.capabilities):
                raise ValueError(
                    f"{cls.__qualname__}.capabilities must be a {self.capabilities.__name__} instance"
                )
            api = caps.api if caps.api != self.api_version else api
        if api != self.api_version:
            raise ValueError(f"written for {self.api_name} {api}, this kvstrata supports {self.api_version}")
        if self.check is not None:
            self.check(cls)


#: every plugin kind by the ``PluginHost`` attribute holding its registry (read-only)
PLUGIN_KINDS: Mapping[str, PluginKind] = MappingProxyType(
    {
        "pool_types": PluginKind(
            "pool type",
            POOL_TYPES_GROUP,
            PoolType,
            PoolConfig,
            POOL_API_VERSION,
            "pool-type API",
            "kvstrata_register_pool_types",
            check=_pool_role,
        ),
        "storage_backends": PluginKind(
            "storage backend",
            STORAGE_BACKENDS_GROUP,
            StorageBackend,
            BackendConfig,
            BACKEND_API_VERSION,
            "backend API",
            "kvstrata_register_storage_backends",
            BackendCapabilities,
        ),
        "eviction_policies": PluginKind(
            "eviction policy",
            EVICTION_POLICIES_GROUP,
            EvictionPolicy,
            EvictionPolicyConfig,
            EVICTION_API_VERSION,
            "eviction-policy API",
            "kvstrata_register_eviction_policies",
            PolicyCapabilities,
        ),
    }
)


@dataclass(frozen=True)
class HookPluginError:
    """A ``kvstrata.plugins`` hook module that failed to load (reported, never fatal)."""

    name: str
    distribution: str | None
    version: str | None
    error: str
    #: its module failed to import (a reinstall may mend that; a registration it made, such as a
    #: name a built-in already has, it cannot)
    import_failed: bool = False


class PluginHost:
    """Owns the pool-type, storage-backend and eviction-policy registries and the pluggy manager."""

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        disabled: set[str] | None = None,
        plugins: list[Any] | tuple[Any, ...] = (),
    ) -> None:
        settings = plugin_settings()
        self.autoload = (not settings.disable_plugin_autoload) if autoload is None else autoload
        self.disabled = settings.disabled if disabled is None else set(disabled)
        self.pm = pluggy.PluginManager("kvstrata")
        self.pm.add_hookspecs(hookspecs)
        self.pool_types: Registry[PoolType] = self._registry("pool_types")
        self.storage_backends: Registry[StorageBackend] = self._registry("storage_backends")
        self.eviction_policies: Registry[EvictionPolicy] = self._registry("eviction_policies")
        self.hook_plugin_errors: list[HookPluginError] = []
        #: installed hook plugins that loaded: name -> (distribution, version)
        self.hook_plugins: dict[str, tuple[str | None, str | None]] = {}
        #: installed packages whose entry points could not be read (skipped, never fatal)
        self.distribution_errors: list[str] = []
        if self.autoload:
            # one scan of every installed distribution's entry points for all four groups: a
            # scan reads each distribution's files and costs ~4 ms with a few hundred installed
            installed, broken = installed_entry_points()
            for problem in broken:
                self.distribution_errors.append(problem)
                warnings.warn(f"kvstrata skipped an installed package: {problem}", stacklevel=2)
            distributions: DistributionNames = {}
            for attribute in PLUGIN_KINDS:
                registry = getattr(self, attribute)
                registry.discover(installed.select(group=registry.group), distributions)
        # Historic calls: every plugin registered now or later feeds the same registries.
        for attribute, kind in PLUGIN_KINDS.items():
            hook = getattr(self.pm.hook, kind.register_hook)
            hook.call_historic(kwargs={"register": getattr(self, attribute).register})
        if self.autoload:  # after the historic calls: each plugin's registrations run as it is
            # registered, so one whose hook registers a bad class is reported alone
            self._load_hook_plugins(installed.select(group=HOOK_PLUGINS_GROUP))
        for plugin in plugins:
            self.register_plugin(plugin)

    def _registry(self, attribute: str) -> Registry[Any]:
        kind = PLUGIN_KINDS[attribute]
        return Registry(kind.kind, kind.group, kind.validate, disabled=self.disabled)

    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``host.hook.kvstrata_configure(...)``; events go through :meth:`notify`)."""
        return self.pm.hook

    def notify(self, event: str, **kwargs: Any) -> None:
        """Call the event hook ``event`` (an observer: configure, eviction, prefetch, backend
        open/close) on each plugin in pluggy's order, each on its own: one that raises is logged
        by name and ignored, the others still hear the event. A metrics plugin must never fail
        the operation it watches half-way (units taken before an eviction's event would leak),
        nor silence another plugin."""
        hook = getattr(self.pm.hook, event)
        impls = hook.get_hookimpls()
        if any(impl.wrapper or impl.hookwrapper for impl in impls):  # pluggy runs wrappers' halves
            try:
                hook(**kwargs)
            except Exception:
                log.exception("kvstrata hook %s raised; ignored", event)
            return
        for impl in reversed(impls):  # pluggy's order: last registered first
            try:
                impl.function(*(kwargs[name] for name in impl.argnames))
            except Exception as exc:
                log.error(
                    "kvstrata plugin %r: hook %s raised %s: %s (ignored; traceback at DEBUG)",
                    impl.plugin_name, event, type(exc).__name__, exc,
                )  # fmt: skip
                log.debug("kvstrata plugin %r: hook %s", impl.plugin_name, event, exc_info=True)

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a hook plugin (module or object) in-process; one implementing a hook kvstrata
        has no spec for (a misspelt name) is refused (``pluggy.PluginValidationError``)."""
        self.pm.register(plugin, name=name)
        self._check_known_hooks(plugin)

    def _check_known_hooks(self, plugin: object) -> None:
        """pluggy accepts an implementation of a hook no spec declares and never calls it (its
        ``check_pending``, which nothing ran, would say so): a misspelt ``kvstrata_evicton``
        observer was silently deaf. Refuse the plugin, unregistered, naming the hook."""
        unknown = sorted(
            caller.name
            for caller in self.pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
        )
        if unknown:
            self.pm.unregister(plugin)
            raise pluggy.PluginValidationError(
                plugin,
                f"implements {', '.join(unknown)}, which kvstrata does not call (misspelt? the hooks "
                "are in kvstrata.hookspecs; mark a hook of a newer kvstrata optionalhook=True)",
            )

    def _load_hook_plugins(self, points: Iterable[importlib.metadata.EntryPoint]) -> None:
        # A custom loop instead of pluggy's load_setuptools_entrypoints: one broken plugin is
        # reported with its distribution and does not hide the others.
        for ep in points:
            dist_name, version = distribution_of(ep, {})
            if disabled_item(self.disabled, ep.name, dist_name) is not None:
                continue
            origin = " ".join(filter(None, (dist_name, version)))
            known = dist_name if dist_name != UNKNOWN_DISTRIBUTION else None
            imported = taken = False
            try:
                if self.pm.get_plugin(ep.name) is not None:  # (it was once skipped without a word)
                    taken = True
                    raise ValueError(
                        f"the name {ep.name!r} is taken by {self._origin(ep.name)}'s "
                        f"hook plugin; uninstall one, or block this one with "
                        f"KVSTRATA_DISABLED_PLUGINS={dist_name}:{ep.name}"
                    )
                plugin = ep.load()
                imported = True
                self.pm.register(plugin, name=ep.name)  # runs its registration hooks too
                self._check_known_hooks(plugin)
                self.hook_plugins[ep.name] = (known, version)
            except (Exception, SystemExit) as exc:  # (a plugin calling sys.exit at import)
                if imported and self.pm.get_plugin(ep.name) is not None:
                    self.pm.unregister(name=ep.name)
                error = HookPluginError(
                    ep.name,
                    known,
                    version,
                    f"{type(exc).__name__}: {exc}",
                    import_failed=not imported and not taken,
                )
                self.hook_plugin_errors.append(error)
                warnings.warn(
                    f"kvstrata hook plugin {ep.name!r} from {origin} failed to load: {error.error}",
                    stacklevel=2,
                )

    def _origin(self, name: str) -> str:
        """The distribution (and version) a loaded hook plugin came from, as errors name it."""
        if name not in self.hook_plugins:
            return "another plugin"
        return " ".join(filter(None, self.hook_plugins[name])) or UNKNOWN_DISTRIBUTION

    def close(self) -> None:
        for plugin in list(self.pm.get_plugins()):
            self.pm.unregister(plugin)
