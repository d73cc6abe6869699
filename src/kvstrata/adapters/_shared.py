"""The layer every engine adapter shares: who the engine is, a cache opened for its layout, and
storage wired for adapters that move pages to L3 themselves.

An adapter (HF, SGLang, vLLM) is only the translation of its engine's objects and calls; what
decides *which stored bytes an engine may read* is decided here, once, for all of them:

* :class:`EngineIdentity` -- every fact that changes the bytes of a state (engine, model id,
  weights digest, dtypes, layout, page size, parallel topology, tenant salt). Its
  :attr:`~EngineIdentity.namespace` is a readable prefix plus a BLAKE2b digest of the canonical
  JSON of those facts: no ``hash()``, no per-process seed, so a restart gets the same namespace
  and any other value of any field gets another one.
* :func:`open_cache` -- a kvstrata cache (lease API, :class:`~kvstrata.CacheController`) for an
  engine whose cache kvstrata manages (HF): the user's config, the adapter's pools and overrides
  merged, the identity's namespace as ``model.name``.
* :class:`EngineStorage` -- storage over the public :func:`kvstrata.engine_kit.open_storage`
  (backend plugin opened, storage engine), an I/O plan per pool, zero-copy host memory
  registered, for an engine that keeps its own L1/L2 and asks kvstrata to store and fetch pages
  (SGLang, a vLLM connector).
* :func:`weights_digest` -- xxh3-128 over every byte of every weight tensor (streamed), for
  adapters that hold the model; :func:`page_key` -- an engine's page key as an injective
  page-hash component, for engines that bring their own page hashes.

How a key is complete by construction (DESIGN "The key is complete by construction")::

    key = {namespace tag}.{pool type}-{pool}-{layout}.{shard}.{page hash}.{object}
           |               |                          |       `- token chain (page size tokens
           |               |                          |          per page) or the engine's key
           |               |                          `- tp rank/size (sharded pools), pp, cp
           |               `- the pool's layout fingerprint: dtype, shapes, page size, layers
           `- namespace (this identity) + cache salt

Parallel coordinates go to the shard component, not the namespace digest, so a TP-replicated
pool (MLA) written by rank 0 is read by every rank; the salt goes to the namespace tag and the
chain root, so :meth:`EngineIdentity.chain_root` serves per-request salts (vLLM's ``cache_salt``).

Use from an adapter::

    identity = EngineIdentity(engine="vllm", model="org/model", weights=weights_digest(params),
                              dtypes=("bfloat16",), layout={"block": "NHD"}, page_size=16,
                              parallel=ParallelConfig(tp_rank=r, tp_size=n), cache_salt="")
    storage = EngineStorage(identity, "l3", backend_config, checksum="xxh3")
    plan = storage.add_pool(spec.name, spec, host_region=region)   # once per pool
    hashes = hash_pages(token_ids, 16, identity.chain_root(request_salt))  # kvstrata.engine_kit
    storage.engine.put(spec.name, hashes, units) ... storage.close()

    # or, where kvstrata manages the engine's cache (lease API):
    cache, identity = open_cache(identity, user_config, pools=pools, overrides={"a.b": value})
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

import kvstrata
from kvstrata import CacheController
from kvstrata.engine_kit import (
    ChecksumPolicy,
    DeviceTensors,
    IOMode,
    IOPlan,
    ParallelConfig,
    StorageEngine,
    StorageMetrics,
    namespace_root,
    open_storage,
    plan_pool,
)
from kvstrata.plugins import BufferRegion, PluginHost, PoolSpec, StorageBackend

log = logging.getLogger(__name__)

ConfigSource = str | Path | list[str | Path] | Mapping[str, Any] | None

_IDENTITY_PERSON = b"kvstrata-id-v1"
_NAMESPACE_DIGEST_BYTES = 12
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: Bytes of a weight tensor hashed per step (a device tensor is copied to the host this much at a time).
WEIGHT_CHUNK_BYTES = 64 << 20


class EngineIdentity(BaseModel):
    """Every fact that changes the bytes of a stored state, as an adapter knows them.

    Fields an adapter cannot know at start-up may stay empty when they are covered elsewhere in
    every key: a pool's dtype, shapes and page size are in its key's layout component (SGLang's
    pools register after start-up), the parallel coordinates in its shard component.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="the adapter: hf, sglang, vllm ...")
    model: str = Field(min_length=1, description="model id or served name (readable part of the namespace)")
    weights: str | None = Field(
        default=None,
        description="digest of all weights (weights_digest, or one the caller vouches for); None: "
        "the model id alone identifies the weights -- changing them under the same id is on the caller",
    )
    dtypes: tuple[str, ...] = Field(default=(), description="state dtypes (also per pool in the layout key)")
    layout: dict[str, Any] = Field(
        default_factory=dict,
        description="engine-specific layout facts (JSON values): config, pools, block layout",
    )
    page_size: int | None = Field(default=None, ge=1, description="tokens per page (None: from the config)")
    parallel: ParallelConfig | None = Field(default=None, description="None: from the config")
    cache_salt: str | None = Field(default=None, description="tenant salt (None: from the config)")

    def facts(self) -> dict[str, Any]:
        """What the namespace digest covers (the parallel coordinates and the salt go elsewhere
        in every key: see the module docstring)."""
        return {
            "engine": self.engine,
            "model": self.model,
            "weights": self.weights,
            "dtypes": list(self.dtypes),
            "layout": self.layout,
            "page_size": self.page_size,
        }

    @property
    def namespace(self) -> str:
        """``{model}-{digest}`` (the model id made key-safe; the adapter picks a readable id such as
        ``hf-llama``): a valid ``model.name``, the same in every process."""
        text = json.dumps(self.facts(), sort_keys=True, separators=(",", ":"), default=_json_default)
        digest = hashlib.blake2b(
            text.encode(), digest_size=_NAMESPACE_DIGEST_BYTES, person=_IDENTITY_PERSON
        ).hexdigest()
        readable = _UNSAFE.sub("-", self.model).strip("-.")[:48] or "model"
        return f"{readable}-{digest}"

    def chain_root(self, cache_salt: str | None = None) -> str:
        """Root of the page-hash chain of this namespace and a salt (default: the identity's):
        what a connector hashing tokens itself seeds its chain with for a per-request salt."""
        salt = self.cache_salt if cache_salt is None else cache_salt
        return namespace_root(self.namespace, salt or "")


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"identity layout value {value!r} is not JSON: describe it with str/int/list/dict")


