"""Unit memory: what an engine reads, writes and computes in, on the device tier.

The controller hands out unit indices; these methods turn them into tensors in each buffer's
declared unit layout (token-major or head-major, any dtype, bit-exact), map model layer ids to a
pool's layers (``layer_ids``), give zero-copy views for engines that compute in place, and fork a
restored state into a private working slot (engines update conv/SSM states in place, and a cached
checkpoint must stay as it was). Kept apart from the lease API so each reads on one screen; the
controller inherits them and supplies ``pools``, ``tree`` and ``layout``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

import torch

from kvstrata.core.boundary import exclusive
from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.lease import Lease, require_lease
from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.row_copy import UnitArrays
from kvstrata.core.stack import NO_UNITS, PoolKind, StackLayout
from kvstrata.core.transfer import copy_units, host_arrays
from kvstrata.core.tree import PrefixTree
from kvstrata.core.tree_bytes import UNIT, unit_tensor
from kvstrata.plugins.pool_type import PoolSpec

#: the byte order of the int64 unit bytes the tree and a lease keep (numpy's native one)
_ORDER = sys.byteorder
#: fork_state's plan of one state pool: its name, tree index, and per follower its name, device
#: buffers and their numpy rows (None: not a CPU tier)
StatePlan = tuple[str, int, list[tuple[str, PoolBuffers, UnitArrays | None]]]


class UnitMemory:
    """Device unit access for the engine (mixed into :class:`~kvstrata.core.controller.CacheController`)."""

    pools: PoolGroup
    tree: PrefixTree
    layout: StackLayout
    #: the index tensor of each state slot forked from, keyed by the slot's stored int64 bytes
    #: (the tree keeps ``bytes``): a chunked request forks at every chunk, and building a tensor
    #: from the bytes each time cost more than the copy's bookkeeping. Never handed out (nobody
    #: can change one); at most one entry per device unit of the state pools.
    _slot_index: dict[bytes, torch.Tensor]
    #: fork_state's plan per layout (see ``_state_pools``)
    _forks: tuple[object, list[StatePlan]] | None
    #: raises once the cache is closed (the controller's)
    _check_open: Callable[[], None]

    @exclusive
    def fork_state(self, lease: Lease) -> dict[str, torch.Tensor]:
        """Copy the state at the lease's committed end into its newly allocated state slot, for
        every state pool (and its sidecars), and return those working units: engines update
        states in place, and the cached checkpoint must stay as it was. Each new slot is filled
        once: a slot the engine already runs in (no new one since) is returned as it is, never
        reset to the checkpoint; with nothing to compute (a chunk the cache held whole) there is
        no slot and the units are empty."""
        if type(lease) is not Lease or lease._issuer is not self:  # (require_lease's one test)
            require_lease(lease, self)
        if lease.closed:
            raise RuntimeError("lease is closed (inserted or released)")
        out: dict[str, torch.Tensor] = {}
        node, forks = lease.node, self._forks  # (the plan made once per layout: read it inline)
        plan = forks[1] if forks is not None and forks[0] is self.layout.tree_pools else self._state_pools()
        for name, p, followers in plan:
            pending = lease.slot_to_fork(name)
            if pending is None:
                if lease.pages > lease.allocated_pages:
                    raise RuntimeError("fork_state copies into the lease's new state slot: allocate first")
                out.update(dict.fromkeys((follower for follower, _, _ in followers), NO_UNITS))
                continue
            slot, working, new = pending
            raw = node.device_raw[p] if new and node is not None else None
            for follower, buffers, arrays in followers:
                if raw is not None:
                    self._fork_slot(buffers, arrays, raw, slot)
                out[follower] = working
        return out

    def _fork_slot(self, buffers: PoolBuffers, arrays: UnitArrays | None, raw: bytes, slot: bytes) -> None:
        """Copy the state slot stored as ``raw`` into ``slot`` (both int64 bytes: the tree's and
        the lease's). Both are the cache's own units (the tree's and the allocator's), in range
        by construction: on a CPU tier (``arrays``: its rows as numpy) one row assignment per
        buffer, else :func:`copy_units`."""
        if arrays is not None and len(raw) == UNIT and len(slot) == UNIT:
            src, dst = int.from_bytes(raw, _ORDER), int.from_bytes(slot, _ORDER)
            for src_array, dst_array in arrays:
                dst_array[dst] = src_array[src]
            return
        source = self._slot_index.get(raw)
        if source is None:
            self._slot_index[raw] = source = unit_tensor(raw)
        copy_units(buffers, source, buffers, unit_tensor(slot)).wait()

    def _state_pools(self) -> list[StatePlan]:
        """Per state pool: its name, tree index and (follower, device buffers, their numpy rows
        on a CPU tier) triples, made once per layout (a chunked request forks at every chunk;
        ``add_pool`` makes a new layout)."""
        tree_pools = self.layout.tree_pools
        cached = self._forks
        if cached is not None and cached[0] is tree_pools:
            return cached[1]
        index, pools = self.tree.index, self.pools.pools
        plan: list[StatePlan] = []
        for tp in tree_pools.values():
            if tp.kind is PoolKind.STATE:
                devices = [(name, pools[name].device) for name in tp.followers]
                rows = [(name, device, host_arrays(device, device)) for name, device in devices]
                plan.append((tp.name, index[tp.name], rows))
        self._forks = (tree_pools, plan)
        return plan

    def read_units(
        self, pool: str, units: torch.Tensor | Sequence[int], *, layer: int | None = None
    ) -> dict[str, torch.Tensor]:
        """A copy of device ``units`` of ``pool`` per buffer, ``(n, [layers,] *unit_shape)`` in the
        pool's declared unit layout; ``layer`` is a model layer id (the pool's ``layer_ids``)."""
        spec, buffers = self._device(pool)
        return buffers.read_units(units, layer=None if layer is None else spec.layer_index(layer))

    def write_units(
        self,
        pool: str,
        units: torch.Tensor | Sequence[int],
        tensors: Mapping[str, torch.Tensor],
        *,
        layer: int | None = None,
    ) -> None:
        """Write ``tensors`` (buffer -> ``(n, [layers,] *unit_shape)``) into device ``units``."""
        spec, buffers = self._device(pool)
        buffers.write_units(units, tensors, layer=None if layer is None else spec.layer_index(layer))

    def device_view(self, pool: str, buffer: str, *, layer: int | None = None) -> torch.Tensor:
        """Zero-copy typed view ``(units, [layers,] *unit_shape)`` of one device buffer, for
        engines that compute in place."""
        spec, buffers = self._device(pool)
        return buffers.buffer_view(buffer, layer=None if layer is None else spec.layer_index(layer))

    def _device(self, pool: str) -> tuple[PoolSpec, PoolBuffers]:
        self._check_open()  # a closed cache's memory is no longer the engine's to use
        found = self.pools.pool(pool)
        return found.spec, found.device
