"""Controller cost of chunked prefill on one lease: linear in the pages, whatever the chunk size.

An engine prefills a long prompt chunk by chunk on one lease (allocate, fork the state, insert
with ``close=False``, extend), with a kv + Mamba stack whose state is checkpointed at every
insert. This measures the controller's own time (thread CPU time of the calling thread: tiny buffers, no
model, the engine writes nothing), per page, for 128 / 512 / 2048 pages, chunks of 1 and 8 pages,
without L3 and with a file L3 (the final flush not timed: the L3 writes drain on the storage
threads), against one lookup + insert of the whole request measured in the same run; every case
in a fresh cache, cases interleaved per round (order rotating), medians and min-max over
``--rounds``. Two ratios answer "is it linear?" and "what does chunking cost?":

* per-page cost at 2048 pages / per-page cost at 128 pages (linear: <= 1.3);
* chunked (8 pages) / one insert per request, at 2048 pages (goal: <= 3x).

Write-through backs up a lease kept open in batches (``policy.write_through_batch_pages``, default
64 pages); the same chunked case with a backup at every insert (``write_through_batch_pages: 1``,
the promise before batching) is measured beside it, without L3, and printed as its own ratio.

    python benchmarks/engine.py [--quick] [--rounds N] [--json OUT]

``--quick`` measures only the cases of the two ratios (2048 pages whole and in 8-page chunks,
1-page chunks with file L3 at 128 and 2048 pages).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _results import Figure, write_results

import kvstrata

PAGE = 64
SIZES = (128, 512, 2048)
#: (pages, chunk pages (0: the whole request), file L3, write_through_batch_pages (None: default))
Case = tuple[int, int, bool, int | None]
#: the 8-page chunks without L3 backed up at every insert: the write-through promise before batching
EVERY_INSERT: Case = (SIZES[-1], 8, False, 1)


def stack(pages: int, l3: Path | None, batch: int | None = None) -> dict:
    """kv + mamba with tiny buffers (the controller's cost, not the copies), room for every page
    and a state slot per page (chunks of one page checkpoint every page); ``batch``: the
    write-through batch of an open lease (None: the default)."""
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
        "policy": {} if batch is None else {"write_through_batch_pages": batch},
    }


def chunked(cache: kvstrata.CacheController, request: torch.Tensor, chunk: int) -> None:
    total = len(request)
    lease = cache.lookup(request[: chunk * PAGE])
    cache.admit(lease)
    while True:
        cache.allocate(lease)
        cache.fork_state(lease)
        last = lease.pages * PAGE >= total
        cache.insert(lease, close=last)
        if last:
            return
        lease.extend(request[lease.pages * PAGE : (lease.pages + chunk) * PAGE])


def one_shot(cache: kvstrata.CacheController, request: torch.Tensor, _chunk: int) -> None:
    lease = cache.lookup(request)
    cache.admit(lease)
    cache.allocate(lease)
    cache.insert(lease)


def measure(
    pages: int, chunk: int, with_l3: bool, seed: int, batch: int | None = None
) -> tuple[float, float]:
    """(controller thread CPU seconds, wall seconds) of one request of ``pages`` pages in a fresh
    cache, the loop only: the flush after it (L3 writes draining) is not timed."""
    request = torch.randint(0, 50_000, (pages * PAGE,), generator=torch.Generator().manual_seed(seed))
    run = one_shot if chunk == 0 else chunked
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-engine-") as tmp:
        cache = kvstrata.open(stack(pages, Path(tmp) if with_l3 else None, batch), environ={})
        try:
            gc.collect()
            wall, cpu = time.perf_counter(), time.thread_time()
            run(cache, request, chunk)
            seconds = time.thread_time() - cpu, time.perf_counter() - wall
            cache.flush()
            return seconds
        finally:
            cache.close()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the cases of the two ratios")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, cases interleaved (median, min-max)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # (pages, chunk, L3, write-through batch): chunk 0 is one lookup + insert of the whole request
    if args.quick:
        cases: list[Case] = [(SIZES[-1], chunk, l3, None) for l3 in (False, True) for chunk in (0, 8)]
        cases += [(pages, 1, True, None) for pages in (SIZES[0], SIZES[-1])]
    else:
        cases = [(pages, chunk, l3, None) for l3 in (False, True) for chunk in (0, 1, 8) for pages in SIZES]
    cases.append(EVERY_INSERT)
    for chunk, l3, batch in {case[1:] for case in cases}:  # warm-up: imports, allocator, first calls
        measure(16, chunk, l3, 99, batch)
    cpu: dict[Case, list[float]] = {case: [] for case in cases}
    wall: dict[Case, list[float]] = {case: [] for case in cases}
    for round_id in range(args.rounds):
        shift = round_id % len(cases)  # interleaved, the order rotating per round
        for case in cases[shift:] + cases[:shift]:
            pages, chunk, l3, batch = case
            thread_s, wall_s = measure(pages, chunk, l3, round_id, batch)
            cpu[case].append(thread_s / case[0] * 1e6)
            wall[case].append(wall_s / case[0] * 1e6)
    print(
        f"controller thread CPU per page, us: median (min-max) of {args.rounds} rounds "
        "(wall clock beside; flush not timed)"
    )
    print(f"{'L3':>5} {'chunk':>8} {'pages':>6} {'CPU us/page':>22} {'wall us/page':>22}")
    for case in cases:
        pages, chunk, l3, batch = case
        label = "whole" if chunk == 0 else f"{chunk}p" + ("" if batch is None else f" b{batch}")
        where = "file" if l3 else "none"
        print(f"{where:>5} {label:>8} {pages:>6} {spread(cpu[case]):>22} {spread(wall[case]):>22}")
    figures = []
    print()

    def ratio(metric: str, case: Case, base: Case, label: str, goal: float) -> None:
        if case not in cpu or base not in cpu:
            return
        value, baseline = statistics.median(cpu[case]), statistics.median(cpu[base])
        fig = Figure.against(metric, value, "us/page", baseline, label)
        figures.append(fig)
        per_round = [a / b for a, b in zip(cpu[case], cpu[base], strict=True)]
        verdict = "met" if fig.ratio is not None and fig.ratio <= goal else "NOT met"
        print(
            f"{metric}: {fig.ratio:.2f}x {label} (per round {min(per_round):.2f}-{max(per_round):.2f}); "
            f"goal <= {goal:g}: {verdict}"
        )

    big, small = SIZES[-1], SIZES[0]
    for l3 in (False, True):
        where = "file L3" if l3 else "no L3"
        ratio(
            f"chunked (8 pages) prefill of {big} pages, {where}",
            (big, 8, l3, None),
            (big, 0, l3, None),
            "one insert per request",
            3.0,
        )
        for chunk in (1, 8):
            ratio(
                f"per-page cost at {big} pages, {chunk}-page chunks, {where}",
                (big, chunk, l3, None),
                (small, chunk, l3, None),
                f"per-page cost at {small} pages",
                1.3,
            )
    ratio(
        f"beside: chunked (8 pages) prefill of {big} pages, no L3, a backup at every insert",
        EVERY_INSERT,
        (big, 0, False, None),
        "one insert per request",
        3.0,
    )
    if args.json:
        write_results(args.json, "engine", figures)


if __name__ == "__main__":
    main()
