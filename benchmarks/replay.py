"""Replay the Mooncake conversation trace through the real tiers with real bytes.

Three runs, each on a small model stack with 512-token pages (the trace's block size):

1. ``file``: KV + Mamba-like state, device 1M tokens, host 4M tokens, write-through to the file
   backend in a temporary directory; every restored page verified. Wall time and tokens/s.
2. ``device-only, unlimited``: a device tier that never evicts, no host or storage tier.
3. ``device-only, 3M tokens``: the paper's Fig. 9 cache size.

Baselines measured in the same run: the reference simulator (``kvstrata simulate``: LRU over trace
blocks) for the hit rates, and its bookkeeping-only token rate for throughput. The paper's figures
(conversation trace: 40 % unlimited, 41 % of that with 3M tokens ≈ 16 %) are printed alongside.

    python benchmarks/replay.py [--quick] [--limit N] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import Figure, write_results
from _traces import find_trace

from kvstrata.core.config import env_overrides, set_path, validate_config
from kvstrata.plugins.host import PluginHost
from kvstrata.replay.driver import run_replay_detailed
from kvstrata.replay.report import ReplayResult
from kvstrata.replay.simulate import SimulationConfig, simulate
from kvstrata.replay.trace import TraceRequest, read_trace

PAPER_UNLIMITED, PAPER_3M_SHARE = 0.40, 0.41
QUICK_REQUESTS = 1500
PAGE = 512


def stack(*, device_tokens: int, host_tokens: int, l3: Path | None, hybrid: bool) -> dict[str, Any]:
    """A small stack: 16 bytes of KV per token (8 KiB pages), optionally a small Mamba-like state."""
    pools: dict[str, Any] = {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4}}
    if hybrid:
        pools["mamba"] = {
            "type": "mamba",
            "layers": 2,
            "conv": [{"shape": [3, 64], "dtype": "bfloat16"}],
            "temporal": {"shape": [2, 16, 16], "dtype": "float32"},
            "device_units": 64,
            "host_units": 256,
        }
    storage = {"l3": {"type": "file", "path": str(l3)}} if l3 is not None else {}
    return {
        "model": {"name": "bench-replay", "page_size": PAGE, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": device_tokens},
            "host": {"capacity_tokens": host_tokens},
            "storage": storage,
        },
        "policy": {"write": "write_through"},
    }


def replay(requests: list[TraceRequest], data: dict[str, Any], label: str) -> tuple[ReplayResult, float]:
    host = PluginHost()
    for path, value in env_overrides():  # KVSTRATA_A__B=... applies here as to any config
        set_path(data, path, value)
    config = validate_config(data, host, f"benchmark stack {label!r}")
    last = [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 10 or done == total:
            print(f"  {label}: {done:,}/{total:,} requests", file=sys.stderr, flush=True)
            last[0] = now

    start = time.perf_counter()
    result, _ = run_replay_detailed(config, host, requests, progress=progress)
    return result, time.perf_counter() - start


def describe(label: str, result: ReplayResult, wall: float, simulated: float) -> None:
    h = result.hit_rate
    print(
        f"{label:28s} {result.requests:>6,} req  {wall:7.1f} s  {result.tokens_per_s / 1e6:6.2f} Mtok/s  "
        f"hit device {h.device:6.2%} host {h.host:6.2%} storage {h.storage:6.2%} total {h.total:6.2%}  "
        f"(simulator {simulated:6.2%})  corrupt served {result.corrupt_pages_served} "
        f"detected {result.corrupt_pages_detected}  failures {result.failures}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_REQUESTS} requests only")
    parser.add_argument("--limit", type=int, help="first N requests (default: the whole trace)")
    args = parser.parse_args()
    limit = args.limit or (QUICK_REQUESTS if args.quick else None)
    requests = read_trace(find_trace("conversation_trace.jsonl"), limit=limit)
    total_tokens = sum(r.input_length for r in requests)

    start = time.perf_counter()
    sim_unlimited = simulate(requests).hit_rate
    sim_s = time.perf_counter() - start
    sim_3m = simulate(requests, SimulationConfig(capacity_tokens=3_000_000)).hit_rate
    print(f"conversation trace: {len(requests):,} requests, {total_tokens:,} input tokens")
    print(
        f"reference simulator: unlimited {sim_unlimited:.2%}, 3M tokens {sim_3m:.2%} "
        f"(paper: {PAPER_UNLIMITED:.0%} and {PAPER_UNLIMITED * PAPER_3M_SHARE:.1%})"
    )

    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-replay-") as tmp:
        data = stack(device_tokens=1 << 20, host_tokens=4 << 20, l3=Path(tmp) / "l3", hybrid=True)
        file_run, file_wall = replay(requests, data, "file")
    describe("file L3 (kv + state)", file_run, file_wall, sim_unlimited)
    unlimited_data = stack(device_tokens=total_tokens + PAGE, host_tokens=0, l3=None, hybrid=False)
    unlimited, unlimited_wall = replay(requests, unlimited_data, "device-only unlimited")
    describe("device-only, unlimited", unlimited, unlimited_wall, sim_unlimited)
    capped, capped_wall = replay(
        requests, stack(device_tokens=3_000_000, host_tokens=0, l3=None, hybrid=False), "device-only 3M"
    )
    describe("device-only, 3M tokens", capped, capped_wall, sim_3m)
    print(
        f"acceptance: unlimited {unlimited.hit_rate.total:.2%} (paper {PAPER_UNLIMITED:.0%}), "
        f"3M {capped.hit_rate.total:.2%} (paper ≈{PAPER_UNLIMITED * PAPER_3M_SHARE:.1%}); "
        f"file run {file_wall:.1f} s for {len(requests):,} requests (goal: < 120 s for 12,031)"
    )

    sim_rate = total_tokens / sim_s if sim_s > 0 else float("nan")
    figures += [
        Figure.against("file L3 replay wall time", file_wall, "s", None),
        Figure.against(
            "file L3 replay throughput", file_run.tokens_per_s, "tokens/s", sim_rate, "simulator bookkeeping"
        ),
        Figure.against(
            "file L3 replay total hit rate", file_run.hit_rate.total, "fraction", sim_unlimited, "simulator"
        ),
        Figure.against("file L3 replay storage hit rate", file_run.hit_rate.storage, "fraction", None),
        Figure.against("file L3 corrupt pages served", file_run.corrupt_pages_served, "pages", None),
        Figure.against(
            "device-only unlimited hit rate", unlimited.hit_rate.total, "fraction", sim_unlimited, "simulator"
        ),
        Figure.against(
            "device-only 3M-token hit rate", capped.hit_rate.total, "fraction", sim_3m, "simulator"
        ),
        Figure.against(
            "device-only unlimited hit rate vs paper",
            unlimited.hit_rate.total,
            "fraction",
            PAPER_UNLIMITED,
            "paper Tab. 2",
        ),
        Figure.against(
            "device-only 3M-token hit rate vs paper",
            capped.hit_rate.total,
            "fraction",
            PAPER_UNLIMITED * PAPER_3M_SHARE,
            "paper Fig. 9",
        ),
    ]
    if args.json:
        write_results(args.json, "replay", figures)
    failed = file_run.corrupt_pages_served + unlimited.corrupt_pages_served + capped.corrupt_pages_served
    if failed:
        raise SystemExit(f"{failed} corrupt pages served")


if __name__ == "__main__":
    main()
