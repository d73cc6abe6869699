"""Every pool of every example stack round-trips bit-exact through a storage backend, and a second
process (fresh memory, its own backend instance) reads back exactly the bytes the first wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "tests" / "stacks").glob("*.yaml"))
PAGES = 6

# One module-level script shared by the writer (in-process) and the reader (subprocess).
SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from kvstrata.core.config import load
    from kvstrata.core.integrity import stored_objects
    from kvstrata.core.io_plan import plan_backend
    from kvstrata.core.keys import hash_pages, namespace_root
    from kvstrata.core.pool_group import PoolGroup
    from kvstrata.core.storage_engine import PoolBatch, StorageEngine
    from kvstrata.core.object_views import object_regions
    from kvstrata.plugins import PluginHost

    def open_stack(config_path, overrides, pages):
        host = PluginHost()
        config = load([config_path], overrides=overrides, plugins=host, environ={})
        group = PoolGroup(config, host)
        (instance, backend_config), = config.tiers.storage.items()
        backend = host.storage_backends.require(backend_config.type)(instance, backend_config)
        backend.open()
        specs = {name: pool.spec for name, pool in group.pools.items()}
        caps = backend.instance_capabilities()
        plans = plan_backend(instance, caps, specs.values(), parallel=config.parallel)
        engine = StorageEngine(backend, specs, plans, model_name=config.model.name,
                               cache_salt=config.model.cache_salt, parallel=config.parallel)
        tokens = torch.arange(pages * config.model.page_size, dtype=torch.int64) * 7 + 3
        hashes = hash_pages(tokens, config.model.page_size,
                            namespace_root(config.model.name, config.model.cache_salt))
        return group, backend, engine, plans, hashes

    def batches(group, plans, hashes):
        out, indices = {}, {}
        for name, pool in group.pools.items():
            if not plans[name].enabled:
                continue
            idx = torch.arange(len(hashes), dtype=torch.int64)
            # stored_objects: the spec's objects, or one header-only marker for a bufferless pool
            per_object = [object_regions(pool.host, suffix, idx) for suffix, _ in stored_objects(pool.spec)]
            units = [[regions[i] for regions in per_object] for i in range(len(hashes))]
            out[name], indices[name] = PoolBatch(hashes, units), idx
        return out, indices

    def digests(group, indices):
        result = {}
        for name, idx in indices.items():
            pool = group.pools[name]
            if pool.spec.logical:  # a header-only marker per page: its "ok" is what it proves
                continue
            data = torch.cat([pool.host.unit_view(b.name)[idx].flatten() for b in pool.spec.buffers])
            result[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return result

    if __name__ == "__main__":
        config_path, overrides, pages = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        group, backend, engine, plans, hashes = open_stack(config_path, overrides, pages)
        todo, indices = batches(group, plans, hashes)
        results = engine.get_group(todo)
        print(json.dumps({"ok": {n: r.ok for n, r in results.items()}, "digests": digests(group, indices)}))
        backend.close()
    """
)


@pytest.fixture(scope="module")
def stack_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "stack_io.py"
    path.write_text(SCRIPT)
    return path


def load_script(path: Path) -> dict:
    namespace: dict = {"__name__": "stack_io"}
    exec(compile(path.read_text(), str(path), "exec", dont_inherit=True), namespace)
    return namespace


@pytest.fixture(params=["file", "mooncake"])
def storage_overrides(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """``--set`` overrides that point the example's ``l3`` at a fresh file directory or at the
    session's real Mooncake master (objects land in the session mooncake_client's segment, so they
    outlive the writer and a second process can read them)."""
    if request.param == "file":
        return [f"tiers.storage.l3.path={tmp_path / 'l3'}"]
    mooncake = request.getfixturevalue("mooncake_inprocess_config")
    return [
        "tiers.storage.l3.type=mooncake",
        f"tiers.storage.l3.master={mooncake.master}",
        f"tiers.storage.l3.metadata_server={mooncake.metadata_server}",
        "tiers.storage.l3.segment_bytes=0",
        "tiers.storage.l3.local_buffer_bytes=0",
    ]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_pool_round_trips_through_storage_and_a_second_process(
    example: Path, storage_overrides: list[str], stack_script: Path
) -> None:
    script = load_script(stack_script)
    overrides = storage_overrides
    group, backend, engine, plans, hashes = script["open_stack"](example, overrides, PAGES)
    todo, indices = script["batches"](group, plans, hashes)
    assert todo, f"{example.name}: no pool is stored at all"
    # every pool is stored, the bufferless (logical) anchor too: its marker objects gate the rest
    assert set(todo) == set(group.pools), {name: plan.reason for name, plan in plans.items()}
    generator = torch.Generator().manual_seed(1234)
    for name in todo:
        if group.pools[name].spec.logical:
            continue
        backing = group.pools[name].host.backing
        backing.copy_(torch.randint(0, 256, backing.shape, dtype=torch.uint8, generator=generator))
    written = engine.put_group(todo)
    assert all(all(result.ok) for result in written.values()), written
    expected = script["digests"](group, indices)
    backend.close()

    env_path = str(REPO / "src")
    reader = subprocess.run(
        [sys.executable, str(stack_script), str(example), json.dumps(overrides), str(PAGES)],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert reader.returncode == 0, reader.stderr[-2000:]
    report = json.loads(reader.stdout.strip().splitlines()[-1])
    assert report["ok"] == {name: [True] * PAGES for name in todo}
    assert report["digests"] == expected, f"{example.name}: bytes differ in the second process"
