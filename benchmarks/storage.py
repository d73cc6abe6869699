"""Storage-tier overhead: our backends' batch put/get next to the raw calls they wrap, in ONE run.

Workload: a batch of 64 pages of 256 KiB (16 MiB). Every round uses fresh keys (Mooncake does not
rewrite existing keys, so reusing keys would time a no-op). Raw and ours run in every round, in
alternating order, so drift on this shared VM hits both alike; 1 warm-up round, then the median
of ``--rounds``.

* Mooncake, in-process (``setup``: this process owns the only segment, the memcpy path):
  raw ``batch_put_from`` / ``batch_get_into`` of the pages vs ``MooncakeBackend.put/get`` of the
  same pages as objects (integrity-header region + page region, as the core sends them), on the
  same client. Goal: ours >= 0.9 x raw.
* Mooncake, standalone (``setup_dummy`` to a ``mooncake_client``; buffers from the backend's
  allocator), same comparison (``--no-standalone`` skips it).
* File: raw ``open``/``os.write``/``close`` and ``open``/``readinto``/``close`` of one file per page
  vs ``FileBackend.put/get`` (atomic temp + rename, header + page). Goal: ours >= 0.8 x raw.

Run: ``PYTHONPATH=src python benchmarks/storage.py`` (about 20-40 s; starts and stops its own
mooncake_master / mooncake_client on free loopback ports).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _results import Figure, write_results

from kvstrata.core.buffers import region_tensor
from kvstrata.core.integrity import HEADER_BYTES
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject
from kvstrata.storage_backends.mooncake import MooncakeBackend
from kvstrata.testing.mooncake_servers import MooncakeMaster, MooncakeStandaloneClient

GIB = float(1 << 30)


@dataclass
class Row:
    section: str
    op: str
    ours_s: float
    raw_s: float
    goal: float
    payload_bytes: int
    raw_same_shape_s: float | None = None

    def cells(self) -> list[str]:
        ours = self.payload_bytes / self.ours_s / GIB
        raw = self.payload_bytes / self.raw_s / GIB
        ratio = ours / raw
        verdict = "ok" if ratio >= self.goal else "below goal"
        return [
            self.section,
            self.op,
            f"{ours:.2f}",
            f"{raw:.2f}",
            f"{ratio:.2f}",
            f">= {self.goal:.1f} ({verdict})",
            f"{self.ours_s * 1e3:.2f} / {self.raw_s * 1e3:.2f}",
            "-" if self.raw_same_shape_s is None else f"{self.raw_same_shape_s / self.ours_s:.2f}",
        ]


def region_of(tensor: torch.Tensor) -> BufferRegion:
    return BufferRegion(tensor.data_ptr(), tensor.numel())


class PageSet:
    """Source/target pages plus per-object headers in ordinary memory, as the core provides them."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self.source, self.target = source, target
        self.pages, self.page_bytes = source.shape
        self.headers = torch.randint(0, 256, (self.pages, HEADER_BYTES), dtype=torch.uint8)
        self.headers_out = torch.zeros_like(self.headers)

    def objects(self, keys: list[str], into: bool) -> list[StorageObject]:
        """Objects as the core builds them: pointers by arithmetic on the pool base, no indexing."""
        page_base = (self.target if into else self.source).data_ptr()
        header_base = (self.headers_out if into else self.headers).data_ptr()
        size = self.page_bytes
        return [
            StorageObject(
                key,
                (
                    BufferRegion(header_base + i * HEADER_BYTES, HEADER_BYTES),
                    BufferRegion(page_base + i * size, size),
                ),
            )
            for i, key in enumerate(keys)
        ]

    def page_ptrs(self, into: bool) -> list[int]:
        base = (self.target if into else self.source).data_ptr()
        return [base + i * self.page_bytes for i in range(self.pages)]

    def multi_buffers(self, into: bool) -> list[list[int]]:
        """Per page, the (header, page) pointers of the raw multi-buffer calls."""
        page_base = (self.target if into else self.source).data_ptr()
        header_base = (self.headers_out if into else self.headers).data_ptr()
        size = self.page_bytes
        return [[header_base + i * HEADER_BYTES, page_base + i * size] for i in range(self.pages)]

    def verify(self) -> None:
        if not torch.equal(self.source, self.target):
            raise SystemExit("benchmark read back different bytes: refusing to report figures")


def fresh_keys(tag: str, count: int) -> list[str]:
    round_id = uuid.uuid4().hex[:12]
    return [f"bench/{tag}/{round_id}/{i}" for i in range(count)]


