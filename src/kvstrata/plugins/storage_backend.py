"""The storage-backend plugin contract: per-key batch I/O plus declared capabilities.

A backend sees objects as a key and an ordered list of memory regions (pointer, length). The same
call serves both I/O paths the core may plan: for *zero-copy* the regions point straight into
registered host-pool memory; for *copy* they point into a staging buffer the core filled. The
integrity header is always the first region, so a backend stores opaque bytes and never needs to
know about pools, layouts or checksums.
"""

from __future__ import annotations

import ctypes
import os
import re
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from kvstrata.plugins.user_config import UserConfig

#: Plugin API generation this core implements.
BACKEND_API_VERSION = 1

#: Key in :attr:`BackendCapabilities.pools` meaning "any pool type".
ANY_POOL = "*"

#: The first bytes of every object the core stores (the magic of its integrity header). A backend
#: whose namespace may hold other data (a directory a user points it at) checks them before it
#: adopts or evicts anything, so it never touches what it cannot prove it wrote.
OBJECT_MAGIC = b"KVS1"


class PoolCapabilities(BaseModel):
    """What a backend can do for one pool type."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    zero_copy: bool = False  # reads/writes registered host buffers directly
    split_heads: bool = False  # can store per-head shards (heterogeneous TP re-sharding)


class BackendCapabilities(BaseModel):
    """A backend's declaration; the core plans every I/O path from this, never from the name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api: int = BACKEND_API_VERSION
    pools: dict[str, PoolCapabilities] = Field(
        description="pool type name -> capabilities; '*' covers every pool type"
    )
    batch_exists: bool = False  # one call answers many keys
    multi_buffer_objects: bool = False  # an object may be gathered from several regions
    atomic_visibility: bool = False  # a key becomes visible only once fully written
    overwrite: Literal["skip_existing", "replace"] = "skip_existing"
    persistent: bool = False  # survives a restart of the process / service
    shared_across_instances: bool = False  # other processes or hosts see the same objects
    self_evicting: bool = False  # makes room by itself (puts may fail per key when full)
    host_allocator: bool = False  # host pools must be allocated by the backend (shared memory)
    removable: bool = False  # implements remove(): the core deletes damaged and unused objects
    #: ``get`` takes ``check`` and calls it on every object it read, in the thread that read it:
    #: the core then verifies checksums there and makes no second pass over the batch's bytes.
    checks_reads: bool = False
    max_object_bytes: int | None = None

    def for_pool(self, pool_type: str) -> PoolCapabilities | None:
        """Capabilities for a pool type, or ``None`` when the backend cannot store it."""
        return self.pools.get(pool_type, self.pools.get(ANY_POOL))


class BreakerConfig(UserConfig):
    """When the core stops calling a backend instance that keeps failing (see ``core.breaker``)."""

    failures: int = Field(
        default=3, ge=0, description="consecutive failed calls (raised / timed out) that open it; 0 = never"
    )
    cooldown_s: float = Field(
        default=5.0, gt=0, description="seconds it stays open before one trial call is let through"
    )


#: Environment variable naming kvstrata's per-user cache directory; backend paths may use it
#: (``$KVSTRATA_CACHE_DIR/l3``) even when it is not set.
CACHE_DIR_ENV = "KVSTRATA_CACHE_DIR"


