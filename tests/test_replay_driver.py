"""The replay driver through the real controller: hit rates against the independent simulator,
storage hits from a second process, namespace isolation, write-through host hits, corruption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.core.config import KvstrataConfig, load
from kvstrata.plugins.host import PluginHost
from kvstrata.replay.driver import run_replay, run_replay_detailed
from kvstrata.replay.simulate import simulate
from kvstrata.replay.trace import MOONCAKE_BLOCK_SIZE, TraceRequest, read_trace
from trace_files import full_trace

REPO = Path(__file__).resolve().parents[1]
#: Requests of the conversation trace compared against the simulator (a few seconds of replay).
PREFIX_REQUESTS = 400


def tiny_stack(tmp_path: Path, *, page_size: int = 64, **tiers: Any) -> Path:
    """A small KV stack (64 bytes per token) as a YAML file; ``tiers`` replaces the tiers section."""
    data = {
        "model": {
            "name": "replay-test",
            "page_size": page_size,
            "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}},
        },
        "tiers": tiers,
    }
    path = tmp_path / f"stack-{len(list(tmp_path.glob('stack-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def config(path: Path, *overrides: str) -> KvstrataConfig:
    return load([path], overrides=overrides, plugins=PluginHost())


def whole_pages_only(request: TraceRequest) -> TraceRequest:
    """The request as a page-granular cache sees it with 512-token pages: the trailing partial
    block is never a whole page, so it can neither hit nor be inserted."""
    full = request.input_length // MOONCAKE_BLOCK_SIZE
    return TraceRequest(request.timestamp_ms, full * MOONCAKE_BLOCK_SIZE, 0, request.hash_ids[:full])


def test_device_only_unlimited_hit_rate_equals_reference_simulator(tmp_path: Path) -> None:
    requests = read_trace(full_trace("conversation_trace.jsonl"), limit=PREFIX_REQUESTS)
    never_evict = sum(r.input_length for r in requests) + MOONCAKE_BLOCK_SIZE
    stack = tiny_stack(
        tmp_path, page_size=512, device={"capacity_tokens": never_evict}, host={"capacity_tokens": 0}
    )
    result, details = run_replay_detailed(config(stack), PluginHost(), requests)

    # The simulator on the same prefix, with the page-granular view of each request: equal hits.
    reference = simulate([whole_pages_only(r) for r in requests])
    assert result.requests == len(requests)
    assert result.tokens == sum(r.input_length for r in requests)
    assert sum(details.timeline_hits["device"]) == reference.hit_tokens
    assert result.hit_rate.total == pytest.approx(reference.hit_tokens / result.tokens, abs=1e-12)
    assert result.hit_rate.host == result.hit_rate.storage == 0.0
    assert result.hit_rate.total > 0.05  # conversation turns share long prefixes
    # ... and the block-level simulator differs only by the partial last blocks (< 1 point here)
    assert result.hit_rate.total == pytest.approx(simulate(requests).hit_rate, abs=0.01)
    assert result.corrupt_pages_served == 0 and result.failures == 0


def write_trace(path: Path, *blocks: range) -> Path:
    """A hand-made trace: one request per range of hash ids, each block full (512 tokens)."""
    lines = [
        json.dumps({"timestamp": i, "input_length": len(r) * 512, "output_length": 1, "hash_ids": list(r)})
        for i, r in enumerate(blocks)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_write_through_on_a_tiny_device_tier_serves_from_host(tmp_path: Path) -> None:
    # A (20 blocks), then B (20 other blocks) pushes A off the 24-block device tier, then A again.
    trace = write_trace(tmp_path / "t.jsonl", range(0, 20), range(100, 120), range(0, 20))
    stack = tiny_stack(tmp_path, device={"capacity_tokens": 24 * 512}, host={"capacity_tokens": 64 * 512})
    result, details = run_replay_detailed(
        config(stack, "policy.write=write_through"), PluginHost(), read_trace(trace)
    )
    assert details.timeline_hits["host"][2] > 0  # A came back from the host tier
    assert details.timeline_hits["device"][2] + details.timeline_hits["host"][2] == 20 * 512
    assert result.hit_rate.host > 0.0
    assert result.bytes.device_to_host > 0 and result.bytes.host_to_device > 0
    assert result.corrupt_pages_served == 0 and result.failures == 0


def _replay_cli(*args: str | Path) -> dict[str, Any]:
    out = Path(str(args[-1]))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "replay", *map(str, args[:-1]), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def file_l3_stack(tmp_path: Path, l3: Path, requests: list) -> Path:
    """A tiny stack whose device tier holds the biggest request, with a file L3 at ``l3``."""
    biggest = max(r.input_length for r in requests)
    return tiny_stack(
        tmp_path,
        device={"capacity_tokens": biggest + 1024},
        host={"capacity_tokens": 4 * biggest},
        storage={"l3": {"type": "file", "path": str(l3)}},
    )


def test_second_process_is_served_from_storage_and_another_model_is_not(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    requests = read_trace(limit=30)
    stack = file_l3_stack(tmp_path, l3, requests)
    first = run_replay(config(stack), PluginHost(), requests)
    assert first.bytes.host_to_storage > 0
    assert first.corrupt_pages_served == 0

    # A fresh process, cold device and host tiers, same L3: the trace is served from storage.
    second = _replay_cli("--limit", "30", "-c", stack, tmp_path / "second.json")
    assert second["hit_rate"]["storage"] > 0.0
    assert second["bytes"]["storage_to_host"] > 0
    assert second["corrupt_pages_served"] == 0
    assert second["corrupt_pages_detected"] == 0
    assert second["hit_rate"]["total"] >= first.hit_rate.total

    # Another model name on the same L3 directory: nothing of the first model may be served.
    other = run_replay(config(stack, "model.name=another-model"), PluginHost(), requests)
    assert other.hit_rate.storage == 0.0
    assert other.bytes.storage_to_host == 0
    assert other.corrupt_pages_served == 0


def test_corrupted_storage_objects_are_detected_never_served(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    requests = read_trace(limit=12)
    stack = file_l3_stack(tmp_path, l3, requests)
    run_replay(config(stack), PluginHost(), requests)
    objects = [p for p in l3.rglob("*") if p.is_file() and p.stat().st_size > 256]
    assert objects
    for path in objects:  # flip the last payload byte of every stored object
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = run_replay(config(stack), PluginHost(), requests)
    assert again.corrupt_pages_detected > 0
    assert again.corrupt_pages_served == 0
    assert again.hit_rate.storage == 0.0


def test_wrong_bytes_on_the_device_are_counted_as_served_corruption(tmp_path: Path) -> None:
    """Fault injection: scribble over the device pool between two passes; the verifier must see it."""
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    requests = read_trace(limit=6)
    stack = tiny_stack(
        tmp_path,
        device={"capacity_tokens": 8 * max(r.input_length for r in requests)},
        host={"capacity_tokens": 0},
    )
    with CacheController(config(stack), PluginHost()) as cache:
        clean, _ = replay_with_cache(cache, requests)
        assert clean.corrupt_pages_served == 0
        backing = cache.pools.pools["kv"].device.backing
        assert backing is not None
        backing ^= 0x5A  # every byte of every device page is now wrong
        dirty, details = replay_with_cache(cache, requests)
    assert dirty.hit_rate.device > 0.9  # the same requests again: almost all on the device
    hit_pages = sum(details.timeline_hits["device"]) // 64
    assert dirty.corrupt_pages_served == hit_pages


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_chunked_replay_counts_each_hit_and_each_wrong_unit_once(tmp_path: Path, chunk: int) -> None:
    """``chunk_pages``: a request's reuse is what the cache held when it arrived, found by any of
    its chunks (only the first chunk's lookup counted: a request held whole on the device read
    1/8 of its pages as hits at one page per chunk, storage hits 0 % while L3 served them); and
    a wrong unit counts once, though every chunk checks the whole prefix again (one wrong unit
    counted 8 times at one page per chunk)."""
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    requests = read_trace(limit=6)
    l3 = tmp_path / "l3"
    stack = file_l3_stack(tmp_path, l3, requests)
    # reads wait whole: under the default ``timeout`` policy a loaded machine (a CI run with two
    # workers) cut one of the runs' reads at admit, and the two hit rates differed by that
    wait = "policy.prefetch.policy=wait_complete"
    first = run_replay(config(stack, wait), PluginHost(), requests)
    whole = run_replay(config(stack, wait), PluginHost(), requests)  # a fresh cache on that L3
    chunked = run_replay(config(stack, wait), PluginHost(), requests, chunk_pages=chunk)
    assert first.hit_rate.storage == 0 and whole.hit_rate.storage > 0.5
    assert chunked.hit_rate.storage == pytest.approx(whole.hit_rate.storage)
    assert chunked.hit_rate.total == pytest.approx(whole.hit_rate.total)
    assert chunked.corrupt_pages_served == 0

    room = 8 * max(r.input_length for r in requests)
    device_only = tiny_stack(tmp_path, device={"capacity_tokens": room}, host={"capacity_tokens": 0})
    with CacheController(config(device_only), PluginHost()) as cache:
        replay_with_cache(cache, requests)
        again, _ = replay_with_cache(cache, requests)
        same, _ = replay_with_cache(cache, requests, chunk_pages=chunk)
        assert same.hit_rate.device == pytest.approx(again.hit_rate.device) and again.hit_rate.device > 0.9
        backing = cache.pools.pools["kv"].device.backing
        assert backing is not None
        backing ^= 0x5A  # every unit of every device page is now wrong
        dirty, details = replay_with_cache(cache, requests, chunk_pages=chunk)
    assert dirty.corrupt_pages_served == sum(details.timeline_hits["device"]) // 64


def test_the_checkpoint_split_counts_hits_past_the_checkpoint(tmp_path: Path) -> None:
    """A Mamba stack serves a request up to its last 512-token boundary, then whole: an
    identical request later finds all 9 whole pages of 64 tokens cached (a state at both ends),
    but only the first step's 8 counted as reuse."""
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    request = TraceRequest(0.0, 600, 1, (1, 2))
    stack = load(
        [REPO / "tests" / "stacks" / "hybrid-mamba.yaml"],
        overrides=["tiers.storage={}"],
        plugins=PluginHost(),
    )
    with CacheController(stack, PluginHost()) as cache:
        first, _ = replay_with_cache(cache, [request])
        again, _ = replay_with_cache(cache, [request])
    assert first.hit_rate.total == 0
    assert again.hit_rate.device * 600 == pytest.approx(9 * 64) and again.corrupt_pages_served == 0


