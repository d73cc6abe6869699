"""Where a chunk of the engine loop goes: controller time per call of chunked prefill on one lease.

``benchmarks/engine.py`` says whether chunked prefill costs what one insert of the whole request
does; this says which call a chunk's fixed cost sits in. The same stack and loop (kv + Mamba,
tiny buffers, no model; ``allocate``, ``fork_state``, ``insert(close=False)``, ``extend`` per
chunk), each call timed on its own (thread CPU time of the calling thread), per round a fresh
cache for the chunked request and three more for one lookup + insert of the whole request each
(the round's baseline: their median), measured in the same run. Prints microseconds per call
(median, min-max over ``--rounds``) and the chunk's total against the whole insert's cost for the
same pages. Beside each call, the floor (``engine_floor.py``: the same steps on the same buffers
with no cache around them, measured in the same round), and what the floor's chunk would make of
the goal: how much of a chunk is the cache's bookkeeping, and how much no Python design avoids.

Ratios, printed and in ``--json``: the **ratio of the medians** (median chunk over median whole
insert, ``Figure.against``, as ``engine.py`` and every other script), with the per-round ratios'
min-max beside it (each round's chunk over the same round's whole insert) and, printed only, their
median -- the statistic this script printed as its headline until session 44, which the README's
older figures quote.

    python benchmarks/engine_calls.py [--pages N] [--chunk PAGES ...] [--l3] [--rounds N]
                                      [--insert-every N] [--quick] [--json OUT]

The goal's chunk is 8 pages (512 tokens); 32 pages (2048 tokens) is measured
beside it by default, so the tables show how the fixed cost per chunk fades with larger chunks.
``--insert-every N`` (default 1, the goal's loop) inserts only every N-th chunk: an engine that
leaves a state checkpoint (and a tree node) every N chunks instead of every chunk; ``insert``
then reads per chunk, amortised (the floor keeps inserting every chunk).
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
from engine import PAGE, stack
from engine_floor import floor_calls

import kvstrata

CALLS = ("allocate", "fork_state", "insert", "extend")


def chunked_calls(
    cache: kvstrata.CacheController, request: torch.Tensor, chunk: int, insert_every: int = 1
) -> dict[str, float]:
    """Seconds per call of each kind (thread CPU time), for one chunked request (``insert_every``:
    insert only every N-th chunk and the last; ``insert`` is then per chunk, amortised)."""
    clock = time.thread_time
    spent = dict.fromkeys(CALLS, 0.0)
    chunks = 0
    total = len(request)
    lease = cache.lookup(request[: chunk * PAGE])
    cache.admit(lease)
    while True:
        start = clock()
        cache.allocate(lease)
        allocated = clock()
        cache.fork_state(lease)
        forked = clock()
        last = lease.pages * PAGE >= total
        if last or (chunks + 1) % insert_every == 0:
            cache.insert(lease, close=last)
        inserted = clock()
        spent["allocate"] += allocated - start
        spent["fork_state"] += forked - allocated
        spent["insert"] += inserted - forked
        chunks += 1
        if last:
            break
        piece = request[lease.pages * PAGE : (lease.pages + chunk) * PAGE]  # the engine's slice
        start = clock()
        lease.extend(piece)
        spent["extend"] += clock() - start
    return {call: seconds / (chunks - (call == "extend")) for call, seconds in spent.items()}


def whole(cache: kvstrata.CacheController, request: torch.Tensor) -> float:
    """Thread CPU seconds of one lookup + insert of the whole request."""
    start = time.thread_time()
    lease = cache.lookup(request)
    cache.admit(lease)
    cache.allocate(lease)
    cache.insert(lease)
    return time.thread_time() - start


#: whole inserts per round, each on a fresh cache: the round's baseline is their median (one
#: insert of 2048 pages takes ~2.5 ms, where one scheduler hiccup moved a single sample by 2x)
WHOLE_SAMPLES = 3


def measure(
    pages: int, chunk: int, l3: bool, seed: int, insert_every: int = 1
) -> tuple[dict[str, float], float, dict[str, float]]:
    """(seconds per call of the chunked loop, seconds of one whole insert (median), seconds per
    call of the floor), for one request in fresh caches."""
    request = torch.randint(0, 50_000, (pages * PAGE,), generator=torch.Generator().manual_seed(seed))
    out: list = []
    runs = [lambda c: chunked_calls(c, request, chunk, insert_every)]
    runs += [lambda c: whole(c, request)] * WHOLE_SAMPLES
    for run in runs:
        with tempfile.TemporaryDirectory(prefix="kvstrata-bench-calls-") as tmp:
            cache = kvstrata.open(stack(pages, Path(tmp) if l3 else None), environ={})
            try:
                gc.collect()
                out.append(run(cache))
                cache.flush()
            finally:
                cache.close()
    gc.collect()
    floor = floor_calls(request, chunk, PAGE)
    return out[0], statistics.median(out[1:]), floor


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def report(pages: int, chunk: int, l3: bool, rounds: int, insert_every: int = 1) -> list[Figure]:
    """Measure one chunk size over ``rounds``, print its table and return its figures."""
    per_call: dict[str, list[float]] = {call: [] for call in CALLS}
    floor_call: dict[str, list[float]] = {call: [] for call in CALLS}
    chunk_us: list[float] = []
    floor_us: list[float] = []
    whole_us: list[float] = []
    for round_id in range(rounds):
        calls, seconds, floor = measure(pages, chunk, l3, round_id, insert_every)
        for call in CALLS:
            per_call[call].append(calls[call] * 1e6)
            floor_call[call].append(floor[call] * 1e6)
        chunk_us.append(sum(calls.values()) * 1e6)
        floor_us.append(sum(floor.values()) * 1e6)
        whole_us.append(seconds * 1e6 / pages * chunk)
    every = f", an insert every {insert_every} chunks (per chunk, amortised)" if insert_every > 1 else ""
    print(
        f"{pages} pages in {chunk}-page chunks ({chunk * PAGE} tokens){every}, "
        f"L3 {'file' if l3 else 'none'}: "
        f"controller thread CPU us per call, median (min-max) of {rounds} rounds; "
        "floor: the same steps with no cache (engine_floor.py"
        + (", and no L3: it hashes and writes nothing)" if l3 else ")")
    )
    print(f"{'':>12} {'cache':>7} {'':14} {'floor':>7}")
    for call in CALLS:
        print(f"{call:>12} {spread(per_call[call])}  {spread(floor_call[call])}")
    print(f"{'chunk':>12} {spread(chunk_us)}  {spread(floor_us)}")
    print(f"{'whole':>12} {spread(whole_us)}  (one insert of the whole request, per {chunk} pages)")
    whole = statistics.median(whole_us)
    label = "one insert of the whole request, per chunk's pages"
    what = f"{chunk}-page chunk of {pages} pages"
    what += f", insert every {insert_every}" if insert_every > 1 else ""
    figures = [
        Figure.against(f"{what}, controller CPU", statistics.median(chunk_us), "us", whole, label),
        Figure.against(
            f"{chunk}-page chunk of {pages} pages, floor (no cache)",
            statistics.median(floor_us),
            "us",
            whole,
            label,
        ),
    ]
    for figure, values, what_for in (
        (figures[0], chunk_us, "chunk / whole insert of the same pages"),
        (figures[1], floor_us, "floor chunk / whole insert of the same pages"),
    ):
        per_round = [v / w for v, w in zip(values, whole_us, strict=True)]
        print(
            f"{what_for}: {figure.ratio:.2f} (ratio of the medians, as --json writes it; per round "
            f"{min(per_round):.2f}-{max(per_round):.2f}, their median {statistics.median(per_round):.2f})"
            + (" (goal <= 3)" if figure is figures[0] else " (what no cache beats)")
        )
    above = [c / f for c, f in zip(chunk_us, floor_us, strict=True)]
    print(f"chunk / floor chunk, per round: {spread(above).strip()} (the cache's bookkeeping)\n")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, help="pages per request (default 2048, the goal's; --quick 512)")
    parser.add_argument(
        "--chunk", type=int, nargs="+", default=[8, 32],
        help="pages per chunk, one table each (default: 8, the goal's, and 32 = 2048 tokens)",
    )  # fmt: skip
    parser.add_argument("--l3", action="store_true", help="with a file L3 (its flush not timed)")
    parser.add_argument("--rounds", type=int, help="rounds per chunk size (default 5; --quick 3)")
    parser.add_argument(
        "--insert-every", type=int, default=1,
        help="insert every N-th chunk (default 1: every chunk, the goal's loop): a checkpoint per N chunks",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="CI-sized: 512 pages, 3 rounds")
    parser.add_argument("--json", type=Path, help="also write the figures (benchmarks/README.md convention)")
    args = parser.parse_args()
    pages = args.pages if args.pages is not None else 512 if args.quick else 2048
    rounds = args.rounds if args.rounds is not None else 3 if args.quick else 5
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    if args.insert_every < 1:
        parser.error(f"--insert-every must be at least 1, got {args.insert_every}")
    for chunk in args.chunk:
        if chunk < 1 or pages < 2 * chunk:
            parser.error(f"--pages ({pages}) must hold at least two chunks of --chunk {chunk}")
    if pages != 2048:
        print(f"{pages} pages, not the goal's 2048: a fresh cache's first insert pays a one-off cost")
        print("(copy views built on first use, first touch of pool memory: benchmarks/README.md, session")
        print("19), a larger share of a shorter whole insert, so the ratios read lower than at 2048\n")
    figures: list[Figure] = []
    for chunk in args.chunk:
        measure(2 * chunk, chunk, args.l3, 99)  # warm-up: imports, allocator, first calls
        figures += report(pages, chunk, args.l3, rounds, args.insert_every)
    if args.json:
        write_results(args.json, "engine_calls", figures)


if __name__ == "__main__":
    main()
