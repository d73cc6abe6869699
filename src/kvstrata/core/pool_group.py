"""A model stack's pools on the device and host tiers: one anchor, components and sidecars.

The group turns the validated config into :class:`Pool` objects (spec + device buffers + host
buffers + allocators), sizes every pool from one budget, checks host memory before allocating, and
accepts pools added after start (a draft worker starts later). It reads specs only: no pool type
is known here by name.

Sizing (units = pages for token-page pools, slots for node-state pools):

* token pages: ``ceil(tiers.device.capacity_tokens / page_size)`` on the device and
  ``ceil(tiers.host.capacity_tokens / page_size)`` on the host;
* node state: ``device_units`` or one slot per 16 device pages (at least two), and on the host
  ``host_units`` or the device slots times the host/device token ratio;
* a pool's ``device_units`` / ``host_units`` override either;
* sidecars always have exactly their index source's units and share its allocators.

Engine-supplied device tiers (``device_tensors``): a pool listed there uses the engine's own
tensors as its device tier instead of allocating one (see
:meth:`kvstrata.core.buffers.PoolBuffers.from_tensors`; per buffer one ``(layers, units,
*unit_shape)`` tensor or a sequence of per-layer ``(units, *unit_shape)`` tensors). Its device
units are the tensors' unit count: they replace the ``capacity_tokens`` default, a configured
``device_units`` must equal them, and a sidecar's tensors must hold its index source's units.
Those tensors are the engine's memory, so they are not counted against the host memory budget.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from pydantic import ValidationError

from kvstrata.core.allocator import UnitAllocator
from kvstrata.core.buffers import EngineTensor, HostAllocatorFn, PoolBuffers, engine_tensor_units
from kvstrata.core.config import HostTierConfig, KvstrataConfig, anchor_instances, dotted
from kvstrata.core.transfer import TransferHandle, as_index, copy_unit_bytes, copy_units, issue_copies
from kvstrata.plugins.errors import ConfigError, PluginError
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.pool_type import (
    Granularity,
    Layout,
    ModelContext,
    PoolConfig,
    PoolRole,
    PoolSpec,
    PoolType,
)
from kvstrata.plugins.storage_backend import BufferRegion

log = logging.getLogger(__name__)

#: Node-state pools without ``device_units`` get one slot per this many device pages.
DEVICE_PAGES_PER_STATE_SLOT = 16
MIN_DEFAULT_STATE_SLOTS = 2  #: a request resuming from a locked cached checkpoint forks it into its own


class HostMemoryError(MemoryError):
    """The host tier does not fit in this rank's share of host memory."""


def host_memory_budget(tier: HostTierConfig, available_bytes: int | None = None) -> int:
    """Bytes this rank may allocate: ``(available - reserve_bytes) // ranks_per_host``."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    return max(0, available - tier.reserve_bytes) // tier.ranks_per_host


def check_host_memory(
    requested: int,
    tier: HostTierConfig,
    available_bytes: int | None = None,
    what: str = "",
    *,
    device_on_host: bool = False,
) -> None:
    """Fail with the requested and available bytes when ``requested`` exceeds the budget
    (``device_on_host``: the device tier lives in host memory too, and is named as a cause)."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    budget = host_memory_budget(tier, available)
    if requested > budget:
        raise HostMemoryError(
            f"not enough host memory{' for ' + what if what else ''}: requested {requested} bytes "
            f"({requested / 2**30:.2f} GiB), available to this rank {budget} bytes "
            f"({budget / 2**30:.2f} GiB) = (available {available} - reserve_bytes {tier.reserve_bytes}) "
            f"// ranks_per_host {tier.ranks_per_host}; "
            + (
                "lower tiers.device.capacity_tokens (the device tier is on the CPU: host memory), "
                "tiers.host.capacity_tokens or the pools' device_units / host_units"
                if device_on_host
                else "lower tiers.host.capacity_tokens or the pools' host_units"
            )
        )


