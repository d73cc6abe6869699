"""L3 restores of hybrid stacks across processes, configs, races and damage: bit-exact or a miss.

The project's worst bug was an intermittent wrong hybrid state after an eviction to L3. Session 43
fuzzed restores within one process; these cases add what it left (audit 46):

- cross-process: a writer process runs a random engine loop (``l3_fuzz_support.Driver``) and
  exits, or is SIGKILLed during one of its flushes; a reader process with the same config, one
  running beside the writer and one with another host layout must restore every byte exactly (or
  miss), one with another model name, page size or pool shape / dtype must miss, one with the
  other checksum setting must be exact or miss -- on the ``file`` backend and on a real Mooncake
  master (CI's seeds: hybrid-mamba write-back clean, swa-mamba write-through killed, and on
  Mooncake mla-nsa-draft write-through killed);
- races in one process: two caches of one stack on one file L3, stepped in turns, one bounded
  (its L3 evictions remove and recycle the files the other's prefetches read), each with its own
  checksum setting and write policy;
- damage: objects flipped, truncated or stripped of their checksum after the writer exited.

Each case is drawn from a seed; ``KVSTRATA_L3_FUZZ_SEEDS=N`` runs N seeds per case (CI: the few
listed). What ran for audit 46 is in its report.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controller_support import DEVICE, open_cache
from l3_fuzz_support import Driver, plan, read_all

REPO = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "l3_fuzz_support.py"
STACKS = ("hybrid-mamba", "swa-mamba", "mla-nsa-draft")
WRITES = ("write_through", "write_through_selective", "write_back")
#: per stack: overrides under which no object the writer stored may be served
FOREIGN = {
    "hybrid-mamba": ["model.pools.mamba.temporal.dtype=bfloat16", "model.pools.kv.head_dim=64"],
    "swa-mamba": ["model.pools.mamba.temporal.shape=[2,16,8]", "model.pools.swa.head_dim=32"],
    "mla-nsa-draft": ["model.pools.mla.kv_lora_rank=256", "model.pools.indexer.key_dtype=bfloat16"],
}
#: ``KVSTRATA_L3_FUZZ_STEPS=N``: N times the in-process cases' steps
STEPS = int(os.environ.get("KVSTRATA_L3_FUZZ_STEPS", "1"))
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
COMMON_FOREIGN = ["model.page_size=32", "model.name=another-model"]


def log(case: str, seed: int, seen: dict[str, Any]) -> None:
    """With ``KVSTRATA_L3_FUZZ_LOG=FILE``, one JSON line per case run: what a long run covered."""
    if os.environ.get("KVSTRATA_L3_FUZZ_LOG"):
        with open(os.environ["KVSTRATA_L3_FUZZ_LOG"], "a") as out:
            out.write(json.dumps({"case": case, "seed": seed, **seen}) + "\n")


def seeds(default: list[int]) -> list[int]:
    count = int(os.environ.get("KVSTRATA_L3_FUZZ_SEEDS", "0"))
    first = int(os.environ.get("KVSTRATA_L3_FUZZ_FIRST", "1000"))
    return list(range(first, first + count)) if count else default


def _process(role: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SUPPORT), role, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            "PYTHONPATH": str(REPO / "src"),
            "PATH": "/usr/bin:/bin",
            "KVSTRATA_TEST_DEVICE": DEVICE,
            "OMP_NUM_THREADS": "1",
        },
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _write(spec: dict[str, Any], rng: random.Random) -> str:
    """The writer process to its end, or SIGKILLed a random moment into a random flush."""
    proc = _process("write", spec)
    if not spec.get("kill"):
        _finish(proc)
        return "clean"
    assert proc.stdout is not None
    flushes = rng.randint(1, 3)
    for line in proc.stdout:
        if line.startswith("FLUSH"):
            flushes -= 1
            if not flushes:
                time.sleep(rng.choice([0, 0.001, 0.003, 0.01, 0.03]))  # (a flush takes ms)
                break
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    return "killed"


def cross_process_case(seed: int, storage: list[str], l3: Path, name: str) -> dict[str, Any]:
    """One writer, then readers with the same and with other configs; returns what they saw."""
    rng = random.Random(seed)
    stack = rng.choice(STACKS)
    own = [f"policy.write={rng.choice(WRITES)}", f"model.name={name}", *storage]
    if rng.random() < 0.3:
        own.append("policy.checksum=none")
    spec = {"stack": stack, "l3": str(l3), "overrides": own, "seed": seed, "ops": rng.randint(20, 80)}
    spec["kill"] = rng.random() < 0.5
    until = l3.parent / "writer-ended"
    during = _process("read", {**spec, "until": str(until)})  # reads while the writer writes
    try:
        ended = _write(spec, rng)
    except BaseException:
        during.kill()
        raise
    until.touch()
    temps = len(list(l3.rglob(".*.tmp-*"))) if l3.is_dir() else 0  # a killed put's leftovers
    # the same model with another host layout (the payload order is canonical): exact or a miss
    readers = {"same": own, "layout": [*own, f"tiers.host.layout={rng.choice(LAYOUTS)}"]}
    other = rng.choice([*FOREIGN[stack], *COMMON_FOREIGN])
    readers["foreign"] = [*own, other]
    flipped = "none" if "policy.checksum=none" not in own else "xxh3"
    readers["checksum"] = [*own, f"policy.checksum={flipped}"]
    seen: dict[str, Any] = {"during": _finish(during)}
    # the checksum reader last: one with xxh3 removes objects that declare none (checksum_missing)
    for labels in (("same", "foreign", "layout"), ("checksum",)):
        procs = {label: _process("read", {**spec, "overrides": readers[label]}) for label in labels}
        seen.update({label: _finish(proc) for label, proc in procs.items()})
    where = f"seed {seed}: {stack} {own} {ended}, foreign {other}: {seen}"
    assert seen["same"]["bad"] == 0 and seen["same"]["corrupt"] == 0, where
    assert seen["during"]["bad"] == 0 and seen["during"]["corrupt"] == 0, where
    assert seen["checksum"]["bad"] == 0 and seen["layout"]["bad"] == 0, where
    assert seen["foreign"]["storage"] == 0 and seen["foreign"]["bad"] == 0, where
    return {"stack": stack, "config": own[:1], "ended": ended, "temps": temps, "other": other, **seen}


def mooncake_storage(config: Any) -> list[str]:
    return [
        "tiers.storage.l3.type=mooncake",
        f"tiers.storage.l3.master={config.master}",
        f"tiers.storage.l3.metadata_server={config.metadata_server}",
        "tiers.storage.l3.segment_bytes=0",
        "tiers.storage.l3.local_buffer_bytes=0",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds([3, 7]))
def test_another_process_restores_a_written_or_killed_writers_l3_exactly_or_misses(
    seed: int, tmp_path: Path
) -> None:
    log("file", seed, cross_process_case(seed, [], tmp_path / "l3", f"fuzz-{tmp_path.name}"))


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.parametrize("seed", seeds([6]))
def test_another_process_restores_from_mooncake_exactly_or_misses(
    seed: int, tmp_path: Path, mooncake_inprocess_config: Any
) -> None:
    storage = mooncake_storage(mooncake_inprocess_config)
    name = f"fuzz-{tmp_path.name}"  # a namespace of its own on the session's master
    log("mooncake", seed, cross_process_case(seed, storage, tmp_path / "unused", name))


def two_caches_case(seed: int, l3: Path, steps: int) -> dict[str, int]:
    """Two caches of one stack on one directory stepped in turns; the second bounded, so its L3
    evictions remove (or recycle) objects the first is reading. Every admit checks its bytes."""
    rng = random.Random(seed)
    stack = rng.choice(STACKS)
    requests = plan(seed)
    drivers = []
    for bounded in (False, True):
        sets = [f"policy.write={rng.choice(WRITES)}", f"policy.checksum={rng.choice(['xxh3', 'none'])}"]
        if bounded:
            sets.append(f"tiers.storage.l3.capacity_bytes={rng.choice([1, 4, 16]) << 20}")
            sets.append("policy.checksum=xxh3")  # (recycling evicted files needs verified reads)
        cache = open_cache(stack, l3, sets)
        drivers.append(Driver(cache, random.Random(rng.random()), requests))
    try:
        for _ in range(steps):
            rng.choice(drivers).step()
        stats = {"storage_pages": sum(d.stats["storage_pages"] for d in drivers)}
        for driver in drivers:
            driver.close_all()
            seen = read_all(driver.cache, requests)
            assert seen["bad"] == 0, f"seed {seed}: {stack}: {seen}"
            stats["storage_pages"] += seen["storage"]
    finally:
        for driver in drivers:
            driver.close_all()
            driver.cache.close()
    return {"stack": stack, **stats}


@pytest.mark.parametrize("seed", seeds([2]))
def test_two_caches_on_one_l3_one_evicting_what_the_other_reads_keep_bytes_exact(
    seed: int, tmp_path: Path
) -> None:
    log("two_caches", seed, two_caches_case(seed, tmp_path / "l3", STEPS * 60))


def damage(path: Path, how: str) -> None:
    """What the fault matrix does to an object (``faults/test_fault_storage_damage.py``), and a
    torn write: a file cut short."""
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[64 + (len(raw) - 64) // 2] ^= 0x01
    elif how == "forge":  # the checksum kind and value zeroed, then a payload byte changed
        raw[6:8] = bytes(2)
        raw[40:48] = bytes(8)
        raw[-1] ^= 0x5A
    else:  # torn
        del raw[len(raw) // 2 :]
    path.write_bytes(bytes(raw))


def damaged_case(seed: int, l3: Path, ops: int) -> dict[str, int]:
    rng = random.Random(seed)
    stack = rng.choice(STACKS)
    requests = plan(seed)
    checksum = rng.choice(["xxh3", "none"])
    sets = [f"policy.write={rng.choice(WRITES)}", f"policy.checksum={checksum}"]
    with open_cache(stack, l3, sets) as cache:
        driver = Driver(cache, random.Random(seed), requests)
        for _ in range(ops):
            driver.step()
        driver.close_all()
    objects = sorted(p for p in l3.rglob("*") if p.is_file() and not p.name.startswith("."))
    # unchecked reads cannot see a flipped byte or a forged checksum; a cut they can
    hows = ["flip", "forge", "torn"] if checksum == "xxh3" else ["torn"]
    hit = rng.sample(objects, k=max(1, len(objects) // 3)) if objects else []
    for path in hit:
        damage(path, rng.choice(hows))
    with open_cache(stack, l3, sets) as cache:
        seen = read_all(cache, requests)
    assert seen["bad"] == 0, f"seed {seed}: {stack} {sets}, {len(hit)} of {len(objects)} damaged: {seen}"
    return {"stack": stack, "config": sets, "damaged": len(hit), "of": len(objects), **seen}


@pytest.mark.parametrize("seed", seeds([4]))
def test_damaged_torn_and_forged_objects_are_misses_never_data(seed: int, tmp_path: Path) -> None:
    log("damaged", seed, damaged_case(seed, tmp_path / "l3", STEPS * 40))
