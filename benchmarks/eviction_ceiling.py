"""How far can insert-time prediction go? ``learned``'s ranking fed by an offline model.

``learned`` predicts online, from what the tree shows when a request inserts pages, whether a
later request continues that prefix. This script asks what the *best* such prediction would give:
a gradient-boosted classifier (scikit-learn) fitted offline on the whole trace, **cross-fitted**
(fitted on one half of the requests, predicting the other, and the other way round, so no
request's prediction has seen its own outcome), over everything a request carries when it is
inserted, with an unbounded key history:

- ``cache``: pages new to the history, pages before them, the total, the turn (requests that built
  the chain), requests since the chain was last read, and the tokens of the partial last block;
- ``cache + output``: the same plus the request's output length, which only the engine knows
  (after decoding) and no trace hint carries to the cache.

The label is ``learned``'s own: a later request holds the request's last full page within the
horizon. Its predictions replace ``learned``'s model, ranked exactly as ``learned`` ranks (the
same adaptive shift and re-read floor), and also with a fixed shift of 200 / 800 requests per unit
of log-odds. Baseline in the same run: LRU and ``learned`` on the same trace and capacity. Issue 18
asks for 19.7 % (conversation) and 38.0 % (synthetic) at 3M tokens.

    pip install scikit-learn   # this script only; kvstrata itself does not need it
    python benchmarks/eviction_ceiling.py [--capacity-tokens 3000000] [--horizon 1000] [--json OUT]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from _eviction import FixedInsertScore, hit_rate
from _results import Figure, skip, write_results
from _traces import find_trace

from kvstrata.eviction_policies.learned import LearnedConfig, LearnedPolicy
from kvstrata.plugins import PolicyContext
from kvstrata.plugins.eviction_policy import E
from kvstrata.replay.simulate import TraceFuture, full_blocks
from kvstrata.replay.trace import TraceRequest, read_trace

TRACES = ("conversation", "synthetic")
BLOCK = 512
CLIP = 6.0  # largest |log-odds| a prediction may carry
FIXED_SHIFTS = (200.0, 800.0)


def insert_features(trace: Sequence[TraceRequest]) -> tuple[list[list[float]], list[int]]:
    """One row per request: what its insert shows (see the module docstring), and its output length."""
    turn: dict[int, int] = {}
    last_read: dict[int, int] = {}
    rows: list[list[float]] = []
    outputs: list[int] = []
    for index, request in enumerate(trace):
        keys = full_blocks(request, BLOCK)
        known = 0
        while known < len(keys) and keys[known] in turn:
            known += 1
        chain_turn = turn[keys[known - 1]] if known else 0
        gap = index - last_read[keys[known - 1]] if known else -1
        rows.append([len(keys) - known, known, len(keys), chain_turn, gap, request.input_length % BLOCK])
        outputs.append(request.output_length)
        for key in keys:
            turn.setdefault(key, chain_turn + 1)
            last_read[key] = index
    return rows, outputs


def reused_within(trace: Sequence[TraceRequest], horizon: int) -> list[int]:
    """1 where a later request holds the request's last full block within ``horizon`` requests."""
    seen_at: dict[int, int] = {}
    labels = [0] * len(trace)
    for index in range(len(trace) - 1, -1, -1):  # backwards: the next use of each key is known
        keys = full_blocks(trace[index], BLOCK)
        if keys:
            later = seen_at.get(keys[-1])
            labels[index] = int(later is not None and later - index <= horizon)
        for key in keys:
            seen_at[key] = index
    return labels


def cross_fitted_log_odds(rows: list[list[float]], labels: list[int]) -> tuple[list[float], float]:
    """Each half predicted by a model fitted on the other; returns log-odds and the ROC AUC."""
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score

    x, y = np.asarray(rows, dtype=float), np.asarray(labels)
    first = np.arange(len(y)) < len(y) // 2
    p = np.zeros(len(y))
    for train, test in ((first, ~first), (~first, first)):
        model = HistGradientBoostingClassifier(max_iter=150, max_depth=4, random_state=0)
        p[test] = model.fit(x[train], y[train]).predict_proba(x[test])[:, 1]
    p = np.clip(p, 1e-6, 1 - 1e-6)
    log_odds = np.clip(np.log(p / (1 - p)), -CLIP, CLIP)
    return log_odds.tolist(), float(roc_auc_score(y, p))


class OfflinePrediction(FixedInsertScore):
    """``learned`` whose insert scores come from an offline model (benchmark only)."""

    def __init__(
        self, context: PolicyContext, future: TraceFuture, log_odds: list[float], shift: float | None
    ) -> None:
        super().__init__(context, future)
        self.per_request, self.fixed_shift = log_odds, shift
        self.mean = 0.0  # running mean of the scores, as learned keeps for its re-read floor

    def shift(self) -> float:
        return super().shift() if self.fixed_shift is None else self.fixed_shift

    def insert_score(self, entries: Sequence[E]) -> float:
        score = self.per_request[self.future.now]
        self.mean += 0.01 * (score - self.mean)
        return score

    def reread_floor(self) -> float | None:
        return self.mean + self.settings.reread_bonus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capacity-tokens", type=int, default=3_000_000)
    parser.add_argument("--horizon", type=int, default=1000, help="requests within which a reuse counts")
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    parser.add_argument("--quick", action="store_true", help="accepted for run_all.py: the run is short")
    args = parser.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:
        skip("eviction_ceiling.py needs scikit-learn (benchmark only): pip install scikit-learn")
    capacity, horizon = args.capacity_tokens, args.horizon
    figures: list[Figure] = []
    shifts: list[tuple[str, float | None]] = [("learned's shift", None)]
    shifts += [(f"shift {s:g}", s) for s in FIXED_SHIFTS]
    print(f"{capacity / 1e6:g}M tokens, horizon {horizon} requests; offline model cross-fitted on halves")
    print("| trace | LRU | learned (online) | features | AUC | " + " | ".join(n for n, _ in shifts) + " |")
    print("| --- | ---: | ---: | --- | ---: | " + " | ".join("---:" for _ in shifts) + " |")
    for name in TRACES:
        trace = read_trace(find_trace(f"{name}_trace.jsonl"))
        future = TraceFuture(trace, BLOCK)
        context = PolicyContext(
            tier="device", capacity_pages=capacity // BLOCK, page_size=BLOCK, page_bytes=1
        )
        lru = hit_rate(trace, capacity, None, future)
        online = hit_rate(trace, capacity, LearnedPolicy(LearnedConfig(), context), future)
        rows, outputs = insert_features(trace)
        labels = reused_within(trace, horizon)
        variants = {"cache": rows, "cache + output": [[*r, o] for r, o in zip(rows, outputs, strict=True)]}
        figures += [Figure.against(f"{name} learned {capacity / 1e6:g}M", online, "fraction", lru, "LRU")]
        for label, x in variants.items():
            log_odds, auc = cross_fitted_log_odds(x, labels)
            rates = [
                hit_rate(trace, capacity, OfflinePrediction(context, future, log_odds, shift), future)
                for _, shift in shifts
            ]
            print(
                f"| {name} | {lru:.1%} | {online:.1%} | {label} | {auc:.3f} | "
                + " | ".join(f"{rate:.1%}" for rate in rates)
                + " |",
                flush=True,
            )
            figures.append(
                Figure.against(
                    f"{name} offline {label} {capacity / 1e6:g}M", max(rates), "fraction", lru, "LRU"
                )
            )
    if args.json:
        write_results(args.json, "eviction_ceiling", figures)


if __name__ == "__main__":
    main()
