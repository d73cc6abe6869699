"""Conformance kit for pool types: subclass :class:`PoolTypeConformance` in your tests.

::

    from kvstrata.testing.pool_kit import PoolTypeConformance

    class TestMyPool(PoolTypeConformance):
        pool_config = {"type": "mine", "layers": 2, "width": 64}

        @pytest.fixture
        def pool_host(self, kvstrata_host):
            kvstrata_host.pool_types.register(MyPoolType)   # or an installed entry point
            return kvstrata_host

It checks, through the real cache (``kvstrata.open``) at two page sizes (:data:`PAGE_SIZES`): the
declared spec (names, the model's page size, role, buffers whose byte sizes add up, objects that
cover them, a ``layer_first`` layout), and a round trip of random bytes through the
host tier and an L3 into a new cache with empty L1 and L2, restored bit-exact where the pool's
hit rule says a prefix may be served, never past a prompt's shared part. A pool that is not an
anchor is tested next to a ``kv`` anchor named ``anchor`` (a sidecar's ``index_source`` may
name it). A small per-request state (a conv state, a scalar) is a ``mamba`` pool with named
``states``: test it with ``{"type": "mamba", "states": {...}}``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstrata
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.pool_type import (
    Granularity,
    HitRuleKind,
    Layout,
    ModelContext,
    PoolRole,
    PoolSpec,
    dtype_itemsize,
)

#: Tokens per page of the kit's stacks (each test runs at :data:`PAGE_SIZES`); pages of its prompts.
PAGE = 16
PAGE_SIZES = (4, PAGE)
PAGES = 6
POOL = "under_test"


def pool_spec(
    host: PluginHost, config: dict[str, Any], anchor: str = POOL, page_size: int = PAGE
) -> PoolSpec:
    """The spec an instance named :data:`POOL` declares."""
    cls = host.pool_types.require(str(config["type"]))
    return cls(POOL, cls.Config(**config), ModelContext(page_size=page_size, anchor=anchor)).spec()


def stack(config: dict[str, Any], role: PoolRole, l3: str, page_size: int = PAGE) -> dict[str, Any]:
    pools: dict[str, Any] = {POOL: config}
    if role is not PoolRole.ANCHOR:
        pools = {"anchor": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8}, **pools}
    return {
        "model": {"name": "pool-kit", "page_size": page_size, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 64 * page_size},
            "host": {"capacity_tokens": 128 * page_size},
            "storage": {"l3": {"type": "file", "path": l3}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def page_bytes(spec: Any, page: int, prompt_seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random content of one unit (every buffer, every layer) for ``page``."""
    generator = torch.Generator().manual_seed(prompt_seed * 1_000_003 + page)
    out = {}
    for buffer in spec.buffers:
        dtype = getattr(torch, buffer.dtype)
        nbytes = buffer.layers * math.prod(buffer.unit_shape) * dtype_itemsize(buffer.dtype)
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        out[buffer.name] = raw.view(dtype).reshape(1, buffer.layers, *buffer.unit_shape)
    return out


def unit_pages(spec: PoolSpec, first: int, count: int, end: int) -> list[int]:
    """The page whose content each of ``count`` units holds: a state slot holds the state after
    the last page (``end - 1``), every other unit one page from ``first`` on."""
    if spec.granularity is Granularity.NODE_STATE:
        return [end - 1] * count
    return list(range(first, first + count))


def fill_and_insert(cache: Any, prompt: torch.Tensor, seed: int) -> None:
    lease = cache.lookup(prompt)
    cache.admit(lease)
    for name, units in cache.allocate(lease).items():
        spec = cache.pools.pool(name).spec
        if spec.logical or not len(units):
            continue
        pages = unit_pages(spec, lease.allocated_first_page(name), len(units), lease.pages)
        data = [page_bytes(spec, page, seed) for page in pages]
        cache.write_units(name, units, {b.name: torch.cat([d[b.name] for d in data]) for b in spec.buffers})
    cache.insert(lease)


def check_restored(cache: Any, prompt: torch.Tensor, seed: int, shared_pages: int) -> int:
    """Look ``prompt`` up, check every restored unit of the pool under test byte for byte;
    returns the pages restored."""
    lease = cache.lookup(prompt)
    cache.admit(lease)
    try:
        cached = lease.cached_pages
        assert cached <= shared_pages, f"{cached} pages restored, but only {shared_pages} were stored"
        spec = cache.pools.pool(POOL).spec
        if cached and not spec.logical:
            units = lease.prefix_units(POOL)
            pages = unit_pages(spec, lease.prefix_first_page(POOL), len(units), cached)
            got = cache.read_units(POOL, units)
            for i, page in enumerate(pages):
                want = page_bytes(spec, page, seed)
                for name, tensor in want.items():
                    assert torch.equal(got[name][i : i + 1].view(torch.uint8), tensor.view(torch.uint8)), (
                        f"pool {POOL!r} buffer {name!r}: unit for page {page} restored with other bytes"
                    )
        return cached
    finally:
        cache.release(lease)


