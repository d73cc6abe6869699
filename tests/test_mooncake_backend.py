"""MooncakeBackend against REAL mooncake_master / mooncake_client processes on loopback ports.

Objects follow the core's shape: a small integrity header in ordinary (unregistered) memory as
the first region, then payload regions in host-pool memory.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstrata.core.breaker import BreakerState
from kvstrata.core.buffers import region_tensor
from kvstrata.plugins.errors import MissingDependencyError, StorageError
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject
from kvstrata.storage_backends.mooncake import (
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    MooncakeBackend,
    MooncakeConfig,
    tcp_probe,
)
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes
from kvstrata.testing.mooncake_servers import MooncakeMaster, MooncakeStandaloneClient, free_loopback_port

pytestmark = pytest.mark.mooncake

HEADER_BYTES = 48
PAGE_BYTES = 16 << 10


def region_of(tensor: torch.Tensor) -> BufferRegion:
    return BufferRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def header_buffers(count: int, fill: bool) -> tuple[torch.Tensor, list[BufferRegion]]:
    """Headers in ordinary memory (never registered): one row per object."""
    headers = torch.randint(0, 256, (count, HEADER_BYTES), dtype=torch.uint8)
    if not fill:
        headers.zero_()
    return headers, [BufferRegion(headers[i].data_ptr(), HEADER_BYTES) for i in range(count)]


def fresh_keys(count: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"test/{prefix}/{i}" for i in range(count)]


@pytest.fixture(scope="module")
def inprocess(mooncake_master: MooncakeMaster) -> Iterator[MooncakeBackend]:
    """One in-process client for the module: setup/close of a client costs seconds."""
    config = mooncake_master.backend_config(segment_bytes=64 << 20, local_buffer_bytes=0)
    backend = MooncakeBackend("test", config)
    backend.open()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def standalone(mooncake_standalone_client: MooncakeStandaloneClient) -> Iterator[MooncakeBackend]:
    config = mooncake_standalone_client.backend_config(
        local_buffer_bytes=1 << 20,
        staging_bytes=4096,  # 64 headers of 48 bytes (64-aligned): bigger batches are split
        host_memory_limit_bytes=8 << 20,
    )
    backend = MooncakeBackend("test-standalone", config)
    backend.open()
    yield backend
    backend.close()


def test_single_region_objects_round_trip_bit_exact(inprocess: MooncakeBackend) -> None:
    source = torch.randint(0, 256, (8, PAGE_BYTES), dtype=torch.uint8)
    target = torch.zeros_like(source)
    inprocess.register_host_memory(region_of(source))
    inprocess.register_host_memory(region_of(target))
    keys = fresh_keys(8)
    assert (
        inprocess.put([StorageObject(k, (region_of(source[i]),)) for i, k in enumerate(keys)]) == [True] * 8
    )
    assert inprocess.exists(keys) == [True] * 8
    read = inprocess.get([StorageObject(k, (region_of(target[i]),)) for i, k in enumerate(keys)])
    assert read == [PAGE_BYTES] * 8
    assert torch.equal(source, target)


def test_multi_region_objects_with_unregistered_header_round_trip(inprocess: MooncakeBackend) -> None:
    keys_half = torch.randint(0, 256, (6, PAGE_BYTES), dtype=torch.uint8)
    values_half = torch.randint(0, 256, (6, PAGE_BYTES // 2), dtype=torch.uint8)
    inprocess.register_host_memory(region_of(keys_half))
    inprocess.register_host_memory(region_of(values_half))
    headers, header_regions = header_buffers(6, fill=True)
    keys = fresh_keys(6)
    objects = [
        StorageObject(k, (header_regions[i], region_of(keys_half[i]), region_of(values_half[i])))
        for i, k in enumerate(keys)
    ]
    assert inprocess.put(objects) == [True] * 6

    out_k, out_v = torch.zeros_like(keys_half), torch.zeros_like(values_half)
    out_headers, out_header_regions = header_buffers(6, fill=False)
    read = inprocess.get(
        [
            StorageObject(k, (out_header_regions[i], region_of(out_k[i]), region_of(out_v[i])))
            for i, k in enumerate(keys)
        ]
    )
    assert read == [HEADER_BYTES + PAGE_BYTES + PAGE_BYTES // 2] * 6
    assert torch.equal(out_headers, headers)
    assert torch.equal(out_k, keys_half)
    assert torch.equal(out_v, values_half)


def test_partial_batch_reports_misses_per_key(inprocess: MooncakeBackend) -> None:
    source = torch.randint(0, 256, (4, PAGE_BYTES), dtype=torch.uint8)
    keys = fresh_keys(4)
    stored = keys[::2]
    assert inprocess.put([StorageObject(keys[i], (region_of(source[i]),)) for i in (0, 2)]) == [True, True]
    assert inprocess.exists(keys) == [True, False, True, False]

    target = torch.full_like(source, 7)
    misses_before = inprocess.code_counts[OBJECT_NOT_FOUND]
    read = inprocess.get([StorageObject(k, (region_of(target[i]),)) for i, k in enumerate(keys)])
    assert read == [PAGE_BYTES, OBJECT_NOT_FOUND, PAGE_BYTES, OBJECT_NOT_FOUND]
    assert inprocess.code_counts[OBJECT_NOT_FOUND] == misses_before + 2
    assert torch.equal(target[0::2], source[0::2])
    assert bool((target[1::2] == 7).all()), "a miss must leave the target untouched"
    assert stored == [keys[0], keys[2]]


def test_a_key_named_twice_in_one_get_fills_both_targets(inprocess: MooncakeBackend) -> None:
    # Mooncake fills only the last target of a repeated key and reports both as read: the first
    # kept stale bytes, which the storage engine counted as damage and removed from the store
    source = torch.randint(0, 256, (2, PAGE_BYTES), dtype=torch.uint8)
    inprocess.register_host_memory(region_of(source))
    keys = fresh_keys(2)
    assert (
        inprocess.put([StorageObject(k, (region_of(source[i]),)) for i, k in enumerate(keys)]) == [True] * 2
    )
    target = torch.zeros((3, PAGE_BYTES), dtype=torch.uint8)
    inprocess.register_host_memory(region_of(target))
    order = [keys[0], keys[0], keys[1]]
    read = inprocess.get([StorageObject(k, (region_of(target[i]),)) for i, k in enumerate(order)])
    assert read == [PAGE_BYTES] * 3
    assert torch.equal(target[0], source[0]) and torch.equal(target[1], source[0])
    assert torch.equal(target[2], source[1])


@pytest.mark.parametrize("mode", ["inprocess", "standalone"])
def test_an_object_longer_than_its_regions_is_reported_by_its_length(
    mode: str, request: pytest.FixtureRequest
) -> None:
    # another layout under our key: Mooncake refuses the read (-600), which was a plain miss on
    # every read, never counted nor replaced; now the caller sees its length and leading bytes,
    # so its verification rejects the object (and removes it). Standalone (registered memory
    # only) skipped that re-read: the page missed for good (a put leaves an existing key)
    backend: MooncakeBackend = request.getfixturevalue(mode)
    longer = torch.randint(0, 256, (PAGE_BYTES + 512,), dtype=torch.uint8)
    [key] = fresh_keys(1)
    assert backend.put([StorageObject(key, (region_of(longer),))]) == [True]
    target = torch.zeros((PAGE_BYTES,), dtype=torch.uint8)
    assert backend.get([StorageObject(key, (region_of(target),))]) == [PAGE_BYTES + 512]
    assert torch.equal(target, longer[:PAGE_BYTES])


@pytest.mark.parametrize("mode", ["inprocess", "standalone"])
def test_a_longer_foreign_object_under_our_key_is_rejected_and_the_page_stored_again(
    mode: str, request: pytest.FixtureRequest
) -> None:
    backend: MooncakeBackend = request.getfixturevalue(mode)
    kit, specs = BackendConformance(), conformance_specs()
    engine = kit.engine(backend, specs, model_name=f"longer-{uuid.uuid4().hex[:8]}")
    hashes = page_hashes(1, seed=7)
    [key] = engine.object_keys("index", hashes)[0]
    foreign = torch.ones((4096,), dtype=torch.uint8)  # longer than the header and the page
    assert backend.put([StorageObject(key, (region_of(foreign),))]) == [True]
    source, target = kit.pools(specs, 1, seed=3), kit.pools(specs, 1, seed=None)
    kit.register(backend, engine, source)
    kit.register(backend, engine, target)
    first = engine.get("index", hashes, target["index"].units([0]))
    assert first.ok == [False] and first.rejected == (0,)
    assert engine.put("index", hashes, source["index"].units([0])).ok == [True]
    assert engine.get("index", hashes, target["index"].units([0])).ok == [True]


def test_existing_key_is_not_rewritten(inprocess: MooncakeBackend) -> None:
    first = torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8)
    second = first.flip(0).clone() + 1
    (key,) = fresh_keys(1)
    assert inprocess.put([StorageObject(key, (region_of(first),))]) == [True]
    assert inprocess.put([StorageObject(key, (region_of(second),))]) == [True]
    target = torch.zeros_like(first)
    assert inprocess.get([StorageObject(key, (region_of(target),))]) == [PAGE_BYTES]
    assert torch.equal(target, first)


def test_register_host_memory_tolerates_overlaps(inprocess: MooncakeBackend) -> None:
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    inprocess.register_host_memory(region_of(pool[: 512 << 10]))
    inprocess.register_host_memory(region_of(pool[: 512 << 10]))  # again: no-op
    inprocess.register_host_memory(region_of(pool[4096:8192]))  # inside: no-op
    inprocess.register_host_memory(region_of(pool))  # superset: only the tail is registered
    with pytest.raises(StorageError, match="empty"):
        inprocess.register_host_memory(BufferRegion(pool.data_ptr(), 0))


def test_read_from_a_second_process_is_bit_exact(
    inprocess: MooncakeBackend, mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    count = 5
    source = torch.randint(0, 256, (count, PAGE_BYTES), dtype=torch.uint8)
    headers, header_regions = header_buffers(count, fill=True)
    keys = fresh_keys(count)
    objects = [StorageObject(k, (header_regions[i], region_of(source[i]))) for i, k in enumerate(keys)]
    assert inprocess.put(objects) == [True] * count
    expected = tmp_path / "expected.pt"
    torch.save({"keys": keys, "headers": headers, "pages": source}, expected)
    reader = textwrap.dedent(
        f"""
        import sys, torch
        from kvstrata.plugins.storage_backend import BufferRegion, StorageObject
        from kvstrata.storage_backends.mooncake import MooncakeBackend, MooncakeConfig
        data = torch.load({str(expected)!r})
        keys, headers, pages = data["keys"], data["headers"], data["pages"]
        out_headers, out_pages = torch.zeros_like(headers), torch.zeros_like(pages)
        backend = MooncakeBackend("reader", MooncakeConfig(
            master={mooncake_master.address!r}, metadata_server={mooncake_master.metadata_url!r},
            segment_bytes=0, local_buffer_bytes=0))
        backend.open()
        backend.register_host_memory(BufferRegion(out_pages.data_ptr(), out_pages.numel()))
        objects = [StorageObject(k, (BufferRegion(out_headers[i].data_ptr(), out_headers.shape[1]),
                                     BufferRegion(out_pages[i].data_ptr(), out_pages.shape[1])))
                   for i, k in enumerate(keys)]
        read = backend.get(objects)
        backend.close()
        assert read == [headers.shape[1] + pages.shape[1]] * len(keys), read
        assert torch.equal(out_headers, headers) and torch.equal(out_pages, pages), "bytes differ"
        print("READ-OK", len(keys))
        """
    )
    src_dir = Path(__file__).resolve().parents[1] / "src"
    env_path = f"{src_dir}"
    completed = subprocess.run(
        [sys.executable, "-c", reader],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), "PYTHONPATH": env_path},
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    assert f"READ-OK {count}" in completed.stdout


def test_close_while_other_threads_read_and_write_ends_them_cleanly(mooncake_master: MooncakeMaster) -> None:
    """An adapter closes its backend while its I/O thread works: closing the native store under a
    running call killed the process (SIGSEGV). Now close waits for running calls, and later
    calls fail with StorageError. In a child process: a crash must not take pytest with it."""
    child = textwrap.dedent(
        f"""
        import ctypes, threading, time
        from kvstrata.plugins.errors import StorageError
        from kvstrata.plugins.storage_backend import BufferRegion, StorageObject
        from kvstrata.storage_backends.mooncake import MooncakeBackend, MooncakeConfig
        def round_(r):
            backend = MooncakeBackend("closing", MooncakeConfig(
                master={mooncake_master.address!r}, metadata_server={mooncake_master.metadata_url!r},
                segment_bytes=64 << 20, local_buffer_bytes=0))
            backend.open()
            count, size = 32, 256 << 10
            source = ctypes.create_string_buffer(count * size)
            target = ctypes.create_string_buffer(count * size)
            def objects(buffer, suffix=""):
                base = ctypes.addressof(buffer)
                return [StorageObject(f"closing/{{r}}/{{i}}{{suffix}}",
                                      (BufferRegion(base + i * size, size),)) for i in range(count)]
            backend.put(objects(source))
            stop, errors, calls = threading.Event(), [], [0]
            def work(kind):
                n = 0
                while not stop.is_set():
                    try:
                        if kind == "get":
                            backend.get(objects(target))
                        else:
                            backend.put(objects(source, f"/{{n}}")[:8])
                        calls[0] += 1
                    except StorageError as exc:
                        errors.append(str(exc))
                    n += 1
            threads = [threading.Thread(target=work, args=(kind,)) for kind in ("get", "get", "put")]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            backend.close()
            time.sleep(0.3)
            stop.set()
            for thread in threads:
                thread.join(30)
            assert calls[0] > 0 and errors and all("is not open" in e for e in errors), errors[:3]
        for r in range(3):  # a crash came in most rounds, not all
            round_(r)
        print("SURVIVED")
        """
    )
    src_dir = Path(__file__).resolve().parents[1] / "src"
    completed = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=180,
        env={**_clean_env(), "PYTHONPATH": str(src_dir)},
    )
    assert completed.returncode == 0, (
        completed.returncode,
        completed.stdout[-2000:],
        completed.stderr[-4000:],
    )
    assert "SURVIVED" in completed.stdout


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_unreachable_master_fails_fast() -> None:
    dead = f"127.0.0.1:{free_loopback_port()}"
    backend = MooncakeBackend("dead", MooncakeConfig(master=dead, connect_timeout_s=1.0))
    assert "unreachable" in (backend.probe() or "")
    started = time.monotonic()
    with pytest.raises(StorageError, match=f"mooncake_master unreachable: {dead}"):
        backend.open()
    assert time.monotonic() - started < 15, "the probe must fail before setup's ~90 s retry loop"
    with pytest.raises(StorageError, match="not open"):
        backend.exists(["k"])


def test_unreachable_standalone_client_fails_fast() -> None:
    dead = f"127.0.0.1:{free_loopback_port()}"
    backend = MooncakeBackend("dead", MooncakeConfig(standalone=True, client=dead, connect_timeout_s=1.0))
    started = time.monotonic()
    with pytest.raises(StorageError, match=f"mooncake_client unreachable: {dead}"):
        backend.open()
    assert time.monotonic() - started < 15


def test_missing_mooncake_module_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fault injection: make the import fail as on a machine without the wheel.
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    backend = MooncakeBackend("x", MooncakeConfig())
    extra = "mooncake" if os.path.exists("/dev/nvidiactl") else "mooncake-cpu"  # this machine's wheel
    with pytest.raises(MissingDependencyError, match=rf"run `pip install 'kvstrata\[{extra}\]'`$"):
        backend.open()


def test_full_segment_puts_fail_per_key_with_not_stored(tmp_path: Path) -> None:
    """A dedicated master and a tiny segment: puts beyond capacity answer -200 per key."""
    with MooncakeMaster(log_dir=tmp_path) as master:
        backend = MooncakeBackend(
            "tiny",
            master.backend_config(segment_bytes=16 << 20, local_buffer_bytes=0),
        )
        backend.open()
        try:
            pages = torch.randint(0, 256, (24, 1 << 20), dtype=torch.uint8)  # 24 MiB > 16 MiB
            backend.register_host_memory(region_of(pages))
            keys = fresh_keys(24)
            stored = backend.put([StorageObject(k, (region_of(pages[i]),)) for i, k in enumerate(keys)])
            assert any(stored) and not all(stored), stored
            assert backend.code_counts[NO_AVAILABLE_HANDLE] == stored.count(False)
            target = torch.zeros_like(pages)
            read = backend.get([StorageObject(k, (region_of(target[i]),)) for i, k in enumerate(keys)])
            for i, (ok, got) in enumerate(zip(stored, read, strict=True)):
                if not ok:
                    assert got == OBJECT_NOT_FOUND, f"key {i} was not stored but read {got}"
                elif got > 0:  # stored keys may since have been evicted; what is read is exact
                    assert torch.equal(target[i], pages[i])
            assert any(got > 0 for got in read)
        finally:
            backend.close()


def test_exists_keeps_an_object_in_mooncakes_eviction_order(tmp_path: Path) -> None:
    """Why the core asks a self-evicting L3 for the prefixes its own tiers serve (core/l3_touch.py):
    to Mooncake an ``exists`` is a use. Its master grants the object a lease and, when the segment
    is full, evicts in lease order; the object asked about outlives the objects put after it.
    (Only one ``exists`` before the check: every ``exists`` refreshes what it finds.)"""
    page = 512 << 10
    with MooncakeMaster(log_dir=tmp_path, lease_ttl_ms=50) as master:
        backend = MooncakeBackend("lru", master.backend_config(segment_bytes=16 << 20, local_buffer_bytes=0))
        backend.open()
        try:
            pages = torch.randint(0, 256, (40, page), dtype=torch.uint8)  # 20 MiB > the 16 MiB segment
            backend.register_host_memory(region_of(pages))
            old, new = fresh_keys(16), fresh_keys(24)
            for i, key in enumerate(old):  # one at a time, apart: leases in put order
                assert backend.put([StorageObject(key, (region_of(pages[i]),))]) == [True]
                time.sleep(0.01)
            time.sleep(0.1)  # every lease expired: all 16 may be evicted
            hot = old[0]  # put first: without a use, the first to go
            assert backend.exists([hot]) == [True]
            time.sleep(0.1)
            for j, key in enumerate(new):
                backend.put([StorageObject(key, (region_of(pages[16 + j]),))])
                time.sleep(0.02)  # the master's eviction thread makes room between puts
            time.sleep(0.5)
            present = backend.exists(old)
            assert not all(present[1:]), "the segment overflowed but no old object was evicted"
            assert present[0], f"the object asked about was evicted before colder ones: {present}"
        finally:
            backend.close()


def test_standalone_round_trip_with_backend_allocated_memory(standalone: MooncakeBackend) -> None:
    assert standalone.instance_capabilities().host_allocator is True
    assert MooncakeBackend.capabilities.host_allocator is False
    count = 100  # 100 headers > 64 that fit the 4 KiB staging area: the batch is split
    pool_region = standalone.allocate_host_memory(count * 4096)
    pool = region_tensor(pool_region).view(count, 4096)
    pool.copy_(torch.randint(0, 256, (count, 4096), dtype=torch.uint8))
    headers, header_regions = header_buffers(count, fill=True)
    keys = fresh_keys(count)
    objects = [StorageObject(k, (header_regions[i], region_of(pool[i]))) for i, k in enumerate(keys)]
    assert standalone.put(objects) == [True] * count
    assert standalone.exists([*keys, "missing/" + keys[0]]) == [True] * count + [False]

    expected = pool.clone()
    pool.zero_()
    out_headers, out_header_regions = header_buffers(count, fill=False)
    read = standalone.get(
        [StorageObject(k, (out_header_regions[i], region_of(pool[i]))) for i, k in enumerate(keys)]
    )
    assert read == [HEADER_BYTES + 4096] * count
    assert torch.equal(pool, expected)
    assert torch.equal(out_headers, headers)


def test_standalone_stages_an_object_larger_than_the_staging_area(standalone: MooncakeBackend) -> None:
    # an adapter's copy plan stages whole pages: one larger than staging_bytes (a 64-token page
    # of an 8B model is 8 MiB, the default 4 MiB) could never be stored; the area grows instead
    count, size = 3, 3 * 4096  # each object alone is 3x the 4 KiB staging area
    pages = torch.randint(0, 256, (count, size), dtype=torch.uint8)  # ordinary memory: staged
    keys = fresh_keys(count)
    assert (
        standalone.put([StorageObject(k, (region_of(pages[i]),)) for i, k in enumerate(keys)])
        == [True] * count
    )
    target = torch.zeros_like(pages)
    assert (
        standalone.get([StorageObject(k, (region_of(target[i]),)) for i, k in enumerate(keys)])
        == [size] * count
    )
    assert torch.equal(target, pages)


def test_standalone_read_of_a_shorter_object_leaves_the_rest_of_its_region(
    standalone: MooncakeBackend,
) -> None:
    # a region read through the staging area received the whole area's span: past a shorter
    # object's end, what earlier transfers had left there -- other keys' bytes
    keys = fresh_keys(2)
    longer = torch.full((1024,), 0x02, dtype=torch.uint8)  # ordinary memory: staged
    shorter = torch.full((256,), 0x01, dtype=torch.uint8)
    assert standalone.put(
        [StorageObject(keys[0], (region_of(longer),)), StorageObject(keys[1], (region_of(shorter),))]
    ) == [True, True]
    other = torch.zeros(1024, dtype=torch.uint8)
    assert standalone.get([StorageObject(keys[0], (region_of(other),))]) == [1024]  # now in the area
    target = torch.full((1024,), 0x5A, dtype=torch.uint8)
    assert standalone.get([StorageObject(keys[1], (region_of(target),))]) == [256]
    assert bool((target[:256] == 0x01).all())
    assert bool((target[256:] == 0x5A).all()), "bytes past the object's end were written (another key's)"


def test_standalone_refuses_foreign_memory_and_covers_late_pools(standalone: MooncakeBackend) -> None:
    foreign = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(StorageError, match="allocate_host_memory"):
        standalone.register_host_memory(region_of(foreign))

    # A pool added after start gets its own region that the mooncake_client maps.
    late = region_tensor(standalone.allocate_host_memory(64 << 10))
    late.copy_(torch.randint(0, 256, late.shape, dtype=torch.uint8))
    (key,) = fresh_keys(1)
    assert standalone.put([StorageObject(key, (region_of(late[:32768]),))]) == [True]
    assert standalone.get([StorageObject(key, (region_of(late[32768:]),))]) == [32768]
    assert torch.equal(late[:32768], late[32768:])

    # Beyond the configured budget the refusal names requested bytes and the limit.
    with pytest.raises(
        StorageError, match=r"cannot allocate 16777216 bytes .*host_memory_limit_bytes=8388608"
    ):
        standalone.allocate_host_memory(16 << 20)


def test_segment_below_mooncake_minimum_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="at least 16777216"):
        MooncakeConfig(segment_bytes=4 << 20)


def test_closed_backend_fails_operations_not_the_process(mooncake_master: MooncakeMaster) -> None:
    backend = MooncakeBackend(
        "short",
        mooncake_master.backend_config(segment_bytes=0, local_buffer_bytes=0),
    )
    backend.open()
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(StorageError, match="not open"):
        backend.put([StorageObject("k", (BufferRegion(1, 1),))])


def test_master_going_away_turns_calls_into_failures(tmp_path: Path) -> None:
    """Kill the master under a running client: calls return failures (after Mooncake's RPC timeout)."""
    master = MooncakeMaster(log_dir=tmp_path).start()
    try:
        backend = MooncakeBackend(
            "orphan",
            master.backend_config(segment_bytes=16 << 20),
        )
        backend.open()
        page = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        (key,) = fresh_keys(1)
        assert backend.put([StorageObject(key, (region_of(page),))]) == [True]
    finally:
        master.stop()
    try:
        assert "unreachable" in (backend.probe() or "")
        with pytest.raises(StorageError, match="batch_is_exist failed"):
            backend.exists([key])
        assert any(code <= -900 for code in backend.code_counts), backend.code_counts
        # After an all-RPC-failure batch the backend probes first: the message proves it did not
        # wait for another Mooncake RPC timeout.
        with pytest.raises(StorageError, match=r"unreachable.*failing batch_put_from fast"):
            backend.put([StorageObject(key + "/2", (region_of(page),))])
    finally:
        backend.close()


def test_a_killed_master_leaves_the_store_unclosed_rather_than_blocking_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Seconds after its master was killed, Mooncake's native close retries its unmount for ~10 s
    holding the GIL (so ``close(timeout=)`` overran: audit s35); a refused endpoint, like a
    silent one, is left unclosed with a warning naming it."""
    master = MooncakeMaster(log_dir=tmp_path).start()
    backend = MooncakeBackend("killed", master.backend_config(segment_bytes=16 << 20, rpc_timeout_s=1))
    try:
        backend.open()
        page = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        assert backend.put([StorageObject(fresh_keys(1)[0], (region_of(page),))]) == [True]
    finally:
        pid = master.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # not stopped cleanly: killed
        master.stop()
    time.sleep(3)  # the engine runs on for a while before it shuts down
    caplog.set_level("WARNING", logger="kvstrata.storage_backends.mooncake")
    backend.close()
    warned = [r.getMessage() for r in caplog.records if "not closed cleanly" in r.getMessage()]
    assert len(warned) == 1 and f"master {master.address}" in warned[0], caplog.text


def test_shipped_config_fixture_round_trips_across_instances(
    mooncake_inprocess_config: MooncakeConfig,
) -> None:
    """The plugin's config fixture (what a conformance subclass uses): a second instance reads what a
    closed first one wrote, since objects live in the session mooncake_client's segment."""
    page = torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8)
    (key,) = fresh_keys(1)
    writer = MooncakeBackend("writer", mooncake_inprocess_config)
    writer.open()
    try:
        assert writer.put([StorageObject(key, (region_of(page),))]) == [True]
        assert writer.corrupt_for_test(key, "flip", offset=3)
    finally:
        writer.close()
    reader = MooncakeBackend("reader", mooncake_inprocess_config)
    reader.open()
    try:
        target = torch.zeros_like(page)
        assert reader.get([StorageObject(key, (region_of(target),))]) == [PAGE_BYTES]
        expected = page.clone()
        expected[3] ^= 0xFF
        assert torch.equal(target, expected)
        assert reader.corrupt_for_test(key, "truncate")
        assert reader.get([StorageObject(key, (region_of(target),))]) == [PAGE_BYTES // 2]
    finally:
        reader.close()


def test_object_shorter_than_its_regions_reads_short_not_failed(inprocess: MooncakeBackend) -> None:
    """Mooncake fails a multi-buffer read of a shorter object (-800); the backend re-reads the
    leading bytes so the core sees a short read (truncation it can count), never full data."""
    source = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    (key,) = fresh_keys(1)
    assert inprocess.put([StorageObject(key, (region_of(source[:1500]),))]) == [True]
    head, body = torch.zeros(100, dtype=torch.uint8), torch.zeros(2900, dtype=torch.uint8)
    read = inprocess.get([StorageObject(key, (region_of(head), region_of(body)))])
    assert read == [1500]
    assert torch.equal(head, source[:100])
    assert torch.equal(body[:1400], source[100:1500])
    assert bool((body[1400:] == 0).all())


class TestMooncakeInProcessConformance(BackendConformance):
    """The shared backend conformance kit against a real master (in-process client)."""

    @pytest.fixture
    def backend_factory(self, mooncake_inprocess_config: MooncakeConfig) -> Callable[[str], StorageBackend]:
        return lambda instance: _opened(MooncakeBackend(instance, mooncake_inprocess_config))


class TestMooncakeStandaloneConformance(BackendConformance):
    """The kit against a real ``mooncake_client`` (setup_dummy): host pools are not from the
    backend's allocator here, so every plan is ``copy`` and regions go through its staging area.
    Each test writes under its own namespace (the kit's ``_fresh_namespace``): the session
    segment keeps the in-process class's objects, whose identical keys once made
    ``test_existence_prefix_semantics`` fail depending on test order."""

    @pytest.fixture
    def backend_factory(self, mooncake_standalone_config: MooncakeConfig) -> Callable[[str], StorageBackend]:
        return lambda instance: _opened(MooncakeBackend(instance, mooncake_standalone_config))


def _opened(backend: MooncakeBackend) -> MooncakeBackend:
    backend.open()
    return backend


# --- deadlines and the circuit breaker against an endpoint that does not answer (issue 15, defect 2) --


def test_open_against_a_socket_that_is_not_a_master_gives_up_at_its_deadline() -> None:
    """A port that accepts TCP but never answers: a TCP probe passes and setup (which holds the
    GIL) would retry for minutes; open refuses within connect_timeout_s instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert tcp_probe(address, 1.0) is None, "the endpoint does accept TCP: only an answer tells"
        config = MooncakeConfig(
            master=address, segment_bytes=16 << 20, local_buffer_bytes=0, connect_timeout_s=1
        )
        backend = MooncakeBackend("mute", config)
        outcome: list[BaseException] = []
        opener = threading.Thread(target=lambda: _capture(backend.open, outcome), daemon=True)
        opener.start()
        opener.join(120)  # liveness guard only: without the answer probe setup blocks ~35 s
        assert not opener.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], StorageError), outcome
        assert "accepts connections but did not answer within 1 s" in str(outcome[0])
        assert "setup" not in str(outcome[0]), "refused before setup was tried"
        with pytest.raises(StorageError, match="not open"):
            backend.exists(["k"])


def _capture(call: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:
        errors.append(exc)


def _stop_and_wait(pid: int) -> None:
    """SIGSTOP ``pid`` and return once the kernel shows every one of its threads stopped: on a busy
    VM a master thread can still answer a request sent right after ``kill`` returned (seen once in
    a full run: ``exists`` answered by a master just SIGSTOPped)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError):
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


