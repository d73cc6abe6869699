"""The pool-type plugin contract: what a kind of per-request state declares about itself.

A pool type (``kv``, ``mamba``, ``swa`` ...) never moves bytes itself. It turns its user config into
a frozen :class:`PoolSpec` -- role in the model stack, granularity, hit rule, partial-hit rule,
replication across ranks, buffers and the objects they form -- and the core does everything else
(allocation, transfers, keys, hit folding) by reading that spec. That is what keeps ``core/`` free
of pool names.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kvstrata.plugins.user_config import UserConfig

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


class UnitLayout(StrEnum):
    """Order of a token-page unit's dimensions, as the engine's kernels read them.

    It is part of ``unit_shape`` (and so of the stored objects' layout fingerprint): kvstrata moves
    the unit's bytes as they are, it never transposes between the two.
    """

    TOKEN_MAJOR = "token_major"  # (page, heads, dim): a token's heads are adjacent (paged kernels)
    HEAD_MAJOR = "head_major"  # (heads, page, dim): a head's tokens are adjacent ([B, H, T, D])


class BufferSpec(BaseModel):
    """One tensor of a pool: ``layers`` x units x ``unit_shape`` elements of ``dtype``.

    ``unit_layout`` and ``unit_dims`` describe one unit for engines, adapters and tools (which
    dimension is the page, the heads ...); the core moves bytes and reads neither.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    dtype: str
    layers: int = Field(ge=1)
    unit_shape: tuple[int, ...]  # elements of one unit (page or slot) in one layer
    #: token-page buffers: the order of page and heads in ``unit_shape``; None for state slots
    unit_layout: UnitLayout | None = None
    #: one name per ``unit_shape`` dimension (e.g. ``("page", "heads", "head_dim")``); () = unnamed
    unit_dims: tuple[str, ...] = ()

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

    @model_validator(mode="after")
    def _dims_name_the_shape(self) -> BufferSpec:
        if self.unit_dims:
            if len(self.unit_dims) != len(self.unit_shape):
                raise ValueError(
                    f"buffer {self.name!r}: unit_dims {list(self.unit_dims)} name "
                    f"{len(self.unit_dims)} dimensions, unit_shape {list(self.unit_shape)} has "
                    f"{len(self.unit_shape)}"
                )
            if len(set(self.unit_dims)) != len(self.unit_dims):
                raise ValueError(f"buffer {self.name!r}: unit_dims repeat a name: {list(self.unit_dims)}")
        return self

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


class LayerIdError(KeyError):
    """A model layer id that is not one of a pool's layers."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


def check_layer_ids(value: list[int] | tuple[int, ...] | None) -> list[int] | tuple[int, ...] | None:
    """``layer_ids`` are distinct, non-negative model layer ids."""
    if value is None:
        return value
    if not value:
        raise ValueError("layer_ids is empty; leave it out to number the pool's layers 0..layers-1")
    negative = [layer for layer in value if layer < 0]
    if negative:
        raise ValueError(f"layer_ids must be >= 0, got {negative}")
    repeated = sorted({layer for layer in value if list(value).count(layer) > 1})
    if repeated:
        raise ValueError(f"layer_ids must be unique; repeated: {repeated}")
    return value


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
    #: tier layouts the pool's buffers can be held in: the device tier is always layer_first, so
    #: a pool with buffers needs it to open in a stack; page_first is the default host layout
    layouts: tuple[Layout, ...] = (Layout.LAYER_FIRST, Layout.PAGE_FIRST)
    eviction_priority: int = 0  # lower goes first when components compete for device room
    #: model layer id of each pool layer (pool layer i holds model layer ``layer_ids[i]``);
    #: None: the pool's layers are the model layers 0..layers-1
    layer_ids: Annotated[tuple[int, ...] | None, AfterValidator(check_layer_ids)] = None
    #: facts beyond the buffers' shapes that decide what the bytes hold, as (name, value) pairs (a
    #: sliding window: another window computes other K/V from the same tokens). They go into the
    #: layout fingerprint, so an object stored under other facts is never this pool's hit.
    fingerprint_extra: tuple[tuple[str, int | str], ...] = ()

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
        if self.layer_ids is not None:
            if not self.buffers:
                raise ValueError(f"pool {self.name!r} holds no layers, so it takes no layer_ids")
            wrong = {b.name: b.layers for b in self.buffers if b.layers != len(self.layer_ids)}
            if wrong:
                raise ValueError(
                    f"pool {self.name!r}: layer_ids has {len(self.layer_ids)} ids but buffers have "
                    f"layers {wrong}"
                )
        return self

    def check_index_source(self, source: PoolSpec) -> None:
        """A sidecar holds one unit per index of ``source`` (its index_source): a page where
        that pool hands out pages, a state slot where it hands out slots. A page sidecar of a
        state pool got one unit per tree node, where its data needs one per page."""
        if self.granularity is not source.granularity:
            raise ValueError(
                f"model.pools.{self.name}.index_source: sidecar pool {self.name!r} ({self.pool_type}) "
                f"holds {self.granularity.value} units, "
                f"but its index_source {source.name!r} ({source.pool_type}) hands out "
                f"{source.granularity.value} units: a sidecar shares its source's indices, so both "
                "need one granularity (choose another index_source)"
            )

    @property
    def layers(self) -> int:
        """Layers of the pool (0 for a logical pool); every buffer of a built-in type has as many."""
        return max((buffer.layers for buffer in self.buffers), default=0)

    def layer_index(self, layer_id: int) -> int:
        """The pool layer index holding model layer ``layer_id`` (see ``layer_ids``)."""
        layer_id = operator.index(layer_id)  # TypeError for a non-integer id
        if self.layer_ids is None:
            if 0 <= layer_id < self.layers:
                return layer_id
            raise LayerIdError(
                f"pool {self.name!r} has no model layer {layer_id!r}: it has no layer_ids, so its "
                f"layers are model layers 0..{self.layers - 1}"
            )
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise LayerIdError(
                f"pool {self.name!r} has no model layer {layer_id!r}; its layer_ids: {list(self.layer_ids)}"
            ) from None

    def buffer(self, name: str) -> BufferSpec:
        """The buffer called ``name`` (KeyError listing the pool's buffers otherwise)."""
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        names = [b.name for b in self.buffers]
        raise KeyError(f"pool {self.name!r} has no buffer {name!r}; buffers: {names}")

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


class PoolConfig(UserConfig):
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
        "(token-page pools) or one slot per 16 device pages, at least 2 (node-state pools); not for sidecars",
    )
    host_units: int | None = Field(
        default=None,
        ge=0,
        description="L2 pages/slots of this pool; default: from tiers.host.capacity_tokens "
        "(token-page pools) or device_units x the host/device token ratio (node-state pools)",
    )
    state_every_pages: int | None = Field(
        default=None,
        ge=1,
        description="node-state pools: how often the engine checkpoints a state (its chunk size "
        "in pages: every insert is a checkpoint); sizes the default device_units to one slot per "
        "this many device pages (default 16)",
    )
    layer_ids: Annotated[list[int] | None, AfterValidator(check_layer_ids)] = Field(
        default=None,
        description="model layer id of each of the pool's layers, in pool order (unique; as many as "
        "`layers`); lets an engine address a layer by its model layer id. Default: 0..layers-1",
    )

    @model_validator(mode="after")
    def _layer_ids_cover_layers(self) -> PoolConfig:
        layers = getattr(self, "layers", None)
        if self.layer_ids is not None and isinstance(layers, int) and len(self.layer_ids) != layers:
            raise ValueError(
                f"layer_ids has {len(self.layer_ids)} ids but layers is {layers}: give one model "
                "layer id per pool layer"
            )
        return self


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
        if config.index_source is not None and self.role is not PoolRole.SIDECAR:
            # (a type whose role is fixed -- swa, mamba, logical -- ignored it without a word)
            raise ValueError(
                f"model.pools.{instance}.index_source is {config.index_source!r}, but a {self.name} "
                f"pool is a {self.role.value} with its own indices; only sidecars share another "
                "pool's indices. Remove index_source"
            )

    @abstractmethod
    def spec(self) -> PoolSpec:
        """The frozen declaration the core works from."""
