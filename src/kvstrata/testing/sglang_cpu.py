"""Import SGLang's real HiCache modules on a CPU-only machine, for tests and benchmarks.

Inside an SGLang server nothing here is needed: ``sglang`` is already imported and
``kvstrata.adapters.sglang`` imports ``sglang.srt.mem_cache.hicache_storage`` like any module.

On a machine without a GPU stack, ``import sglang.srt.mem_cache...`` fails before reaching the
code we want to exercise: ``sglang/__init__.py`` (the public-API facade) pulls the HF/model stack,
and the host-pool modules import GPU kernels, device pools and ``sglang.srt.utils`` (which imports
triton at module level). :func:`load_sglang_mem_cache` therefore does exactly two things:

1. registers a bare ``sglang`` package object whose ``__path__`` is the installed package, so
   ``sglang/__init__.py`` is not executed (its submodules import from the real files);
2. serves the module trees in :data:`CPU_STAND_INS` as small stand-ins. Each one is imported at
   module level by the host-pool modules but only *called* on a GPU/NPU path:

   * ``sglang.srt.utils``: the device predicates ``is_cuda``/``is_hip``/``is_npu``/``is_xpu``/
     ``is_mps`` (all False here); any other name raises AttributeError, so a new use is loud;
   * ``sglang.kernels``: GPU transfer kernels; ``can_use_*`` answer False, anything else raises
     when *called*;
   * ``sglang.srt.mem_cache.memory_pool``: device KV pools (triton); names are placeholder classes
     that nothing is an instance of;
   * ``sglang.srt.layers``: model layers; functions raise when called (DCP kernel indices only).

Everything else -- ``hicache_storage`` (the storage ABC, ``HiCacheFile``, ``PoolTransfer``),
``storage.backend_factory`` (the dynamic loader), ``pool_host.{base,common,mha,mla,page_unified}``,
``device_pool_info``, ``platforms``, ``runtime_context``, ``environ`` -- is SGLang's real code,
imported from the installed package. Install it without its dependencies (its metadata pins a
CUDA torch); the one package its mem_cache modules import beyond kvstrata's own is ``msgspec``::

    pip install --no-deps 'sglang==0.5.23' && pip install msgspec 'torch==2.13.0'

The host pools built by :func:`mha_host_pool` / :func:`mla_host_pool` are SGLang's own classes,
constructed the way its pool assembler does, over small CPU "device" buffers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = "pip install --no-deps 'sglang==0.5.23' && pip install msgspec 'torch==2.13.0'"

#: Module trees served as CPU stand-ins: name -> (what unknown attributes become, why).
CPU_STAND_INS = {
    "sglang.srt.utils": ("utils", "device predicates only (its __init__ imports triton)"),
    "sglang.kernels": ("functions", "GPU transfer kernels, called only on CUDA/ROCm"),
    "sglang.srt.mem_cache.memory_pool": ("classes", "device KV pools (triton), used in isinstance checks"),
    "sglang.srt.layers": ("functions", "model layers; the host pools call them only under DCP"),
}


class SGLangUnavailable(RuntimeError):
    """SGLang (or one of the small packages its mem_cache modules import) is not installed."""


def _device_predicates() -> dict[str, Callable[[], bool]]:
    cuda = torch.cuda.is_available() and torch.version.cuda is not None
    hip = torch.cuda.is_available() and torch.version.hip is not None
    return {
        "is_cuda": lambda: cuda,
        "is_hip": lambda: hip,
        "is_npu": lambda: False,
        "is_xpu": lambda: False,
        "is_mps": lambda: False,
    }


class _StandIn(types.ModuleType):
    """A stand-in module; ``kind`` says what unknown attribute names resolve to."""

    def __init__(self, name: str, kind: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self._kind = kind
        if kind == "utils":
            for attr, fn in _device_predicates().items():
                setattr(self, attr, fn)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        where = f"{self.__name__}.{attr}"
        if self._kind == "utils":
            raise AttributeError(f"{where}: not provided by kvstrata's CPU stand-in for sglang.srt.utils")
        if self._kind == "classes":
            placeholder = type(attr, (), {"__module__": self.__name__})
            setattr(self, attr, placeholder)
            return placeholder
        if attr.startswith("can_use_"):
            return lambda *args, **kwargs: False

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{where} is a GPU code path, unavailable on this CPU-only machine")

        unavailable.__name__ = attr
        return unavailable


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds

    def _kind(self, name: str) -> str | None:
        for root, kind in self.kinds.items():
            if name == root or name.startswith(root + "."):
                return kind
        return None

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if self._kind(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandIn(spec.name, self._kind(spec.name) or "functions")

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def load_sglang_mem_cache() -> types.ModuleType:
    """Make ``sglang.srt.mem_cache.*`` importable on this machine; returns ``hicache_storage``.

    Idempotent. When ``sglang`` was already imported for real (inside a server), changes nothing.
    Raises :class:`SGLangUnavailable` with the install command when SGLang or a dependency is missing.
    """
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise SGLangUnavailable(f"sglang is not installed: {INSTALL_HINT}")
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = None
        sys.modules["sglang"] = package
        if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _StandInFinder({name: kind for name, (kind, _) in CPU_STAND_INS.items()}))
    try:
        module = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    except ModuleNotFoundError as exc:
        raise SGLangUnavailable(f"importing SGLang's mem_cache failed ({exc}): {INSTALL_HINT}") from exc
    return module


# --- SGLang host pools over CPU "device" buffers -----------------------------------------------


@dataclass(frozen=True)
class DevicePools:
    """The per-layer device tensors a host pool was built over (kept alive with it)."""

    tensors: tuple[torch.Tensor, ...]


def _pointer_table(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    page_size: int,
    host_pages: int,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int | None = None,
    head_group_num: int = 1,
    v_head_dim: int | None = None,
) -> Any:
    """SGLang's real ``MHATokenToKVPoolHost`` with ``host_pages`` pages (``head_group_num``: the
    kv-head groups of the ``page_unified`` layout); with a ``v_head_dim`` other than ``head_dim``
    its ``AsymmetricMHATokenToKVPoolHost`` (K and V in two buffers; page_first and
    page_first_direct only)."""
    load_sglang_mem_cache()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost

    tokens = device_tokens or page_size
    v_dim = head_dim if v_head_dim is None else v_head_dim
    pool_class = MHATokenToKVPoolHost if v_dim == head_dim else AsymmetricMHATokenToKVPoolHost
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, v_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_pointer_table(k), v_data_ptrs=_pointer_table(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=v_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = pool_class(
        info,
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers - 1,
        host_token_capacity=host_pages * page_size,
        head_group_num=head_group_num,
    )
    pool._kvstrata_device_buffers = DevicePools(k + v)
    return pool


def mla_host_pool(
    *,
    layers: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    page_size: int,
    host_pages: int,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int | None = None,
) -> Any:
    """SGLang's real ``MLATokenToKVPoolHost`` (one latent+rope row per token per layer)."""
    load_sglang_mem_cache()
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = device_tokens or page_size
    dim = kv_lora_rank + qk_rope_head_dim
    rows = tuple(torch.zeros(tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_pointer_table(rows),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        kv_cache_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
        info,
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers - 1,
        target_layer_num=layers,
        host_token_capacity=host_pages * page_size,
    )
    pool._kvstrata_device_buffers = DevicePools(rows)
    return pool


def storage_config(
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    model_name: str | None = "demo-model",
    is_mla_model: bool = False,
    is_page_first_layout: bool = True,
    extra_config: dict[str, Any] | None = None,
) -> Any:
    """SGLang's real ``HiCacheStorageConfig`` as its cache controller fills it for one rank."""
    module = load_sglang_mem_cache()
    return module.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla_model,
        enable_storage_metrics=False,
        is_page_first_layout=is_page_first_layout,
        model_name=model_name,
        extra_config=extra_config,
    )
