"""Reference hit-rate simulator on the full Mooncake traces, next to the paper's figures.

The "baseline" here is the published figure (Mooncake FAST'25, Table 2 and Fig. 9), not a
measurement: the ratio says how close our counting convention comes to the paper's.
Also times the simulator itself (requests/s), baseline: reading and validating the trace.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _results import Figure, write_results
from _traces import find_trace

from kvstrata.replay.simulate import SimulationConfig, simulate
from kvstrata.replay.trace import read_trace

PAPER = {  # trace -> (unlimited cache ratio, share of it reached with a 3M-token cache)
    "conversation_trace.jsonl": (0.40, 0.41),
    "synthetic_trace.jsonl": (0.66, 0.46),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    parser.add_argument("--quick", action="store_true", help="conversation trace only")
    args = parser.parse_args()
    figures: list[Figure] = []
    names = list(PAPER)[:1] if args.quick else list(PAPER)
    for name in names:
        start = time.perf_counter()
        trace = read_trace(find_trace(name))
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        unlimited = simulate(trace).hit_rate
        sim_s = time.perf_counter() - start
        three_m = simulate(trace, SimulationConfig(capacity_tokens=3_000_000)).hit_rate
        paper_max, paper_share = PAPER[name]
        short = name.removesuffix("_trace.jsonl")
        figures += [
            Figure.against(f"{short} hit rate, unlimited", unlimited, "fraction", paper_max, "paper Tab. 2"),
            Figure.against(
                f"{short} hit rate, 3M tokens LRU",
                three_m,
                "fraction",
                paper_max * paper_share,
                "paper Fig. 9",
            ),
            Figure.against(
                f"{short} simulate throughput", len(trace) / sim_s, "req/s", len(trace) / read_s, "trace read"
            ),
        ]
    for f in figures:
        ratio = f"{f.ratio:.3f}" if f.ratio is not None else "-"
        print(f"{f.metric:45s} {f.value:14.4f} {f.unit:9s} baseline {f.baseline:.4f} ratio {ratio}")
    if args.json:
        write_results(args.json, "simulate", figures)


if __name__ == "__main__":
    main()