def backend_round(section: str, backend: StorageBackend, pages: PageSet) -> tuple[float, float]:
    """Our path: ``backend.put`` then ``backend.get`` of fresh keys (header + page objects, as the
    core sends them); returns (put seconds, get seconds) after checking the bytes came back."""
    keys = fresh_keys("ours", pages.pages)
    started = time.perf_counter()
    stored = backend.put(pages.objects(keys, into=False))
    put_s = time.perf_counter() - started
    pages.target.zero_()
    started = time.perf_counter()
    got = backend.get(pages.objects(keys, into=True))
    get_s = time.perf_counter() - started
    if not all(stored) or any(g != pages.page_bytes + HEADER_BYTES for g in got):
        detail = getattr(backend, "code_counts", "")
        raise SystemExit(f"{section}: backend put/get failed: {stored} {got} {detail}")
    pages.verify()
    return put_s, get_s


def prefault_segment(store: Any, pages: PageSet, segment_bytes: int) -> None:
    """Touch the whole segment once (fill, then remove everything): a long-running cache writes
    into memory it has used before, so first-touch page faults would misstate steady state."""
    count, size = pages.pages, pages.page_bytes
    for _ in range(segment_bytes // (count * size) + 1):
        codes = store.batch_put_from(
            fresh_keys("prefault", count), pages.page_ptrs(into=False), [size] * count
        )
        if any(code != 0 for code in codes):
            break
    store.remove_all()


def bench_mooncake(
    section: str, backend: MooncakeBackend, pages: PageSet, rounds: int, segment_bytes: int, prefault: bool
) -> list[Row]:
    store = backend.native_store
    count, size = pages.pages, pages.page_bytes
    payload = count * size
    times: dict[str, list[float]] = {
        name: [] for name in ("raw_put", "raw_get", "our_put", "our_get", "raw2_put", "raw2_get")
    }
    if prefault:
        prefault_segment(store, pages, segment_bytes)

    def raw_round() -> tuple[float, float]:
        keys = fresh_keys("raw", count)
        started = time.perf_counter()
        codes = store.batch_put_from(keys, pages.page_ptrs(into=False), [size] * count)
        put_s = time.perf_counter() - started
        pages.target.zero_()
        started = time.perf_counter()
        read = store.batch_get_into(keys, pages.page_ptrs(into=True), [size] * count)
        get_s = time.perf_counter() - started
        if any(c != 0 for c in codes) or any(r != size for r in read):
            raise SystemExit(f"{section}: raw Mooncake put/get failed: {set(codes)} {set(read)}")
        pages.verify()
        return put_s, get_s

    def raw_same_shape_round() -> tuple[float, float]:
        """Raw Mooncake with the very regions our objects have (header + page): what the
        multi-region call itself costs, so the overhead of our Python layer shows separately."""
        keys = fresh_keys("raw2", count)
        started = time.perf_counter()
        codes = store.batch_put_from_multi_buffers(
            keys, pages.multi_buffers(into=False), [[HEADER_BYTES, size]] * count
        )
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        read = store.batch_get_into_multi_buffers(
            keys, pages.multi_buffers(into=True), [[HEADER_BYTES, size]] * count
        )
        get_s = time.perf_counter() - started
        if any(c != 0 for c in codes) or any(r != size + HEADER_BYTES for r in read):
            raise SystemExit(f"{section}: raw multi-buffer put/get failed: {set(codes)} {set(read)}")
        return put_s, get_s

    def our_round() -> tuple[float, float]:
        return backend_round(section, backend, pages)

    def one_round(record: bool, ours_first: bool) -> None:
        order = (our_round, raw_round) if ours_first else (raw_round, our_round)
        if not backend.config.standalone:  # standalone: raw calls cannot read ordinary-memory headers
            order = (*order, raw_same_shape_round)
        measured = {fn: fn() for fn in order}
        if record:
            times["our_put"].append(measured[our_round][0])
            times["our_get"].append(measured[our_round][1])
            times["raw_put"].append(measured[raw_round][0])
            times["raw_get"].append(measured[raw_round][1])
            if raw_same_shape_round in measured:
                times["raw2_put"].append(measured[raw_same_shape_round][0])
                times["raw2_get"].append(measured[raw_same_shape_round][1])

    one_round(record=False, ours_first=False)
    for index in range(rounds):
        one_round(record=True, ours_first=index % 2 == 1)
    med = {name: statistics.median(values) if values else None for name, values in times.items()}
    return [
        Row(section, "put", med["our_put"], med["raw_put"], 0.9, payload, med["raw2_put"]),
        Row(section, "get", med["our_get"], med["raw_get"], 0.9, payload, med["raw2_get"]),
    ]


def bench_file(pages: PageSet, rounds: int, root: Path) -> list[Row]:
    from kvstrata.storage_backends.file import FileBackend

    count = pages.pages
    payload = count * pages.page_bytes
    backend = FileBackend("bench", FileBackend.Config(path=root / "ours"))
    backend.open()
    raw_dir = root / "raw"
    raw_dir.mkdir()
    src_views = [memoryview(pages.source[i].numpy()) for i in range(count)]
    dst_views = [memoryview(pages.target[i].numpy()) for i in range(count)]
    times: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "our_put": [], "our_get": []}

    def raw_round() -> tuple[float, float]:
        tag = uuid.uuid4().hex[:12]
        paths = [raw_dir / f"{tag}-{i}" for i in range(count)]
        started = time.perf_counter()
        for path, view in zip(paths, src_views, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, view)
            finally:
                os.close(fd)
        put_s = time.perf_counter() - started
        pages.target.zero_()
        started = time.perf_counter()
        for path, view in zip(paths, dst_views, strict=True):
            with open(path, "rb", buffering=0) as handle:
                handle.readinto(view)
        get_s = time.perf_counter() - started
        pages.verify()
        return put_s, get_s

    def one_round(record: bool, ours_first: bool) -> None:
        # Alternate the order: dirty pages of the first writer's batch slow the second's down.
        if ours_first:
            ours, raw = backend_round("file", backend, pages), raw_round()
        else:
            raw, ours = raw_round(), backend_round("file", backend, pages)
        if record:
            for name, value in zip(times, (*raw, *ours), strict=True):
                times[name].append(value)

    try:
        one_round(record=False, ours_first=False)
        for index in range(rounds):
            one_round(record=True, ours_first=index % 2 == 1)
    finally:
        backend.close()
    med = {name: statistics.median(values) for name, values in times.items()}
    return [
        Row("file (page cache)", "put", med["our_put"], med["raw_put"], 0.8, payload),
        Row("file (page cache)", "get", med["our_get"], med["raw_get"], 0.8, payload),
    ]