@dataclass
class Pool:
    """One pool instance: its plugin, spec, memory on both tiers and the allocators it uses.

    A sidecar's allocators are its index owner's objects (shared, not copies).
    """

    instance: str
    pool_type: PoolType
    spec: PoolSpec
    device: PoolBuffers
    host: PoolBuffers | None
    device_allocator: UnitAllocator
    host_allocator: UnitAllocator | None
    index_owner: str  # the pool whose allocators this one uses (itself unless a sidecar)

    @property
    def role(self) -> PoolRole:
        return self.spec.role

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes


def build_order(specs: Mapping[str, PoolSpec], existing: Sequence[str] = ()) -> list[str]:
    """Index owners before the sidecars that borrow their indices."""
    order: list[str] = []
    placed = set(existing)
    pending = dict(specs)
    while pending:
        ready = [n for n, s in pending.items() if s.index_source is None or s.index_source in placed]
        if not ready:
            raise ValueError(f"model.pools: index_source cycle or unknown source among {sorted(pending)}")
        for name in ready:  # a sidecar holds what its source hands out (pages, or state slots)
            if (source := pending.pop(name).index_source) in specs:
                specs[name].check_index_source(specs[source])
        order += ready
        placed.update(ready)
    return order


def describe_pool(pool: Pool) -> dict[str, Any]:
    """What ``kvstrata doctor`` shows of one pool."""
    return {
        "pool": pool.instance,
        "type": pool.spec.pool_type,
        "role": pool.role.value,
        "index_owner": pool.index_owner,
        "bytes_per_unit": pool.spec.bytes_per_unit,
        "device_units": pool.device.units,
        "device_memory": "kvstrata" if pool.device.owned else "engine",
        "host_units": 0 if pool.host is None else pool.host.units,
        "host_layout": None if pool.host is None else pool.host.layout.value,
        "host_bytes": pool.host_bytes,
    }


def _check_late_pool(instance: str, spec: PoolSpec, anchor: str, pools: Mapping[str, Pool]) -> None:
    """A pool added after start must be a sidecar of a pool in the group: the tree holds values
    of the pools it was built with only."""
    if spec.role is PoolRole.ANCHOR:
        raise ValueError(f"pool {instance!r} would be a second anchor (anchor: {anchor!r})")
    if spec.role is not PoolRole.SIDECAR:
        raise ValueError(
            f"pool {instance!r} is a {spec.role.value}: only sidecars (pools with an index_source) "
            "can be added after start"
        )
    if spec.index_source is not None and spec.index_source not in pools:
        raise ValueError(f"pool {instance!r}: index_source {spec.index_source!r} is not in the group")
    if spec.index_source is not None:
        spec.check_index_source(pools[spec.index_source].spec)


def checked_spec(plugin: PoolType, host: PluginHost, anchor: str | None) -> PoolSpec:
    """``plugin.spec()``, refused naming the plugin's package when it contradicts what the core keys,
    plans and sizes by (instance, type, the model's page size, anchor role): it failed later with a
    bare ``KeyError``, or got another type's capabilities and keys, or another page size."""
    spec = plugin.spec()
    instance, type_name, page_size = plugin.instance, plugin.name, plugin.model.page_size
    wrong: list[str] = []
    if not isinstance(spec, PoolSpec):
        wrong.append(f"returned a {type(spec).__name__}, not a PoolSpec")
    else:
        if spec.name != instance:
            wrong.append(f"name is {spec.name!r}, not the instance name {instance!r}")
        if spec.pool_type != type_name:
            wrong.append(f"pool_type is {spec.pool_type!r}, not the plugin's name {type_name!r}")
        if spec.page_size != page_size:
            wrong.append(f"page_size is {spec.page_size}, not the model's page_size {page_size}")
        if anchor is not None and (spec.role is PoolRole.ANCHOR) != (instance == anchor):
            should = "the anchor" if instance == anchor else f"not the anchor (that is {anchor!r})"
            wrong.append(f"role is {spec.role.value}, but by its type's default_role it is {should}")
    if wrong:
        origin = host.pool_types.entry(type_name).origin
        raise PluginError(
            f"pool type {type_name!r} from {origin} declared an inconsistent spec for pool {instance!r}: "
            + "; ".join(wrong)
        )
    return spec


