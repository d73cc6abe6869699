"""The pool-type plugin contract: what a kind of per-request state declares about itself.

A pool type (``kv``, ``mamba``, ``swa`` ...) never moves bytes itself. It turns its user config into
a frozen :class:`PoolSpec` -- role in the model stack, granularity, hit rule, partial-hit rule,
replication across ranks, buffers and the objects they form -- and the core does everything else
(allocation, transfers, keys, hit folding) by reading that spec. That is what keeps ``core/`` free
of pool names.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

#: Plugin API generation this core implements; a plugin declares the one it was written against.
POOL_API_VERSION = 1

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (torch spelling, without the ``torch.`` prefix)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPE_BYTES)}") from None


SUPPORTED_DTYPES = tuple(_DTYPE_BYTES)


def check_dtype(value: str) -> str:
    """Validator of a config's dtype name: one of :data:`SUPPORTED_DTYPES`."""
    if value not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {list(SUPPORTED_DTYPES)}")
    return value


#: A config field holding a dtype name (validated by :func:`check_dtype`).
Dtype = Annotated[str, AfterValidator(check_dtype)]


class PoolRole(StrEnum):
    """Where a pool sits in a model stack."""

    ANCHOR = "anchor"  # owns the page index space and the prefix keys; its object commits a page
    COMPONENT = "component"  # own allocator, tracked per tree node (swa, mamba)
    SIDECAR = "sidecar"  # reuses another pool's page indices and keys (nsa indexer, draft)


class Granularity(StrEnum):
    """What one allocation unit of the pool holds."""

    TOKEN_PAGES = "token_pages"  # one unit = one page of ``page_size`` tokens
    NODE_STATE = "node_state"  # one unit = one state slot (the state after a node's last token)


class HitRuleKind(StrEnum):
    """Which stored pages a prefix of length P needs from this pool to be usable."""

    ALL_PAGES = "all_pages"  # every page in [0, P)
    TRAILING_PAGES = "trailing_pages"  # only the last ``pages`` pages before P
    PREFIX_END_STATE = "prefix_end_state"  # a state stored at page P-1 (the prefix must end there)


class HitRule(BaseModel):
    """A hit rule and its parameter (the trailing page count for ``trailing_pages``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: HitRuleKind
    pages: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _pages_match_kind(self) -> HitRule:
        if self.kind is HitRuleKind.TRAILING_PAGES and self.pages < 1:
            raise ValueError("trailing_pages needs pages >= 1")
        return self


class PartialHit(StrEnum):
    """What happens when this pool holds less of a prefix than the anchor."""

    CLAMP = "clamp"  # the prefix shrinks to what this pool holds
    ALL_OR_NOTHING = "all_or_nothing"  # the whole prefetch is dropped


class Replication(StrEnum):
    """How a pool's content relates across tensor-parallel ranks."""

    SHARDED = "sharded"  # each rank holds its own shard: every rank writes, keys carry rank/size
    REPLICATED = "replicated"  # identical on every rank: one rank writes, keys carry no rank


class Layout(StrEnum):
    """Host buffer layouts (see README: which is cheap for which transfer)."""

    LAYER_FIRST = "layer_first"  # [layer][unit][...]: matches device layout, page scattered
    PAGE_FIRST = "page_first"  # [unit][layer][...]: one page contiguous across layers
    PAGE_FIRST_DIRECT = "page_first_direct"  # [unit][layer][tokens...] grouped for direct copies


class BufferSpec(BaseModel):
    """One tensor of a pool: ``layers`` x units x ``unit_shape`` elements of ``dtype``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    dtype: str
    layers: int = Field(ge=1)
    unit_shape: tuple[int, ...]  # elements of one unit (page or slot) in one layer

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        dtype_itemsize(value)
        return value

    @field_validator("unit_shape")
    @classmethod
    def _positive_dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(dim < 1 for dim in value):
            raise ValueError(f"unit_shape needs positive dimensions, got {value}")
        return value

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return math.prod(self.unit_shape) * dtype_itemsize(self.dtype)

    @property
    def bytes_per_unit(self) -> int:
        return self.layers * self.bytes_per_unit_per_layer


class ObjectSpec(BaseModel):
    """One stored object per unit: the concatenation of the named buffers' bytes for that unit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    suffix: str = Field(pattern=r"^[a-z0-9_]+$")
    buffers: tuple[str, ...] = Field(min_length=1)