def test_a_request_shorter_than_a_page_is_served_not_a_crash(tmp_path: Path) -> None:
    """No whole page: nothing to match or insert (its page hashes are an empty list, not None)."""
    stack = tiny_stack(tmp_path, page_size=512, device={"capacity_tokens": 4096}, host={"capacity_tokens": 0})
    requests = [TraceRequest(0.0, 10, 1, (5,)), TraceRequest(1.0, 600, 1, (5, 6))]
    result = run_replay(config(stack), PluginHost(), requests)
    assert result.requests == 2 and result.failures == 0 and result.corrupt_pages_served == 0


# --- the check sees what an engine would compute with (audit 26: faults it did not notice) -------


def _swa_replay(monkeypatch: pytest.MonkeyPatch, fault: str) -> Any:
    """Two requests, the second sharing the first's 8 pages, on the swa stack with ``fault``."""
    from kvstrata.core.controller import CacheController
    from kvstrata.core.lease import Lease

    units_of, first_of = Lease.prefix_units, Lease.prefix_first_page
    if fault == "window_short":  # consistent bookkeeping, the window's oldest page missing
        monkeypatch.setattr(
            Lease, "prefix_units", lambda self, p: units_of(self, p)[-1:] if p == "swa" else units_of(self, p)
        )
        monkeypatch.setattr(
            Lease,
            "prefix_first_page",
            lambda self, p: self.cached_pages - 1 if p == "swa" else first_of(self, p),
        )
    elif fault == "unit_missing":  # one unit fewer than the prefix's pages
        monkeypatch.setattr(
            Lease, "prefix_units", lambda self, p: units_of(self, p)[1:] if p == "full" else units_of(self, p)
        )
    elif fault == "allocation_overlaps_prefix":  # the request's own new unit is a prefix unit
        allocate = CacheController.allocate

        def overlapping(self: CacheController, lease: Lease, **kwargs: Any) -> Any:
            got = allocate(self, lease, **kwargs)
            if lease.cached_pages and len(got["full"]):
                got["full"][0] = lease.prefix_units("full")[0]
            return got

        monkeypatch.setattr(CacheController, "allocate", overlapping)
    requests = [TraceRequest(0.0, 512, 0, (1,)), TraceRequest(1.0, 1024, 0, (1, 2))]
    stack = load(
        [REPO / "tests" / "stacks" / "swa.yaml"], overrides=["tiers.storage={}"], plugins=PluginHost()
    )
    result, _ = run_replay_detailed(stack, PluginHost(), requests)
    return result