def _stopped_master_scenario(log_dir: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Child process (one Mooncake client in it: observed, a client opened after another one was
    closed in the same process answered batch_is_exist with the master stopped). Reports what it
    saw; the parent asserts."""
    seen: dict[str, object] = {}
    master = MooncakeMaster(log_dir=Path(log_dir), client_ttl_s=120).start()
    pid = master.process.pid
    assert pid is not None
    stopped = False
    try:
        config = master.backend_config(
            segment_bytes=16 << 20,
            local_buffer_bytes=0,
            rpc_timeout_s=1,
            connect_timeout_s=1,
            circuit_breaker={"failures": 2, "cooldown_s": 2},
        )
        backend = MooncakeBackend("stopped", config)
        backend.open()
        kit = BackendConformance()
        specs = conformance_specs()
        engine = kit.engine(backend, specs, model_name=f"breaker-{uuid.uuid4().hex[:8]}")
        source, target = kit.pools(specs, 3, seed=41), kit.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=41)
        seen["put"] = engine.put("state", hashes, source["state"].units(range(3))).ok
        stopped = True
        _stop_and_wait(pid)
        first = engine.exists("state", hashes)
        second = engine.get("state", hashes, target["state"].units(range(3)))
        seen["first"] = (first.ok, first.failed, first.error)
        seen["second"] = (second.ok, second.failed)
        seen["state_after_two"] = str(engine.read_breaker.state)
        seen["trips"] = engine.metrics.breaker_trips
        codes = dict(backend.code_counts)
        refused = [engine.exists("state", hashes) for _ in range(10)]
        seen["refused"] = sum("circuit breaker open" in (r.error or "") for r in refused)
        seen["codes_unchanged"] = dict(backend.code_counts) == codes
        os.kill(pid, signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 90  # a trial goes through every 2 s
        while engine.read_breaker.state is not BreakerState.CLOSED and time.monotonic() < deadline:
            engine.exists("state", hashes)
            time.sleep(0.2)
        seen["recovered"] = str(engine.read_breaker.state)
        seen["read_back"] = engine.get("state", hashes, target["state"].units(range(3))).ok
        seen["bit_exact"] = all(
            source["state"].unit_bytes(i) == target["state"].unit_bytes(i) for i in range(3)
        )
        stopped = True
        _stop_and_wait(pid)
        backend.close()  # would hold the GIL ~15 s in Mooncake's close without the answer probe
        seen["closed"] = True
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        master.stop()
        queue.put(seen)


def test_stopped_master_opens_the_breaker_then_recovers(tmp_path: Path) -> None:
    """SIGSTOP the real master (by PID): calls end at the RPC deadline, the breaker opens after two
    of them and later calls never reach Mooncake; after SIGCONT a trial call closes it and the
    data written before is read back bit exact; close() of a client whose master is stopped returns
    after the answer probe instead of blocking in Mooncake's close."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_stopped_master_scenario, args=(str(tmp_path), queue))
    child.start()
    try:
        seen = queue.get(timeout=240)  # liveness guard: a hang anywhere ends the test here
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0, seen
    assert seen["put"] == [True] * 3
    first_ok, first_failed, first_error = seen["first"]  # type: ignore[misc]
    assert first_ok == [False] * 3 and first_failed == 3 and "not answering" in (first_error or "")
    assert seen["second"] == ([False] * 3, 3)
    assert seen["state_after_two"] == "open" and seen["trips"] == 1
    assert seen["refused"] == 10 and seen["codes_unchanged"], "no call reached the stopped master"
    assert seen["recovered"] == "closed"
    assert seen["read_back"] == [True] * 3 and seen["bit_exact"]
    assert seen.get("closed") is True, "close blocked on the stopped master"


class _AnsweringStore:
    """Fault injection: a store whose every ``batch_remove`` answers ``code`` for each key."""

    def __init__(self, code: int) -> None:
        self.code = code

    def batch_remove(self, keys: list[str], force: bool) -> list[int]:
        return [self.code] * len(keys)


@pytest.mark.parametrize(
    ("code", "outage"),
    [(-900, True), (-999, True), (-1010, True), (-1100, False), (-1300, False), (-1700, False)],
)
def test_only_rpc_and_failover_codes_make_a_call_an_outage(code: int, outage: bool) -> None:
    """Every key answering an RPC (-9xx) or failover (-10xx) code is the service not answering: the
    call raises (the breaker counts it). A tenant's quota (-1700), offload off (-1300) or a file
    error (-11xx) refuses those keys only -- read as an outage, a full quota opened the breaker."""
    backend = MooncakeBackend("l3", MooncakeBackend.Config())
    backend._store = _AnsweringStore(code)
    if outage:
        with pytest.raises(StorageError, match="unreachable or not answering"):
            backend.remove(["a", "b"])
    else:
        assert backend.remove(["a", "b"]) == [False, False]
        assert backend.code_counts[code] == 2