# --- weights ------------------------------------------------------------------------------------


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 (hex) of every weight: each tensor's name, dtype, shape and *all* its bytes, in
    the given order (``model.state_dict().items()``; a tensor tied to an earlier one is hashed as
    that tie, not read twice). Streams in chunks of
    :data:`WEIGHT_CHUNK_BYTES`, so a device tensor never needs a second full copy on the host.
    Not a defence against a party crafting a collision (xxh3 is not cryptographic): it tells
    checkpoints apart, which is what a namespace needs from it."""
    hasher = xxhash.xxh3_128()
    seen: dict[tuple[Any, ...], str] = {}  # tied weights (lm_head = embeddings) are hashed once
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            raise ValueError(f"weight {name!r} is on the meta device: load the weights before hashing them")
        hasher.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        view = (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and view in seen:
            hasher.update(f"tied\0{seen[view]}\0".encode())
            continue
        seen[view] = name
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
        for start in range(0, raw.numel(), WEIGHT_CHUNK_BYTES):
            chunk = raw[start : start + WEIGHT_CHUNK_BYTES]
            hasher.update(chunk.cpu().numpy() if chunk.device.type != "cpu" else chunk.numpy())
    return hasher.hexdigest()


# --- a kvstrata cache for an engine's layout ------------------------------------------------------


def open_cache(
    identity: EngineIdentity,
    config: ConfigSource,
    *,
    pools: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    plugins: PluginHost | None = None,
    device_tensors: DeviceTensors | None = None,
) -> tuple[CacheController, EngineIdentity]:
    """A cache for ``pools`` (``model.pools``) over the user's ``config`` and ``overrides``
    (``{"a.b": value}``). Identity fields that are set are written into the config; those left
    ``None`` (page size, parallel, salt) are read from it. Returns the cache and the complete
    identity, whose namespace is the cache's ``model.name``."""
    host = plugins or PluginHost()
    source: Any = {} if config is None else config
    # the pools first: an override may refine one of them (model.pools.x.device_units)
    settings: dict[str, Any] = {"model.pools": copy.deepcopy(dict(pools)), **(overrides or {})}
    if identity.page_size is not None:
        settings["model.page_size"] = identity.page_size
    if identity.cache_salt is not None:
        settings["model.cache_salt"] = identity.cache_salt
    if identity.parallel is not None:
        settings["parallel"] = identity.parallel.model_dump()
    # the namespace needs the page size, which the config may set: resolve it first
    pending = copy.deepcopy({**settings, "model.name": "pending"})
    resolved = kvstrata.load(source, overrides=pending, plugins=host)
    complete = identity.model_copy(
        update={
            "page_size": resolved.model.page_size,
            "cache_salt": resolved.model.cache_salt,
            "parallel": resolved.parallel,
        }
    )
    settings["model.name"] = complete.namespace
    cache = kvstrata.open(source, overrides=settings, plugins=host, device_tensors=device_tensors)
    return cache, complete