def user_cache_dir() -> Path:
    """kvstrata's per-user cache directory: ``$KVSTRATA_CACHE_DIR``, else the platform's user cache
    directory (``~/.cache/kvstrata`` on Linux, via platformdirs). Per user, so two users of one
    machine never share or delete each other's objects, and never a fixed path under /tmp."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return platformdirs.user_cache_path("kvstrata", appauthor=False)


def expand_path(value: str) -> str:
    """Expand environment variables and ``~`` in a path; ``$KVSTRATA_CACHE_DIR`` falls back to
    :func:`user_cache_dir` when the variable is not set. A variable that is not set is a
    ``ValueError`` (left as written, ``$VAR/l3`` would be a directory named ``$VAR`` here)."""
    for token in (f"${{{CACHE_DIR_ENV}}}", f"${CACHE_DIR_ENV}"):
        if token in value:
            value = value.replace(token, str(user_cache_dir()))
    expanded = os.path.expandvars(value)
    unset = sorted({name for pair in _VARIABLE.findall(expanded) for name in pair if name} - set(os.environ))
    if unset:
        raise ValueError(f"{value!r} names environment variable(s) that are not set: {', '.join(unset)}")
    return os.path.expanduser(expanded)


_VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def _not_empty(value: object) -> object:
    if isinstance(value, str) and not value.strip():
        raise ValueError("must name a directory (an empty path would mean the current directory)")
    return value


#: A directory a backend config must be given (``path: StoragePath``): an empty or blank string is
#: refused with the field's dotted path, since it would silently mean the current directory.
StoragePath = Annotated[Path, BeforeValidator(_not_empty)]


def _is_path_field(annotation: Any) -> bool:
    """``Path``, or a type built of it (``Path | None``, ``StoragePath``, ``StoragePath | None``)."""
    return annotation is Path or any(_is_path_field(arg) for arg in typing.get_args(annotation))


class BackendConfig(UserConfig):
    """Base of every backend's ``Config``; a plugin narrows ``type`` to ``Literal[name]``.

    Every ``Path`` field of a backend config expands ``$VARIABLES`` and ``~`` (see :func:`expand_path`):
    ``path: $KVSTRATA_CACHE_DIR/l3`` puts objects in the per-user cache directory.
    Fields here apply to every backend instance and are read by the core, not the plugin.
    """

    model_config = ConfigDict(extra="forbid")

    type: str
    circuit_breaker: BreakerConfig = Field(
        default_factory=BreakerConfig,
        description="stop calling this instance after repeated failures, so L1/L2 keep full speed",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_paths(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        paths = {name for name, field in cls.model_fields.items() if _is_path_field(field.annotation)}
        expanded = dict(data)
        errors: list[Any] = []  # pydantic's InitErrorDetails: located at the field, not the section
        for key in sorted(paths & expanded.keys()):
            if isinstance(expanded[key], str):
                try:
                    expanded[key] = expand_path(expanded[key])
                except ValueError as exc:
                    errors.append(
                        {"type": "value_error", "loc": (key,), "input": data[key], "ctx": {"error": exc}}
                    )
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return expanded


@dataclass(frozen=True, slots=True)
class BufferRegion:
    """A contiguous range of host memory: the unit of zero-copy I/O."""

    ptr: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class StorageObject:
    """One object to put or get: its key and the regions its bytes come from / go to, in order.

    ``views``: byte views of the non-empty regions, in order, as the core built them with the
    batch (None: none built). A backend that moves bytes with Python's vectored I/O takes them
    from :func:`object_views`: inside an I/O loop, where each page's copy has just evicted the
    interpreter's data from the CPU caches, making a view costs several times what it costs in
    the core's loop over the batch (measured: ~4 us per object in the file backend's read loop)."""

    key: str
    regions: tuple[BufferRegion, ...]
    views: list[memoryview] | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(region.nbytes for region in self.regions)


# --- byte views of regions: what a backend needs to read or write an object's memory ---------
# They live in the plugin API (not the core) so a third-party backend needs nothing internal.


def _memory_view_factory() -> Callable[[int, int, int], memoryview] | None:
    """CPython's ``PyMemoryView_FromMemory``: one C call, about 4x cheaper than a ctypes array
    view, and region views are built per object on every storage I/O."""
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    try:  # a private prototype: never alters the shared ctypes.pythonapi attribute
        return prototype(("PyMemoryView_FromMemory", ctypes.pythonapi))  # type: ignore[return-value]
    except (AttributeError, OSError):  # not CPython
        return None


_FROM_MEMORY = _memory_view_factory()
_PYBUF_WRITE = 0x200


def region_view(region: BufferRegion) -> memoryview:
    """A writable byte view of raw memory (no copy); the memory must outlive the view."""
    if region.nbytes == 0:
        return memoryview(b"")
    if _FROM_MEMORY is not None:
        return _FROM_MEMORY(region.ptr, region.nbytes, _PYBUF_WRITE)
    return memoryview((ctypes.c_ubyte * region.nbytes).from_address(region.ptr)).cast("B")


def region_views(regions: Sequence[BufferRegion]) -> list[memoryview]:
    """Writable byte views of the non-empty ``regions``, in order (vectored I/O takes these)."""
    return [region_view(region) for region in regions if region.nbytes]


def object_views(obj: StorageObject) -> list[memoryview]:
    """Writable byte views of ``obj``'s non-empty regions, in order: the ones the core built
    with the batch (:attr:`StorageObject.views`), else made now (:func:`region_views`)."""
    views = obj.views
    return views if views is not None else region_views(obj.regions)


def leading_regions(regions: Sequence[BufferRegion], nbytes: int) -> tuple[BufferRegion, ...]:
    """``regions`` cut to their first ``nbytes`` bytes."""
    out: list[BufferRegion] = []
    remaining = nbytes
    for region in regions:
        if remaining <= 0:
            break
        out.append(BufferRegion(region.ptr, min(region.nbytes, remaining)))
        remaining -= region.nbytes
    return tuple(out)


#: ``check(row, nbytes)``: what the core may hand ``StorageBackend.get`` to run on each object found,
#: in the thread that read it, right after reading it (``row``: the object's position in the batch,
#: ``nbytes``: the bytes read). The core verifies checksums there -- in parallel, on bytes still in
#: the CPU cache -- rather than one object after another once the batch returned.
ReadCheck = Callable[[int, int], None]


class StorageBackend(ABC):
    """Base class of storage-backend plugins. Subclasses set ``name``, ``Config``, ``capabilities``.

    Results are per key: a failed key never fails the batch. An exception escaping a method fails
    only the operation that called it (the core catches it); it must never be used for a miss.
    """

    name: ClassVar[str]
    Config: ClassVar[type[BackendConfig]]
    capabilities: ClassVar[BackendCapabilities]
    api_version: ClassVar[int] = BACKEND_API_VERSION
    #: ``{importable module: install command}``, checked before ``open`` so a missing extra
    #: fails with the exact command, e.g. ``{"mooncake.store": "pip install 'kvstrata[mooncake]'"}``.
    requires: ClassVar[dict[str, str]] = {}

    def __init__(self, instance: str, config: BackendConfig) -> None:
        self.instance = instance
        self.config = config

    @classmethod
    def unavailable_reason(cls, config: BackendConfig | None = None) -> str | None:
        """Why this backend cannot work on this machine (``None`` when it can).

        Called without instantiating, by ``kvstrata plugins`` and before ``open``.
        """
        return None

    def instance_capabilities(self) -> BackendCapabilities:
        """Capabilities of this configured instance (a mode may change them, e.g. host_allocator).

        Defaults to the class declaration; the core plans I/O from this, not the class attribute.
        """
        return self.capabilities

    def open(self) -> None:  # noqa: B027 - optional hook, most backends need no setup
        """Connect / create resources. Heavy imports belong here, not at module import."""

    def close(self) -> None:  # noqa: B027
        """Release every resource; the backend is unusable afterwards."""

    def probe(self) -> str | None:
        """Quick reachability check for ``kvstrata doctor``: ``None`` if reachable, else why not."""
        return None

    def where(self) -> str | None:
        """Where this instance keeps its objects and how long they last, in words (``kvstrata
        replay`` prints it at start-up); ``None`` lets the caller describe it from the config."""
        return None

    def register_host_memory(self, region: BufferRegion) -> None:  # noqa: B027
        """Make a host buffer usable for zero-copy I/O (called again for pools added later)."""

    def allocate_host_memory(self, nbytes: int) -> BufferRegion:
        """Allocate host-pool memory from the backend (only when ``capabilities.host_allocator``)."""
        raise NotImplementedError(f"storage backend {self.name!r} does not allocate host memory")

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per-key presence.

        Optional extension: a backend whose ``exists`` also takes ``leading: bool = False`` (the
        core reads the signature) is asked with ``leading=True`` when only the leading run of
        present keys matters (SGLang's ``batch_exists``, ``exists_prefix``): it may answer False
        for every key after the first missing one without checking them.
        """

    @abstractmethod
    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        """Store each object's bytes (read from its regions); per-key success."""

    @abstractmethod
    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        """Read each object into its regions; per key the bytes read, or a negative code on a miss.
        An object longer than its regions may be reported by its whole length, its leading bytes
        read (the core rejects it by its header and length, and can replace it).

        Optional extension: a backend whose ``get`` also takes ``check: ReadCheck | None = None``
        (declared by ``capabilities.checks_reads``; the core also reads the signature) is handed
        one and calls ``check(row, nbytes)`` for every object it found, in the thread that read
        it, before returning. A backend whose ``get`` takes only ``objects`` never gets one; the
        core then hashes what it read on its own thread, a second pass over the batch.
        """

    def set_read_verification(self, verified: bool) -> None:  # noqa: B027 - optional hook
        """The core says whether every object it reads from this instance is checksum-verified
        (policy ``xxh3``): a backend may then take a shortcut under which a concurrent reader
        could see a torn object, since such an object is a miss, never data (the ``file``
        backend rewrites evicted files in place only then)."""

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects; per key True when it is gone (removed now, or absent already).

        Optional: a backend that implements it declares ``capabilities.removable``. The core calls
        it for objects that failed verification (damaged, or another layout's), so they are not
        read forever, and for objects no reader asks for again (a finished vLLM request's own
        state checkpoints), so they do not hold the store's room.
        """
        raise NotImplementedError(f"storage backend {self.name!r} does not remove objects")
