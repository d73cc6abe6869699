"""I/O plans: capabilities x pool spec x config -> how (and whether) a pool goes to a backend.

Computed once at attach per (backend instance, pool), frozen, logged and shown by
``kvstrata doctor``; the data path reads only the plan, never a backend or pool-type name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import HEADER_BYTES, stored_objects
from kvstrata.core.keys import is_writer
from kvstrata.plugins.pool_type import PoolSpec
from kvstrata.plugins.storage_backend import BackendCapabilities


class IOMode(StrEnum):
    ZERO_COPY = "zero_copy"  # regions point into registered host-pool memory
    COPY = "copy"  # the engine stages each object in a contiguous buffer
    OFF = "off"  # this pool is not stored on this backend (see reason)


class IOPlan(BaseModel):
    """How one pool is stored on one backend instance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str  # backend instance name
    pool: str  # pool instance name
    pool_type: str
    mode: IOMode
    reason: str  # why this mode (always set, for the doctor table and logs)
    read_only: bool = False  # replicated pool on a non-writer rank: reads only
    object_bytes: dict[str, int] = {}  # suffix -> stored bytes (header included)

    @property
    def enabled(self) -> bool:
        return self.mode is not IOMode.OFF

    @property
    def writes(self) -> bool:
        return self.enabled and not self.read_only


def plan_pool(
    backend: str,
    capabilities: BackendCapabilities,
    spec: PoolSpec,
    *,
    parallel: ParallelConfig,
    split_heads: bool = False,
    host_memory_from_backend: bool = False,
) -> IOPlan:
    """One plan. ``split_heads``: the deployment needs per-head shards of this pool (heterogeneous
    TP); ``host_memory_from_backend``: the host pools were allocated by this backend (required for
    zero-copy when the backend declares ``host_allocator``)."""
    sizes = {suffix: HEADER_BYTES + nbytes for suffix, nbytes in stored_objects(spec)}
    base = {"backend": backend, "pool": spec.name, "pool_type": spec.pool_type, "object_bytes": sizes}

    def off(reason: str) -> IOPlan:
        return IOPlan(mode=IOMode.OFF, reason=reason, **base)

    pool_caps = capabilities.for_pool(spec.pool_type)
    if pool_caps is None:
        stored = ", ".join(sorted(capabilities.pools)) or "none"
        return off(f"backend does not store pool type {spec.pool_type!r} (stores: {stored})")
    if split_heads and not pool_caps.split_heads:
        return off(f"split-head shards requested for {spec.pool_type!r} but the backend lacks split_heads")
    limit = capabilities.max_object_bytes
    if limit is not None:
        too_big = {suffix: n for suffix, n in sizes.items() if n > limit}
        if too_big:
            return off(f"objects {too_big} exceed the backend's max_object_bytes {limit}")
    read_only = not is_writer(spec, parallel)
    if not pool_caps.zero_copy:
        mode, reason = IOMode.COPY, "backend has no zero-copy for this pool"
    elif not capabilities.multi_buffer_objects:
        mode = IOMode.COPY
        reason = "zero-copy needs multi-buffer objects (header + payload regions); staging instead"
    elif capabilities.host_allocator and not host_memory_from_backend:
        mode = IOMode.COPY
        reason = "backend needs host pools from its allocator; they were not: staging instead"
    else:
        mode, reason = IOMode.ZERO_COPY, "zero-copy from registered host memory"
    if spec.logical:
        reason = "no bytes: one header-only marker object per unit (the commit marker)"
    if read_only:
        reason += "; read-only: replicated pool, TP rank 0 writes it"
    return IOPlan(mode=mode, reason=reason, read_only=read_only, **base)


def plan_backend(
    backend: str,
    capabilities: BackendCapabilities,
    specs: Iterable[PoolSpec],
    *,
    parallel: ParallelConfig,
    split_heads: Mapping[str, bool] | None = None,
    host_memory_from_backend: bool = False,
) -> dict[str, IOPlan]:
    """Plans for every pool of a stack on one backend, keyed by pool instance name."""
    split_heads = split_heads or {}
    return {
        spec.name: plan_pool(
            backend,
            capabilities,
            spec,
            parallel=parallel,
            split_heads=split_heads.get(spec.name, False),
            host_memory_from_backend=host_memory_from_backend,
        )
        for spec in specs
    }
