"""Cost of the object checksum (xxh3_64 over the payload regions) vs a memcpy of the same bytes.

Run: ``python benchmarks/checksum.py [--mib 64] [--repeat 5]``. Prints GiB/s for each and the
ratio, measured in this run, so the number is meaningful on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvstrata.core.integrity import payload_checksum
from kvstrata.plugins.storage_backend import BufferRegion


def best_seconds(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="payload size")
    parser.add_argument("--region-kib", type=int, default=256, help="size of one region (a page object)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    step = args.region_kib << 10
    regions = [
        BufferRegion(source.data_ptr() + off, min(step, nbytes - off)) for off in range(0, nbytes, step)
    ]
    gib = nbytes / 2**30
    copy_s = best_seconds(lambda: target.copy_(source), args.repeat)
    hash_s = best_seconds(lambda: payload_checksum(regions), args.repeat)
    print(f"payload {args.mib} MiB in {len(regions)} regions of {args.region_kib} KiB")
    print(f"memcpy (torch copy_) : {gib / copy_s:8.2f} GiB/s")
    print(f"xxh3_64 checksum     : {gib / hash_s:8.2f} GiB/s")
    print(f"checksum / memcpy throughput ratio: {copy_s / hash_s:.2f}")


if __name__ == "__main__":
    main()