@pytest.mark.parametrize("fault", ["none", "window_short", "unit_missing", "allocation_overlaps_prefix"])
def test_replay_counts_what_the_engine_would_compute_with(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # a window one page short passed (the expected range came from the lease under test), a unit
    # missing ended the run as bad input (exit 2), and a prefix page the request's own allocation
    # overwrote was never seen (the prefix was checked before allocate)
    result = _swa_replay(monkeypatch, fault)
    assert result.requests == 2
    assert (result.corrupt_pages_served > 0) == (fault != "none"), result


class _StopAfter:
    """A stop request (Ctrl-C between requests) that turns true at the ``n``-th check."""

    def __init__(self, n: int) -> None:
        self.n, self.checks = n, 0
        self.pending_writes = lambda: 0

    @property
    def requested(self) -> bool:
        self.checks += 1
        return self.checks > self.n


def test_a_replay_stopped_in_its_warm_up_reports_nothing_measured(tmp_path: Path) -> None:
    """It reported 0 requests and 0 tokens beside the warm-up's bytes and match latencies: the
    measured part's first snapshot was never taken, and the delta was the whole run's."""
    from kvstrata.core.collective import LocalCollective
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    tier = {"capacity_tokens": 8192}
    stack = tiny_stack(tmp_path, page_size=512, device=tier, host=tier)
    requests = [TraceRequest(float(i), 4 * 512, 1, tuple(range(100 * i, 100 * i + 4))) for i in range(8)]
    with CacheController(config(stack), PluginHost(), collective=LocalCollective()) as cache:
        result, details = replay_with_cache(cache, requests, warmup_fraction=0.5, stop=_StopAfter(3))
        assert cache.metrics.snapshot()["bytes"]["device_to_host"] > 0  # the warm-up moved bytes
    assert details.interrupted_after == 3
    assert result.requests == 0 and result.tokens == 0
    assert sum(result.bytes.model_dump().values()) == 0
    assert "match" not in details.latencies


def test_the_latency_count_is_every_measured_operation_not_the_samples_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metrics keep the newest ``LATENCY_SAMPLES`` latencies (100k); past that the summary's
    count read the window's size, not the lookups measured (shown with a window of 8)."""
    import kvstrata.core.metrics as metrics_module
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    monkeypatch.setattr(metrics_module, "LATENCY_SAMPLES", 8)
    stack = tiny_stack(tmp_path, device={"capacity_tokens": 1 << 20})
    with CacheController(config(stack), PluginHost()) as cache:
        before = cache.metrics.latency_count["match"]
        _result, details = replay_with_cache(cache, read_trace(limit=20))
        lookups = cache.metrics.latency_count["match"] - before
    assert lookups >= 20 and len(cache.metrics.latency_s["match"]) == 8
    assert details.latencies["match"].count == lookups


def test_warm_up_l3_writes_still_in_flight_are_not_counted_as_measured(tmp_path: Path) -> None:
    """The measured part's bytes are its own requests': the warm-up's L3 writes still queued
    when the measured part began landed in it (``host_to_storage`` with no measured write)."""
    from kvstrata.core.collective import LocalCollective
    from kvstrata.core.controller import CacheController
    from kvstrata.replay.driver import replay_with_cache

    tier = {"capacity_tokens": 8192}
    slow = {"l3": {"type": "memory", "latency_s": 0.3}}  # the warm-up's write is still in flight
    stack = tiny_stack(tmp_path, page_size=512, device=tier, host=tier, storage=slow)
    # the second request repeats the first: served whole from the device, it writes nothing
    requests = [TraceRequest(float(i), 4 * 512, 1, (1, 2, 3, 4)) for i in range(2)]
    with CacheController(config(stack), PluginHost(), collective=LocalCollective()) as cache:
        result, _details = replay_with_cache(cache, requests, warmup_fraction=0.5)
        assert cache.metrics.snapshot()["bytes"]["host_to_storage"] > 0  # the warm-up wrote to L3
    assert result.requests == 1 and result.hit_rate.device > 0
    assert result.bytes.host_to_storage == 0 and result.bytes.device_to_host == 0, result.bytes