# --- storage for adapters that move pages themselves ---------------------------------------------


class EngineStorage:
    """One storage backend instance, its storage engine and a plan per pool, keyed by an
    :class:`EngineIdentity` (parallel coordinates and salt default to one rank, no salt).

    ``backend_config``: a validated backend config (``PluginBackendConfig`` of the backend
    plugin). Pools are added as the engine describes them (:meth:`add_pool`); the engine's
    ``put`` / ``get`` / ``exists`` calls are then :attr:`engine`'s. ``config_path``: where the
    engine's user wrote the storage instances, named by an error opening the backend.
    """

    def __init__(
        self,
        identity: EngineIdentity,
        instance: str,
        backend_config: Any,
        *,
        checksum: ChecksumPolicy = "xxh3",
        plugins: PluginHost | None = None,
        config_path: str = "tiers.storage",
    ) -> None:
        self.identity = identity.model_copy(
            update={
                "parallel": identity.parallel or ParallelConfig(),
                "cache_salt": identity.cache_salt or "",
            }
        )
        self.plugins = plugins or PluginHost()
        self.parallel: ParallelConfig = self.identity.parallel  # type: ignore[assignment]
        self.engine: StorageEngine = open_storage(
            instance,
            backend_config,
            namespace=self.identity.namespace,
            cache_salt=self.identity.cache_salt or "",
            parallel=self.parallel,
            checksum=checksum,
            plugins=self.plugins,
            config_path=config_path,
        )
        self.backend: StorageBackend = self.engine.backend
        self.capabilities = self.backend.instance_capabilities()
        self._lock = threading.Lock()
        self._registered: set[int] = set()
        self._keep_alive: list[Any] = []
        self._closed = False

    @property
    def metrics(self) -> StorageMetrics:
        return self.engine.metrics

    def add_pool(
        self, name: str, spec: PoolSpec, *, host_region: BufferRegion | None = None, owner: Any = None
    ) -> IOPlan:
        """Plan ``spec`` on the backend (once per name) and register ``host_region`` for zero-copy
        where the plan says so; ``owner`` (the engine's host pool) is kept alive as long as the
        backend, because registered memory must outlive it. Returns the pool's plan."""
        with self._lock:
            if name not in self.engine.specs:
                plan = plan_pool(self.backend.instance, self.capabilities, spec, parallel=self.parallel)
                self.engine.add_pool(name, spec, plan)
            plan = self.engine.plans[name]
            if (
                plan.mode is IOMode.ZERO_COPY
                and host_region is not None
                and host_region.ptr not in self._registered
            ):
                self.backend.register_host_memory(host_region)
                self._registered.add(host_region.ptr)
                if owner is not None:
                    self._keep_alive.append(owner)
        return plan

    def write_problem(self) -> str | None:
        """Why the store cannot take a write now (a read-only or missing directory, an
        unreachable master: the backend's ``probe``), or None. Asked once at an engine's start,
        so a cache that can only fail its saves says so instead of counting failures."""
        try:
            return self.backend.probe()
        except Exception as exc:  # a plugin's probe must not stop the engine
            return f"its probe raised {type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Announce the close to the plugins, close the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            backend = self.backend
            self.plugins.notify("kvstrata_backend_closing", instance=backend.instance, backend=backend)
        finally:
            self.backend.close()
            self.plugins.close()


# --- keys an engine brings -------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z0-9-]{1,128}")
_HASHED_MARK = "_"
_PAGE_KEY_PERSON = b"kvstrata-pk-v1"


def page_key(key: str) -> str:
    """An engine's page key as the page-hash component of kvstrata keys, injective over all
    strings: a key of ``[A-Za-z0-9-]`` (hex digests: SGLang's SHA-256 chain) passes as it is;
    any other key becomes ``_`` + its BLAKE2b-128 -- a form no passed-through key can take (it
    holds ``_``), so no key reads another key's object."""
    if _PLAIN_KEY.fullmatch(key):
        return key
    raw = key.encode("utf-8", "surrogatepass")
    return _HASHED_MARK + hashlib.blake2b(raw, digest_size=16, person=_PAGE_KEY_PERSON).hexdigest()
