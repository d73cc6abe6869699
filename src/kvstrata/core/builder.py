"""Start-up in one pass: config -> backend, pools, tree, stack layout, storage engine and plans.

The controller receives the finished parts (:class:`CacheParts`) and never re-enters start-up,
so following a config through start-up means reading this file top to bottom:

1. the ``kvstrata_configure`` hook sees the config;
2. the storage backend (if any) is opened; its capabilities say whether host pools must live in
   its memory;
3. the pool group allocates every pool on both tiers; the prefix tree tracks the anchor and the
   components; :class:`~kvstrata.core.stack.StackLayout` records how each pool is treated;
4. an I/O plan per (backend, pool) is made from capabilities x specs, zero-copy host memory is
   registered with the backend, and the storage engine is built over those plans;
5. the controller's working parts are wired over those objects: the eviction policy of each tier
   (``policy.eviction``) and the retention hints, unit allocation and eviction, load-back, the
   writer and (with L3) the prefetcher.

A pool added later (a draft pool) goes through :func:`add_late_pool`, the same planning step.

:func:`check_startup` runs the checks of steps 2-3 that a config can fail (one storage instance,
a host tier under L3, a usable device, pool sizing, no pool without device units) without opening
or allocating anything: ``kvstrata config validate``, ``doctor`` and ``replay`` call it first, so
each refuses exactly what start-up would refuse, with the same message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvstrata.core.config import KvstrataConfig, ParallelConfig, PoolConfig
from kvstrata.core.integrity import ChecksumPolicy
from kvstrata.core.io_plan import IOMode, IOPlan, plan_backend
from kvstrata.core.keys import namespace_root
from kvstrata.core.load_back import LoadBack
from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.part_context import PartContext
from kvstrata.core.policies import check_live_policy, install_policies
from kvstrata.core.pool_group import Pool, PoolGroup
from kvstrata.core.prefetcher import Prefetcher
from kvstrata.core.retention import Retention
from kvstrata.core.stack import StackLayout
from kvstrata.core.storage_engine import StorageEngine
from kvstrata.core.tier_units import TierUnits
from kvstrata.core.tree import PrefixTree
from kvstrata.core.unit_digests import UnitDigests
from kvstrata.core.writer import Writer
from kvstrata.plugins import PluginHost
from kvstrata.plugins.errors import ConfigError, PluginError, StorageError
from kvstrata.plugins.pool_type import PoolSpec
from kvstrata.plugins.storage_backend import BACKEND_API_VERSION, BackendCapabilities, StorageBackend

log = logging.getLogger(__name__)

#: one pool's engine tensors: ``{buffer: tensor}``, or a list per layer
EngineTensors = Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
#: the engine's tensors per pool (``kvstrata.open(device_tensors=...)``)
DeviceTensors = Mapping[str, EngineTensors]
#: a pool's settings, as a model or as written in a config file
PoolSpecs = PoolConfig | Mapping[str, Any]


class StartupError(ConfigError, ValueError):
    """A config start-up cannot build; the message names the setting to change. A
    :class:`~kvstrata.plugins.ConfigError` (what ``kvstrata.open`` documents for a bad config,
    and ``kvstrata config validate`` reports) and, as it always was, a ``ValueError``."""

    def __init__(self, message: str) -> None:
        self.errors, self.source = [("", message)], None
        Exception.__init__(self, message)  # (the message as written: it names the setting)


def check_startup(config: KvstrataConfig, plugins: PluginHost, *, machine: bool = True) -> None:
    """Raise :class:`StartupError` (or the pool group's own ``ValueError``) for a config that
    :func:`build_cache` would refuse, without opening a backend or allocating memory.
    ``machine``: also check that this machine has the configured device (not for a config
    written for another machine)."""
    _check_storage(config)
    _check_device(config, machine=machine)
    _check_eviction(config, plugins)
    sizing = _named(lambda: _SizingOnly(config, plugins))
    _check_device_units(config, {name: units for name, (_, units) in sizing.sized.items()})
    _check_host_units(config)


def startup_host_bytes(config: KvstrataConfig, plugins: PluginHost) -> int:
    """Host memory the pools of ``config`` take at start-up: their host tiers, and their device
    tiers where L1 is on the CPU (the figure start-up checks against the rank's budget)."""
    return int(_SizingOnly(config, plugins).__dict__["requested_bytes"])


class _SizingOnly(PoolGroup):
    """The pool group's own start-up: plugins, specs, order and sizing with every check they
    make; the memory check and the allocation are skipped (``sized``: pool -> (spec, units))."""

    def _check_memory(self, requested: int, what: str) -> None:
        self.__dict__["requested_bytes"] = requested  # what start-up checks, not checked here

    def _add(self, name: str, plugin: Any, spec: PoolSpec, units: tuple[int, int]) -> Any:
        self.__dict__.setdefault("sized", {})[name] = (spec, units)


def _check_storage(config: KvstrataConfig) -> None:
    storage = config.tiers.storage
    if len(storage) > 1:
        raise StartupError(
            f"tiers.storage: one storage instance per cache is supported, got {sorted(storage)}"
        )
    if storage and config.tiers.host.capacity_tokens <= 0:
        raise StartupError(
            "tiers.storage needs a host tier (L3 reads and writes go through L2): "
            "set tiers.host.capacity_tokens > 0"
        )


def _check_device(config: KvstrataConfig, *, machine: bool) -> None:
    name = config.tiers.device.device
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise StartupError(f"tiers.device.device {name!r} is not a torch device: {exc}") from None
    if device.type not in ("cpu", "cuda"):  # (copies between tiers are CPU or CUDA streams)
        raise StartupError(f"tiers.device.device {name!r}: the device tier is 'cpu' or 'cuda[:N]'")
    if machine:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as exc:  # torch asserts when not built for CUDA
            raise StartupError(
                f"tiers.device.device {name!r} cannot be used on this machine: {exc}"
            ) from None


def _check_eviction(config: KvstrataConfig, plugins: PluginHost) -> None:
    if config.policy.eviction is not None:
        try:
            check_live_policy(plugins, config.policy.eviction)
        except ValueError as exc:  # (pydantic's errors too: a bad option of the policy)
            raise StartupError(f"policy.eviction: {exc}") from None


def _check_device_units(config: KvstrataConfig, units: Mapping[str, tuple[int, int]]) -> None:
    """A pool with no device unit cannot serve a single page (L1 is where the model reads)."""
    for name, (device_units, _) in units.items():
        if device_units > 0:
            continue
        pool = config.model.pools[name]
        if pool.device_units == 0:
            raise StartupError(
                f"model.pools.{name}.device_units is 0: the pool would hold nothing on the device"
            )
        raise StartupError(
            f"tiers.device.capacity_tokens is {config.tiers.device.capacity_tokens}: pool {name!r} would get "
            "no device units; set it to at least one page"
        )


_Group = TypeVar("_Group", bound=PoolGroup)


def _named(build: Callable[[], _Group]) -> _Group:
    """``build()`` the pool group; where it refuses a config value (its message starts with the
    value's dotted path, ``model.pools...``), as a :class:`StartupError`: ``kvstrata.open``
    documents a ``ConfigError`` naming the field, and these were bare ``ValueError``s (a sidecar's
    ``device_units``, an ``index_source`` on a component ...). Other refusals (the engine's
    tensors) stay as they were."""
    try:
        return build()
    except ConfigError:
        raise
    except ValueError as exc:
        if str(exc).startswith("model.pools"):
            raise StartupError(str(exc)) from None
        raise


def _check_host_units(config: KvstrataConfig) -> None:
    """A page reaches the host tier (and L3, which goes through it) only with a host unit in
    every pool of the stack: one pool set to no host units turned both off for every pool, with
    no word at start-up (doctor said every pool could be stored)."""
    if config.tiers.host.capacity_tokens <= 0:
        return
    for name, pool in config.model.pools.items():
        if pool.host_units == 0:
            raise StartupError(
                f"model.pools.{name}.host_units is 0: no page of the stack could be on the host tier "
                "or in L3 (a page needs a host unit in every pool); set it to at least one, or "
                "tiers.host.capacity_tokens=0 to run without a host tier"
            )


@dataclass
class CacheParts:
    """Everything start-up builds; the controller coordinates these objects."""

    config: KvstrataConfig
    plugins: PluginHost
    pools: PoolGroup
    tree: PrefixTree
    layout: StackLayout
    metrics: CacheMetrics
    backend: StorageBackend | None = None
    engine: StorageEngine | None = None
    units: TierUnits = field(init=False)
    retention: Retention = field(init=False)
    context: PartContext = field(init=False)  # what load-back, the writer and the prefetcher share
    load_back: LoadBack = field(init=False)
    writer: Writer = field(init=False)
    prefetcher: Prefetcher | None = None

    @property
    def page_size(self) -> int:
        return self.config.model.page_size

    @property
    def namespace_root(self) -> str:
        return namespace_root(self.config.model.name, self.config.model.cache_salt)


def build_cache(
    config: KvstrataConfig, plugins: PluginHost, *, device_tensors: DeviceTensors | None = None
) -> CacheParts:
    """Open the backend and build every part; on any failure the opened backend is closed.
    ``device_tensors``: an engine's own device memory per pool and buffer, used as L1."""
    plugins.notify("kvstrata_configure", config=config)
    _check_device(config, machine=True)
    _check_eviction(config, plugins)
    backend, host_allocator = _open_backend(config, plugins)
    announced = False  # the plugins heard the backend open (its engine was made)
    try:
        pools = _named(
            lambda: PoolGroup(config, plugins, host_allocator=host_allocator, device_tensors=device_tensors)
        )
        _check_device_units(config, {name: (pool.device.units, 0) for name, pool in pools.pools.items()})
        _check_host_units(config)
        tree = PrefixTree(pool.spec for pool in pools.pools.values())
        parts = CacheParts(config, plugins, pools, tree, StackLayout.of(pools, tree), CacheMetrics())
        if backend is not None:
            _attach_storage(parts, backend)
            announced = True
        _wire(parts)
    except BaseException:
        if backend is not None:
            try:  # observers that heard it open hear it close, as at close()
                if announced:
                    plugins.notify("kvstrata_backend_closing", instance=backend.instance, backend=backend)
            finally:
                backend.close()
        raise
    return parts


def _wire(parts: CacheParts) -> None:
    """The controller's working parts, sharing the pools, tree, layout, metrics and engine."""
    policy, notify = parts.config.policy, parts.plugins.notify

    def on_eviction(tier: str, pool: str, units: int) -> None:
        notify("kvstrata_eviction", tier=tier, pool=pool, units=units)

    if policy.eviction is not None:  # else the tree's own LRU order
        install_policies(parts.plugins, policy.eviction, parts.pools, parts.tree)
    fraction = policy.retention.max_pinned_fraction
    pinnable = int(fraction * parts.pools.anchor.device_allocator.units)
    unit_caps = {  # every other tree pool: a state pool's slots can run out before the pages
        p: int(fraction * allocator.units)
        for name, p in parts.tree.index.items()
        if p and (allocator := parts.pools.pools[name].device_allocator) is not None
    }
    parts.retention = Retention(parts.tree, pinnable, parts.metrics, unit_caps=unit_caps)
    parts.tree.set_retention(parts.retention)
    parts.units = TierUnits(
        parts.pools,
        parts.tree,
        delete_unbacked=policy.write != "write_back",
        on_eviction=on_eviction,
        metrics=parts.metrics,
    )
    parts.context = PartContext(
        parts.pools,
        parts.tree,
        parts.layout,
        parts.units,
        parts.metrics,
        policy,
        page_size=parts.page_size,
        namespace_root=parts.namespace_root,
    )
    parts.load_back = LoadBack(parts.context)
    parts.writer = Writer(parts.context, parts.engine)
    if parts.engine is not None:
        parts.prefetcher = Prefetcher(parts.context, parts.engine, notify, parts.writer.window_ends)
    if parts.config.debug.unit_digests:
        parts.writer.digests = UnitDigests(parts.pools, parts.layout)
        if parts.prefetcher is not None:
            parts.prefetcher.digests = parts.writer.digests


def _open_backend(config: KvstrataConfig, plugins: PluginHost) -> tuple[StorageBackend | None, Any]:
    storage = config.tiers.storage
    if not storage:
        return None, None
    _check_storage(config)
    ((instance, backend_config),) = storage.items()
    backend = open_storage_backend(plugins, instance, backend_config)
    caps = backend.instance_capabilities()
    return backend, (backend.allocate_host_memory if caps.host_allocator else None)


def open_storage_backend(
    plugins: PluginHost, instance: str, backend_config: Any, *, config_path: str = "tiers.storage"
) -> StorageBackend:
    """The configured backend plugin, opened (shared with the adapters that drive L3 directly).

    A backend that cannot open (a path that cannot be created, a server that does not answer, a
    plugin whose constructor or ``instance_capabilities`` raises) is a :class:`StorageError`
    naming the config entry, whatever the plugin raised (kept as the cause): a user reads which
    instance of which backend failed, not an ``OSError`` from deep in a plugin. Plugin errors
    (a missing extra, a 3FS mount that is not there) pass as they are: they already say what to
    do. ``config_path``: where the user wrote the storage instances (an engine adapter's config
    sits under its own key: ``config.tiers.storage``)."""
    backend_class = plugins.storage_backends.require(backend_config.type)
    backend: StorageBackend | None = None
    try:  # the constructor and the capabilities are the plugin's code too: the same error
        backend = backend_class(instance, backend_config)
        backend.open()
        _check_capabilities(plugins, backend)  # what the caller asks next: an open backend answers it
    except PluginError:
        _close_quietly(backend)
        raise
    except Exception as exc:
        _close_quietly(backend)
        what = str(exc) if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
        raise StorageError(
            f"storage instance {instance!r} ({config_path}.{instance}, type {backend_config.type!r}) "
            f"could not be opened: {what}"
        ) from exc
    return backend


def _check_capabilities(plugins: PluginHost, backend: StorageBackend) -> None:
    """An instance's capabilities are held to the class's contract (a ``BackendCapabilities`` of
    this backend API): anything else failed after the open, with the backend left open."""
    caps = backend.instance_capabilities()
    if isinstance(caps, BackendCapabilities) and caps.api == BACKEND_API_VERSION:
        return
    what = f"api {caps.api}" if isinstance(caps, BackendCapabilities) else f"a {type(caps).__name__}"
    origin = plugins.storage_backends.entry(backend.name).origin
    raise PluginError(
        f"storage backend {backend.name!r} from {origin}: instance_capabilities() of {backend.instance!r} "
        f"returned {what}, not the BackendCapabilities of backend API {BACKEND_API_VERSION}"
    )


def _close_quietly(backend: StorageBackend | None) -> None:
    """Release what a failed ``open`` may have taken; the open's error is the one to report."""
    if backend is None:  # its constructor failed: nothing was opened
        return
    try:
        backend.close()
    except Exception:  # the open's error is the one reported
        log.debug("closing backend %r after a failed open failed too", backend.instance, exc_info=True)


def new_storage_engine(
    backend: StorageBackend,
    specs: Mapping[str, PoolSpec],
    plans: Mapping[str, IOPlan],
    *,
    model_name: str,
    cache_salt: str,
    parallel: ParallelConfig,
    checksum: ChecksumPolicy,
    plugins: PluginHost,
) -> StorageEngine:
    """The storage engine over an opened backend (keys namespaced by ``model_name`` and
    ``cache_salt``); announces the backend to the plugins."""
    engine = StorageEngine(
        backend,
        specs,
        plans,
        model_name=model_name,
        cache_salt=cache_salt,
        parallel=parallel,
        checksum=checksum,
        notify=plugins.notify,
    )
    plugins.notify(
        "kvstrata_backend_opened",
        instance=backend.instance,
        backend=backend,
        capabilities=backend.instance_capabilities(),
    )
    return engine


def _attach_storage(parts: CacheParts, backend: StorageBackend) -> None:
    config = parts.config
    specs = {name: pool.spec for name, pool in parts.pools.pools.items()}
    plans = _plan(parts.pools, backend, config, specs.values())
    engine = new_storage_engine(
        backend,
        specs,
        plans,
        model_name=config.model.name,
        cache_salt=config.model.cache_salt,
        parallel=config.parallel,
        checksum=config.policy.checksum,
        plugins=parts.plugins,
    )
    parts.backend, parts.engine = backend, engine
    parts.metrics.attach(engine.metrics)


def add_late_pool(
    parts: CacheParts, name: str, config: PoolSpecs, device_tensors: EngineTensors | None
) -> Pool:
    """Add a sidecar after start (anything else, or tensors that do not fit it, is refused with
    nothing added), drop what was cached without its data (pinned pages too: every pin is
    released), plan its storage I/O."""
    pool = parts.pools.add_pool(name, config, device_tensors=device_tensors)
    released = parts.retention.release_all()
    if released:
        log.warning(
            "add_pool(%r): released %d pin(s): the pages cached before it are dropped", name, released
        )
    parts.units.drop_everything()
    if parts.tree.root.children:  # a locked node would be served with units no one wrote
        raise RuntimeError(f"add_pool({name!r}): pages cached before it are still locked; none may be served")
    parts.layout.refresh(parts.pools, parts.tree)
    if parts.engine is not None and parts.backend is not None:
        (plan,) = _plan(parts.pools, parts.backend, parts.config, [pool.spec]).values()
        parts.engine.add_pool(pool.instance, pool.spec, plan)
    return pool


def _plan(
    pools: PoolGroup, backend: StorageBackend, config: KvstrataConfig, specs: Iterable[PoolSpec]
) -> dict[str, IOPlan]:
    """Plan each (backend, pool) I/O path, register zero-copy host memory, log the plans."""
    caps = backend.instance_capabilities()
    host_from_backend = bool(caps.host_allocator)
    plans = plan_backend(
        backend.instance, caps, specs, parallel=config.parallel, host_memory_from_backend=host_from_backend
    )
    if not host_from_backend:  # backend-allocated memory is registered already
        seen: set[int] = set()
        for name, plan in plans.items():
            host = pools.pools[name].host
            if plan.mode is not IOMode.ZERO_COPY or host is None:
                continue
            region = host.region()
            if region is not None and region.ptr not in seen:
                seen.add(region.ptr)
                backend.register_host_memory(region)
    for name, plan in plans.items():
        log.info("I/O plan %s/%s: %s (%s)", backend.instance, name, plan.mode.value, plan.reason)
    return plans
