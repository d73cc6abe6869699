"""Device <-> host page transfer throughput of a kv pool, against a plain tensor copy.

For 64-token pages of a realistic MHA pool it times ``copy_units`` (gather/scatter by index lists)
for each host layout and index pattern, and, in the same run, a plain contiguous ``copy_`` of the
same number of bytes between the same devices. Prints GiB/s and the ratio (goal >= 0.8). Each
pattern's copies are checked once, outside the timing, to land the bytes they were given.

    python benchmarks/pools.py                 # cpu "device"
    python benchmarks/pools.py --device cuda   # pinned host memory, side stream
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _results import Figure, write_results

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.object_views import read_objects
from kvstrata.core.transfer import copy_units
from kvstrata.plugins.pool_type import Layout, ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_pair(
    baseline: Callable[[], object], candidate: Callable[[], object], device: torch.device, repeats: int
) -> tuple[float, float, list[float]]:
    """Median seconds of both functions, sampled alternately so machine noise hits both alike, and
    the ratio (baseline / candidate time) of each round, for its spread."""
    samples: tuple[list[float], list[float]] = ([], [])
    for fn in (baseline, candidate):  # warm-up (first touch, pinned-staging caches)
        fn()
    sync(device)
    for _ in range(repeats):
        for fn, out in zip((baseline, candidate), samples, strict=True):
            start = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - start)
    rounds = [base / ours for base, ours in zip(*samples, strict=True)]
    return statistics.median(samples[0]), statistics.median(samples[1]), rounds


def check_round_trip(
    device_pool: PoolBuffers, dev: torch.Tensor, host_pool: PoolBuffers, host: torch.Tensor
) -> None:
    """Outside the timing: each direction lands the very bytes of the units it was given (fresh
    bytes on the source side first), so a fast but wrong copy cannot report a figure."""
    directions = ((device_pool, dev, host_pool, host), (host_pool, host, device_pool, dev))
    for src, src_idx, dst, dst_idx in directions:
        assert src.backing is not None and dst.backing is not None
        src.backing.random_(0, 256)
        dst.backing.zero_()
        copy_units(src, src_idx, dst, dst_idx).wait()
        sync(src.device if src.device.type == "cuda" else dst.device)
        want, got = read_objects(src, "kv", src_idx).cpu(), read_objects(dst, "kv", dst_idx).cpu()
        if not torch.equal(want, got):
            raise SystemExit(f"{host_pool.layout.value}: copy_units moved wrong bytes; refusing to report")


def plain_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Callable[[], object]:
    """Contiguous copy of the same bytes, as 8-byte words (the pool copies' currency)."""
    dst_words, src_words = dst.view(torch.int64), src.view(torch.int64)
    return lambda: dst_words.copy_(src_words, non_blocking=non_blocking)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="torch device of the L1 pool (cpu, cuda, cuda:1)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pages", type=int, default=64, help="pages per tier")
    parser.add_argument("--batch", type=int, default=32, help="pages per transfer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both sides alike)")
    parser.add_argument("--quick", action="store_true", help="3 repeats (CI-sized)")
    parser.add_argument("--json", help="write results in the benchmarks/README.md format")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    figures: list[Figure] = []
    torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    page = 64
    config = KVConfig(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")
    spec = KVPoolType("kv", config, ModelContext(page_size=page, anchor="kv")).spec()
    pin = device.type == "cuda"
    device_pool = PoolBuffers(spec, args.pages, device=device, layout=Layout.LAYER_FIRST)
    device_pool.backing.random_(0, 256)
    nbytes = args.batch * spec.bytes_per_unit

    # baseline: one contiguous copy of the same bytes between the same two places
    plain_device = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    plain_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    d2h_plain = plain_copy(plain_host, plain_device, pin)
    h2d_plain = plain_copy(plain_device, plain_host, pin)

    generator = torch.Generator().manual_seed(0)
    scattered_device = torch.randperm(args.pages, generator=generator)[: args.batch]
    patterns = {
        "scattered->run": (scattered_device, torch.arange(args.batch)),
        "scattered->scattered": (
            scattered_device,
            torch.randperm(args.pages, generator=generator)[: args.batch],
        ),
    }
    gib = 2**30
    print(
        f"kv pool: {args.layers} layers x {args.kv_heads} heads x {args.head_dim} dim bf16, "
        f"page {page} tokens = {spec.bytes_per_unit / 2**20:.2f} MiB/page; {args.batch} pages = "
        f"{nbytes / 2**20:.0f} MiB per transfer; device {device}; {args.repeats} interleaved samples"
    )
    header = (
        f"{'host layout':<18} {'indices dev->host':<21} {'D->H':>6} {'plain':>6} {'ratio':>5} {'min-max':<9} "
        f"{'H->D':>6} {'plain':>6} {'ratio':>5} {'min-max':<9}  (GiB/s)"
    )
    print(header)
    print("-" * len(header))
    for layout in spec.layouts:
        host_pool = PoolBuffers(spec, args.pages, device="cpu", layout=layout, pin_memory=pin)
        for label, (dev_idx, host_idx) in patterns.items():
            dev_idx_dev = dev_idx.to(device)

            def d2h(
                host_pool: PoolBuffers = host_pool, dev: torch.Tensor = dev_idx_dev, host=host_idx
            ) -> None:
                copy_units(device_pool, dev, host_pool, host).wait()

            def h2d(
                host_pool: PoolBuffers = host_pool, dev: torch.Tensor = dev_idx_dev, host=host_idx
            ) -> None:
                copy_units(host_pool, host, device_pool, dev).wait()

            check_round_trip(device_pool, dev_idx_dev, host_pool, host_idx)
            base_out, pool_out, rounds_out = timed_pair(d2h_plain, d2h, device, args.repeats)
            base_in, pool_in, rounds_in = timed_pair(h2d_plain, h2d, device, args.repeats)
            cells = [
                f"{nbytes / pool_out / gib:>6.2f}",
                f"{nbytes / base_out / gib:>6.2f}",
                f"{base_out / pool_out:>5.2f}",
                f"{min(rounds_out):>4.2f}-{max(rounds_out):<4.2f}",
                f"{nbytes / pool_in / gib:>6.2f}",
                f"{nbytes / base_in / gib:>6.2f}",
                f"{base_in / pool_in:>5.2f}",
                f"{min(rounds_in):>4.2f}-{max(rounds_in):<4.2f}",
            ]
            print(f"{layout.value:<18} {label:<21} " + " ".join(cells))
            for direction, ours, plain in (("D->H", pool_out, base_out), ("H->D", pool_in, base_in)):
                figures.append(
                    Figure.against(
                        f"{direction} {layout.value} {label}",
                        nbytes / ours / gib,
                        "GiB/s",
                        nbytes / plain / gib,
                        "plain contiguous copy",
                    )
                )
    print("ratio = plain-copy time / gather-scatter time for the same bytes, of the medians (goal >= 0.8);")
    print("min-max = the same ratio per round (each round times both back to back)")
    if args.json:
        write_results(args.json, "pools", figures)


if __name__ == "__main__":
    main()