class PoolGroup:
    """All pools of one model stack on this rank (see the module docstring for sizing)."""

    def __init__(
        self,
        config: KvstrataConfig,
        plugins: PluginHost,
        *,
        host_allocator: HostAllocatorFn | None = None,
        available_host_bytes: Callable[[], int] | None = None,
        device_tensors: Mapping[str, Mapping[str, EngineTensor]] | None = None,
    ) -> None:
        """Build and allocate every pool of ``config.model.pools``.

        ``host_allocator`` -- a backend's ``allocate_host_memory`` when its capabilities say host
        pools must live in its memory; ``available_host_bytes`` -- override of the psutil reading
        (for callers that account memory themselves); ``device_tensors`` -- ``{pool: {buffer:
        tensor}}``: the engine's own device memory for those pools (see the module docstring).
        """
        self.config = config
        self.plugins = plugins
        self.page_size = config.model.page_size
        self.device = torch.device(config.tiers.device.device)
        self.host_tier = config.tiers.host
        self.host_enabled = config.tiers.host.capacity_tokens > 0
        pin = config.tiers.host.pin_memory
        self.pin_memory = self.device.type == "cuda" if pin is None else pin
        self.device_pages = math.ceil(config.tiers.device.capacity_tokens / self.page_size)
        self.host_pages = math.ceil(config.tiers.host.capacity_tokens / self.page_size)
        self._host_allocator = host_allocator
        self._available = available_host_bytes
        self._lock = threading.Lock()
        self.pools: dict[str, Pool] = {}
        self.anchor_name = self._find_anchor(config.model.pools)
        self.context = ModelContext(page_size=self.page_size, anchor=self.anchor_name)
        self._device_tensors: dict[str, Mapping[str, EngineTensor]] = dict(device_tensors or {})
        #: ``followers`` per owner, made once (a backup asks per pool per batch); reset per pool added
        self._followers: dict[str, tuple[Pool, ...]] = {}
        unknown = sorted(set(self._device_tensors) - set(config.model.pools))
        if unknown:
            raise ValueError(
                f"device_tensors names pools {unknown} that are not in model.pools {list(config.model.pools)}"
            )

        plugins_by_name = {name: self._instantiate(name, cfg) for name, cfg in config.model.pools.items()}
        specs = {name: checked_spec(p, plugins, self.anchor_name) for name, p in plugins_by_name.items()}
        order = build_order(specs)
        units = {}
        for name in order:
            units[name] = self._units(specs[name], plugins_by_name[name].config, units)
        requested = sum(self._tier_bytes(specs[name], units[name]) for name in order)
        self._check_memory(requested, f"pools {order}")
        for name in order:
            self._add(name, plugins_by_name[name], specs[name], units[name])

    # --- construction -------------------------------------------------------------------------

    def _find_anchor(self, pools: Mapping[str, PoolConfig]) -> str:
        anchors = anchor_instances(pools, self.plugins)
        if len(anchors) != 1:
            raise ValueError(f"a model stack needs exactly one anchor pool; found {anchors or 'none'}")
        return anchors[0]

    def _instantiate(self, instance: str, config: PoolConfig | Mapping[str, Any]) -> PoolType:
        if isinstance(config, Mapping):
            type_name = config.get("type")
            if not isinstance(type_name, str):
                raise ValueError(f"pool {instance!r}: missing `type` (the pool type name)")
            try:
                config = self.plugins.pool_types.get(type_name).Config.model_validate(dict(config))
            except ValidationError as exc:  # named as the same pool in a config file would be
                where = f"model.pools.{instance}"
                raise ConfigError([(dotted([where, *e["loc"]]), e["msg"]) for e in exc.errors()]) from None
        cls = self.plugins.pool_types.get(config.type)
        return cls(instance, config, self.context)

    def _units(
        self,
        spec: PoolSpec,
        config: PoolConfig,
        known: Mapping[str, tuple[int, int]],
    ) -> tuple[int, int]:
        """(device units, host units) of one pool."""
        if spec.index_source is not None:
            if config.device_units is not None or config.host_units is not None:
                raise ValueError(
                    f"model.pools.{spec.name}.{'host' if config.device_units is None else 'device'}_units: a "
                    f"sidecar of {spec.index_source!r} shares that pool's indices: no device/host_units"
                )
            if spec.index_source in self.pools:
                source = self.pools[spec.index_source]
                return source.device.units, source.host.units if source.host is not None else 0
            return known[spec.index_source]
        device = config.device_units
        engine_units = self._engine_units(spec)
        if engine_units is not None:
            if device is not None and device != engine_units:
                raise ValueError(
                    f"model.pools.{spec.name}.device_units is {device} but the engine's device tensors "
                    f"hold {engine_units} units; drop device_units or make them agree"
                )
            device = engine_units
        if spec.granularity is Granularity.NODE_STATE:
            if device is None:
                every = config.state_every_pages or DEVICE_PAGES_PER_STATE_SLOT
                device = max(MIN_DEFAULT_STATE_SLOTS, math.ceil(self.device_pages / every))
            host = config.host_units
            if host is None:
                tokens = self.config.tiers
                ratio = tokens.host.capacity_tokens / max(1, tokens.device.capacity_tokens)
                host = math.ceil(device * ratio)
        else:
            if config.state_every_pages is not None:
                raise ValueError(
                    f"model.pools.{spec.name}.state_every_pages: state_every_pages sizes node-state pools "
                    "(one state per node); this pool holds token pages"
                )
            device = self.device_pages if device is None else device
            host = self.host_pages if config.host_units is None else config.host_units
        return device, (host if self.host_enabled else 0)

    def _engine_units(self, spec: PoolSpec) -> int | None:
        """Units of the engine's device tensors for this pool (None: kvstrata allocates)."""
        tensors = self._device_tensors.get(spec.name)
        if tensors is None:
            return None
        return engine_tensor_units(spec, tensors, Layout.LAYER_FIRST)

    def _host_layout(self, spec: PoolSpec) -> Layout:
        wanted = self.host_tier.layout
        if spec.logical or wanted in spec.layouts:
            return wanted
        chosen = Layout.PAGE_FIRST if Layout.PAGE_FIRST in spec.layouts else spec.layouts[0]
        log.warning(
            "pool %r does not support host layout %s; using %s", spec.name, wanted.value, chosen.value
        )
        return chosen

    def _tier_bytes(self, spec: PoolSpec, units: tuple[int, int]) -> int:
        """Host RAM a pool takes: its host tier, plus its device tier when L1 lives on the CPU."""
        device_units, host_units = units
        total = spec.bytes_per_unit * host_units
        if self.device.type == "cpu" and spec.name not in self._device_tensors:
            total += spec.bytes_per_unit * device_units
        return total

    def _check_memory(self, requested: int, what: str) -> None:
        available = self._available() if self._available is not None else None
        check_host_memory(
            requested, self.host_tier, available, what, device_on_host=self.device.type == "cpu"
        )

    def _add(self, name: str, plugin: PoolType, spec: PoolSpec, units: tuple[int, int]) -> Pool:
        device_units, host_units = units
        if name in self._device_tensors:
            device = PoolBuffers.from_tensors(
                spec,
                self._device_tensors[name],
                units=device_units,
                layout=Layout.LAYER_FIRST,
                device=self.device,
            )
        else:
            device = PoolBuffers(spec, device_units, device=self.device, layout=Layout.LAYER_FIRST)
        host = None
        if self.host_enabled:
            host = PoolBuffers(
                spec,
                host_units,
                device="cpu",
                layout=self._host_layout(spec),
                pin_memory=self.pin_memory,
                allocator=self._host_allocator,
            )
        if spec.index_source is None:
            owner = name
            device_alloc = UnitAllocator(device_units, name=f"{name}/device")
            host_alloc = UnitAllocator(host_units, name=f"{name}/host") if host is not None else None
        else:
            source = self.pools[spec.index_source]
            owner = source.index_owner
            device_alloc, host_alloc = source.device_allocator, source.host_allocator
        pool = Pool(name, plugin, spec, device, host, device_alloc, host_alloc, owner)
        self.pools[name] = pool
        self._followers.clear()
        return pool

    # --- runtime ------------------------------------------------------------------------------

    def add_pool(
        self,
        instance: str,
        config: PoolConfig | Mapping[str, Any],
        *,
        device_tensors: Mapping[str, EngineTensor] | None = None,
    ) -> Pool:
        """Add a pool after start (e.g. a draft pool); memory is checked for the new bytes.

        ``device_tensors`` -- ``{buffer: tensor}``: the engine's own device memory for it.
        """
        with self._lock:
            if instance in self.pools:
                raise ValueError(f"pool {instance!r} already exists in this group")
            if device_tensors is not None:
                self._device_tensors[instance] = device_tensors
            try:
                return self._add_late(instance, config)
            except BaseException:
                self._device_tensors.pop(instance, None)
                raise

    def _add_late(self, instance: str, config: PoolConfig | Mapping[str, Any]) -> Pool:
        plugin = self._instantiate(instance, config)
        spec = checked_spec(plugin, self.plugins, None)  # (a late anchor: refused below)
        _check_late_pool(instance, spec, self.anchor_name, self.pools)
        units = self._units(spec, plugin.config, {})
        self._check_memory(self._tier_bytes(spec, units), f"pool {instance!r}")
        return self._add(instance, plugin, spec, units)

    @property
    def anchor(self) -> Pool:
        return self.pools[self.anchor_name]

    def pool(self, instance: str) -> Pool:
        try:
            return self.pools[instance]
        except KeyError:
            raise KeyError(f"no pool {instance!r}; pools: {list(self.pools)}") from None

    def by_role(self, role: PoolRole) -> list[Pool]:
        return [pool for pool in self.pools.values() if pool.role is role]

    def followers(self, owner: str) -> tuple[Pool, ...]:
        """``owner`` and every pool using its indices (its sidecars, transitively), owner first."""
        found = self._followers.get(owner)
        if found is None:
            first = self.pool(owner)
            same = first.index_owner
            sidecars = [p for p in self.pools.values() if p.index_owner == same and p is not first]
            found = self._followers[owner] = (first, *sidecars)
        return found

    def host_buffers(self) -> list[PoolBuffers]:
        return [pool.host for pool in self.pools.values() if pool.host is not None and not pool.host.logical]

    def host_regions(self) -> list[BufferRegion]:
        """Every host allocation of the group, unique by pointer (what a backend registers)."""
        unique: dict[int, int] = {}
        for buffers in self.host_buffers():
            region = buffers.region()
            if region is not None:
                unique[region.ptr] = max(unique.get(region.ptr, 0), region.nbytes)
        return [BufferRegion(ptr, nbytes) for ptr, nbytes in unique.items()]

    def required_host_bytes(self) -> int:
        """Sum of the group's host buffers unique by pointer, including pools added later."""
        return sum(region.nbytes for region in self.host_regions())

    def device_to_host(
        self,
        owner: str,
        device_indices: torch.Tensor | Sequence[int],
        host_indices: torch.Tensor | Sequence[int],
    ) -> list[TransferHandle]:
        """Back up units of ``owner`` and every sidecar following its indices (or int64 bytes)."""
        return self._copy_followers(owner, device_indices, host_indices, to_host=True)

    def host_to_device(
        self,
        owner: str,
        host_indices: torch.Tensor | Sequence[int],
        device_indices: torch.Tensor | Sequence[int],
    ) -> list[TransferHandle]:
        """Load units of ``owner`` and of every sidecar following its indices back to the device."""
        return self._copy_followers(owner, host_indices, device_indices, to_host=False)

    def _copy_followers(
        self,
        owner: str,
        src_indices: torch.Tensor | Sequence[int],
        dst_indices: torch.Tensor | Sequence[int],
        *,
        to_host: bool,
    ) -> list[TransferHandle]:
        """Copy units between the tiers for ``owner`` and every pool following its indices."""
        pairs = [
            (pool.device, pool.host) if to_host else (pool.host, pool.device)
            for pool in self.followers(owner)
            if pool.host is not None
        ]
        if not pairs:
            return []
        if type(src_indices) is bytes and type(dst_indices) is bytes:  # int64 bytes: no tensors
            return issue_copies(copy_unit_bytes, pairs, src_indices, dst_indices)
        return issue_copies(copy_units, pairs, as_index(src_indices), as_index(dst_indices))

    def describe(self) -> list[dict[str, Any]]:
        """One row per pool (for logs and ``kvstrata doctor``)."""
        return [describe_pool(pool) for pool in self.pools.values()]
