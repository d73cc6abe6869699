"""L3 storage path: kvstrata vs SGLang 0.5.23's ``HiCacheFile``, same pages, each side in its own process.

Both sides hold the same 256 KiB pages (``--page-kib``) in host memory and move a batch of
``--pages`` pages per call (128: SGLang's ``STORAGE_BATCH_SIZE``) through a directory of their own:

* **kvstrata**: the ``file`` backend through :class:`~kvstrata.core.storage_engine.StorageEngine`,
  integrity header with an **xxh3 checksum written on put and verified on get** (the default
  policy), zero-copy regions straight from the host buffer: ``engine.put`` / ``engine.get`` /
  ``engine.exists``.
* **HiCacheFile**: SGLang's real class (loaded on CPU by ``kvstrata.testing.sglang_cpu``), default
  configuration, driven with its batch calls: ``batch_set(keys, page tensors)`` /
  ``batch_get(keys, target tensors)`` / ``batch_exists(keys)`` (no checksum: it stores raw bytes).

Each side runs in a worker subprocess of its own (its own interpreter, GIL and allocator); this
process only sends commands and collects the times the workers measured. Every round writes fresh
keys, reads them back (page cache warm for both; the bytes are compared after every read, outside
the timing) and then queries existence of the keys just written ``--exists-repeats`` times (the
median is that round's figure: one query is ~100 us, a scheduler hiccup would decide it). The
order of the two sides alternates per operation and round; 1 warm-up round, then medians and
min-max over ``--rounds``. Ratios are kvstrata / HiCacheFile of the medians: GiB/s for put and get
(bigger is better), microseconds per key for exists (smaller is better).

Goals (issue 30; issue 16 had asked get >= 1.5x): get with xxh3 verified >= 1.0x, put >= 2x, exists
<= 1.0x of HiCacheFile's time per key. The exists-cached row compares the same kvstrata query with
HiCacheFile's strongest existence path, its optional in-memory metadata cache
(``enable_metadata_cache``, off by default; a second instance over the same directory whose cache
saw the keys on the first query of each round).

    PYTHONPATH=src python benchmarks/peers/storage.py [--quick] [--rounds N] [--json OUT]

``--peer-python PATH`` runs the HiCacheFile worker with another interpreter (a peer environment
made by ``benchmarks/peers/setup.sh``); the default is this interpreter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared results helpers

from _results import Figure, write_results  # noqa: E402

GIB = float(1 << 30)
SIDES = ("kvstrata", "HiCacheFile")
#: Floors measured in the same run (put and get only): kvstrata with ``checksum: none`` (what the
#: integrity costs), and a bare loop of ``os`` calls over files of their own (what this machine's
#: page cache allows: no header, no index, no temp file, no rename), on one thread and split over two
#: (what two I/O threads can reach here: the copies out of the page cache share memory bandwidth),
#: and that two-thread loop hashing each page with xxh3 (before its write; after its read, checked
#: against the digest of its write): what verification costs a reader with no engine around it.
FLOORS = ("kvstrata-nosum", "raw", "raw-2threads", "raw-2threads-xxh3")
FLOOR_OPS = ("put", "get")
#: (operation, unit, goal as "kvstrata / HiCacheFile" bound, True when the bound is a minimum)
WORKLOADS = (
    ("put", "GiB/s", 2.0, True),
    ("get", "GiB/s", 1.0, True),
    ("exists", "us/key", 1.0, False),
    ("exists-cached", "us/key", 1.0, False),
)


def page_keys(side: str, round_id: int, count: int) -> list[str]:
    """Fresh keys per round, shaped as each side's caller makes them (hex page hashes)."""
    if side != "HiCacheFile":  # BLAKE2b-128 page hashes, as kvstrata.core.keys.hash_pages gives them
        return [hashlib.blake2b(f"{round_id}-{i}".encode(), digest_size=16).hexdigest() for i in range(count)]
    return [hashlib.sha256(f"{round_id}-{i}".encode()).hexdigest() for i in range(count)]  # SGLang's


# --- the workers (run in their own process) ------------------------------------------------------


