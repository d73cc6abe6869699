"""How good must a reuse prediction be? ``learned``'s ranking with an oracle in place of its model.

``learned`` ranks a leaf by ``last read + shift x log-odds``. Here the log-odds come from the
trace's future (read the way ``belady`` reads it, through ``kvstrata simulate``'s
``TraceFuture``) instead of the online model, in two strengths:

- ``reread oracle``: a prefix read again since it entered the tier scores +3 if a request holds
  its last page within the horizon, else -3 (new inserts keep the model's prediction);
- ``insert oracle``: every insert scores +3 if a later request reads its first new page (reuses
  any of it) within the horizon, else -3, fixed when it enters.

Baseline of every figure: LRU and ``learned`` in the same run, same trace and capacity. Issue 18
asks for 19.7 % (conversation) and 38.0 % (synthetic) at 3M tokens.

    python benchmarks/eviction_oracles.py [--capacity-tokens 3000000] [--horizon 1000] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from pathlib import Path

from _eviction import FixedInsertScore, hit_rate
from _results import Figure, write_results
from _traces import find_trace

from kvstrata.eviction_policies.learned import LearnedConfig, LearnedPolicy
from kvstrata.plugins import PolicyContext
from kvstrata.plugins.eviction_policy import E
from kvstrata.replay.simulate import TraceFuture
from kvstrata.replay.trace import read_trace

TRACES = ("conversation", "synthetic")
SURE = 3.0  # log-odds of a certain outcome (the model's own rarely pass 2)


def truth(future: TraceFuture, key: Hashable, within: int) -> float:
    """The oracle's log-odds: does a request hold ``key`` within ``within`` requests from now?"""
    return SURE if future.next_use(key) - future.now <= within else -SURE


class RereadOracle(LearnedPolicy):
    """Re-read prefixes score the truth; new inserts keep the online model's prediction."""

    def __init__(self, context: PolicyContext, future: TraceFuture, horizon: int) -> None:
        super().__init__(LearnedConfig(), context)
        self.future, self.within = future, horizon

    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        shift = self.shift()
        out = []
        for rank, node_id, node in super().ranked(entries):
            if node in self.reread:
                rank = self.stamp[node] + shift * truth(self.future, node.keys[-1], self.within)
            out.append((rank, node_id, node))
        return out


class InsertOracle(FixedInsertScore):
    """Every insert scores the truth, fixed when it enters."""

    def __init__(self, context: PolicyContext, future: TraceFuture, horizon: int) -> None:
        super().__init__(context, future)
        self.within = horizon

    def insert_score(self, entries: Sequence[E]) -> float:
        # its first new page: is any of it read again?
        return truth(self.future, entries[0].keys[0], self.within)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capacity-tokens", type=int, default=3_000_000)
    parser.add_argument("--horizon", type=int, default=1000, help="requests within which a reuse counts")
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    parser.add_argument("--quick", action="store_true", help="accepted for run_all.py: the run is short")
    args = parser.parse_args()
    capacity, horizon = args.capacity_tokens, args.horizon
    figures: list[Figure] = []
    print(f"{capacity / 1e6:g}M tokens, horizon {horizon} requests")
    print("| trace | LRU | learned | reread oracle | insert oracle |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in TRACES:
        trace = read_trace(find_trace(f"{name}_trace.jsonl"))
        future = TraceFuture(trace, 512)
        context = PolicyContext(tier="device", capacity_pages=capacity // 512, page_size=512, page_bytes=1)
        rates = {
            "lru": hit_rate(trace, capacity, None, future),
            "learned": hit_rate(trace, capacity, LearnedPolicy(LearnedConfig(), context), future),
            "reread oracle": hit_rate(trace, capacity, RereadOracle(context, future, horizon), future),
            "insert oracle": hit_rate(trace, capacity, InsertOracle(context, future, horizon), future),
        }
        print(f"| {name} | " + " | ".join(f"{rate:.1%}" for rate in rates.values()) + " |")
        figures += [
            Figure.against(f"{name} {label} {capacity / 1e6:g}M", rate, "fraction", rates["lru"], "LRU")
            for label, rate in rates.items()
            if label != "lru"
        ]
    if args.json:
        write_results(args.json, "eviction_oracles", figures)


if __name__ == "__main__":
    main()
