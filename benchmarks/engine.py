"""Controller cost of chunked prefill on one lease: linear in the pages, whatever the chunk size.

An engine prefills a long prompt chunk by chunk on one lease (allocate, fork the state, insert
with ``close=False``, extend), with a kv + Mamba stack whose state is checkpointed at every
insert. This measures the controller's own time (tiny buffers, no model: the engine writes
nothing), per page, for 128 / 512 / 2048 pages, chunks of 1 and 8 pages, without L3 and with a
file L3 (including the final flush), against one lookup + insert of the whole request measured in
the same run. Two ratios answer "is it linear?" and "what does chunking cost?":

* per-page cost at 2048 pages / per-page cost at 128 pages (linear: <= 1.3);
* chunked (8 pages) / one insert per request, at 2048 pages (goal: <= 3x).

    python benchmarks/engine.py [--quick] [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _results import Figure, write_results

import kvstrata

PAGE = 64
SIZES = (128, 512, 2048)


def stack(pages: int, l3: Path | None) -> dict:
    """kv + mamba with tiny buffers (the controller's cost, not the copies), room for every page
    and a state slot per page (chunks of one page checkpoint every page)."""
    storage = {"l3": {"type": "file", "path": str(l3)}} if l3 is not None else {}
    return {
        "model": {
            "name": "bench-engine",
            "page_size": PAGE,
            "pools": {
                "kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"},
                "mamba": {
                    "type": "mamba",
                    "layers": 1,
                    "states": {"conv": {"shape": [3, 8]}, "ssm": {"shape": [2, 4, 4], "dtype": "float32"}},
                    "device_units": pages + 8,
                    "host_units": pages + 8,
                },
            },
        },
        "tiers": {
            "device": {"capacity_tokens": (pages + 8) * PAGE},
            "host": {"capacity_tokens": (pages + 8) * PAGE},
            "storage": storage,
        },
    }


def chunked(cache: kvstrata.CacheController, request: torch.Tensor, chunk: int) -> None:
    lease = cache.lookup(request[: chunk * PAGE])
    cache.admit(lease)
    while True:
        cache.allocate(lease)
        cache.fork_state(lease)
        last = lease.pages * PAGE >= len(request)
        cache.insert(lease, close=last)
        if last:
            return
        lease.extend(request[lease.pages * PAGE : (lease.pages + chunk) * PAGE])


def one_shot(cache: kvstrata.CacheController, request: torch.Tensor, _chunk: int) -> None:
    lease = cache.lookup(request)
    cache.admit(lease)
    cache.allocate(lease)
    cache.insert(lease)


def measure(pages: int, chunk: int, with_l3: bool, seed: int) -> float:
    """Seconds for one request of ``pages`` pages in a fresh cache (flush included with L3)."""
    request = torch.randint(0, 50_000, (pages * PAGE,), generator=torch.Generator().manual_seed(seed))
    run = one_shot if chunk == 0 else chunked
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-engine-") as tmp:
        cache = kvstrata.open(stack(pages, Path(tmp) if with_l3 else None), environ={})
        try:
            start = time.perf_counter()
            run(cache, request, chunk)
            cache.flush()
            return time.perf_counter() - start
        finally:
            cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, without the 2048-page 1-page chunks")
    parser.add_argument("--rounds", type=int, default=3, help="fresh caches per case (median)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    cases = [(chunk, l3) for l3 in (False, True) for chunk in (0, 1, 8)]
    for chunk, l3 in cases:  # warm-up: imports, allocator and first-call costs stay out
        measure(16, chunk, l3, seed=99)
    per_page: dict[tuple[int, int, bool], float] = {}
    print(
        f"{'L3':>5} {'chunk':>10} " + " ".join(f"{p:>12}" for p in SIZES) + "   (us of controller per page)"
    )
    for chunk, l3 in cases:
        row = []
        for pages in SIZES:
            if args.quick and chunk == 1 and pages == SIZES[-1]:
                row.append(float("nan"))
                continue
            seconds = statistics.median(measure(pages, chunk, l3, seed) for seed in range(rounds))
            per_page[(pages, chunk, l3)] = seconds / pages
            row.append(seconds / pages * 1e6)
        label = "whole" if chunk == 0 else f"{chunk} page{'s' if chunk > 1 else ''}"
        print(f"{'file' if l3 else 'none':>5} {label:>10} " + " ".join(f"{v:12.1f}" for v in row))
    figures = []
    print()
    for l3 in (False, True):
        where = "file L3" if l3 else "no L3"
        for chunk in (1, 8):
            big = per_page.get((SIZES[-1], chunk, l3))
            if big is None:
                continue
            small = per_page[(SIZES[0], chunk, l3)]
            fig = Figure.against(
                f"per-page cost at {SIZES[-1]} pages, {chunk}-page chunks, {where}",
                big * 1e6,
                "us/page",
                small * 1e6,
                f"per-page cost at {SIZES[0]} pages",
            )
            figures.append(fig)
            print(f"linear? {fig.metric}: {fig.ratio:.2f}x the cost at {SIZES[0]} pages (goal <= 1.3)")
        whole = per_page[(SIZES[-1], 0, l3)]
        fig = Figure.against(
            f"chunked (8 pages) prefill of {SIZES[-1]} pages, {where}",
            per_page[(SIZES[-1], 8, l3)] * 1e6,
            "us/page",
            whole * 1e6,
            "one insert per request",
        )
        figures.append(fig)
        print(f"chunking cost: {fig.metric}: {fig.ratio:.2f}x one insert per request (goal <= 3)")
    if args.json:
        write_results(args.json, "engine", figures)


if __name__ == "__main__":
    main()