class PoolTypeConformance:
    """Behaviour every pool type must show; set :attr:`pool_config`, override ``pool_host``."""

    #: the pool's config as it appears under ``model.pools`` (``type`` and its keys)
    pool_config: dict[str, Any] = {}

    @pytest.fixture
    def pool_host(self) -> PluginHost:
        """A host where the pool type is registered (default: the installed plugins)."""
        return PluginHost()

    @pytest.fixture(params=PAGE_SIZES, ids=lambda size: f"page{size}")
    def page_size(self, request: pytest.FixtureRequest) -> int:
        """The stack's ``model.page_size``: every test runs at two."""
        return int(request.param)

    def _spec(self, host: PluginHost, page_size: int) -> PoolSpec:
        if not self.pool_config:
            raise NotImplementedError("a pool-type conformance class must set `pool_config`")
        spec = pool_spec(host, self.pool_config, page_size=page_size)
        if spec.role is not PoolRole.ANCHOR:
            spec = pool_spec(host, self.pool_config, anchor="anchor", page_size=page_size)
        return spec

    def test_declares_a_consistent_spec(self, pool_host: PluginHost, page_size: int) -> None:
        spec = self._spec(pool_host, page_size)
        assert spec.name == POOL and spec.pool_type == self.pool_config["type"], (
            "spec names the instance and type"
        )
        assert spec.page_size == page_size, (
            f"spec.page_size is {spec.page_size} in a stack of page_size {page_size}: take it from "
            "ModelContext.page_size (every tree pool shares one page size)"
        )
        state = spec.granularity is Granularity.NODE_STATE
        assert state == (spec.hit_rule.kind is HitRuleKind.PREFIX_END_STATE), (
            f"granularity {spec.granularity.value} with hit rule {spec.hit_rule.kind.value}: a state "
            "slot (node_state) is served by prefix_end_state, a page (token_pages) by all_pages or "
            "trailing_pages; the core keys on the granularity, so the hit rule would be ignored"
        )
        if spec.role is PoolRole.ANCHOR:
            assert not state and spec.hit_rule.kind is HitRuleKind.ALL_PAGES, (
                f"an anchor pool holds every page of a prefix (its objects commit the page): "
                f"granularity token_pages, hit rule all_pages, not {spec.granularity.value} / "
                f"{spec.hit_rule.kind.value}"
            )
        if spec.logical:
            assert not spec.buffers, "a logical pool holds no bytes"
            return
        assert spec.buffers, "a pool that is not logical declares at least one buffer"
        for buffer in spec.buffers:
            size = math.prod(buffer.unit_shape) * dtype_itemsize(buffer.dtype)
            assert buffer.bytes_per_unit_per_layer == size, (
                f"buffer {buffer.name!r}: shape and dtype disagree"
            )
        covered = {name for obj in spec.objects for name in obj.buffers}
        assert covered == {b.name for b in spec.buffers}, "the stored objects cover every buffer exactly"
        assert Layout.LAYER_FIRST in spec.layouts, (
            f"spec.layouts is {[layout.value for layout in spec.layouts]}: the device tier holds every pool "
            "layer_first, so a pool with buffers must list Layout.LAYER_FIRST in PoolSpec.layouts"
        )

    def test_round_trip_through_host_and_l3(
        self, pool_host: PluginHost, tmp_path: Path, page_size: int
    ) -> None:
        role = self._spec(pool_host, page_size).role
        config = stack(self.pool_config, role, str(tmp_path / "l3"), page_size)
        prompt = torch.arange(PAGES * page_size) + 7
        with kvstrata.open(config, plugins=pool_host) as cache:
            fill_and_insert(cache, prompt, seed=1)
            assert check_restored(cache, prompt, seed=1, shared_pages=PAGES) > 0, (
                "L1 serves what was inserted"
            )
        with kvstrata.open(config, plugins=pool_host) as cache:  # empty L1/L2: L3 -> L2 -> L1
            restored = check_restored(cache, prompt, seed=1, shared_pages=PAGES)
            assert restored > 0, "a new cache restores the prompt from L3"

    def test_hits_stop_where_prompts_diverge(
        self, pool_host: PluginHost, tmp_path: Path, page_size: int
    ) -> None:
        role = self._spec(pool_host, page_size).role
        config = stack(self.pool_config, role, str(tmp_path / "l3"), page_size)
        prompt = torch.arange(PAGES * page_size) + 7
        other = prompt.clone()
        other[3 * page_size + 1] += 1  # diverges inside page 3: at most pages 0-2 are shared
        with kvstrata.open(config, plugins=pool_host) as cache:
            fill_and_insert(cache, prompt, seed=2)
            check_restored(cache, other, seed=2, shared_pages=3)