class PoolSpec(BaseModel):
    """Everything the core needs to know about one pool instance, computed from its config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # instance name in ``model.pools``
    pool_type: str
    role: PoolRole
    index_source: str | None = None  # sidecars: the pool whose indices and keys it reuses
    granularity: Granularity
    hit_rule: HitRule
    partial_hit: PartialHit
    replication: Replication
    page_size: int = Field(ge=1)
    buffers: tuple[BufferSpec, ...] = ()  # empty for a logical pool
    objects: tuple[ObjectSpec, ...] = ()
    layouts: tuple[Layout, ...] = (Layout.PAGE_FIRST,)
    eviction_priority: int = 0  # lower goes first when components compete for device room

    @model_validator(mode="after")
    def _consistent(self) -> PoolSpec:
        if self.role is PoolRole.SIDECAR and not self.index_source:
            raise ValueError(f"sidecar pool {self.name!r} needs an index_source")
        if self.role is not PoolRole.SIDECAR and self.index_source:
            raise ValueError(f"only sidecars take an index_source (pool {self.name!r})")
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer names in pool {self.name!r}: {names}")
        for obj in self.objects:
            unknown = set(obj.buffers) - set(names)
            if unknown:
                raise ValueError(f"object {obj.suffix!r} names unknown buffers {sorted(unknown)}")
        covered = [b for obj in self.objects for b in obj.buffers]
        if sorted(covered) != sorted(names):
            raise ValueError(f"every buffer must be in exactly one object (pool {self.name!r})")
        if not self.layouts:
            raise ValueError("a pool supports at least one layout")
        return self

    @property
    def logical(self) -> bool:
        """True for a pool that only provides an index space and holds no bytes."""
        return not self.buffers

    @property
    def bytes_per_unit(self) -> int:
        return sum(buffer.bytes_per_unit for buffer in self.buffers)

    def object_bytes(self, suffix: str) -> int:
        """Payload bytes of one stored object (one unit) with this suffix."""
        by_name = {b.name: b for b in self.buffers}
        obj = next(o for o in self.objects if o.suffix == suffix)
        return sum(by_name[name].bytes_per_unit for name in obj.buffers)


class PoolConfig(BaseModel):
    """Base of every pool type's ``Config``; a plugin narrows ``type`` to ``Literal[name]``."""

    model_config = ConfigDict(extra="forbid")

    type: str
    index_source: str | None = Field(
        default=None,
        description="sidecars: the pool whose page indices they share (default: the anchor)",
    )
    device_units: int | None = Field(
        default=None,
        ge=0,
        description="L1 pages/slots of this pool; default: from tiers.device.capacity_tokens "
        "(token-page pools) or one slot per 16 device pages (node-state pools); not for sidecars",
    )
    host_units: int | None = Field(
        default=None,
        ge=0,
        description="L2 pages/slots of this pool; default: from tiers.host.capacity_tokens "
        "(token-page pools) or device_units x the host/device token ratio (node-state pools)",
    )


class ModelContext(BaseModel):
    """Model-wide facts a pool type needs to compute its spec."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    page_size: int = Field(ge=1)
    anchor: str | None = None  # instance name of the stack's anchor pool, once known


class PoolType(ABC):
    """Base class of pool-type plugins. Subclasses set ``name`` and ``Config``."""

    name: ClassVar[str]
    Config: ClassVar[type[PoolConfig]]
    api_version: ClassVar[int] = POOL_API_VERSION
    #: ``{importable module: install command}`` the pool type needs beyond kvstrata's own deps.
    requires: ClassVar[dict[str, str]] = {}
    #: Role of an instance whose config sets no ``index_source``; lets the core find the stack's
    #: anchor before any spec is built. Types that may also act as sidecars (kv, mla) become one
    #: when their config names an ``index_source``.
    default_role: ClassVar[PoolRole]

    @property
    def role(self) -> PoolRole:
        if self.config.index_source:
            return PoolRole.SIDECAR
        return self.default_role

    @property
    def index_source(self) -> str | None:
        """The pool whose indices and keys a sidecar reuses (the anchor unless configured)."""
        if self.role is not PoolRole.SIDECAR:
            return None
        return self.config.index_source or self.model.anchor

    def __init__(self, instance: str, config: PoolConfig, model: ModelContext) -> None:
        self.instance = instance
        self.config = config
        self.model = model

    @abstractmethod
    def spec(self) -> PoolSpec:
        """The frozen declaration the core works from."""
