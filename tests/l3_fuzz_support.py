"""A seeded random engine driver for the L3 fuzz (``test_l3_fuzz.py``), and its process entry.

One :class:`Driver` runs a cache like an engine's scheduler: requests of a few shared stems,
served whole or in chunks, looked up long before they are admitted (their L3 prefetch in flight
while other requests allocate, evict and write to L3), re-read, released, flushed. After every
admit the restored prefix must hold exactly the bytes its pages were computed with
(``controller_support.verify``: content derived from the page hash, pool and buffer), and a
forked state must be the checkpoint it continues from.

Run as a script it is the other process of a cross-process case::

    python l3_fuzz_support.py write SPEC   # the driver, then flush + close; or, with "kill",
                                           # "FLUSH" on stdout before each flush until SIGKILL
    python l3_fuzz_support.py read SPEC    # every planned request once: JSON of hits and bytes
                                           # (with "until": again, fresh caches, until that file is)

``SPEC`` is JSON: stack, l3 directory, overrides, seed, ops (the plan is the seed's, so a reader
asks for exactly the requests a writer served).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from controller_support import fill, fork_checked, open_cache, tokens, verify
from kvstrata.core.controller import CacheController, CacheFullError, Lease

PAGE = 64
STEMS = 3
MAX_OPEN = 3
PREFETCH = ("policy", "wait", "off")


@dataclass(eq=False)
class Request:
    tokens: torch.Tensor
    chunk: int  # pages per chunk, 0: whole


def plan(seed: int, count: int = 24) -> list[Request]:
    """The seed's requests: a prefix of one of a few stems (8 pages) and some fresh pages."""
    rng = random.Random(seed)
    stems = [tokens(seed * 10 + i, 8) for i in range(STEMS)]
    requests = []
    for _ in range(count):
        stem, shared, fresh = rng.randrange(STEMS), rng.randint(0, 8), rng.randint(0, 4)
        body = torch.cat([stems[stem][: shared * PAGE], tokens(rng.randrange(1 << 20), fresh)])
        if len(body):
            requests.append(Request(body, rng.choice([0, 0, 1, 2, 3])))
    return requests


@dataclass(eq=False)
class Open:
    request: Request
    lease: Lease
    admitted: bool = False


@dataclass
class Driver:
    """Random steps on one cache; counts what it saw in ``stats``."""

    cache: CacheController
    rng: random.Random
    requests: list[Request]
    open: list[Open] = field(default_factory=list)
    served: list[Request] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: {"ops": 0, "admits": 0, "storage_pages": 0})

    def step(self) -> None:
        self.stats["ops"] += 1
        choice = self.rng.random()
        if choice < 0.3 and len(self.open) < MAX_OPEN:
            self.look_up(self.rng.choice(self.requests))
        elif choice < 0.75 and self.open:
            self.advance(self.rng.choice(self.open))
        elif choice < 0.8 and self.open:
            entry = self.rng.choice(self.open)
            self.open.remove(entry)
            self.cache.release(entry.lease)
        elif choice < 0.9 and self.served and len(self.open) < MAX_OPEN:
            self.reread(self.rng.choice(self.served))
        elif choice < 0.95:
            self.cache.flush()
        else:
            self.cache.poll()

    def look_up(self, request: Request) -> None:
        first = request.tokens if request.chunk == 0 else request.tokens[: request.chunk * PAGE]
        lease = self.cache.lookup(first, prefetch=self.rng.choice(PREFETCH))
        self.open.append(Open(request, lease))  # admitted later: its prefetch stays in flight

    def admit(self, lease: Lease) -> None:
        self.cache.admit(lease)
        self.stats["admits"] += 1
        self.stats["storage_pages"] += lease.hit_pages.get("storage", 0)
        bad = verify(self.cache, lease)
        assert bad == 0, f"{bad} restored units hold another page's bytes"

    def advance(self, entry: Open) -> None:
        cache, lease, request = self.cache, entry.lease, entry.request
        if not entry.admitted:
            self.admit(lease)
            entry.admitted = True
            return
        try:
            units = cache.allocate(lease)
        except CacheFullError:
            self.open.remove(entry)
            cache.release(lease)
            return
        fork_checked(cache, lease)
        fill(cache, lease, units)
        last = lease.pages * PAGE >= len(request.tokens)
        cache.insert(lease, close=last)
        if last:
            self.open.remove(entry)
            self.served.append(request)
        else:
            at = lease.pages * PAGE
            lease.extend(request.tokens[at : at + request.chunk * PAGE])

    def reread(self, request: Request) -> None:
        lease = self.cache.lookup(request.tokens, prefetch="wait")
        self.admit(lease)
        self.cache.release(lease)

    def close_all(self) -> None:
        for entry in self.open:
            self.cache.release(entry.lease)
        self.open.clear()


def read_all(cache: CacheController, requests: list[Request]) -> dict[str, Any]:
    """Every request once, waiting for L3: pages from storage, wrong units, corrupt objects."""
    storage = bad = 0
    for request in requests:
        lease = cache.lookup(request.tokens, prefetch="wait")
        cache.admit(lease)
        storage += lease.hit_pages.get("storage", 0)
        bad += verify(cache, lease)
        cache.release(lease)
    return {"storage": storage, "bad": bad, "corrupt": cache.metrics.corrupt_detected}


def _read_until(spec: dict[str, Any], l3: Path | None, requests: list[Request]) -> dict[str, Any]:
    """Fresh caches reading every request, one after another, until the file ``until`` exists:
    a reader beside a writer (each cache's reads come from L3, not from the one before)."""
    total = {"storage": 0, "bad": 0, "corrupt": 0, "rounds": 0}
    while total["rounds"] < 100:
        done = Path(spec["until"]).exists()
        with open_cache(spec["stack"], l3, spec["overrides"]) as cache:
            for name, value in read_all(cache, requests).items():
                total[name] += value
        total["rounds"] += 1
        if done:
            break
    return total


def _main(role: str, spec: dict[str, Any]) -> None:
    l3 = Path(spec["l3"]) if spec.get("l3") else None
    requests = plan(spec["seed"])
    if role == "read" and spec.get("until"):
        print(json.dumps(_read_until(spec, l3, requests)), flush=True)
        return
    with open_cache(spec["stack"], l3, spec["overrides"]) as cache:
        if role == "read":
            print(json.dumps(read_all(cache, requests)), flush=True)
            return
        driver = Driver(cache, random.Random(spec["seed"]), requests)
        for _ in range(spec["ops"]):
            driver.step()
        driver.close_all()
        while spec.get("kill"):  # the parent kills this process during one of these flushes
            print("FLUSH", flush=True)
            cache.flush()
            for _ in range(10):  # (work for the next flush)
                driver.step()
        cache.flush()
        print(json.dumps(driver.stats), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], json.loads(sys.argv[2]))
