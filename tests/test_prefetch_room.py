"""A prefetch that finds the host tier full -- every host tier, once warm -- gets its room at
the owner thread's next call (any public call polls), and its read runs while the request waits
for ``admit``: before, room was made only at ``admit``, so in a warm cache no L3 read overlapped
the request's wait, ``timeout`` paid the whole read at ``admit`` and ``best_effort`` never
restored from L3 at all (audit 42)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pytest

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens, verify
from kvstrata.core.metrics import SkipReason
from kvstrata.plugins import PluginHost
from kvstrata.plugins.storage_backend import ReadCheck, StorageObject
from kvstrata.storage_backends._file_config import FileConfig
from kvstrata.storage_backends.file import FileBackend

#: 16 host pages: three served 5-page requests fill it
SMALL_HOST = ["tiers.host.capacity_tokens=1024", "policy.prefetch.host_fraction_limit=1.0"]


class _SlowConfig(FileConfig):
    type: Literal["slowget"] = "slowget"  # type: ignore[assignment]


class SlowGetFileBackend(FileBackend):
    """FAULT INJECTION (timing only): a file backend whose gets take ``delay_s`` longer."""

    name = "slowget"
    Config = _SlowConfig
    delay_s = 0.0

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        time.sleep(self.delay_s)
        return super().get(objects, check)


@pytest.mark.parametrize("stack", ["kv", "hybrid-mamba", "swa"])
@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_a_read_that_found_the_host_tier_full_runs_before_admit(
    stack: str, policy: str, tmp_path: Path
) -> None:
    host = PluginHost()
    host.storage_backends.register(SlowGetFileBackend)
    l3 = f"tiers.storage.l3={{type: slowget, path: {tmp_path}}}"
    wanted = tokens(63, 8)
    with open_cache(stack, None, [l3], host=host) as writer:
        serve(writer, wanted)
        writer.flush()
    # timeout: 0.05 s at admit, far less than the read takes (the read must not start there)
    sets = [l3, *SMALL_HOST, f"policy.prefetch.policy={policy}", "policy.prefetch.timeout_base_s=0.05"]
    with open_cache(stack, None, sets, host=host) as cache:
        for i in range(3):
            serve(cache, tokens(300 + i, 5))
        cache.flush()
        assert cache.pools.pools[cache.layout.anchor].host_allocator.available < 8, "the host tier is full"
        backend = cache.backend
        assert isinstance(backend, SlowGetFileBackend)
        backend.delay_s = 0.3
        lease = cache.lookup(wanted)
        op = lease.prefetch
        assert op is not None
        assert op.done.wait(10) and op.short is not None, "the worker found the host tier full"
        cache.poll()  # the engine's next call (another request's, or a poll): room is made here
        op.done.wait(10)  # the request waits in the engine's queue meanwhile
        cache.admit(lease)
        assert (lease.cached_pages, lease.hit_pages["storage"]) == (8, 8)
        assert lease.skipped == {} and verify(cache, lease) == 0
        cache.release(lease)
        cache.flush()
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


def test_best_effort_does_not_evict_at_admit_for_a_read_it_does_not_wait_for(tmp_path: Path) -> None:
    wanted = tokens(64, 8)
    with open_cache("kv", tmp_path) as writer:
        serve(writer, wanted)
        writer.flush()
    with open_cache("kv", tmp_path, [*SMALL_HOST, "policy.prefetch.policy=best_effort"]) as cache:
        for i in range(3):
            serve(cache, tokens(310 + i, 5))
        cache.flush()
        held = host_units_held_by_tree(cache)
        lease = cache.lookup(wanted)
        assert lease.prefetch is not None and lease.prefetch.done.wait(10)
        cache.admit(lease)  # no call between: admit's own poll must not make room for it
        assert lease.cached_pages == 0 and lease.skipped == {SkipReason.HOST_FULL: 8}
        assert host_units_held_by_tree(cache) == held, "nothing was evicted for the read"
        cache.release(lease)
