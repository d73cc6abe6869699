"""The ``memory`` backend (issue 27, item 13): the conformance kit, the cache through the plugin
hooks (the path an application uses before the entry point is installed), the LRU cap and the
latency / bandwidth knobs (the delay each call asks for, never a measured time)."""

from __future__ import annotations

import tomllib
from collections.abc import Callable

import pytest
import torch

import kvstrata
from controller_support import REPO
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.storage_backend import StorageBackend
from kvstrata.pool_types.kv import KVPoolType
from kvstrata.storage_backends import memory as memory_module
from kvstrata.storage_backends.memory import MemoryBackend, MemoryConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes


class TestMemoryConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self) -> Callable[[str], StorageBackend]:
        def make(instance: str = "conformance") -> StorageBackend:
            backend = MemoryBackend(instance, MemoryConfig())
            backend.open()
            return backend

        return make


class Contributor:
    """An application's in-process registration (what an installed entry point does)."""

    @kvstrata.hookimpl
    def kvstrata_register_storage_backends(self, register: Callable[[type], None]) -> None:
        register(MemoryBackend)


def stack(page_size: int = 16) -> dict[str, object]:
    return {
        "model": {
            "name": "memory-l3",
            "page_size": page_size,
            "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}},
        },
        "tiers": {
            "device": {"capacity_tokens": 256},
            "host": {"capacity_tokens": 512},
            "storage": {"l3": {"type": "memory"}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def test_a_cache_registered_through_the_hooks_restores_from_the_memory_l3(
    kvstrata_bare_host: PluginHost,
) -> None:
    kvstrata_bare_host.pool_types.register(KVPoolType)  # a bare host: the stack's pool type too
    kvstrata_bare_host.register_plugin(Contributor())
    prompt = torch.arange(64)
    with kvstrata.open(stack(), plugins=kvstrata_bare_host) as cache:
        lease = cache.lookup(prompt)
        cache.admit(lease)
        units = cache.allocate(lease)
        spec = cache.pools.pool("kv").spec
        cache.write_units(
            "kv", units["kv"], {b.name: torch.full((4, b.layers, *b.unit_shape), 0.25) for b in spec.buffers}
        )
        cache.insert(lease)
        cache.flush()
        backend = cache.parts.backend
        assert isinstance(backend, MemoryBackend) and backend.stored_bytes > 0
        # drop L1 and L2: the next lookup must come from the memory L3
        cache.units.drop_everything()
        again = cache.lookup(prompt)
        cache.admit(again)
        assert again.hit_pages.get("storage", 0) == 4, again.hit_pages
        k = cache.read_units("kv", again.prefix_units("kv"), layer=0)["k"]
        assert torch.equal(k, torch.full_like(k, 0.25))
        cache.release(again)


def test_the_entry_point_is_declared_in_pyproject() -> None:
    """Discovered by entry point once the package is (re)installed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = project["project"]["entry-points"]["kvstrata.storage_backends"]
    assert group["memory"] == "kvstrata.storage_backends.memory:MemoryBackend"


def test_capacity_keeps_the_most_recently_used_objects() -> None:
    kit = BackendConformance()
    specs = conformance_specs()
    size = None
    backend = MemoryBackend("l3", MemoryConfig())
    engine = kit.engine(backend, specs)
    source = kit.pools(specs, 3, seed=3)
    hashes = page_hashes(3, seed=3)
    assert all(engine.put("attn", hashes[:1], source["attn"].units(range(1))).ok)
    size = backend.stored_bytes
    capped = MemoryBackend("l3", MemoryConfig(capacity_bytes=2 * size))
    engine = kit.engine(capped, specs)
    for page in range(3):
        assert all(engine.put("attn", hashes[page : page + 1], source["attn"].units([page])).ok)
    keys = [engine.object_keys("attn", [h])[0] for h in hashes]
    assert [all(capped.exists(k)) for k in keys] == [False, True, True]
    assert capped.stored_bytes <= 2 * size


def test_latency_and_bandwidth_are_the_delays_each_call_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(memory_module.time, "sleep", slept.append)
    kit = BackendConformance()
    specs = conformance_specs()
    backend = MemoryBackend("l3", MemoryConfig(latency_s=0.002, bandwidth_bytes_per_s=1e6))
    engine = kit.engine(backend, specs, checksum="none")
    source = kit.pools(specs, 1, seed=1)
    hashes = page_hashes(1, seed=1)
    engine.put("attn", hashes, source["attn"].units(range(1)))
    stored = backend.stored_bytes
    assert slept and slept[-1] == pytest.approx(0.002 + stored / 1e6)
    slept.clear()
    keys = engine.object_keys("attn", hashes)[0]
    backend.exists(keys)
    assert slept == [pytest.approx(0.002)]


def test_removing_an_absent_key_returns_true() -> None:
    backend = MemoryBackend("l3", MemoryConfig())
    assert backend.remove(["never-stored"]) == [True]
