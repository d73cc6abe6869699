"""Cost of the object checksum (xxh3_64 over the payload regions) vs a memcpy of the same bytes.

Prints GiB/s for each and the ratio (checksum / memcpy throughput: 1 would mean hashing a page
costs what copying it does), measured in this run, so the number is meaningful on whatever machine
runs it. Best of ``--repeat`` runs each.

    python benchmarks/checksum.py [--mib 64] [--region-kib 256] [--repeat 5] [--quick] [--json OUT]

``--quick`` (CI-sized, as ``run_all.py --quick`` passes it): 16 MiB, 3 repeats.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import Figure, write_results

from kvstrata.core.integrity import payload_checksum
from kvstrata.plugins.storage_backend import BufferRegion


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=None, help="payload size (default 64; --quick 16)")
    parser.add_argument("--region-kib", type=int, default=256, help="size of one region (a page object)")
    parser.add_argument(
        "--repeat", type=int, default=None, help="runs of each, best taken (default 5; --quick 3)"
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: 16 MiB, 3 repeats")
    parser.add_argument("--json", type=Path, help="also write the figures (benchmarks/README.md convention)")
    args = parser.parse_args()
    mib = args.mib if args.mib is not None else 16 if args.quick else 64
    repeat = args.repeat if args.repeat is not None else 3 if args.quick else 5
    if mib < 1 or repeat < 1 or args.region_kib < 1:
        parser.error("--mib, --repeat and --region-kib must be at least 1")
    nbytes = mib << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    step = args.region_kib << 10
    regions = [
        BufferRegion(source.data_ptr() + off, min(step, nbytes - off)) for off in range(0, nbytes, step)
    ]
    gib = nbytes / 2**30
    copy_s = best_seconds(lambda: target.copy_(source), repeat)
    hash_s = best_seconds(lambda: payload_checksum(regions), repeat)
    figure = Figure.against(
        f"xxh3_64 checksum of {mib} MiB in {len(regions)} regions of {args.region_kib} KiB",
        gib / hash_s,
        "GiB/s",
        gib / copy_s,
        "memcpy (torch copy_), same bytes",
    )
    print(f"payload {mib} MiB in {len(regions)} regions of {args.region_kib} KiB, best of {repeat}")
    print(f"memcpy (torch copy_) : {gib / copy_s:8.2f} GiB/s")
    print(f"xxh3_64 checksum     : {gib / hash_s:8.2f} GiB/s")
    print(f"checksum / memcpy throughput ratio: {figure.ratio:.2f}")
    if args.json:
        write_results(args.json, "checksum", [figure])


if __name__ == "__main__":
    main()
