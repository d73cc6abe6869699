"""Shared test helpers: fake installed distributions that drive the real entry-point path."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """One OpenMP thread per test process and per process a test starts (engines, replays):
    CI runs two xdist workers on two cores, and test engines side by side, where each process's
    OpenMP threads, spinning for work, stalled the others (the shared-prefix state machines ran
    71 s beside a second worker against 16 s; the vLLM adapter tests, alone, 188 s against 155)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (read by the processes tests start)
    torch.set_num_threads(1)  # (this process imported torch already)


@pytest.fixture
def make_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Write ``<dist>-<version>.dist-info`` (METADATA + entry_points.txt) and modules to a temp dir
    on ``sys.path``, exactly as pip would leave them, so ``importlib.metadata`` finds them. The
    modules imported from there leave ``sys.modules`` when the test ends: two tests may write one
    module name with different code (a broken plugin and a working one), and an import would
    otherwise find whichever ran first."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # isolate stevedore's disk cache

    def make(
        dist: str,
        version: str,
        entry_points: dict[str, dict[str, str]],
        modules: dict[str, str],
        requires: tuple[str, ...] = (),
    ) -> Path:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        requires_dist = "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requires_dist}"
        )
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines.extend(f"{name} = {target}" for name, target in eps.items())
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():  # "pkg.mod" becomes pkg/__init__.py + pkg/mod.py
            *packages, leaf = module.split(".")
            folder = root.joinpath(*packages)
            for depth in range(1, len(packages) + 1):
                package = root.joinpath(*packages[:depth])
                package.mkdir(exist_ok=True)
                (package / "__init__.py").touch()
            (folder / f"{leaf}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()  # the import system may have listed ``root`` already
        return root

    yield make
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").is_relative_to(root):
            del sys.modules[name]


#: Modules whose tests start engines, servers or second processes, build wheels, or replay whole
#: traces (measured: each costs 5-180 s of a full run). ``pytest -m "not slow"`` leaves them and
#: the tests marked ``@pytest.mark.slow`` out for a fast inner loop; the README's test command
#: runs everything.
SLOW_MODULES = {
    "test_adapter_hf.py",
    "test_adapter_hf_eviction.py",
    "test_adapter_sglang.py",
    "test_adapter_vllm.py",
    "test_adapter_vllm_layout.py",
    "test_mooncake_backend.py",
    "test_mooncake_howto.py",
    "test_newcomer_cli.py",
    "test_newcomer_second_hour.py",
    "test_packaging.py",
    "test_readme.py",
    "test_replay_interrupt.py",
    "test_stack_storage_roundtrip.py",
    "test_valkey_plugin.py",
}


#: Tests of otherwise fast modules that start a second Python process or a Mooncake master
#: (measured: 1.5-6 s each, about 45 s of the fast loop together).
SLOW_TESTS = {
    "test_a_draft_pool_added_at_runtime_is_stored_and_restored",
    "test_cli_lists_and_simulates_a_third_party_policy",
    "test_cli_plugins_json_lists_fake_distribution_and_broken_one",
    "test_cli_show_prints_resolved_config_with_defaults",
    "test_cli_validate_wrong_value_exits_2_and_prints_the_path",
    "test_l3_write_then_a_fresh_process_restores_exact_bytes",
    "test_mooncake_l3_then_a_fresh_process_restores_exact_bytes",
    "test_second_process_is_served_from_storage_and_another_model_is_not",
    "test_two_ranks_drop_or_adopt_a_prefetch_together",
    "test_write_back_eviction_of_nested_nodes_stores_the_right_hashes",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name in SLOW_MODULES or item.path.parent.name == "faults" or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