def mooncake_rows(args: argparse.Namespace, tmp: Path, segment: int, batch_bytes: int) -> list[Row]:
    """The in-process and standalone Mooncake sections, against their own master (and client)."""
    page_bytes = args.page_kib << 10
    rows: list[Row] = []
    with MooncakeMaster(log_dir=tmp) as master:
        backend = MooncakeBackend(
            "bench",
            master.backend_config(segment_bytes=segment, local_buffer_bytes=0),
        )
        backend.open()
        try:
            source = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8)
            target = torch.zeros_like(source)
            backend.register_host_memory(region_of(source))
            backend.register_host_memory(region_of(target))
            pages = PageSet(source, target)
            rows += bench_mooncake(
                "mooncake in-process", backend, pages, args.rounds, segment, not args.no_prefault
            )
        finally:
            backend.close()

        if not args.no_standalone:
            with MooncakeStandaloneClient(master, segment_bytes=segment, log_dir=tmp) as client:
                backend = MooncakeBackend(
                    "bench-standalone",
                    client.backend_config(local_buffer_bytes=1 << 20),
                )
                backend.open()
                try:
                    shape = (args.pages, page_bytes)
                    source = region_tensor(backend.allocate_host_memory(batch_bytes)).view(shape)
                    target = region_tensor(backend.allocate_host_memory(batch_bytes)).view(shape)
                    source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8))
                    rows += bench_mooncake(
                        "mooncake standalone",
                        backend,
                        PageSet(source, target),
                        args.rounds,
                        segment,
                        not args.no_prefault,
                    )
                finally:
                    backend.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-standalone", action="store_true")
    parser.add_argument("--no-mooncake", action="store_true", help="file section only")
    parser.add_argument("--no-prefault", action="store_true", help="time first-touch segment memory")
    parser.add_argument("--quick", action="store_true", help="5 rounds (CI-sized)")
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 5
    page_bytes = args.page_kib << 10
    batch_bytes = args.pages * page_bytes
    # Fresh keys every round: the segment holds every round of both paths without eviction.
    segment = max(256 << 20, 4 * (args.rounds + 1) * batch_bytes)
    rows: list[Row] = []
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-") as tmp:
        if not args.no_mooncake:
            rows += mooncake_rows(args, Path(tmp), segment, batch_bytes)
        file_pages = PageSet(
            torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8),
            torch.zeros((args.pages, page_bytes), dtype=torch.uint8),
        )
        rows += bench_file(file_pages, args.rounds, Path(tmp))

    print(
        f"\n{args.pages} x {args.page_kib} KiB pages per batch ({batch_bytes / (1 << 20):.0f} MiB), "
        f"1 warm-up + median of {args.rounds} rounds, fresh keys each round; "
        f"GiB/s = payload bytes / batch time\n"
    )
    header = [
        "path",
        "op",
        "ours GiB/s",
        "raw GiB/s",
        "ratio",
        "goal",
        "ms ours / raw",
        "ratio vs raw header+page call",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    print(f"\n(total run {time.perf_counter() - started:.1f} s)")
    if args.json:
        figures = [
            Figure.against(
                f"{row.section} {row.op} ({args.pages} x {args.page_kib} KiB)",
                row.payload_bytes / row.ours_s / GIB,
                "GiB/s",
                row.payload_bytes / row.raw_s / GIB,
                f"raw {row.section.split()[0]} calls",
            )
            for row in rows
        ]
        write_results(args.json, "storage", figures)


if __name__ == "__main__":
    main()
