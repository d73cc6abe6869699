"""The benchmark scripts' result conventions (benchmarks/README.md): no timing is asserted here,
only that every script reports the same way, so ``run_all.py``'s table reads one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _figure_calls_with_own_ratio(path: Path) -> list[int]:
    """Lines where ``Figure(...)`` is given a ratio of its own (5th argument or ``ratio=``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Figure"):
            continue
        if len(node.args) >= 5 or any(kw.arg == "ratio" for kw in node.keywords):
            lines.append(node.lineno)
    return lines


def test_every_ratio_is_kvstrata_over_the_baseline() -> None:
    """A ratio is value / baseline everywhere (``Figure.against``): a time's ratio < 1 means
    kvstrata is faster, a throughput's > 1. One script inverting it for times (a "speed-up")
    made its rows read the other way from every other row in the same table."""
    scripts = sorted(BENCHMARKS.glob("*.py")) + sorted((BENCHMARKS / "peers").glob("*.py"))
    assert scripts
    found = {str(p.relative_to(BENCHMARKS)): _figure_calls_with_own_ratio(p) for p in scripts}
    found = {name: lines for name, lines in found.items() if lines}
    assert found == {}


def _run_script(script: str, *args: str, tmp_path: Path, stdout: list[str] | None = None) -> dict:
    import os
    import subprocess
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _results import read_results
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "results.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS.parent / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, proc.stderr
    if stdout is not None:
        stdout.extend(proc.stdout.splitlines())
    return read_results(out)


def test_checksum_takes_quick_and_json_like_the_others(tmp_path: Path) -> None:
    """``run_all.py`` passes ``--json OUT`` (and ``--quick``) to every script it lists."""
    data = _run_script("checksum.py", "--quick", "--mib", "1", "--repeat", "1", tmp_path=tmp_path)
    assert data["name"] == "checksum"
    (figure,) = data["figures"]
    assert figure["unit"] == "GiB/s" and figure["value"] > 0 and figure["baseline"] > 0
    assert abs(figure["ratio"] - figure["value"] / figure["baseline"]) < 1e-9
    run_all = (BENCHMARKS / "run_all.py").read_text()
    assert '"checksum": "checksum.py"' in run_all


@pytest.mark.slow  # a subprocess measuring 3 rounds: ~8 s
def test_engine_calls_writes_the_ratio_it_prints(tmp_path: Path) -> None:
    """The printed chunk / whole ratio and the JSON's are one statistic (the ratio of the medians):
    the JSON had the ratio of medians while the table printed the median of per-round ratios."""
    lines: list[str] = []
    args = ("--pages", "8", "--chunk", "2", "--rounds", "3")
    data = _run_script("engine_calls.py", *args, tmp_path=tmp_path, stdout=lines)
    printed = [
        float(line.split(":", 1)[1].split()[0])
        for line in lines
        if line.startswith(("chunk / whole insert", "floor chunk / whole insert"))
    ]
    written = [figure["ratio"] for figure in data["figures"]]
    assert len(printed) == len(written) == 2
    for shown, ratio in zip(printed, written, strict=True):
        assert abs(shown - ratio) < 0.006, (printed, written)


def _load_peer_script(name: str):  # type: ignore[no-untyped-def]
    """Import a benchmarks/peers script by path without leaving its sys.path edits behind."""
    import importlib.util
    import sys

    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(
            f"_bench_peer_{name}", BENCHMARKS / "peers" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_lmcache_side_gets_vllm_block_slots() -> None:
    """LMCache is fed the slot mapping vLLM builds (16-token blocks, scattered, tokens in order
    in a block), not one random slot per token, a layout no vLLM engine hands it."""
    from types import SimpleNamespace

    import torch

    lmcache = _load_peer_script("lmcache")
    tokens, block = 1024, 16
    blocks = 2 * tokens // block + 1
    worker = SimpleNamespace(slots_total=blocks * block, args=SimpleNamespace(tokens=tokens))
    slots = lmcache.LMCacheWorker._slots(worker, 3)
    assert slots.shape == (tokens,) and len(set(slots.tolist())) == tokens
    assert int(slots.min()) >= 0 and int(slots.max()) < blocks * block
    rows = slots.reshape(-1, block)
    assert torch.equal(rows - rows[:, :1], torch.arange(block).expand_as(rows))  # in order in a block
    assert bool((rows[:, 0] % block == 0).all())  # each block starts on a block boundary
    starts = rows[:, 0] // block
    assert not torch.equal(starts, torch.arange(starts[0], starts[0] + len(starts)))  # scattered
    assert torch.equal(slots, lmcache.LMCacheWorker._slots(worker, 3))  # the same each call