class KvstrataWorker:
    """kvstrata's file backend through the storage engine, xxh3 checksums on (``checksum``)."""

    def __init__(
        self,
        directory: Path,
        pages: int,
        page_bytes: int,
        capacity: int,
        io_threads: int,
        checksum: str = "xxh3",
    ) -> None:
        import torch

        from kvstrata.core.config import ParallelConfig
        from kvstrata.core.io_plan import plan_backend
        from kvstrata.core.storage_engine import StorageEngine
        from kvstrata.plugins.pool_type import (
            BufferSpec,
            Granularity,
            HitRule,
            HitRuleKind,
            ObjectSpec,
            PartialHit,
            PoolRole,
            PoolSpec,
            Replication,
        )
        from kvstrata.plugins.storage_backend import BufferRegion
        from kvstrata.storage_backends.file import FileBackend, FileConfig

        tokens = 64
        spec = PoolSpec(  # one bf16 buffer, one layer, page_bytes per page: one region per page
            name="kv",
            pool_type="kv",
            role=PoolRole.ANCHOR,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.SHARDED,
            page_size=tokens,
            buffers=(
                BufferSpec(
                    name="kv", dtype="bfloat16", layers=1, unit_shape=(tokens, page_bytes // tokens // 2)
                ),
            ),
            objects=(ObjectSpec(suffix="kv", buffers=("kv",)),),
        )
        config = FileConfig(path=directory, capacity_bytes=capacity or None)
        if io_threads:
            config = config.model_copy(update={"io_threads": io_threads})
        self.backend = FileBackend("l3", config)
        self.backend.open()
        parallel = ParallelConfig()
        plans = plan_backend("l3", self.backend.instance_capabilities(), [spec], parallel=parallel)
        self.engine = StorageEngine(
            self.backend,
            {"kv": spec},
            plans,
            model_name="bench-model",
            parallel=parallel,
            checksum=checksum,  # type: ignore[arg-type]
        )
        self.source = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
        self.target = torch.zeros_like(self.source)
        for tensor in (self.source, self.target):
            self.backend.register_host_memory(BufferRegion(tensor.data_ptr(), tensor.numel()))

        def units(tensor: Any) -> list[list[list[BufferRegion]]]:
            base = tensor.data_ptr()
            return [[[BufferRegion(base + i * page_bytes, page_bytes)]] for i in range(pages)]

        self.source_units, self.target_units = units(self.source), units(self.target)

    def put(self, keys: list[str]) -> bool:
        return all(self.engine.put("kv", keys, self.source_units).ok)

    def get(self, keys: list[str]) -> int:
        return self.engine.get("kv", keys, self.target_units).ok.count(True)

    def exists(self, keys: list[str]) -> int:
        return self.engine.exists("kv", keys).prefix

    def exists_cached(self, keys: list[str]) -> int:
        return self.exists(keys)  # kvstrata's index is always on

    def close(self) -> None:
        self.backend.close()


class RawWorker:
    """The floor: per page ``os.open`` / ``os.write`` / ``os.close`` of a file of its own, and
    ``os.open`` / ``os.readv`` / ``os.close`` back; the oldest batches beyond the capacity are
    unlinked inside the put, as the other sides' evictions run inside theirs. ``threads`` > 1
    splits the pages into that many equal shares, one per thread (the calling thread works the
    first): what this machine allows two I/O threads, as kvstrata's file backend runs on two cores.
    ``checksum``: each page is also hashed with xxh3 in the thread that moves it, before its write
    and right after its read (a get counts only pages whose digest matches their put's)."""

    def __init__(
        self,
        directory: Path,
        pages: int,
        page_bytes: int,
        capacity: int,
        _io_threads: int,
        threads: int = 1,
        checksum: bool = False,
    ) -> None:
        import torch
        import xxhash

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = str(directory)
        self.page_bytes = page_bytes
        self.keep = max(1, capacity // (pages * page_bytes)) if capacity else 0
        self.batches: list[list[str]] = []
        self.source = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
        self.target = torch.zeros_like(self.source)
        self.source_views = [memoryview(self.source[i].numpy()) for i in range(pages)]
        self.target_views = [memoryview(self.target[i].numpy()) for i in range(pages)]
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
        #: per file path, the xxh3 digest of what its put wrote (``checksum``): a get checks each
        #: page read against it, as a verifying reader must
        self.digests: dict[str, int] | None = {} if checksum else None
        self.hash = xxhash.xxh3_64_intdigest

    def _split(self, fn: Callable[[int, int], int], count: int) -> int:
        """``fn(start, stop)`` over ``threads`` equal shares of ``range(count)``, summed."""
        if self.pool is None:
            return fn(0, count)
        bounds = [count * i // self.threads for i in range(self.threads + 1)]
        futures = [self.pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, self.threads)]
        return fn(bounds[0], bounds[1]) + sum(future.result() for future in futures)

    def put(self, keys: list[str]) -> bool:
        paths = [f"{self.directory}/{key}" for key in keys]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

        digests, digest = self.digests, self.hash

        def write(start: int, stop: int) -> int:
            for path, view in zip(paths[start:stop], self.source_views[start:stop], strict=True):
                if digests is not None:
                    digests[path] = digest(view)
                fd = os.open(path, flags, 0o644)
                try:
                    os.write(fd, view)
                finally:
                    os.close(fd)
            return stop - start

        self._split(write, len(paths))
        self.batches.append(paths)
        while self.keep and len(self.batches) > self.keep:
            for path in self.batches.pop(0):
                os.unlink(path)
                if digests is not None:
                    del digests[path]
        return True

    def get(self, keys: list[str]) -> int:
        digests, digest = self.digests, self.hash

        def read(start: int, stop: int) -> int:
            got = 0
            for key, view in zip(keys[start:stop], self.target_views[start:stop], strict=True):
                path = f"{self.directory}/{key}"
                fd = os.open(path, os.O_RDONLY)
                try:
                    whole = os.readv(fd, [view]) == self.page_bytes
                finally:
                    os.close(fd)
                if digests is not None:  # hashed right after its read, still in this core's cache
                    whole = whole and digest(view) == digests.get(path)
                got += whole
            return got

        return self._split(read, len(keys))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class HiCacheFileWorker:
    """SGLang's ``HiCacheFile``, default configuration, driven with its batch calls."""

    def __init__(self, directory: Path, pages: int, page_bytes: int, capacity: int, io_threads: int) -> None:
        import torch

        from kvstrata.testing.sglang_cpu import load_sglang_mem_cache, storage_config

        module = load_sglang_mem_cache()
        extra: dict[str, Any] = {"file_storage_path": str(directory)}
        if capacity:
            extra["max_size"] = capacity  # its LRU evictor, default eviction_ratio
        self.storage = module.HiCacheFile(storage_config(extra_config=extra))
        # Its strongest existence path: the optional in-memory metadata cache (off by default),
        # as a second instance over the same directory, used for the exists-cached workload only.
        cached = {**extra, "enable_metadata_cache": True}
        self.cached = module.HiCacheFile(storage_config(extra_config=cached))
        self.source = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
        self.target = torch.zeros_like(self.source)
        # bf16 page views, as SGLang's page_first host pool hands out pages
        self.source_pages = [self.source[i].view(torch.bfloat16) for i in range(pages)]
        self.target_pages = [self.target[i].view(torch.bfloat16) for i in range(pages)]

    def put(self, keys: list[str]) -> bool:
        return bool(self.storage.batch_set(keys, self.source_pages))

    def get(self, keys: list[str]) -> int:
        return sum(page is not None for page in self.storage.batch_get(keys, self.target_pages))

    def exists(self, keys: list[str]) -> int:
        return int(self.storage.batch_exists(keys))

    def exists_cached(self, keys: list[str]) -> int:
        return int(self.cached.batch_exists(keys))

    def close(self) -> None:
        pass


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process) and the result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def worker_main(args: argparse.Namespace) -> None:
    """Answer one JSON line per command line read from stdin: ``OP ROUND`` or ``quit``."""
    import torch

    from kvstrata.testing.sglang_cpu import SGLangUnavailable

    # The storage paths use no torch kernels; the benchmark's own zeroing and comparing would
    # otherwise leave torch's OpenMP threads spinning on the second core through the next timed
    # call (measured: a 2x slower kvstrata get, whose I/O threads need that core).
    torch.set_num_threads(1)
    page_bytes = args.page_kib << 10
    out: TextIO = sys.stdout
    try:
        where = (Path(args.dir), args.pages, page_bytes, capacity_bytes(args), args.io_threads)
        worker: Any
        if args.worker == "kvstrata-nosum":
            worker = KvstrataWorker(*where, checksum="none")
        elif args.worker == "raw-2threads":
            worker = RawWorker(*where, threads=2)
        elif args.worker == "raw-2threads-xxh3":
            worker = RawWorker(*where, threads=2, checksum=True)
        else:
            worker = {"kvstrata": KvstrataWorker, "HiCacheFile": HiCacheFileWorker, "raw": RawWorker}[
                args.worker
            ](*where)
    except (ImportError, SGLangUnavailable) as exc:
        out.write(json.dumps({"error": f"{args.worker}: {exc} (see benchmarks/peers/setup.sh)"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        op, round_id = command[0], int(command[1])
        keys = page_keys(args.worker, round_id, args.pages)  # floors: kvstrata-shaped keys
        if op == "put":
            wall, cpu, ok = timed(lambda keys=keys: worker.put(keys))
            answer: dict[str, Any] = {"wall": wall, "cpu": cpu, "ok": ok}
        elif op == "get":
            worker.target.zero_()
            wall, cpu, got = timed(lambda keys=keys: worker.get(keys))
            equal = bool((worker.target == worker.source).all())
            answer = {"wall": wall, "cpu": cpu, "ok": got == args.pages and equal, "detail": f"{got} pages"}
        elif op in ("exists", "exists-cached"):
            query = worker.exists if op == "exists" else worker.exists_cached
            runs = [timed(lambda keys=keys, query=query: query(keys)) for _ in range(args.exists_repeats)]
            found = {run[2] for run in runs}
            answer = {
                "wall": statistics.median(run[0] for run in runs),
                "cpu": statistics.median(run[1] for run in runs),
                "ok": found == {args.pages},
                "detail": f"found {sorted(found)}",
            }
        else:
            answer = {"ok": False, "detail": f"unknown command {op!r}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    worker.close()


# --- the driver ----------------------------------------------------------------------------------


class Side:
    """One worker subprocess and the commands sent to it."""

    def __init__(self, name: str, python: str, directory: Path, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        src = str(HERE.parents[1] / "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        command = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            name,
            "--dir",
            str(directory),
            "--pages",
            str(args.pages),
            "--page-kib",
            str(args.page_kib),
            "--exists-repeats",
            str(args.exists_repeats),
            "--capacity-batches",
            str(args.capacity_batches),
            "--io-threads",
            str(args.io_threads),
        ]
        self.name = name
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._answer()
        if "error" in ready:
            self.proc.wait(timeout=60)
            raise SystemExit(ready["error"])

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} worker exited (status {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def run(self, op: str, round_id: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{op} {round_id}\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer.get("ok"):
            raise SystemExit(f"{self.name}: {op} of round {round_id} failed: {answer.get('detail', '')}")
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def capacity_bytes(args: argparse.Namespace) -> int:
    """Both sides' capacity: ``--capacity-batches`` batches (plus kvstrata's 64-byte headers)."""
    return int(args.capacity_batches * args.pages * ((args.page_kib << 10) + 64))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: 64 pages, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 11, quick 5)")
    parser.add_argument("--pages", type=int, default=None, help="pages per batch (default 256, quick 64)")
    parser.add_argument("--no-floors", action="store_true", help="skip the checksum-none and raw floors")
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--exists-repeats", type=int, default=11)
    parser.add_argument(
        "--io-threads", type=int, default=0, help="kvstrata file backend io_threads (0: its default, 4)"
    )
    parser.add_argument(
        "--capacity-batches",
        type=float,
        default=3,
        help="both sides evict (LRU) above this many batches: a cache in steady state; 0 = unbounded",
    )
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the HiCacheFile worker")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=SIDES + FLOORS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (5 if args.quick else 11)
    args.pages = args.pages or (64 if args.quick else 256)
    if args.worker:
        worker_main(args)
        return

    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-peers-storage-") as tmp:
        names = SIDES + (() if args.no_floors else FLOORS)
        sides = [
            Side(name, args.peer_python if name == "HiCacheFile" else sys.executable, Path(tmp) / name, args)
            for name in names
        ]
        try:
            for round_id in range(args.rounds + 1):
                for op_index, (op, _, _, _) in enumerate(WORKLOADS):
                    shift = (round_id + op_index) % len(sides)  # the order rotates per op and round
                    for side in sides[shift:] + sides[:shift]:
                        if side.name in FLOORS and op not in FLOOR_OPS:
                            continue
                        answer = side.run(op, round_id)
                        if round_id:  # round 0 warms up
                            times.setdefault((side.name, op), []).append(answer["wall"])
                            cpu.setdefault((side.name, op), []).append(answer["cpu"])
        finally:
            for side in sides:
                side.close()

    batch_bytes = args.pages * (args.page_kib << 10)

    def figures_of(side: str, op: str, clock: dict[tuple[str, str], list[float]]) -> list[float]:
        if op.startswith("exists"):
            return [t / args.pages * 1e6 for t in clock[(side, op)]]
        return [batch_bytes / t / GIB for t in clock[(side, op)]]

    print(
        f"L3 file path: {args.pages} pages x {args.page_kib} KiB per batch, fresh keys each round; "
        f"1 warm-up + {args.rounds} rounds, each side in its own process, order alternating"
    )
    columns = ("kvstrata median (min-max)", "HiCacheFile median (min-max)")
    print(f"{'workload':<34} {columns[0]:>26} {columns[1]:>29} {'ratio':>6}  goal")
    figures = []
    for op, unit, goal, at_least in WORKLOADS:
        ours, theirs = figures_of("kvstrata", op, times), figures_of("HiCacheFile", op, times)
        ratio = statistics.median(ours) / statistics.median(theirs)
        met = ratio >= goal if at_least else ratio <= goal
        name, metric, peer = {
            "put": ("put (kvstrata: xxh3 header)", "put, xxh3 header", "HiCacheFile"),
            "get": ("get (kvstrata: xxh3 verified)", "get, xxh3 verified", "HiCacheFile"),
            "exists": ("exists, all present (lower=better)", "exists per key, all present", "HiCacheFile"),
            "exists-cached": (
                "  vs HiCacheFile metadata cache on",
                "exists per key, all present, peer with its metadata cache",
                "HiCacheFile, enable_metadata_cache",
            ),
        }[op]
        bound = f"{'>=' if at_least else '<='} {goal:g} ({'met' if met else 'NOT met'})"
        print(f"{name:<34} {spread(ours):>26} {spread(theirs):>29} {ratio:>6.2f}  {bound}  [{unit}]")
        metric = f"L3 file {metric} ({args.pages} x {args.page_kib} KiB pages)"
        figures.append(
            Figure.against(metric, statistics.median(ours), unit, statistics.median(theirs), f"SGLang {peer}")
        )
        cpu_ours, cpu_theirs = figures_of("kvstrata", op, cpu), figures_of("HiCacheFile", op, cpu)
        cpu_ratio = statistics.median(cpu_ours) / statistics.median(cpu_theirs)
        label = "  CPU time of the worker"
        print(f"{label:<34} {spread(cpu_ours):>26} {spread(cpu_theirs):>29} {cpu_ratio:>6.2f}")
        for floor in FLOORS if op in FLOOR_OPS and not args.no_floors else ():
            values = figures_of(floor, op, times)
            floor_ratio = statistics.median(values) / statistics.median(theirs)
            label = {
                "kvstrata-nosum": "  floor: kvstrata, checksum none",
                "raw": "  floor: raw os loop",
                "raw-2threads": "  floor: raw os loop, 2 threads",
                "raw-2threads-xxh3": "  floor: raw loop, 2 threads, xxh3",
            }[floor]
            print(f"{label:<34} {spread(values):>26} {spread(theirs):>29} {floor_ratio:>6.2f}")
            figures.append(
                Figure.against(
                    f"L3 file {op}, floor {floor} ({args.pages} x {args.page_kib} KiB pages)",
                    statistics.median(values),
                    unit,
                    statistics.median(theirs),
                    "SGLang HiCacheFile",
                )
            )
    if args.json:
        write_results(args.json, "peers_storage", figures)


if __name__ == "__main__":
    main()
